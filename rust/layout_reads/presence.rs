//! Which modules of a list lack a parameter: the `layout` check for a provider that
//! names a parameter a planned module does not have, over every planned module at once.
//!
//! Each answer is `getattr(module, "_parameters")` and a dict lookup, but the modules of a large
//! plan lie far apart in memory and each answer waits on a chain of cache lines (the module, its
//! instance dict, the dict's values, the `_parameters` dict, that dict's keys). As in the walk's
//! look-ahead, the chains of the modules a few positions ahead are followed one link further at
//! each step, so their misses overlap instead of adding up. The prefetches are hints only (they
//! run where `Lookahead` knows CPython's layout): every answer comes from `getattr` and
//! `PyDict_Contains`.

use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{ffi, intern};

use super::{DictChain, Lookahead, SlotTable};

/// How many modules ahead each link is asked for (one lookup takes about as long as a step of
/// the walk, so the walk's spacing serves here too).
const LINKS: [(DictChain, usize); 5] = [
    (DictChain::Object, 20),
    (DictChain::InstanceDict, 16),
    (DictChain::Slot, 12),
    (DictChain::Dict, 8),
    (DictChain::Entries, 4),
];

/// The positions in `rows` (every index of `modules` when `None`) of the modules whose
/// `_parameters` dict has no key `path`. A `_parameters` that is not a dict is a `TypeError`, and a
/// row beyond the list an `IndexError`, each naming the module's index.
pub fn modules_lacking(
    modules: &Bound<'_, PyList>,
    path: &Bound<'_, PyString>,
    rows: Option<&[u32]>,
) -> PyResult<Vec<u32>> {
    let py = modules.py();
    let name = intern!(py, "_parameters");
    let mut chains = ParameterChains {
        layout: Lookahead::new(py),
        slots: SlotTable::default(),
    };
    let row_at = |position: usize| rows.map_or(position, |rows| rows[position] as usize);
    let mut lacking = Vec::new();
    let mut position = 0;
    // `getattr` may run Python code that changes the list: its length is read at every step.
    while position < rows.map_or(modules.len(), <[u32]>::len) {
        for (link, distance) in LINKS {
            let ahead = position + distance;
            if ahead < rows.map_or(modules.len(), <[u32]>::len) && row_at(ahead) < modules.len() {
                // SAFETY: the row is in bounds, so the item is a live, borrowed reference that
                // no Python code can release before `follow` returns.
                unsafe {
                    let item =
                        ffi::PyList_GetItem(modules.as_ptr(), row_at(ahead) as ffi::Py_ssize_t);
                    if !item.is_null() {
                        chains.follow(link, item);
                    }
                }
            }
        }
        let index = row_at(position);
        let module = modules.get_item(index).map_err(|_| {
            PyIndexError::new_err(format!(
                "row {index} is beyond the {} modules",
                modules.len()
            ))
        })?;
        let parameters = module.getattr(name)?;
        let parameters = parameters.cast::<PyDict>().map_err(|_| {
            PyTypeError::new_err(format!(
                "modules[{index}]._parameters is a {}, not a dict",
                parameters
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        chains.learn(&module, parameters);
        if !parameters.contains(path)? {
            lacking.push(position as u32);
        }
        position += 1;
    }
    Ok(lacking)
}

/// Follows modules' chains to their `_parameters` keys, ahead of the lookups.
struct ParameterChains {
    layout: Lookahead,
    /// Which slot held `_parameters`, per class.
    slots: SlotTable,
}

impl ParameterChains {
    fn learn(&mut self, module: &Bound<'_, PyAny>, parameters: &Bound<'_, PyDict>) {
        let class = module.get_type().as_ptr() as usize;
        if !self.slots.knows(class) {
            // SAFETY: `module` is alive.
            let slot = unsafe {
                self.layout
                    .slot_holding(module.as_ptr(), parameters.as_ptr())
            };
            self.slots.insert(class, slot);
        }
    }

    /// Asks for `link` of `module`'s chain to its `_parameters` keys.
    ///
    /// # Safety
    /// `module` must be alive.
    unsafe fn follow(&mut self, link: DictChain, module: *mut ffi::PyObject) {
        let slot = self.slots.for_link(link, module);
        // The header, indices and entries of a dict of a few parameters.
        self.layout.follow(link, module, slot, 2);
    }
}
