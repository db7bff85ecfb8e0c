//! "Did you mean": the existing FQNs nearest to a pattern that selects nothing.
//!
//! The distance aligns the pattern's segments with a name's segments (a segment the glob matches
//! costs nothing, `**` absorbs any number of segments, other segments cost their edit distance).
//! Segment costs are computed once per distinct name segment, so the scan stays linear. A name is
//! offered only when it costs at most half of writing the longer of the two anew: the root `''`
//! or `layers` for `lm_haed` would be noise.

use regex_automata::meta::Regex;
use rustc_hash::FxHashMap;

use crate::names::NameTable;
use crate::pattern::{Pattern, Strategy, REGEX_PREFIX};

enum PatternSegment {
    Globstar,
    Glob {
        text: String,
        matcher: Option<Regex>,
    },
}

/// The `count` names nearest to `pattern`, nearest first, ties in table order; only names near
/// enough to be meant (see the module's note).
pub fn nearest_names(pattern: &str, names: &NameTable, count: usize) -> Vec<String> {
    if count == 0 || names.is_empty() {
        return Vec::new();
    }
    let scored: Vec<(usize, usize)> = match split_segments(pattern) {
        Some(segments) => score_by_segments(&segments, names),
        None => {
            let target = pattern.strip_prefix(REGEX_PREFIX).unwrap_or(pattern);
            let target_length = target.chars().count();
            names
                .iter()
                .enumerate()
                .filter_map(|(i, name)| {
                    let cost = edit_distance(target, name);
                    near_enough(cost, target_length.max(name.chars().count())).then_some((cost, i))
                })
                .collect()
        }
    };
    let mut best: Vec<(usize, usize)> = Vec::with_capacity(count.min(names.len()) + 1);
    for candidate in scored {
        if best.len() < count || candidate < best[best.len() - 1] {
            let at = best.partition_point(|b| *b < candidate);
            best.insert(at, candidate);
            best.truncate(count);
        }
    }
    best.into_iter()
        .map(|(_, i)| names.get(i).to_owned())
        .collect()
}

