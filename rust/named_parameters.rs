//! A model's parameters as `named_parameters()` gives them — each once, under the first FQN of
//! the first module holding it — from the parameters a full walk met, with each one's kind: the
//! parameters of a kind share shape, dtype, device type and `requires_grad`, so a caller that sizes them
//! (the plan report) computes once per kind rather than once per parameter.
//!
//! Every read goes through `getattr`; nothing here depends on CPython's object layout.

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use rustc_hash::FxHashMap;

use crate::names::NameTable;

/// What makes two parameters alike: their shape, their dtype (the address of the `torch.dtype`
/// object, one per dtype), their device's type (`meta`, `cpu`, `cuda`) and whether they require
/// grad.
#[derive(PartialEq, Eq, Hash)]
struct Kind {
    shape: Vec<i64>,
    dtype: usize,
    device: String,
    requires_grad: bool,
}

/// The parameters found: `fqns[i]` and `kinds[i]` for each, one parameter per kind, and each
/// later FQN of a parameter met before (a tie, or a shared module's alias) with its first FQN.
pub struct NamedParameters<'t> {
    pub fqns: Vec<&'t str>,
    pub kinds: Vec<u32>,
    pub samples: Vec<Py<PyAny>>,
    pub ties: Vec<(&'t str, &'t str)>,
}

/// The distinct parameters among `names[i]`, `objects[i]` (a full walk's, in walk order: a
/// shared module's parameters again under each alias, which `named_parameters()` leaves out).
/// A parameter without a shape, dtype or `requires_grad` is a `TypeError` naming it.
pub fn named_parameters<'t>(
    py: Python<'_>,
    names: &'t NameTable,
    objects: &[Py<PyAny>],
) -> PyResult<NamedParameters<'t>> {
    let mut found = NamedParameters {
        fqns: Vec::new(),
        kinds: Vec::new(),
        samples: Vec::new(),
        ties: Vec::new(),
    };
    let mut first_name: FxHashMap<usize, &'t str> = FxHashMap::default();
    let mut kinds: FxHashMap<Kind, u32> = FxHashMap::default();
    // Kinds compare dtypes by address: each one read is kept alive, so no address is reused.
    let mut dtypes = Vec::new();
    for (fqn, parameter) in names.iter().zip(objects) {
        if let Some(&first) = first_name.get(&(parameter.as_ptr() as usize)) {
            found.ties.push((fqn, first));
            continue;
        }
        first_name.insert(parameter.as_ptr() as usize, fqn);
        let parameter = parameter.bind(py);
        let kind = kind_of(parameter, &mut dtypes)
            .map_err(|e| PyTypeError::new_err(format!("parameter '{fqn}' is not a tensor: {e}")))?;
        let next = kinds.len() as u32;
        let index = *kinds.entry(kind).or_insert(next);
        if index == next {
            found.samples.push(parameter.clone().unbind());
        }
        found.fqns.push(fqn);
        found.kinds.push(index);
    }
    Ok(found)
}

fn kind_of<'py>(
    parameter: &Bound<'py, PyAny>,
    dtypes: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<Kind> {
    let py = parameter.py();
    let shape = parameter.getattr(intern!(py, "shape"))?;
    // `torch.Size` is a tuple: read in place rather than through an iterator.
    let shape = match shape.cast::<PyTuple>() {
        Ok(sizes) => sizes
            .iter()
            .map(|size| size.extract::<i64>())
            .collect::<PyResult<Vec<i64>>>(),
        Err(_) => shape
            .try_iter()?
            .map(|size| size?.extract::<i64>())
            .collect::<PyResult<Vec<i64>>>(),
    }?;
    let dtype = parameter.getattr(intern!(py, "dtype"))?;
    let address = dtype.as_ptr() as usize;
    dtypes.push(dtype);
    let requires_grad = parameter
        .getattr(intern!(py, "requires_grad"))?
        .is_truthy()?;
    let device = parameter
        .getattr(intern!(py, "device"))?
        .getattr(intern!(py, "type"))?
        .extract::<String>()?;
    Ok(Kind {
        shape,
        dtype: address,
        device,
        requires_grad,
    })
}
