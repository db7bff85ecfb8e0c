//! Reading the `str` items of a list in place, for names by the million.
//!
//! Asking CPython for each item (`PyList_GetItem`) and its UTF-8 text (`PyUnicode_AsUTF8AndSize`)
//! costs two calls per name, as much as matching a name does. Where `layout_reads` allows it, a
//! list's item array and an ASCII `str`'s text are read where they lie; any other item goes
//! through the API.

use std::marker::PhantomData;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};
use pyo3::{ffi, Borrowed};

use crate::utf8::not_utf8_error;

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

/// The items of `list` read in place, where `layout_reads` allows it (`None`: through the API).
///
/// Crate-internal: the texts are borrowed from the list's items, which hold while no Python code
/// runs and the list does not change; every caller here matches names and runs nothing else.
pub(crate) fn list_texts<'l>(list: &'l Bound<'_, PyList>) -> Option<ListTexts<'l>> {
    let layout = super::layout(list.py())?;
    // SAFETY: the callers keep the condition above.
    Some(unsafe { ListTexts::with_offsets(list, layout.text) })
}

/// The `str` items of a list, borrowed in place where they can be, naming `what[i]` for an item
/// that is not one. Crate-internal, borrowed as `list_texts`'s are.
pub(crate) fn list_strs<'a>(
    list: &'a Bound<'_, PyList>,
    what: &'a str,
) -> impl Iterator<Item = PyResult<&'a str>> + 'a {
    let texts = list_texts(list);
    (0..list.len()).map(move |i| {
        if let Some(text) = texts.as_ref().and_then(|texts| texts.ascii(i)) {
            return Ok(text);
        }
        // SAFETY: PyList_GetItem checks the index and returns a reference borrowed from the list.
        let item = unsafe {
            Borrowed::from_ptr_or_err(
                list.py(),
                ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t),
            )
        }?;
        let mut size: ffi::Py_ssize_t = 0;
        // SAFETY: `item` is alive; for a str, the UTF-8 buffer CPython returns (and caches in the
        // object) lives as long as the object, which the list holds while it is borrowed.
        let data = unsafe { ffi::PyUnicode_AsUTF8AndSize(item.as_ptr(), &mut size) };
        if data.is_null() {
            PyErr::fetch(list.py());
            if item.is_instance_of::<PyString>() {
                return Err(not_utf8_error(&format!("{what}[{i}]"), &item.to_owned()));
            }
            let name = item.get_type().name().map(|n| n.to_string());
            return Err(PyTypeError::new_err(format!(
                "{what}[{i}] must be a str, got {}",
                name.as_deref().unwrap_or("?")
            )));
        }
        // SAFETY: CPython hands out valid UTF-8 of `size` bytes.
        Ok(unsafe {
            std::str::from_utf8_unchecked(std::slice::from_raw_parts(data.cast(), size as usize))
        })
    })
}

impl<'l> ListTexts<'l> {
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
