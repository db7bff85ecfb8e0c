//! Rows that agree on every key column: validation checks each distinct (spec, sharding, class)
//! once, and a plan of 188k modules sharing a few layouts is a few groups.

use rustc_hash::FxHashMap;

/// The rows `0..rows` grouped by their keys in every column (`columns[c][row]`), each group
/// ascending, the groups in the order of their first row. Columns shorter than `rows` are an
/// error naming the column.
pub fn same_key_groups(columns: &[Vec<usize>], rows: usize) -> Result<Vec<Vec<u32>>, String> {
    if let Some((index, column)) = columns.iter().enumerate().find(|(_, c)| c.len() != rows) {
        return Err(format!(
            "column {index} has {} rows, not {rows}",
            column.len()
        ));
    }
    // Each column refines the groups of the ones before: a new group per (group, key) pair,
    // numbered in the order of its first row, so the last numbering is already in row order.
    let mut group_of = vec![0u32; rows];
    for column in columns {
        let mut numbering: FxHashMap<(u32, usize), u32> = FxHashMap::default();
        let mut last: Option<((u32, usize), u32)> = None;
        for (group, &key) in group_of.iter_mut().zip(column) {
            let pair = (*group, key);
            *group = match last {
                Some((seen, number)) if seen == pair => number,
                _ => {
                    let next = numbering.len() as u32;
                    let number = *numbering.entry(pair).or_insert(next);
                    last = Some((pair, number));
                    number
                }
            };
        }
    }
    let count = group_of.iter().map(|&g| g as usize + 1).max().unwrap_or(0);
    let mut groups = vec![Vec::new(); count];
    for (row, &group) in group_of.iter().enumerate() {
        groups[group as usize].push(row as u32);
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_agreeing_on_every_column_share_a_group_in_first_row_order() {
        let columns = vec![vec![7, 5, 7, 5, 7], vec![1, 1, 1, 2, 1]];
        assert_eq!(
            same_key_groups(&columns, 5).unwrap(),
            vec![vec![0, 2, 4], vec![1], vec![3]]
        );
    }

    #[test]
    fn no_columns_is_one_group_and_no_rows_none() {
        assert_eq!(same_key_groups(&[], 3).unwrap(), vec![vec![0, 1, 2]]);
        assert_eq!(
            same_key_groups(&[vec![]], 0).unwrap(),
            Vec::<Vec<u32>>::new()
        );
    }

    #[test]
    fn a_key_alone_is_no_group_across_columns() {
        // Row 1 shares column 0's key with row 0 and column 1's with row 2: all three differ.
        let columns = vec![vec![1, 1, 2], vec![3, 4, 4]];
        assert_eq!(
            same_key_groups(&columns, 3).unwrap(),
            vec![vec![0], vec![1], vec![2]]
        );
    }

    #[test]
    fn a_short_column_is_named() {
        let error = same_key_groups(&[vec![1, 2], vec![1]], 2).unwrap_err();
        assert_eq!(error, "column 1 has 1 rows, not 2");
    }
}
