//! `ModuleTree`: what a walk or an index of names saw, and the typed records it answers with.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyType};

use crate::hits::{count_hits, distinct_runs, grouped_hits};
use crate::selection::{select, PatternOwner};
use crate::suggest::nearest_names;
use crate::walk::TreeIndex;

/// The modules a plan's requests and overrides select (`ModuleTree.selected`), one row each in
/// tree order; `modules` and `classes` are empty offline.
#[pyclass(name = "SelectedModules", module = "meshbind._core", frozen, get_all)]
pub struct SelectedModules {
    /// The module index of each row.
    module_indices: Vec<u32>,
    /// Each row's first FQN (a `list[str]`).
    fqns: Py<PyList>,
    modules: Vec<Py<PyAny>>,
    classes: Vec<Py<PyType>>,
    /// The first request selecting each row (`None`: only overrides do).
    first_request: Vec<Option<u32>>,
    /// `(row, requests)`: the rows other requests select too.
    other_requests: Vec<(u32, Vec<u32>)>,
    /// `(row, overrides)`: the rows overrides select.
    overrides: Vec<(u32, Vec<u32>)>,
}

/// Each parameter once, under its first FQN, in `named_parameters()` order
/// (`ModuleTree.named_parameters`): parameters of one kind share shape, dtype and
/// `requires_grad`, and `samples[k]` is the first of kind `k`; `ties` maps each later FQN of a
/// parameter (`named_parameters(remove_duplicate=False)`'s) to its first.
#[pyclass(name = "NamedParameters", module = "meshbind._core", frozen, get_all)]
pub struct NamedParameters {
    /// A `list[str]`.
    fqns: Py<PyList>,
    kinds: Vec<u32>,
    samples: Vec<Py<PyAny>>,
    /// `(later FQN, first FQN)`, in walk order.
    ties: Vec<(String, String)>,
}

/// What a walk saw: every FQN, the module and class behind it, and every match.
#[pyclass(name = "ModuleTree", module = "meshbind._core", frozen)]
pub struct ModuleTree {
    pub(super) index: TreeIndex,
    /// How many patterns the set that made it has.
    pub(super) pattern_count: usize,
}

#[pymethods]
impl ModuleTree {
    /// The number of FQNs visited, aliases included.
    fn __len__(&self) -> usize {
        self.index.names.len()
    }

    #[getter]
    fn module_count(&self) -> usize {
        self.index.module_first_name.len()
    }

    /// Whether the walk visited the whole tree (nothing was pruned).
    #[getter]
    fn complete(&self) -> bool {
        self.index.complete
    }

    /// Whether a module this pruned walk kept (`modules=True`), or one it entered on the way, may
    /// have an alias the walk did not visit: when met, something besides its parent's `_modules`
    /// held it.
    #[getter]
    fn may_share_matches(&self) -> bool {
        self.index.may_share_matches
    }

    /// The FQNs at the given name indices (all of them, in walk order, without indices).
    #[pyo3(signature = (indices = None))]
    fn names(&self, indices: Option<Vec<u32>>) -> PyResult<Vec<&str>> {
        match indices {
            None => Ok(self.index.names.iter().collect()),
            Some(indices) => indices
                .iter()
                .map(|&i| self.checked_name(i as usize))
                .collect(),
        }
    }

    /// The module index each name denotes.
    fn name_modules(&self) -> Vec<u32> {
        self.index.name_module.clone()
    }

    /// The first FQN of every module, in tree order.
    #[cfg(feature = "test-hooks")]
    fn module_names(&self) -> Vec<&str> {
        self.index
            .module_first_name
            .iter()
            .map(|&n| self.index.names.get(n as usize))
            .collect()
    }

    /// The first FQN of each module at the given module indices.
    fn module_fqns(&self, indices: Vec<u32>) -> PyResult<Vec<&str>> {
        indices
            .iter()
            .map(|&i| match self.index.module_first_name.get(i as usize) {
                Some(&name) => Ok(self.index.names.get(name as usize)),
                None => Err(PyValueError::new_err(format!("no module with index {i}"))),
            })
            .collect()
    }

    /// The module objects at the given module indices (empty for an offline index).
    fn modules(&self, py: Python<'_>, indices: Vec<u32>) -> PyResult<Vec<Py<PyAny>>> {
        indices
            .iter()
            .map(|&i| {
                self.index
                    .modules
                    .get(i as usize)
                    .map(|m| m.clone_ref(py))
                    .ok_or_else(|| PyValueError::new_err(format!("no module with index {i}")))
            })
            .collect()
    }

    /// Each parameter once, under its first FQN, in `named_parameters()` order. Needs a full walk
    /// with `parameters=True`.
    fn named_parameters(&self, py: Python<'_>) -> PyResult<NamedParameters> {
        let index = &self.index;
        if !index.complete || !index.parameters.read || index.modules.is_empty() {
            return Err(PyValueError::new_err(
                "named_parameters needs a full walk that read the parameters: \
                 walk(root, prune=False, parameters=True)",
            ));
        }
        let parameters = &index.parameters;
        let found =
            crate::named_parameters::named_parameters(py, &parameters.names, &parameters.objects)?;
        Ok(NamedParameters {
            fqns: PyList::new(py, found.fqns)?.unbind(),
            kinds: found.kinds,
            samples: found.samples,
            ties: found
                .ties
                .iter()
                .map(|&(later, first)| (later.to_owned(), first.to_owned()))
                .collect(),
        })
    }