/// The top-level segments of a glob, or `None` where segments are not separable
/// (`re:` patterns, braces holding dots).
fn split_segments(pattern: &str) -> Option<Vec<PatternSegment>> {
    if pattern.starts_with(REGEX_PREFIX) || pattern.is_empty() {
        return None;
    }
    let mut segments = Vec::new();
    let mut current = String::new();
    let (mut depth, mut escaped) = (0usize, false);
    for c in pattern.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '{' | '[' | '<' => depth += 1,
            '}' | ']' | '>' => depth = depth.saturating_sub(1),
            '.' if depth > 0 => return None,
            '.' => {
                segments.push(segment(std::mem::take(&mut current)));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    segments.push(segment(current));
    Some(segments)
}

fn segment(text: String) -> PatternSegment {
    if text == "**" {
        return PatternSegment::Globstar;
    }
    let matcher = Pattern::compile(&text)
        .ok()
        .filter(|pattern| !matches!(pattern.strategy, Strategy::Fallback(_)))
        .and_then(|pattern| Regex::builder().build_from_hir(&pattern.hir()?).ok());
    PatternSegment::Glob { text, matcher }
}

/// The cost of each name near enough (see `nearest_names`) with its index.
fn score_by_segments(pattern: &[PatternSegment], names: &NameTable) -> Vec<(usize, usize)> {
    let mut interned: FxHashMap<&str, usize> = FxHashMap::default();
    // Per distinct name segment: its length (the cost of leaving it unmatched) and its cost
    // against each pattern segment.
    let mut segment_lengths: Vec<usize> = Vec::new();
    let mut segment_costs: Vec<Vec<usize>> = vec![Vec::new(); pattern.len()];
    let skip_costs: Vec<usize> = pattern
        .iter()
        .map(|p| match p {
            PatternSegment::Globstar => 0,
            PatternSegment::Glob { text, .. } => text.chars().count(),
        })
        .collect();
    let pattern_length: usize = skip_costs.iter().sum();
    let mut name_segments: Vec<usize> = Vec::new();
    let (mut above, mut row): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
    let mut scored = Vec::with_capacity(names.len());
    for (index, name) in names.iter().enumerate() {
        name_segments.clear();
        for part in name.split('.') {
            let next_id = interned.len();
            let id = *interned.entry(part).or_insert(next_id);
            if id == next_id {
                segment_lengths.push(part.chars().count().max(1));
                for (k, p) in pattern.iter().enumerate() {
                    segment_costs[k].push(segment_cost(p, part));
                }
            }
            name_segments.push(id);
        }
        // Rows: pattern segments; columns: name segments.
        above.clear();
        above.push(0);
        for &id in &name_segments {
            above.push(above[above.len() - 1] + segment_lengths[id]);
        }
        let anew = pattern_length.max(above[name_segments.len()]);
        for (k, p) in pattern.iter().enumerate() {
            row.clear();
            row.push(above[0] + skip_costs[k]);
            for (j, &id) in name_segments.iter().enumerate() {
                let aligned = match p {
                    PatternSegment::Globstar => row[j].min(above[j]),
                    PatternSegment::Glob { .. } => above[j] + segment_costs[k][id],
                };
                row.push(
                    aligned
                        .min(above[j + 1] + skip_costs[k])
                        .min(row[j] + segment_lengths[id]),
                );
            }
            std::mem::swap(&mut row, &mut above);
        }
        let cost = above[name_segments.len()];
        if near_enough(cost, anew) {
            scored.push((cost, index));
        }
    }
    scored
}

/// Whether a name that costs `cost` is worth offering, where writing it anew costs `anew`.
fn near_enough(cost: usize, anew: usize) -> bool {
    2 * cost <= anew
}

fn segment_cost(pattern: &PatternSegment, name_segment: &str) -> usize {
    match pattern {
        PatternSegment::Globstar => 0,
        PatternSegment::Glob { text, matcher } => {
            if matcher.as_ref().is_some_and(|m| m.is_match(name_segment)) {
                0
            } else {
                edit_distance(text, name_segment)
            }
        }
    }
}

/// Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut two_back = vec![0; b.len() + 1];
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    let mut current = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        current[0] = i;
        for j in 1..=b.len() {
            let substitution = previous[j - 1] + usize::from(a[i - 1] != b[j - 1]);
            let mut best = substitution.min(previous[j] + 1).min(current[j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(two_back[j - 2] + 1);
            }
            current[j] = best;
        }
        std::mem::swap(&mut two_back, &mut previous);
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(names: &[&str]) -> NameTable {
        let mut t = NameTable::default();
        for n in names {
            t.push(n);
        }
        t
    }

    #[test]
    fn edit_distance_counts_swaps_once() {
        assert_eq!(edit_distance("lm_haed", "lm_head"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn suggests_the_misspelled_segment() {
        let names = table(&[
            "",
            "embed_tokens",
            "layers",
            "layers.0",
            "layers.0.mlp",
            "layers.0.mlp.experts",
            "layers.0.mlp.experts.0",
            "layers.0.mlp.experts.0.down_proj",
            "layers.0.mlp.experts.1.down_proj",
            "lm_head",
        ]);
        let near = nearest_names("layers.*.mlp.expertz.*.down_proj", &names, 3);
        assert_eq!(near[0], "layers.0.mlp.experts.0.down_proj");
        assert_eq!(near[1], "layers.0.mlp.experts.1.down_proj");
        assert_eq!(nearest_names("lm_haed", &names, 1), vec!["lm_head"]);
        assert_eq!(nearest_names("re:lm_hed", &names, 1), vec!["lm_head"]);
        assert_eq!(
            nearest_names("**.down_prj", &names, 1),
            vec!["layers.0.mlp.experts.0.down_proj"]
        );
    }

    #[test]
    fn offers_only_names_near_enough_to_be_meant() {
        let names = table(&["", "layers", "lm_head", "norm", "layers.0.self_attn"]);
        // `layers` shares an `l` with `lm_haed` (cost 6 of 7), the root nothing.
        assert_eq!(nearest_names("lm_haed", &names, 3), vec!["lm_head"]);
        assert_eq!(nearest_names("re:lm_haed", &names, 3), vec!["lm_head"]);
        assert!(nearest_names("qqq", &names, 3).is_empty());
        assert!(nearest_names("re:qqq", &names, 3).is_empty());
        // A missing prefix (cost 5 of 16) is near enough: `self_` is what was forgotten.
        assert!(
            nearest_names("layers.*.attn", &names, 3).contains(&"layers.0.self_attn".to_owned())
        );
        // Half of writing it anew is the limit: `ab` is `ax` with one change, `xy` two.
        let short = table(&["ab", "xy"]);
        assert_eq!(nearest_names("ax", &short, 3), vec!["ab"]);
    }
}
