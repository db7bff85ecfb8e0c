//! `PlacementTable`: the placement rows of every planned module, checked in one call.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::checks::{PlacementKind, PlacementRow, PlacementTable, TableError};

/// torch's placement kinds, as `PlacementTable.row` takes them (`meshbind.names.PlacementKind`).
#[pyclass(
    name = "PlacementKind",
    module = "meshbind._core",
    eq,
    eq_int,
    frozen,
    from_py_object
)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum PyPlacementKind {
    #[pyo3(name = "SHARD")]
    Shard,
    #[pyo3(name = "REPLICATE")]
    Replicate,
    #[pyo3(name = "PARTIAL")]
    Partial,
}

impl From<PyPlacementKind> for PlacementKind {
    fn from(kind: PyPlacementKind) -> Self {
        match kind {
            PyPlacementKind::Shard => PlacementKind::Shard,
            PyPlacementKind::Replicate => PlacementKind::Replicate,
            PyPlacementKind::Partial => PlacementKind::Partial,
        }
    }
}

/// `meshbind.errors.ProblemCode`: a problem's code crosses as the Python enum member, never as text.
static PROBLEM_CODE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// A problem `PlacementTable.check` found: the unit it is about, its `ProblemCode` (`LAYOUT` or
/// `EXPERT`) and its message.
#[pyclass(name = "PlacementProblem", module = "meshbind._core", frozen, get_all)]
pub struct PlacementProblem {
    unit: u32,
    code: Py<PyAny>,
    message: String,
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

    /// One row of a `PlacementKind`; `rank`, `first_dim` and (for a
    /// `Shard(dim)`) `dim_size` give the parameter's shape where it is known.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (unit, label, axis, kind, dim = 0, rank = None, first_dim = None, dim_size = None))]
    fn row(
        &mut self,
        unit: u32,
        label: u32,
        axis: u32,
        kind: PyPlacementKind,
        dim: i64,
        rank: Option<i64>,
        first_dim: Option<i64>,
        dim_size: Option<i64>,
    ) -> PyResult<()> {
        let row = PlacementRow {
            module: unit,
            label,
            axis,
            kind: kind.into(),
            dim,
            rank,
            first_dim,
            dim_size,
            is_param: false,
        };
        self.inner.row(row).map_err(table_error)
    }

    /// Every problem.
    fn check(&self, py: Python<'_>) -> PyResult<Vec<PlacementProblem>> {
        let code_class = PROBLEM_CODE.import(py, "meshbind.errors", "ProblemCode")?;
        self.inner
            .check()
            .into_iter()
            .map(|p| {
                Ok(PlacementProblem {
                    unit: p.module,
                    code: code_class.call1((p.code.as_str(),))?.unbind(),
                    message: p.message,
                })
            })
            .collect()
    }
}