    /// The distinct classes met, and the class index of every module.
    fn classes(&self, py: Python<'_>) -> Vec<Py<PyType>> {
        self.index.classes.iter().map(|c| c.clone_ref(py)).collect()
    }

    fn module_classes(&self) -> Vec<u32> {
        self.index.module_class.clone()
    }

    /// The indices of the modules whose class is one of `classes`, in tree order.
    fn modules_of_classes(&self, classes: Vec<u32>) -> Vec<u32> {
        self.index.modules_of_classes(&classes)
    }

    /// Every match as two parallel lists: name indices and pattern indices, in walk order.
    #[cfg(feature = "test-hooks")]
    fn hits(&self) -> (Vec<u32>, Vec<u32>) {
        self.index.hits.iter().copied().unzip()
    }

    /// `(fqn, [pattern indices])` for every matched FQN, in walk order.
    fn matches(&self) -> Vec<(&str, Vec<u32>)> {
        grouped_hits(&self.index.names, &self.index.hits)
    }

    /// One row per module a request or an override selects, in tree order. Pattern `i` belongs to
    /// request `request_patterns[i]`, pattern `len(request_patterns) + k` to override
    /// `override_patterns[k]`.
    fn selected(
        &self,
        py: Python<'_>,
        request_patterns: Vec<u32>,
        override_patterns: Vec<u32>,
    ) -> PyResult<SelectedModules> {
        let owners: Vec<PatternOwner> = (request_patterns.into_iter().map(PatternOwner::Request))
            .chain(override_patterns.into_iter().map(PatternOwner::Override))
            .collect();
        let found = select(&self.index, &owners);
        let index = &self.index;
        let fqns: Vec<&str> = (found.modules.iter())
            .map(|&m| {
                index
                    .names
                    .get(index.module_first_name[m as usize] as usize)
            })
            .collect();
        let (modules, classes) = if index.modules.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let module = |&m: &u32| index.modules[m as usize].clone_ref(py);
            let class =
                |&m: &u32| index.classes[index.module_class[m as usize] as usize].clone_ref(py);
            (
                found.modules.iter().map(module).collect(),
                found.modules.iter().map(class).collect(),
            )
        };
        Ok(SelectedModules {
            module_indices: found.modules,
            fqns: PyList::new(py, fqns)?.unbind(),
            modules,
            classes,
            first_request: found.first_request,
            other_requests: found.other_requests,
            overrides: found.overrides,
        })
    }

    /// How many names matched at least one pattern.
    fn matched_names(&self) -> usize {
        distinct_runs(self.index.hits.iter().map(|&(name, _)| name))
    }

    /// How many names each pattern of the set matched (a 0: the pattern selects nothing).
    fn hit_counts(&self) -> Vec<u32> {
        count_hits(&self.index.hits, self.pattern_count)
    }

    /// How many parameters each pattern matched (a walk with `parameters=True`).
    fn parameter_hit_counts(&self) -> Vec<u32> {
        count_hits(&self.index.parameters.hits, self.pattern_count)
    }

    /// The parameter FQNs the walk met (every one for a full walk, the matching ones pruned).
    fn parameter_names(&self) -> Vec<&str> {
        self.index.parameters.names.iter().collect()
    }

    /// `(parameter FQN, [pattern indices])` for every matched parameter, in walk order.
    fn parameter_matches(&self) -> Vec<(&str, Vec<u32>)> {
        grouped_hits(&self.index.parameters.names, &self.index.parameters.hits)
    }

    /// The `count` parameter FQNs met nearest to `pattern` ("did you mean" among parameters).
    #[cfg(feature = "test-hooks")]
    #[pyo3(signature = (pattern, count = 3))]
    fn nearest_parameters(&self, pattern: &str, count: usize) -> Vec<String> {
        nearest_names(pattern, &self.index.parameters.names, count)
    }

    /// `(alias, ancestor FQN)` for every alias that names one of its own ancestors.
    fn cycles(&self) -> Vec<(String, String)> {
        self.index.cycles.clone()
    }

    /// The `count` visited FQNs nearest to `pattern` ("did you mean"), leaving out those too far
    /// from it to be meant.
    #[pyo3(signature = (pattern, count = 3))]
    fn nearest(&self, pattern: &str, count: usize) -> Vec<String> {
        nearest_names(pattern, &self.index.names, count)
    }
}

impl ModuleTree {
    fn checked_name(&self, index: usize) -> PyResult<&str> {
        if index < self.index.names.len() {
            Ok(self.index.names.get(index))
        } else {
            Err(PyValueError::new_err(format!("no name with index {index}")))
        }
    }
}
