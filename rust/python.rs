//! The binding layer: converts arguments, maps errors, and nothing else.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyMemoryView, PyString, PyType};

use crate::checks::{PlacementKind, PlacementRow, PlacementTable, TableError};
use crate::hits::{count_hits, distinct_runs, grouped_hits};
use crate::layout_reads::{list_strs, list_texts};
use crate::matcher::{BuildError, MatchError, PatternSet};
use crate::selection::{select, PatternOwner};
use crate::sequence::{HitsError, IndexHits, NameIndexer};
use crate::suggest::nearest_names;
use crate::utf8::not_utf8_error;
use crate::walk::{walk_tree, TreeIndex, WalkError, WalkMode};

/// `meshbind.errors.PatternError`: the error family is defined once, on the Python side.
static PATTERN_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// A `meshbind.PatternError` with its `pattern`, `position` (a character offset) and `reason`.
fn pattern_error(py: Python<'_>, error: &crate::pattern::PatternError) -> PyErr {
    let made = || -> PyResult<PyErr> {
        let class = PATTERN_ERROR.import(py, "meshbind.errors", "PatternError")?;
        let value = class.call1((error.message(),))?;
        value.setattr("pattern", &error.pattern)?;
        value.setattr("position", error.position)?;
        value.setattr("reason", &error.reason)?;
        Ok(PyErr::from_value(value))
    };
    made().unwrap_or_else(|e| e)
}

fn match_error(error: MatchError) -> PyErr {
    PyRuntimeError::new_err(error.to_string())
}

fn walk_error(error: WalkError) -> PyErr {
    match error {
        WalkError::Python(e) => e,
        WalkError::Match(e) => match_error(e),
    }
}

/// `values` itself when it is a list, else a new list of its items; a bare `str` or something
/// that is not iterable is a `TypeError` naming `what`.
fn as_list<'py>(values: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyList>> {
    if let Ok(list) = values.cast_exact::<PyList>() {
        return Ok(list.clone());
    }
    if values.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of str, not a single str"
        )));
    }
    values.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be a sequence of str, got {}",
            type_name(values)
        ))
    })?;
    let list = values.py().get_type::<PyList>().call1((values,))?;
    Ok(list.cast_into::<PyList>()?)
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}

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

/// `ModuleTree.selected`: see there.
type SelectedRows<'t> = (
    Vec<u32>,
    Vec<&'t str>,
    Vec<Py<PyAny>>,
    Vec<Py<PyType>>,
    Vec<Option<u32>>,
    Vec<(u32, Vec<u32>)>,
    Vec<(u32, Vec<u32>)>,
);

/// `ModuleTree.named_parameters`: FQNs, each one's kind, one parameter per kind.
type NamedParameterLists<'t> = (Vec<&'t str>, Vec<u32>, Vec<Py<PyAny>>);

/// What a walk saw: every FQN, the module and class behind it, and every match.
#[pyclass(name = "ModuleTree", module = "meshbind._core", frozen)]
pub struct ModuleTree {
    index: TreeIndex,
    /// How many patterns the set that made it has.
    pattern_count: usize,
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

