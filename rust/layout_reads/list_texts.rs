//! Reading the `str` items of a list in place, for names by the million.
//!
//! Asking CPython for each item (`PyList_GetItem`) and its UTF-8 text (`PyUnicode_AsUTF8AndSize`)
//! costs two calls per name, as much as matching a name does. Where `layout_reads` allows it, a
//! list's item array and an ASCII `str`'s text are read where they lie; any other item goes
//! through the API.

use std::marker::PhantomData;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::lookahead::prefetch;
use super::TextOffsets;

/// `state.compact` and `state.ascii`: the text follows the header, one byte per character.
pub const COMPACT_ASCII: u32 = 1 << 5 | 1 << 6;
/// How many items ahead of the one read a string is asked for: a list's strings may lie anywhere
/// in memory (allocated among a model's objects, say).
const READ_AHEAD: usize = 16;

/// The items of a list, read in place; shared by the threads matching runs of it.
pub struct ListTexts<'l> {
    items: *const *mut ffi::PyObject,
    len: usize,
    offsets: TextOffsets,
    list: PhantomData<&'l PyList>,
}

// SAFETY: the items are only read, while the list stays as it is (see `ListTexts::new`).
unsafe impl Sync for ListTexts<'_> {}

impl<'l> ListTexts<'l> {
    /// The items of `list`, where `layout_reads` allows reading them in place.
    ///
    /// # Safety
    /// No Python code may run, and the list may not change, while the texts are read.
    pub unsafe fn new(list: &'l Bound<'_, PyList>) -> Option<Self> {
        let layout = super::layout(list.py())?;
        Some(Self::with_offsets(list, layout.text))
    }

    /// The items of `list` read with `offsets` (the self-check's, before they are confirmed).
    ///
    /// # Safety
    /// As for `new`; and `offsets.list_items` must give the list's item array.
    pub(super) unsafe fn with_offsets(list: &'l Bound<'_, PyList>, offsets: TextOffsets) -> Self {
        ListTexts {
            items: *(list.as_ptr() as *const u8)
                .add(offsets.list_items)
                .cast::<*const *mut ffi::PyObject>(),
            len: list.len(),
            offsets,
            list: PhantomData,
        }
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
            if *base.add(self.offsets.str_state).cast::<u32>() & COMPACT_ASCII != COMPACT_ASCII {
                return None;
            }
            let length = *base.add(self.offsets.str_length).cast::<ffi::Py_ssize_t>() as usize;
            // ASCII is valid UTF-8.
            Some(std::str::from_utf8_unchecked(std::slice::from_raw_parts(
                base.add(self.offsets.str_text),
                length,
            )))
        }
    }
}
