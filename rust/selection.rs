//! Which requests and overrides select each module: what resolution's one record per selected
//! module starts from.

use crate::walk::TreeIndex;

/// Who a pattern of the plan's set belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatternOwner {
    Request(u32),
    Override(u32),
}

/// The modules some request or override selects, ascending (tree order), one row each.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Selection {
    pub modules: Vec<u32>,
    /// The request of each module's first match (`None`: only overrides select it).
    pub first_request: Vec<Option<u32>>,
    /// `(row, the other requests selecting it, ascending)`, for the rows that have some.
    pub other_requests: Vec<(u32, Vec<u32>)>,
    /// `(row, the overrides selecting it, ascending)`, for the rows that have some.
    pub overrides: Vec<(u32, Vec<u32>)>,
}

/// What one module has been selected by, while the matches are read.
#[derive(Default, Clone)]
struct Owners {
    first_request: Option<u32>,
    other_requests: Vec<u32>,
    overrides: Vec<u32>,
    selected: bool,
}

/// Reads every match of `index` once, mapping its pattern to `owners[pattern]`.
pub fn select(index: &TreeIndex, owners: &[PatternOwner]) -> Selection {
    let mut by_module = vec![Owners::default(); index.module_first_name.len()];
    for &(name, pattern) in &index.hits {
        let (Some(owner), Some(&module)) = (
            owners.get(pattern as usize),
            index.name_module.get(name as usize),
        ) else {
            continue;
        };
        let Some(entry) = by_module.get_mut(module as usize) else {
            continue;
        };
        entry.selected = true;
        match *owner {
            PatternOwner::Request(request) => match entry.first_request {
                None => entry.first_request = Some(request),
                Some(first) if first != request => entry.other_requests.push(request),
                Some(_) => {}
            },
            PatternOwner::Override(number) => entry.overrides.push(number),
        }
    }
    let mut selection = Selection::default();
    for (module, mut entry) in by_module.into_iter().enumerate() {
        if !entry.selected {
            continue;
        }
        let row = selection.modules.len() as u32;
        selection.modules.push(module as u32);
        selection.first_request.push(entry.first_request);
        for (list, out) in [
            (&mut entry.other_requests, &mut selection.other_requests),
            (&mut entry.overrides, &mut selection.overrides),
        ] {
            if !list.is_empty() {
                list.sort_unstable();
                list.dedup();
                out.push((row, std::mem::take(list)));
            }
        }
    }
    selection
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matcher::{MatchError, PatternSet};
    use crate::sequence::NameIndexer;

    fn index_of(patterns: &[&str], names: &[&str]) -> TreeIndex {
        let Ok(set) = PatternSet::new(patterns) else {
            panic!("the patterns compile")
        };
        set.with_matcher(|m| {
            let mut indexer = NameIndexer::new(false);
            names.iter().try_for_each(|name| indexer.push(name, m))?;
            Ok::<_, MatchError>(indexer.finish())
        })
        .unwrap()
    }

    #[test]
    fn a_module_keeps_its_first_request_and_lists_the_others_once() {
        let index = index_of(
            &["a.*", "a.b", "a.{b,c}", "z"],
            &["", "a", "a.b", "a.c", "d"],
        );
        use PatternOwner::{Override, Request};
        // Patterns 0 and 2 belong to request 0, pattern 1 to request 1, pattern 3 to override 0.
        let selection = select(&index, &[Request(0), Request(1), Request(0), Override(0)]);
        assert_eq!(selection.modules, vec![2, 3]);
        assert_eq!(selection.first_request, vec![Some(0), Some(0)]);
        assert_eq!(selection.other_requests, vec![(0, vec![1])]);
        assert!(selection.overrides.is_empty());
    }

    #[test]
    fn overrides_are_listed_ascending_and_alone_select_a_row_without_a_request() {
        let index = index_of(&["a.b", "a.*", "a.b", "a.c"], &["a", "a.b", "a.c"]);
        use PatternOwner::{Override, Request};
        let selection = select(&index, &[Override(2), Override(0), Override(2), Request(4)]);
        assert_eq!(selection.modules, vec![1, 2]);
        assert_eq!(selection.first_request, vec![None, Some(4)]);
        assert_eq!(selection.overrides, vec![(0, vec![0, 2]), (1, vec![0])]);
        assert!(selection.other_requests.is_empty());
    }
}
