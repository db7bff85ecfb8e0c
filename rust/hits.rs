//! Reading a walk's matches, `(name, pattern)` pairs in walk order: counted per pattern, grouped
//! per name.

use crate::names::NameTable;

/// How many of `hits` fall to each of `pattern_count` patterns.
pub fn count_hits(hits: &[(u32, u32)], pattern_count: usize) -> Vec<u32> {
    let mut counts = vec![0u32; pattern_count];
    for &(_, pattern) in hits {
        if let Some(c) = counts.get_mut(pattern as usize) {
            *c += 1;
        }
    }
    counts
}

/// `(name, [pattern indices])` for every name that `hits` (in name order) match.
pub fn grouped_hits<'t>(names: &'t NameTable, hits: &[(u32, u32)]) -> Vec<(&'t str, Vec<u32>)> {
    let mut out: Vec<(&str, Vec<u32>)> = Vec::new();
    let mut last = u32::MAX;
    for &(name, pattern) in hits {
        if name != last {
            out.push((names.get(name as usize), Vec::new()));
            last = name;
        }
        if let Some(entry) = out.last_mut() {
            entry.1.push(pattern);
        }
    }
    out
}

/// How many runs of equal values `values` holds: the distinct names of hits grouped by name.
pub fn distinct_runs(values: impl Iterator<Item = u32>) -> usize {
    let mut last = None;
    values.filter(|&v| last.replace(v) != Some(v)).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_are_counted_per_pattern_and_grouped_per_name() {
        let mut names = NameTable::default();
        for name in ["a", "a.b", "c"] {
            names.push(name);
        }
        let hits = [(0, 1), (0, 2), (2, 0), (2, 9)];
        assert_eq!(count_hits(&hits, 3), vec![1, 1, 1]); // pattern 9 is not one of the three
        assert_eq!(
            grouped_hits(&names, &hits),
            vec![("a", vec![1, 2]), ("c", vec![0, 9])]
        );
        assert_eq!(distinct_runs(hits.iter().map(|&(name, _)| name)), 2);
    }
}
