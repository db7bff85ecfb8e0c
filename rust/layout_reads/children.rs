//! A module's children, one `PyDict_Next` step at a time, lent as borrowed references, and what
//! a child's reference count says about who else holds it.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::Borrowed;

/// The entries of a module's `_modules` dict, in order. Each entry is lent, not owned: taking a
/// reference writes to the child object, and a pruned walk that only matches a child's name
/// must not touch the child's memory at all (a cache miss per leaf, a fifth of the `deep` walk).
pub(crate) struct Children<'py> {
    dict: Bound<'py, PyDict>,
    position: ffi::Py_ssize_t,
    size: ffi::Py_ssize_t,
}

/// One step of `Children::next_entry`.
pub(crate) enum Step<'a, 'py> {
    /// A `(name, child)` entry, borrowed from the dict.
    Entry(Borrowed<'a, 'py, PyAny>, Borrowed<'a, 'py, PyAny>),
    /// The dict now holds another number of entries than when the walk met it.
    Changed,
    End,
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

    /// The next entry, lent for as long as `self` is borrowed: the caller runs no Python code
    /// while it holds one, and takes an owned reference (`to_owned`) to a child it keeps or
    /// enters before it does.
    pub(crate) fn next_entry(&mut self) -> Step<'_, 'py> {
        let (mut key, mut value) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: `self.dict` is a live dict; `key` and `value` are references borrowed from it,
        // lent out only while `self` stays borrowed, during which the walk runs no Python code
        // (nothing can remove them from the dict).
        unsafe {
            if ffi::PyDict_Next(self.dict.as_ptr(), &mut self.position, &mut key, &mut value) == 0 {
                return Step::End;
            }
            if ffi::PyDict_Size(self.dict.as_ptr()) != self.size {
                return Step::Changed;
            }
            let py = self.dict.py();
            Step::Entry(Borrowed::from_ptr(py, key), Borrowed::from_ptr(py, value))
        }
    }
}

/// Whether something besides its parent's `_modules` holds `child`, an entry borrowed from that
/// dict (which holds one reference): then the child may have an alias elsewhere.
pub(crate) fn has_other_holders(child: &Borrowed<'_, '_, PyAny>) -> bool {
    // SAFETY: `child` is alive.
    unsafe { ffi::Py_REFCNT(child.as_ptr()) > 1 }
}