    /// Each parameter once, under its first FQN, in `named_parameters()` order: `(fqns, kinds,
    /// samples)`, where parameters of one kind share shape, dtype and `requires_grad` and
    /// `samples[k]` is the first of kind `k`. Needs a full walk with `parameters=True`.
    fn named_parameters(&self, py: Python<'_>) -> PyResult<NamedParameterLists<'_>> {
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
        Ok((found.fqns, found.kinds, found.samples))
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

    /// One row per module a request or an override selects, in tree order: `(module indices,
    /// FQNs, modules, classes, first request (None: only overrides), [(row, other requests)],
    /// [(row, overrides)])`; modules and classes are empty offline. Pattern `i` belongs to request
    /// `request_patterns[i]`, pattern `len(request_patterns) + k` to override `override_patterns[k]`.
    fn selected(
        &self,
        py: Python<'_>,
        request_patterns: Vec<u32>,
        override_patterns: Vec<u32>,
    ) -> SelectedRows<'_> {
        let owners: Vec<PatternOwner> = (request_patterns.into_iter().map(PatternOwner::Request))
            .chain(override_patterns.into_iter().map(PatternOwner::Override))
            .collect();
        let found = select(&self.index, &owners);
        let index = &self.index;
        let fqns = (found.modules.iter())
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
        (
            found.modules,
            fqns,
            modules,
            classes,
            found.first_request,
            found.other_requests,
            found.overrides,
        )
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

impl PyPatternSet {
    /// What a walk or an index of this set found, counted against its patterns.
    fn tree(&self, index: TreeIndex) -> ModuleTree {
        ModuleTree {
            index,
            pattern_count: self.inner.len(),
        }
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

/// Parses every pattern without building a set: raises `PatternError` for the first malformed one.
#[pyfunction]
fn check_patterns(py: Python<'_>, patterns: &Bound<'_, PyAny>) -> PyResult<()> {
    let list = as_list(patterns, "patterns")?;
    for text in list_strs(&list, "patterns") {
        crate::pattern::Pattern::compile(text?).map_err(|e| pattern_error(py, &e))?;
    }
    Ok(())
}

/// The placement rows of the `layout` checks and the expert rule for every planned module, as one
/// table: axes and labels are interned, each unit (modules checked as one) has its
/// `num_experts`, and `check` answers for all of them at once.
#[pyclass(name = "PlacementTable", module = "meshbind._core")]
pub struct PyPlacementTable {
    inner: PlacementTable,
}

fn table_error(error: TableError) -> PyErr {
    PyValueError::new_err(error.0)
}

#[pymethods]
impl PyPlacementTable {
    #[new]
    fn new(axis_sizes: Vec<(String, i64)>, expert_axis: &str) -> PyResult<Self> {
        PlacementTable::new(&axis_sizes, expert_axis)
            .map(|inner| PyPlacementTable { inner })
            .map_err(table_error)
    }

    fn axis(&mut self, name: &str) -> u32 {
        self.inner.axis(name)
    }

    fn label(&mut self, text: &str, is_param: bool) -> u32 {
        self.inner.label(text, is_param)
    }

    #[pyo3(signature = (num_experts = None))]
    fn unit(&mut self, num_experts: Option<i64>) -> PyResult<u32> {
        self.inner.unit(num_experts).map_err(table_error)
    }

    /// One row: `kind` is `"shard"`, `"replicate"` or `"partial"`; `rank`, `first_dim` and (for a
    /// `Shard(dim)`) `dim_size` give the parameter's shape where it is known.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (unit, label, axis, kind, dim = 0, rank = None, first_dim = None, dim_size = None))]
    fn row(
        &mut self,
        unit: u32,
        label: u32,
        axis: u32,
        kind: &str,
        dim: i64,
        rank: Option<i64>,
        first_dim: Option<i64>,
        dim_size: Option<i64>,
    ) -> PyResult<()> {
        let kind = match kind {
            "shard" => PlacementKind::Shard,
            "replicate" => PlacementKind::Replicate,
            "partial" => PlacementKind::Partial,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown placement kind {other:?} (shard, replicate or partial)"
                )))
            }
        };
        let row = PlacementRow {
            module: unit,
            label,
            axis,
            kind,
            dim,
            rank,
            first_dim,
            dim_size,
            is_param: false,
        };
        self.inner.row(row).map_err(table_error)
    }

    /// `(unit, code, message)` for every problem.
    fn check(&self) -> Vec<(u32, &'static str, String)> {
        self.inner
            .check()
            .into_iter()
            .map(|p| (p.module, p.code.as_str(), p.message))
            .collect()
    }
}

/// `(written FQN, member indices)` for entries `(fqns[i], kinds[i])` whose FQNs differ in one
/// numeric segment only (`layers.<0-47>.mlp`), in the order of each group's first entry.
#[pyfunction]
fn index_groups(fqns: Vec<String>, kinds: Vec<u32>) -> PyResult<Vec<(String, Vec<u32>)>> {
    if fqns.len() != kinds.len() {
        return Err(PyValueError::new_err(format!(
            "{} FQNs but {} kinds",
            fqns.len(),
            kinds.len()
        )));
    }
    Ok(crate::index_groups::index_groups(&fqns, &kinds)
        .into_iter()
        .map(|g| (g.written, g.members))
        .collect())
}

/// The rows grouped by the identity of their item in every list of `columns` (the lists of one
/// length), each group ascending, the groups in the order of their first row.
#[pyfunction]
fn same_object_groups(columns: Vec<Bound<'_, PyList>>) -> PyResult<Vec<Vec<u32>>> {
    let rows = columns.first().map_or(0, |column| column.len());
    let keys: Vec<Vec<usize>> = columns
        .iter()
        .map(|column| column.iter().map(|item| item.as_ptr() as usize).collect())
        .collect();
    crate::same_keys::same_key_groups(&keys, rows).map_err(PyValueError::new_err)
}

/// The positions in `rows` (every index when `None`) of the modules of a list whose
/// `_parameters` has no key `path`.
#[pyfunction]
#[pyo3(signature = (modules, path, rows=None))]
fn modules_lacking(
    modules: &Bound<'_, PyList>,
    path: &Bound<'_, PyString>,
    rows: Option<Vec<u32>>,
) -> PyResult<Vec<u32>> {
    crate::layout_reads::modules_lacking(modules, path, rows.as_deref())
}

/// Whether meshbind reads CPython's object layout in place: `"on"`, or `"off: <why>"`
/// (`MESHBIND_NO_LAYOUT_READS` set, an interpreter whose layout is not known, a failed self-check).
#[pyfunction]
fn layout_reads(py: Python<'_>) -> String {
    crate::layout_reads::status(py)
}

/// For the tests of the self-check: runs it with the offset `field` moved on by one word and
/// returns what it found wrong (`None`: it agreed). Unknown fields are a `ValueError`.
#[cfg(feature = "test-hooks")]
#[pyfunction]
fn _layout_self_check(py: Python<'_>, field: Option<&str>) -> PyResult<Option<String>> {
    let layout = match field {
        None => crate::layout_reads::known(py),
        Some(field) => crate::layout_reads::perturbed(py, field)
            .map(|layout| layout.ok_or_else(|| format!("no offset {field:?} on this interpreter")))
            .and_then(|layout| layout),
    };
    let layout = layout.map_err(PyValueError::new_err)?;
    Ok(crate::layout_reads::self_check(py, &layout).err())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPatternSet>()?;
    m.add_class::<ModuleTree>()?;
    m.add_class::<IndexMatches>()?;
    m.add_class::<PyPlacementTable>()?;
    m.add_function(wrap_pyfunction!(check_patterns, m)?)?;
    m.add_function(wrap_pyfunction!(modules_lacking, m)?)?;
    m.add_function(wrap_pyfunction!(index_groups, m)?)?;
    m.add_function(wrap_pyfunction!(same_object_groups, m)?)?;
    m.add_function(wrap_pyfunction!(layout_reads, m)?)?;
    #[cfg(feature = "test-hooks")]
    m.add_function(wrap_pyfunction!(_layout_self_check, m)?)?;
    Ok(())
}
