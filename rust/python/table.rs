//! `PlacementTable`: the placement rows of every planned module, checked in one call.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::checks::{PlacementKind, PlacementRow, PlacementTable, TableError};

/// A problem `PlacementTable.check` found: the unit it is about, its code (`layout` or
/// `expert`) and its message.
#[pyclass(name = "PlacementProblem", module = "meshbind._core", frozen, get_all)]
pub struct PlacementProblem {
    unit: u32,
    code: &'static str,
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

    /// Every problem.
    fn check(&self) -> Vec<PlacementProblem> {
        self.inner
            .check()
            .into_iter()
            .map(|p| PlacementProblem {
                unit: p.module,
                code: p.code.as_str(),
                message: p.message,
            })
            .collect()
    }
}
