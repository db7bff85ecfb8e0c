//! Reading the `str` items of a list in place, for names by the million.
//!
//! Asking CPython for each item (`PyList_GetItem`) and its UTF-8 text (`PyUnicode_AsUTF8AndSize`)
//! costs two calls per name, as much as matching a name does. On the versions whose object
//! layouts are known (3.10 to 3.13, as `lookahead` reads them), a list's item array and an ASCII
//! `str`'s text are read where they lie; any other item goes through the API as before.

use std::marker::PhantomData;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::lookahead::prefetch;

/// `PyListObject.ob_item`, and `PyASCIIObject`'s `length` and `state` fields.
const LIST_ITEMS: usize = 24;
const STR_LENGTH: usize = 16;
const STR_STATE: usize = 32;
/// `state.compact` and `state.ascii`: the text follows the header, one byte per character.
const COMPACT_ASCII: u32 = 1 << 5 | 1 << 6;
/// How many items ahead of the one read a string is asked for: a list's strings may lie anywhere
/// in memory (allocated among a model's objects, say).
const READ_AHEAD: usize = 16;

/// The items of a list, read in place; shared by the threads matching runs of it.
pub struct ListTexts<'l> {
    items: *const *mut ffi::PyObject,
    len: usize,
    /// Where a compact ASCII `str`'s text starts.
    text_offset: usize,
    list: PhantomData<&'l PyList>,
}

// SAFETY: the items are only read, while the list stays as it is (see `ListTexts::new`).
unsafe impl Sync for ListTexts<'_> {}

impl<'l> ListTexts<'l> {
    /// The items of `list`, when the running CPython's layout is known.
    ///
    /// # Safety
    /// No Python code may run, and the list may not change, while the texts are read.
    pub unsafe fn new(list: &'l Bound<'_, PyList>) -> Option<Self> {
        let version = list.py().version_info();
        let text_offset = match (version.major, version.minor) {
            // `PyASCIIObject` lost its `wstr` pointer in 3.12.
            (3, 10 | 11) => 48,
            (3, 12 | 13) => 40,
            _ => return None,
        };
        if !cfg!(target_pointer_width = "64") {
            return None;
        }
        Some(ListTexts {
            items: *(list.as_ptr() as *const u8)
                .add(LIST_ITEMS)
                .cast::<*const *mut ffi::PyObject>(),
            len: list.len(),
            text_offset,
            list: PhantomData,
        })
    }

    /// The text of item `i` when it is exactly a `str` stored compact and ASCII (`None`: read
    /// it through the API). Asks for the string `READ_AHEAD` items on.
    pub fn ascii(&self, i: usize) -> Option<&'l str> {
        if i >= self.len {
            return None;
        }
        // SAFETY: both indices are below the list's length, and its items are alive.
        let item = unsafe {
            let ahead = *self.items.add((i + READ_AHEAD).min(self.len - 1)) as *const u8;
            prefetch(ahead);
            prefetch(ahead.wrapping_add(64));
            *self.items.add(i)
        };
        // SAFETY: the item is alive and unchanged while the list is (see `new`).
        unsafe {
            if ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(ffi::PyUnicode_Type) {
                return None;
            }
            let base = item as *const u8;
            if *base.add(STR_STATE).cast::<u32>() & COMPACT_ASCII != COMPACT_ASCII {
                return None;
            }
            let length = *base.add(STR_LENGTH).cast::<ffi::Py_ssize_t>() as usize;
            // ASCII is valid UTF-8.
            Some(std::str::from_utf8_unchecked(std::slice::from_raw_parts(
                base.add(self.text_offset),
                length,
            )))
        }
    }
}
