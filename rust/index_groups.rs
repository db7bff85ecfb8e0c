//! Grouping FQNs that differ in one numeric segment (a layer index) into one written line,
//! `layers.<0-47>.mlp` for a run of indices, `layers.{0,2,7}.mlp` otherwise: what the error
//! report and the plan report show.

use std::collections::HashMap;

/// One group: the FQN as written (the varying index replaced) and its members, ascending.
#[derive(Debug, PartialEq, Eq)]
pub struct IndexGroup {
    pub written: String,
    pub members: Vec<u32>,
}

fn is_index(segment: &str) -> bool {
    !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit())
}

/// Entries `(fqns[i], kinds[i])` grouped when their kinds are equal and their FQNs have the same
/// segments but for numeric ones, and differ in exactly one of those: in the order of each
/// group's first entry. Entries that share a group but differ in no or several indices stay
/// alone, each its own group.
pub fn index_groups<S: AsRef<str>>(fqns: &[S], kinds: &[u32]) -> Vec<IndexGroup> {
    let segments: Vec<Vec<&str>> = fqns
        .iter()
        .map(|f| f.as_ref().split('.').collect())
        .collect();
    let mut groups: Vec<Vec<u32>> = Vec::new();
    let mut by_shape: HashMap<(u32, Vec<&str>), usize> = HashMap::new();
    for (index, (parts, &kind)) in segments.iter().zip(kinds).enumerate() {
        let shape = parts
            .iter()
            .map(|&s| if is_index(s) { "#" } else { s })
            .collect();
        let slot = *by_shape.entry((kind, shape)).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[slot].push(index as u32);
    }
    let mut out = Vec::with_capacity(groups.len());
    for members in groups {
        // Members share a shape: the same segments, numeric ones at the same positions.
        let first = &segments[members[0] as usize];
        let varying: Vec<usize> = (0..first.len())
            .filter(|&i| is_index(first[i]))
            .filter(|&i| members.iter().any(|&m| segments[m as usize][i] != first[i]))
            .collect();
        if members.len() == 1 || varying.len() != 1 {
            out.extend(members.into_iter().map(|m| IndexGroup {
                written: fqns[m as usize].as_ref().to_owned(),
                members: vec![m],
            }));
            continue;
        }
        let position = varying[0];
        let mut values: Vec<u128> = members
            .iter()
            .filter_map(|&m| segments[m as usize][position].parse().ok())
            .collect();
        values.sort_unstable();
        values.dedup();
        let run = values.len() == members.len()
            && values[values.len() - 1] - values[0] + 1 == values.len() as u128;
        let indices = if run {
            format!("<{}-{}>", values[0], values[values.len() - 1])
        } else {
            format!(
                "{{{}}}",
                values
                    .iter()
                    .map(u128::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )
        };
        let mut written = first.clone();
        written[position] = &indices;
        out.push(IndexGroup {
            written: written.join("."),
            members,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grouped(fqns: &[&str], kinds: &[u32]) -> Vec<(String, Vec<u32>)> {
        index_groups(fqns, kinds)
            .into_iter()
            .map(|g| (g.written, g.members))
            .collect()
    }

    #[test]
    fn a_run_of_layer_indices_is_a_range_and_others_a_set() {
        let run = ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"];
        assert_eq!(
            grouped(&run, &[0, 0, 0]),
            vec![("layers.<0-2>.mlp".to_owned(), vec![0, 1, 2])]
        );
        let gaps = ["layers.0.mlp", "layers.2.mlp", "layers.7.mlp"];
        assert_eq!(
            grouped(&gaps, &[0, 0, 0]),
            vec![("layers.{0,2,7}.mlp".to_owned(), vec![0, 1, 2])]
        );
    }

    #[test]
    fn other_kinds_other_names_and_two_varying_indices_stay_apart() {
        let fqns = [
            "layers.0.a",
            "layers.1.a",
            "layers.0.b",
            "l.0.e.1",
            "l.1.e.0",
            "layers.2.a",
        ];
        assert_eq!(
            grouped(&fqns, &[0, 1, 0, 0, 0, 0]),
            vec![
                ("layers.{0,2}.a".to_owned(), vec![0, 5]),
                ("layers.1.a".to_owned(), vec![1]),
                ("layers.0.b".to_owned(), vec![2]),
                ("l.0.e.1".to_owned(), vec![3]),
                ("l.1.e.0".to_owned(), vec![4]),
            ]
        );
    }

    #[test]
    fn digits_inside_a_name_are_no_index() {
        let fqns = ["mlp.w1", "mlp.w2"];
        assert_eq!(
            grouped(&fqns, &[0, 0]),
            vec![
                ("mlp.w1".to_owned(), vec![0]),
                ("mlp.w2".to_owned(), vec![1])
            ]
        );
    }
}
