//! Which modules of a list lack a parameter: the `layout` check of SPEC §4 for a provider that
//! names a parameter a planned module does not have, over every planned module at once.
//!
//! Each answer is `getattr(module, "_parameters")` and a dict lookup, but the modules of a large
//! plan lie far apart in memory and each answer waits on a chain of cache lines (the module, its
//! instance dict, the dict's values, the `_parameters` dict, that dict's keys). As in the walk's
//! look-ahead, the chains of the modules a few positions ahead are followed one link further at
//! each step, so their misses overlap instead of adding up. The prefetches are hints only (they
//! run where `Lookahead` knows CPython's layout): every answer comes from `getattr` and
//! `PyDict_Contains`.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{ffi, intern};
use rustc_hash::FxHashMap;

use crate::lookahead::{
    prefetch, word, Lookahead, DICT_KEYS, DICT_USED, DICT_VALUES, MANAGED_DICT_WORDS_BEFORE,
};

/// The links from a module to its `_parameters` keys, in the order they are followed.
#[derive(Clone, Copy)]
enum Link {
    Module,
    InstanceDict,
    ParametersSlot,
    ParametersDict,
    ParametersKeys,
}

/// How many modules ahead each link is asked for (one lookup takes about as long as a step of
/// the walk, so the walk's spacing serves here too).
const LINKS: [(Link, usize); 5] = [
    (Link::Module, 20),
    (Link::InstanceDict, 16),
    (Link::ParametersSlot, 12),
    (Link::ParametersDict, 8),
    (Link::ParametersKeys, 4),
];

/// The indices of the modules in `modules` whose `_parameters` dict has no key `path`.
/// A `_parameters` that is not a dict is a `TypeError` naming the module's index.
pub fn modules_lacking(
    modules: &Bound<'_, PyList>,
    path: &Bound<'_, PyString>,
) -> PyResult<Vec<u32>> {
    let py = modules.py();
    let name = intern!(py, "_parameters");
    let mut chains = ParameterChains {
        layout: Lookahead::new(py),
        slots: FxHashMap::default(),
    };
    let mut lacking = Vec::new();
    let mut index = 0;
    // `getattr` may run Python code that changes the list: its length is read at every step.
    while index < modules.len() {
        for (link, distance) in LINKS {
            let ahead = index + distance;
            if ahead < modules.len() {
                // SAFETY: `ahead` is in bounds, so the item is a live, borrowed reference that
                // no Python code can release before `follow` returns.
                unsafe {
                    let item = ffi::PyList_GetItem(modules.as_ptr(), ahead as ffi::Py_ssize_t);
                    if !item.is_null() {
                        chains.follow(link, item);
                    }
                }
            }
        }
        let module = modules.get_item(index)?;
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
            lacking.push(index as u32);
        }
        index += 1;
    }
    Ok(lacking)
}

/// Follows modules' chains to their `_parameters` keys, ahead of the lookups.
struct ParameterChains {
    layout: Lookahead,
    /// Per class: which slot of an instance dict's values held `_parameters` (`None`: not found).
    slots: FxHashMap<usize, Option<usize>>,
}

impl ParameterChains {
    fn learn(&mut self, module: &Bound<'_, PyAny>, parameters: &Bound<'_, PyDict>) {
        let class = module.get_type().as_ptr() as usize;
        if !self.slots.contains_key(&class) {
            // SAFETY: `module` is alive.
            let slot = unsafe {
                self.layout
                    .slot_holding(module.as_ptr(), parameters.as_ptr())
            };
            self.slots.insert(class, slot);
        }
    }

    /// Where `module`'s `_parameters` value sits, the slot checked against the dict's item count.
    ///
    /// # Safety
    /// `module` must be alive.
    unsafe fn parameters_value(&self, module: *mut ffi::PyObject) -> Option<*const *const u8> {
        let slot = (*self.slots.get(&(ffi::Py_TYPE(module) as usize))?)?;
        let dict = self.layout.instance_dict(module)?;
        let values = self.layout.values_of(dict)?;
        (slot < word(dict, DICT_USED) as usize).then(|| values.add(slot))
    }

    /// Asks for `link` of `module`'s chain; the links before it were asked for on earlier steps.
    ///
    /// # Safety
    /// `module` must be alive.
    unsafe fn follow(&self, link: Link, module: *mut ffi::PyObject) {
        match link {
            Link::Module => {
                let at = module as *const u8;
                prefetch(at.wrapping_sub(8 * (MANAGED_DICT_WORDS_BEFORE + 1)));
                prefetch(at);
            }
            Link::InstanceDict => {
                if let Some(dict) = self.layout.instance_dict(module) {
                    prefetch(dict);
                    prefetch(dict.wrapping_add(DICT_VALUES));
                }
            }
            Link::ParametersSlot => {
                if let Some(value) = self.parameters_value(module) {
                    prefetch(value as *const u8);
                }
            }
            Link::ParametersDict => {
                // Not yet known to be a dict (its type is on the line being asked for).
                if let Some(value) = self.parameters_value(module) {
                    prefetch(*value);
                    prefetch((*value).wrapping_add(DICT_KEYS));
                }
            }
            Link::ParametersKeys => {
                if let Some(value) = self.parameters_value(module) {
                    let parameters = *value as *mut ffi::PyObject;
                    if !parameters.is_null() && ffi::PyDict_Check(parameters) != 0 {
                        // The header, indices and entries of a dict of a few parameters.
                        let keys = word(parameters as *const u8, DICT_KEYS);
                        prefetch(keys);
                        prefetch(keys.wrapping_add(64));
                    }
                }
            }
        }
    }
}
