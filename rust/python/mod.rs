//! The binding layer: converts arguments, maps errors, and nothing else. Each class has a file:
//! `patterns.rs` (`PatternSet`, `IndexMatches`), `tree.rs` (`ModuleTree` and its records),
//! `table.rs` (`PlacementTable`).

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyType};

mod patterns;
mod table;
mod tree;

use crate::layout_reads::list_strs;
use crate::matcher::MatchError;
use crate::walk::WalkError;
use patterns::{IndexMatches, PyPatternSet};
use table::{PlacementProblem, PyPlacementKind, PyPlacementTable};
use tree::{ModuleTree, NamedParameters, SelectedModules};

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

/// Parses every pattern without building a set: raises `PatternError` for the first malformed one.
#[pyfunction]
fn check_patterns(py: Python<'_>, patterns: &Bound<'_, PyAny>) -> PyResult<()> {
    let list = as_list(patterns, "patterns")?;
    for text in list_strs(&list, "patterns") {
        crate::pattern::Pattern::compile(text?).map_err(|e| pattern_error(py, &e))?;
    }
    Ok(())
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

/// `rules::split_dim`: the dimension `Shard(dim)` splits in a tensor of rank `rank`, or `None`.
#[pyfunction]
fn split_dim(dim: i64, rank: i64) -> Option<i64> {
    crate::rules::split_dim(dim, rank)
}

/// `rules::not_divisible`: why `count` cannot be split over the `size` ranks of `axis`, or `None`.
#[pyfunction]
fn not_divisible(what: &str, count: i64, axis: &str, size: i64) -> Option<String> {
    crate::rules::not_divisible(what, count, axis, size)
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

/// How many module trees this process has walked (`PatternSet.walk` calls).
#[cfg(feature = "test-hooks")]
#[pyfunction]
fn _walk_count() -> usize {
    crate::walk::WALKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The benchmarks' hand-written pruned walk: how many modules under `root` the `patterns`
/// (literal segments and `*`) name.
#[cfg(feature = "test-hooks")]
#[pyfunction]
fn _hand_pruned_walk(root: &Bound<'_, PyAny>, patterns: Vec<String>) -> PyResult<usize> {
    crate::hand_pruned_walk::count_matches(root, &patterns)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPatternSet>()?;
    m.add_class::<ModuleTree>()?;
    m.add_class::<IndexMatches>()?;
    m.add_class::<PyPlacementTable>()?;
    m.add_class::<PlacementProblem>()?;
    m.add_class::<PyPlacementKind>()?;
    m.add_class::<SelectedModules>()?;
    m.add_class::<NamedParameters>()?;
    m.add_function(wrap_pyfunction!(check_patterns, m)?)?;
    m.add_function(wrap_pyfunction!(modules_lacking, m)?)?;
    m.add_function(wrap_pyfunction!(index_groups, m)?)?;
    m.add_function(wrap_pyfunction!(same_object_groups, m)?)?;
    m.add_function(wrap_pyfunction!(layout_reads, m)?)?;
    m.add_function(wrap_pyfunction!(split_dim, m)?)?;
    m.add_function(wrap_pyfunction!(not_divisible, m)?)?;
    #[cfg(feature = "test-hooks")]
    m.add_function(wrap_pyfunction!(_layout_self_check, m)?)?;
    #[cfg(feature = "test-hooks")]
    m.add_function(wrap_pyfunction!(_walk_count, m)?)?;
    #[cfg(feature = "test-hooks")]
    m.add_function(wrap_pyfunction!(_hand_pruned_walk, m)?)?;
    Ok(())
}
