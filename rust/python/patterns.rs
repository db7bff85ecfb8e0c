//! `PatternSet` and what matching a list of names gives (`IndexMatches`).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView, PyString};

use super::{as_list, match_error, pattern_error, walk_error, ModuleTree};
use crate::hits::distinct_runs;
use crate::layout_reads::{list_strs, list_texts};
use crate::matcher::{BuildError, PatternSet};
use crate::rematch::rematched;
use crate::sequence::{HitsError, IndexHits, NameIndexer};
use crate::utf8::not_utf8_error;
use crate::walk::{walk_tree, TreeIndex, WalkMode};
use pyo3::exceptions::PyValueError;

/// FQN patterns compiled once.
#[pyclass(name = "PatternSet", module = "meshbind._core", frozen)]
pub struct PyPatternSet {
    inner: PatternSet,
}

#[pymethods]
impl PyPatternSet {
    #[new]
    fn new(py: Python<'_>, patterns: &Bound<'_, PyAny>) -> PyResult<Self> {
        let list = as_list(patterns, "patterns")?;
        let texts = list_strs(&list, "patterns").collect::<PyResult<Vec<&str>>>()?;
        match PatternSet::new(&texts) {
            Ok(inner) => Ok(PyPatternSet { inner }),
            Err(BuildError::Pattern(e)) => Err(pattern_error(py, &e)),
            Err(BuildError::Matcher(e)) => Err(PyValueError::new_err(format!(
                "cannot compile the pattern set: {e}"
            ))),
        }
    }

    #[getter]
    fn patterns(&self) -> Vec<String> {
        self.inner.texts.clone()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!("PatternSet(<{} patterns>)", self.inner.len())
    }

    /// The ascending indices of the patterns matching `name`.
    #[pyo3(name = "match")]
    fn match_name(&self, name: &Bound<'_, PyString>) -> PyResult<Vec<u32>> {
        let name = name
            .to_str()
            .map_err(|_| not_utf8_error("name", name.as_any()))?;
        let mut out = Vec::new();
        self.inner
            .with_matcher(|m| m.match_name(name, &mut out))
            .map_err(match_error)?;
        Ok(out)
    }

    /// `match` for every name of a sequence, in one call.
    fn match_many(&self, names: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        let list = as_list(names, "names")?;
        self.inner.with_matcher(|m| {
            list_strs(&list, "names")
                .map(|name| {
                    let mut out = Vec::new();
                    m.match_name(name?, &mut out).map_err(match_error)?;
                    Ok(out)
                })
                .collect()
        })
    }

    /// Walks the module tree under `root` through `_modules`, matching every FQN (aliases
    /// included). With `prune`, subtrees no pattern can reach are not entered and only matching
    /// FQNs are recorded (with `modules`, also the module and class behind each); without it,
    /// every FQN, module and class is indexed.
    /// With `parameters`, each entered module's `_parameters` are matched too, as FQNs of their
    /// own (`parameter_names`, `parameter_matches`): a pruned walk enters a module only when a
    /// pattern can reach below it, so it meets every parameter a pattern can select.
    #[pyo3(signature = (root, *, prune = true, modules = false, parameters = false))]
    fn walk(
        &self,
        root: &Bound<'_, PyAny>,
        prune: bool,
        modules: bool,
        parameters: bool,
    ) -> PyResult<ModuleTree> {
        let mode = match (prune, modules) {
            (false, _) => WalkMode::Full,
            (true, false) => WalkMode::Pruned,
            (true, true) => WalkMode::PrunedModules,
        };
        let index = self
            .inner
            .with_matcher(|m| walk_tree(root, m, mode, parameters))
            .map_err(walk_error)?;
        Ok(self.tree(index))
    }

