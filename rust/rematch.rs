//! A whole tree's names matched again by another pattern set: the same modules, classes and
//! parameters, that set's matches. It reads no Python object, so a plan resolved after its plan
//! source read the tree walks the model once.

use pyo3::prelude::*;

use crate::matcher::{MatchError, Matcher};
use crate::names::NameTable;
use crate::sequence::SequenceMatcher;
use crate::walk::{ParameterIndex, TreeIndex};

/// `tree` with `matcher`'s matches in place of its own. `tree` must record every FQN (a full
/// walk, or an index of names that dropped none): a pruned one has no names where a new pattern
/// may match.
pub fn rematched(
    py: Python<'_>,
    tree: &TreeIndex,
    matcher: &mut Matcher<'_>,
) -> Result<TreeIndex, MatchError> {
    let (hits, parameter_hits) = rematched_hits(tree, matcher)?;
    let parameters = &tree.parameters;
    Ok(TreeIndex {
        names: tree.names.clone(),
        name_module: tree.name_module.clone(),
        modules: tree.modules.iter().map(|m| m.clone_ref(py)).collect(),
        module_first_name: tree.module_first_name.clone(),
        module_class: tree.module_class.clone(),
        classes: tree.classes.iter().map(|c| c.clone_ref(py)).collect(),
        cycles: tree.cycles.clone(),
        hits,
        complete: tree.complete,
        may_share_matches: tree.may_share_matches,
        parameters: ParameterIndex {
            read: parameters.read,
            names: parameters.names.clone(),
            objects: parameters.objects.iter().map(|p| p.clone_ref(py)).collect(),
            hits: parameter_hits,
        },
    })
}

/// `matcher`'s matches over the tree's module names and over its parameter names, as
/// `(name index, pattern index)` in order.
pub fn rematched_hits(
    tree: &TreeIndex,
    matcher: &mut Matcher<'_>,
) -> Result<MatchPairs, MatchError> {
    Ok((
        sequence_hits(&tree.names, matcher)?,
        sequence_hits(&tree.parameters.names, matcher)?,
    ))
}

type MatchPairs = (Vec<(u32, u32)>, Vec<(u32, u32)>);

fn sequence_hits(
    names: &NameTable,
    matcher: &mut Matcher<'_>,
) -> Result<Vec<(u32, u32)>, MatchError> {
    let mut sequence = SequenceMatcher::default();
    let mut scratch = Vec::new();
    let mut hits = Vec::new();
    for (at, name) in names.iter().enumerate() {
        scratch.clear();
        sequence.matches(name, matcher, &mut scratch)?;
        hits.extend(scratch.iter().map(|&pattern| (at as u32, pattern)));
    }
    Ok(hits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matcher::PatternSet;
    use crate::sequence::NameIndexer;

    #[test]
    fn matches_every_name_of_the_tree_again() {
        let names = [
            "",
            "layers",
            "layers.0",
            "layers.0.mlp",
            "layers.1",
            "layers.1.mlp",
        ];
        let (Ok(first), Ok(second)) = (
            PatternSet::new(&["layers.0"]),
            PatternSet::new(&["layers.*.mlp", "layers"]),
        ) else {
            panic!("the patterns compile")
        };
        let tree = first
            .with_matcher(|m| -> Result<TreeIndex, MatchError> {
                let mut indexer = NameIndexer::new(false);
                for name in names {
                    indexer.push(name, m)?;
                }
                Ok(indexer.finish())
            })
            .unwrap();
        assert_eq!(tree.hits, vec![(2, 0)]);
        let (hits, parameter_hits) = second.with_matcher(|m| rematched_hits(&tree, m)).unwrap();
        assert_eq!(hits, vec![(1, 1), (3, 0), (5, 0)]);
        assert!(parameter_hits.is_empty());
    }
}
