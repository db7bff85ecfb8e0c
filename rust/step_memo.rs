//! Where the DFA goes on a child's name, remembered per (parent state, name).
//!
//! In a model the same child names recur under parents the DFA cannot tell apart: every expert
//! of every layer has a `gate_proj`, and the DFA stands in one state after
//! `layers.N.mlp.experts.M.` whatever `N` and `M` are. Stepping it through `gate_proj.` is a
//! chain of dependent table reads; a small direct-mapped memo answers with one comparison.
//!
//! A slot is chosen by the parent state and the name's address (child names are interned, so the
//! address repeats) and confirmed by the parent state and the name's bytes, so a reused address
//! never returns another name's states. A state carries the DFA cache's clear count, so a slot
//! filled before a cache clear never matches a state computed after it.

use std::hash::{Hash, Hasher};

use rustc_hash::FxHasher;

use crate::matcher::{DfaState, MatchError, Matcher};

const SLOTS: usize = 256;
/// Longer names are stepped every time: child names are short.
const MAX_NAME: usize = 32;

#[derive(Clone, Copy)]
struct Slot {
    parent: Option<DfaState>,
    name: [u8; MAX_NAME],
    name_len: usize,
    /// The states after the name, and after the name and a `.`.
    after: Option<DfaState>,
    below: Option<DfaState>,
}

pub struct StepMemo {
    slots: Vec<Option<Slot>>,
}

impl Default for StepMemo {
    fn default() -> Self {
        StepMemo {
            slots: vec![None; SLOTS],
        }
    }
}

impl StepMemo {
    /// The DFA states after `name` from `parent`, and after one more `.`.
    pub fn step(
        &mut self,
        matcher: &mut Matcher<'_>,
        parent: Option<DfaState>,
        name: &str,
    ) -> Result<(Option<DfaState>, Option<DfaState>), MatchError> {
        let bytes = name.as_bytes();
        if bytes.len() > MAX_NAME {
            return matcher.advance_name(parent, bytes);
        }
        let mut hasher = FxHasher::default();
        parent.hash(&mut hasher);
        (bytes.as_ptr() as usize).hash(&mut hasher);
        let slot = &mut self.slots[hasher.finish() as usize % SLOTS];
        if let Some(found) = slot {
            if found.parent == parent && &found.name[..found.name_len] == bytes {
                return Ok((found.after, found.below));
            }
        }
        let (after, below) = matcher.advance_name(parent, bytes)?;
        let mut name = [0; MAX_NAME];
        name[..bytes.len()].copy_from_slice(bytes);
        *slot = Some(Slot {
            parent,
            name,
            name_len: bytes.len(),
            after,
            below,
        });
        Ok((after, below))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matcher::PatternSet;

    fn matches(set: &PatternSet, memo: &mut StepMemo, parent: &str, child: &str) -> Vec<u32> {
        set.with_matcher(|m| {
            let start = m.start().unwrap();
            let state = m.advance(start, parent.as_bytes()).unwrap();
            let (after, _) = memo.step(m, state, child).unwrap();
            let mut out = Vec::new();
            m.finish(&format!("{parent}{child}"), after, &mut out)
                .unwrap();
            out
        })
    }

    #[test]
    fn answers_like_stepping_whatever_was_remembered_before() {
        let Ok(set) = PatternSet::new(&["a.*.x", "b.y", "*.x.z"]) else {
            panic!("the patterns compile")
        };
        let mut memo = StepMemo::default();
        let x = "x";
        let cases = [
            ("a.1.", x, vec![0]),
            ("a.2.", x, vec![0]),
            ("b.", "y", vec![1]),
            ("b.", x, vec![]),
            ("a.3.", "y", vec![]),
            ("a.", x, vec![]),
            ("a.4.", x, vec![0]),
        ];
        // Twice: the second round is answered from the memo.
        for _ in 0..2 {
            for (parent, child, expected) in &cases {
                assert_eq!(
                    &matches(&set, &mut memo, parent, child),
                    expected,
                    "{parent}{child}"
                );
            }
        }
    }

    #[test]
    fn a_name_reusing_an_address_is_not_taken_for_the_old_one() {
        let Ok(set) = PatternSet::new(&["a.x"]) else {
            panic!("the pattern compiles")
        };
        let mut memo = StepMemo::default();
        let mut child = String::with_capacity(8);
        child.push('x');
        assert_eq!(matches(&set, &mut memo, "a.", &child), vec![0]);
        let address = child.as_ptr();
        child.clear();
        child.push('y');
        assert_eq!(child.as_ptr(), address);
        assert_eq!(matches(&set, &mut memo, "a.", &child), Vec::<u32>::new());
    }

    #[test]
    fn long_names_are_stepped() {
        let long = "n".repeat(MAX_NAME + 1);
        let Ok(set) = PatternSet::new(&[format!("a.{long}")]) else {
            panic!("the pattern compiles")
        };
        let mut memo = StepMemo::default();
        assert_eq!(matches(&set, &mut memo, "a.", &long), vec![0]);
        assert_eq!(matches(&set, &mut memo, "b.", &long), Vec::<u32>::new());
    }
}
