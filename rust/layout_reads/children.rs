//! A module's children, one `PyDict_Next` step at a time, and what a child's reference count
//! says about who else holds it.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The entries of a module's `_modules` dict, in order, each taken as owned references (the walk
/// may run Python code, a `getattr`, before it is done with a child).
pub(crate) struct Children<'py> {
    dict: Bound<'py, PyDict>,
    position: ffi::Py_ssize_t,
    size: ffi::Py_ssize_t,
}

impl<'py> Children<'py> {
    pub(crate) fn new(dict: Bound<'py, PyDict>) -> Self {
        let size = dict.len() as ffi::Py_ssize_t;
        Children {
            dict,
            position: 0,
            size,
        }
    }

    /// The dict the entries come from.
    pub(crate) fn dict(&self) -> &Bound<'py, PyDict> {
        &self.dict
    }

    /// How many entries it had when the walk met it.
    pub(crate) fn size(&self) -> ffi::Py_ssize_t {
        self.size
    }

    /// The position of the next entry, as `PyDict_Next` counts (what the look-ahead reads ahead of).
    pub(crate) fn position(&self) -> ffi::Py_ssize_t {
        self.position
    }

    /// Whether the dict now holds another number of entries than when the walk met it.
    pub(crate) fn changed(&self) -> bool {
        self.dict.len() as ffi::Py_ssize_t != self.size
    }

    /// The next `(name, child)` entry, or `None` at the end.
    pub(crate) fn next_entry(&mut self) -> Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (mut key, mut value) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: `self.dict` is a live dict; `key` and `value` are references borrowed from it,
        // turned into owned ones before anything else runs.
        unsafe {
            if ffi::PyDict_Next(self.dict.as_ptr(), &mut self.position, &mut key, &mut value) == 0 {
                return None;
            }
            let py = self.dict.py();
            Some((
                Bound::from_borrowed_ptr(py, key),
                Bound::from_borrowed_ptr(py, value),
            ))
        }
    }
}

/// Whether something besides its parent's `_modules` holds `child`, an entry that dict holds
/// and the walk holds one owned reference to: then the child may have an alias elsewhere.
pub(crate) fn has_other_holders(child: &Bound<'_, PyAny>) -> bool {
    // SAFETY: `child` is alive.
    unsafe { ffi::Py_REFCNT(child.as_ptr()) > 2 }
}
