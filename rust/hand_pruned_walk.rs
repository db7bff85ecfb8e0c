//! The benchmarks' floor of a pruned walk (a `test-hooks` build's only): a walk written by hand
//! for one plan, entering only the modules its patterns' literal segments lead to and comparing
//! names as strings, sharing nothing with the matcher. `benches/plan_resolution.py` times
//! `PatternSet.walk` against it.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::layout_reads::{Children, Step};

/// The plan as a tree of segments: each literal name, or `*` for any one name.
#[derive(Default)]
struct Segment {
    children: Vec<(String, Segment)>,
    any: Option<Box<Segment>>,
    terminal: bool,
}

impl Segment {
    fn add(&mut self, parts: &[&str]) {
        let Some((first, rest)) = parts.split_first() else {
            self.terminal = true;
            return;
        };
        let next = if *first == "*" {
            self.any.get_or_insert_with(Box::default)
        } else if let Some(index) = self.children.iter().position(|(name, _)| name == first) {
            &mut self.children[index].1
        } else {
            self.children
                .push(((*first).to_owned(), Segment::default()));
            &mut self.children.last_mut().expect("just pushed").1
        };
        next.add(rest);
    }

    fn child(&self, name: &str) -> Option<&Segment> {
        self.children
            .iter()
            .find(|(literal, _)| literal == name)
            .map(|(_, segment)| segment)
            .or(self.any.as_deref())
    }
}

/// How many modules under `root` the `patterns` (dot-separated literals and `*`) name, walked
/// through `_modules` into only the modules some pattern continues below.
pub fn count_matches(root: &Bound<'_, PyAny>, patterns: &[String]) -> PyResult<usize> {
    let mut plan = Segment::default();
    for pattern in patterns {
        plan.add(&pattern.split('.').collect::<Vec<_>>());
    }
    let mut count = 0;
    let mut stack = vec![(root.clone(), &plan)];
    while let Some((module, segment)) = stack.pop() {
        let modules = module.getattr(intern!(module.py(), "_modules"))?;
        // Children lent by the dict, as a walk written in C reads them: a child is touched only when entered.
        let mut children = Children::new(modules.cast_into::<PyDict>()?);
        while let Step::Entry(name, child) = children.next_entry() {
            let Some(next) = segment.child(name.cast::<PyString>()?.to_str()?) else {
                continue;
            };
            count += usize::from(next.terminal);
            if !next.children.is_empty() || next.any.is_some() {
                stack.push((child.to_owned(), next));
            }
        }
    }
    Ok(count)
}