    /// The offline form of `walk`: matches a plain sequence of FQNs. With `prune`, only the
    /// FQNs that match are recorded, as in a pruned walk; without it, every FQN is.
    #[pyo3(signature = (names, *, prune = true))]
    fn index_names(&self, names: &Bound<'_, PyAny>, prune: bool) -> PyResult<ModuleTree> {
        let list = as_list(names, "names")?;
        let index = self.inner.with_matcher(|m| -> PyResult<TreeIndex> {
            let mut indexer = NameIndexer::new(prune);
            for name in list_strs(&list, "names") {
                indexer.push(name?, m).map_err(match_error)?;
            }
            Ok(indexer.finish())
        })?;
        Ok(self.tree(index))
    }

    /// This set's matches over a tree that recorded every FQN (`walk(root, prune=False)`, or
    /// `index_names(names, prune=False)`), without walking the model again: the same modules,
    /// classes and parameters, this set's hits.
    fn match_tree(&self, py: Python<'_>, tree: &ModuleTree) -> PyResult<ModuleTree> {
        if !tree.index.complete {
            return Err(PyValueError::new_err(
                "match_tree needs a tree that recorded every FQN: walk(root, prune=False) \
                 or index_names(names, prune=False)",
            ));
        }
        let index = self
            .inner
            .with_matcher(|m| rematched(py, &tree.index, m))
            .map_err(match_error)?;
        Ok(self.tree(index))
    }

    /// The compact form of `match_many`, for names by the million: one `(name position, pattern)`
    /// pair per match, as flat arrays, and how many names each pattern matched. A list of at
    /// least 2^17 names is matched on a thread per core (at most eight), taking chunks in turn.
    fn match_indices(&self, names: &Bound<'_, PyAny>) -> PyResult<IndexMatches> {
        let list = as_list(names, "names")?;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let texts = list_texts(&list);
        let in_place = texts.as_ref().map(|texts| |i| texts.ascii(i));
        let read = || list_strs(&list, "names").collect::<PyResult<Vec<&str>>>();
        let found = IndexHits::of_names(&self.inner, list.len(), in_place, read, threads).map_err(
            |error| match error {
                HitsError::Match(error) => match_error(error),
                HitsError::Read(error) => error,
            },
        )?;
        Ok(IndexMatches {
            names: found.names,
            patterns: found.patterns,
            counts: found.counts,
        })
    }
}

/// What `PatternSet.match_indices` found: flat `uint32` arrays, read as `memoryview`s.
#[pyclass(name = "IndexMatches", module = "meshbind._core", frozen)]
pub struct IndexMatches {
    names: Vec<u32>,
    patterns: Vec<u32>,
    counts: Vec<u32>,
}

#[pymethods]
impl IndexMatches {
    /// The number of `(name, pattern)` matches.
    fn __len__(&self) -> usize {
        self.patterns.len()
    }

    /// The position (in the given sequence) of the name of every match, ascending.
    #[getter]
    fn names<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        uint32_view(py, &self.names)
    }

    /// The pattern of every match: ascending within each name.
    #[getter]
    fn patterns<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        uint32_view(py, &self.patterns)
    }

    /// How many names matched at least one pattern.
    fn matched_names(&self) -> usize {
        distinct_runs(self.names.iter().copied())
    }

    /// How many names each pattern matched (a 0: the pattern selects nothing).
    #[getter]
    fn counts(&self) -> Vec<u32> {
        self.counts.clone()
    }
}

/// A read-only `memoryview` of format `I` over a copy of `values`.
fn uint32_view<'py>(py: Python<'py>, values: &[u32]) -> PyResult<Bound<'py, PyAny>> {
    let bytes = PyBytes::new_with(py, values.len() * 4, |buffer| {
        for (chunk, value) in buffer.chunks_exact_mut(4).zip(values) {
            chunk.copy_from_slice(&value.to_ne_bytes());
        }
        Ok(())
    })?;
    PyMemoryView::from(bytes.as_any())?.call_method1(intern!(py, "cast"), ("I",))
}

impl PyPatternSet {
    /// What a walk or an index of this set found, counted against its patterns.
    fn tree(&self, index: TreeIndex) -> ModuleTree {
        ModuleTree {
            index,
            pattern_count: self.inner.len(),
        }
    }
}
