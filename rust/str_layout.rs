//! Reading the `str` items of a list in place, for names by the million.
//!
//! Asking CPython for each item (`PyList_GetItem`) and its UTF-8 text (`PyUnicode_AsUTF8AndSize`)
//! costs two calls per name, as much as matching a name does. On the versions whose object
//! layouts are known (3.10 to 3.13, as `lookahead` reads them), a list's item array and an ASCII
//! `str`'s text are read where they lie; any other item goes through the API as before.

use pyo3::{ffi, Python};

/// `PyListObject.ob_item`, and `PyASCIIObject`'s `length` and `state` fields.
const LIST_ITEMS: usize = 24;
const STR_LENGTH: usize = 16;
const STR_STATE: usize = 32;
/// `state.compact` and `state.ascii`: the text follows the header, one byte per character.
const COMPACT_ASCII: u32 = 1 << 5 | 1 << 6;

pub struct StrLayout {
    /// Where a compact ASCII `str`'s text starts (`None`: a layout not known here).
    text_offset: Option<usize>,
}

impl StrLayout {
    pub fn new(py: Python<'_>) -> Self {
        let version = py.version_info();
        let text_offset = match (version.major, version.minor) {
            // `PyASCIIObject` lost its `wstr` pointer in 3.12.
            (3, 10 | 11) => Some(48),
            (3, 12 | 13) => Some(40),
            _ => None,
        };
        StrLayout {
            text_offset: text_offset.filter(|_| cfg!(target_pointer_width = "64")),
        }
    }

    /// The item array of `list`, when the layout is known.
    ///
    /// # Safety
    /// `list` must be a live list, not resized while the array is read.
    pub unsafe fn items(&self, list: *mut ffi::PyObject) -> Option<*const *mut ffi::PyObject> {
        self.text_offset?;
        Some(
            *(list as *const u8)
                .add(LIST_ITEMS)
                .cast::<*const *mut ffi::PyObject>(),
        )
    }

    /// The text of `item` when it is exactly a `str` stored compact and ASCII.
    ///
    /// # Safety
    /// `item` must be alive for `'a`, and not change.
    pub unsafe fn ascii<'a>(&self, item: *mut ffi::PyObject) -> Option<&'a str> {
        let text_offset = self.text_offset?;
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
            base.add(text_offset),
            length,
        )))
    }
}
