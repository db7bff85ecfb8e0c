//! Look-ahead through the public C API, for walks that do not read CPython's layout
//! (`MESHBIND_NO_LAYOUT_READS`, or an interpreter whose layout is not known).
//!
//! Each child of a wide module waits, before the walk can enter it, on a chain of cache lines:
//! the child, its instance dict's values, its `_modules` dict, that dict's entries. Without the
//! layout the links cannot be asked for before they are read, but the reading can be moved
//! ahead: a second `PyDict_Next` cursor runs over the same dict `FAR` children ahead of the walk
//! and asks for each child's name and object, takes the child's `_modules` `GETATTR` children
//! ahead and reads that dict's first entry `ENTRIES` ahead. Each step of the walk then works
//! while the misses of the children ahead are in flight, and enters a child with its dict in hand
//! (61 layers of 1024 experts: a third less time).
//!
//! A `_modules` taken ahead is the one the walk's own `getattr` would take: it is taken only on a
//! class known to find it in the instance dict without running Python code (`Attributes`), and
//! whatever the cursor holds is dropped once the walk has run anything that may run Python code.

use std::collections::VecDeque;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use pyo3::{ffi, intern};
use rustc_hash::FxHashMap;

use crate::layout_reads::prefetch;

/// How many children ahead of the walk their names and objects are asked for.
const FAR: usize = 12;
/// How many children ahead their `_modules` is taken.
const GETATTR: usize = 8;
/// How many children ahead that dict's first entry is read (and its value asked for).
const ENTRIES: usize = 4;

/// Reads the attributes the walk needs (`_modules`, `_parameters`) through the public C API.
/// It learns which classes find them in the instance dict alone, and counts the times Python
/// code may have run (`epoch`).
#[derive(Default)]
pub struct Attributes {
    plain: FxHashMap<usize, bool>,
    epoch: u64,
}

impl Attributes {
    /// `getattr(module, name)`. On a class whose lookup runs no Python code (it inherits
    /// `object.__getattribute__` and has no class attribute `_modules` or `_parameters`), a
    /// lookup that finds the attribute is `PyObject_GenericGetAttr`; anything else may run Python
    /// code (a `__getattr__`, a descriptor) and is counted.
    pub fn get<'py>(
        &mut self,
        module: &Bound<'py, PyAny>,
        name: &Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if self.plain(module) {
            // SAFETY: both objects are alive; the call returns a new reference or sets an error.
            let found = unsafe { ffi::PyObject_GenericGetAttr(module.as_ptr(), name.as_ptr()) };
            // SAFETY: a new reference, or null with an error set (taken and dropped here).
            if let Ok(found) = unsafe { Bound::from_owned_ptr_or_err(module.py(), found) } {
                return Ok(found);
            }
        }
        self.epoch += 1;
        module.getattr(name)
    }

    /// Whether `module`'s class looks the walk's attributes up in the instance dict alone,
    /// learned on the first instance met (asking the class may run Python code: counted).
    fn plain(&mut self, module: &Bound<'_, PyAny>) -> bool {
        // SAFETY: the module is alive.
        let class = unsafe { ffi::Py_TYPE(module.as_ptr()) } as usize;
        if let Some(&plain) = self.plain.get(&class) {
            return plain;
        }
        self.epoch += 1;
        let py = module.py();
        let names = [intern!(py, "_modules"), intern!(py, "_parameters")];
        let plain = crate::layout_reads::plain_getattr(module, &names);
        self.plain.insert(class, plain);
        plain
    }

    /// `object`'s `_modules`, taken without running Python code: `None` where that cannot be
    /// known to give what `getattr` gives (a class not met yet, or one not plain) or where the
    /// generic lookup does not find a dict.
    ///
    /// # Safety
    /// `object` must be alive.
    unsafe fn modules_quietly(
        &self,
        py: Python<'_>,
        object: *mut ffi::PyObject,
        name: &Bound<'_, PyString>,
    ) -> Option<Py<PyDict>> {
        if self.plain.get(&(ffi::Py_TYPE(object) as usize)) != Some(&true) {
            return None;
        }
        let found = ffi::PyObject_GenericGetAttr(object, name.as_ptr());
        let found = Bound::from_owned_ptr_or_err(py, found).ok()?;
        found.cast_into::<PyDict>().ok().map(Bound::unbind)
    }
}

/// A child the cursor has met ahead of the walk.
struct Ahead {
    /// The walk's `PyDict_Next` position once it has met this child.
    position: ffi::Py_ssize_t,
    /// Borrowed from the dict being walked: used only while no Python code has run since.
    child: *mut ffi::PyObject,
    modules: Option<Py<PyDict>>,
}

/// The cursor ahead of the walk over one wide module's `_modules`.
#[derive(Default)]
pub struct ChildrenAhead {
    position: ffi::Py_ssize_t,
    ahead: VecDeque<Ahead>,
    /// The `Attributes::epoch` the children in hand were met in.
    epoch: u64,
}

impl ChildrenAhead {
    /// Moves the cursor over `dict` one step on, ahead of the walk. While the walk enters the
    /// children (`entering`), their objects are asked for and their `_modules` taken; otherwise
    /// only their names are asked for.
    ///
    /// # Safety
    /// `dict` must be the live dict the walk iterates.
    pub unsafe fn step(
        &mut self,
        dict: &Bound<'_, PyDict>,
        modules_attr: &Bound<'_, PyString>,
        attributes: &Attributes,
        entering: bool,
    ) {
        if self.epoch != attributes.epoch {
            self.ahead.clear();
            self.epoch = attributes.epoch;
        }
        while self.ahead.len() < FAR {
            let (mut key, mut child) = (std::ptr::null_mut(), std::ptr::null_mut());
            if ffi::PyDict_Next(dict.as_ptr(), &mut self.position, &mut key, &mut child) == 0 {
                break;
            }
            prefetch(key as *const u8);
            if entering {
                prefetch(child as *const u8);
            }
            self.ahead.push_back(Ahead {
                position: self.position,
                child,
                modules: None,
            });
        }
        if !entering {
            return;
        }
        if let Some(entry) = self.ahead.get_mut(GETATTR) {
            if entry.modules.is_none() {
                entry.modules = attributes.modules_quietly(dict.py(), entry.child, modules_attr);
            }
        }
        if let Some(Ahead {
            modules: Some(modules),
            ..
        }) = self.ahead.get(ENTRIES)
        {
            let (mut position, mut key, mut child) =
                (0, std::ptr::null_mut(), std::ptr::null_mut());
            if ffi::PyDict_Next(modules.as_ptr(), &mut position, &mut key, &mut child) != 0 {
                prefetch(child as *const u8);
            }
        }
    }

    /// Drops the children up to the one the walk met at `position` (`child`), and gives the
    /// `_modules` taken for it, if any.
    pub fn take(
        &mut self,
        position: ffi::Py_ssize_t,
        child: *mut ffi::PyObject,
    ) -> Option<Py<PyDict>> {
        while self.ahead.front()?.position <= position {
            let front = self.ahead.pop_front()?;
            if front.position == position && front.child == child {
                return front.modules;
            }
        }
        None
    }
}
