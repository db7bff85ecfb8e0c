//! Where CPython 3.10 to 3.13 keep the fields meshbind reads in place, taken from `#[repr(C)]`
//! mirrors of CPython's own structs rather than written as numbers.
//!
//! pyo3-ffi defines `PyListObject`, `PyASCIIObject` and `PyDictObject` only outside the limited
//! API, laid out for the one version it is built against; meshbind is one abi3 build that runs
//! on every version from 3.10, so it mirrors each version's layout here and picks one at run time
//! (and the self-check in `mod.rs` confirms the pick on objects it builds).

use std::mem::{offset_of, size_of};
use std::os::raw::c_void;

/// `PyObject` of a default (GIL) build: reference count and type.
#[repr(C)]
struct ObjectHead {
    refcnt: isize,
    ob_type: *mut c_void,
}

/// `PyListObject`.
#[repr(C)]
struct ListObject {
    head: ObjectHead,
    ob_size: isize,
    ob_item: *mut *mut c_void,
    allocated: isize,
}

/// `PyASCIIObject` of 3.10 and 3.11 (with the `wstr` pointer 3.12 removed).
#[repr(C)]
struct AsciiObject310 {
    head: ObjectHead,
    length: isize,
    hash: isize,
    state: u32,
    wstr: *mut c_void,
}

/// `PyASCIIObject` of 3.12 and 3.13.
#[repr(C)]
struct AsciiObject312 {
    head: ObjectHead,
    length: isize,
    hash: isize,
    state: u32,
}

/// `PyDictObject` of 3.11 to 3.13.
#[repr(C)]
struct DictObject {
    head: ObjectHead,
    ma_used: isize,
    ma_version_tag: u64,
    ma_keys: *mut c_void,
    ma_values: *mut c_void,
}

/// `PyDictKeysObject` of 3.11 to 3.13 (a default build); `dk_indices` follows it.
#[repr(C)]
struct DictKeysObject {
    dk_refcnt: isize,
    dk_log2_size: u8,
    dk_log2_index_bytes: u8,
    dk_kind: u8,
    dk_version: u32,
    dk_usable: isize,
    dk_nentries: isize,
}

/// `PyDictValues` of 3.13: a header of four bytes, then the values (3.11 and 3.12 keep their
/// bookkeeping before the pointer, so the values start at it).
#[repr(C)]
struct DictValues313 {
    capacity: u8,
    size: u8,
    embedded: u8,
    valid: u8,
    values: [*mut c_void; 1],
}

/// `PyDictUnicodeEntry`: a str-keyed dict's entry.
#[repr(C)]
struct UnicodeEntry {
    me_key: *mut c_void,
    me_value: *mut c_void,
}

/// Byte offsets of a list's item array and of an ASCII `str`'s fields and text.
#[derive(Clone, Copy, Debug)]
pub struct TextOffsets {
    pub list_items: usize,
    pub str_length: usize,
    pub str_state: usize,
    /// Where a compact ASCII `str`'s text starts: right after its header.
    pub str_text: usize,
}

/// Byte offsets of dicts, their keys and values, and of a managed instance dict (3.11+).
#[derive(Clone, Copy, Debug)]
pub struct DictOffsets {
    pub used: usize,
    pub keys: usize,
    pub values: usize,
    /// Where the values start after the `ma_values` pointer.
    pub values_start: usize,
    pub keys_log2_index_bytes: usize,
    pub keys_kind: usize,
    pub keys_entry_count: usize,
    /// Where the index table starts; the entries follow it.
    pub keys_indices: usize,
    pub entry_size: usize,
    pub entry_value: usize,
    /// How many words before the object its managed instance dict pointer sits.
    pub managed_dict_words_before: usize,
}

/// The offsets of CPython `3.minor`, where meshbind knows them; `dict` is `None` on 3.10 (its
/// instances keep no managed dict).
pub fn for_version(minor: u8) -> Option<(TextOffsets, Option<DictOffsets>)> {
    let (str_length, str_state, str_text) = match minor {
        10 | 11 => (
            offset_of!(AsciiObject310, length),
            offset_of!(AsciiObject310, state),
            size_of::<AsciiObject310>(),
        ),
        12 | 13 => (
            offset_of!(AsciiObject312, length),
            offset_of!(AsciiObject312, state),
            size_of::<AsciiObject312>(),
        ),
        _ => return None,
    };
    let text = TextOffsets {
        list_items: offset_of!(ListObject, ob_item),
        str_length,
        str_state,
        str_text,
    };
    let dict = (minor >= 11).then_some(DictOffsets {
        used: offset_of!(DictObject, ma_used),
        keys: offset_of!(DictObject, ma_keys),
        values: offset_of!(DictObject, ma_values),
        values_start: if minor >= 13 {
            offset_of!(DictValues313, values)
        } else {
            0
        },
        keys_log2_index_bytes: offset_of!(DictKeysObject, dk_log2_index_bytes),
        keys_kind: offset_of!(DictKeysObject, dk_kind),
        keys_entry_count: offset_of!(DictKeysObject, dk_nentries),
        keys_indices: size_of::<DictKeysObject>(),
        entry_size: size_of::<UnicodeEntry>(),
        entry_value: offset_of!(UnicodeEntry, me_value),
        // `_PyObject_ManagedDictPointer`: three words before the object, from 3.11 to 3.13.
        managed_dict_words_before: 3,
    });
    Some((text, dict))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mirrors_give_cpythons_offsets_on_64_bit() {
        if !cfg!(target_pointer_width = "64") {
            return;
        }
        let (text, dict) = for_version(11).unwrap();
        assert_eq!(
            (
                text.list_items,
                text.str_length,
                text.str_state,
                text.str_text
            ),
            (24, 16, 32, 48)
        );
        assert_eq!(for_version(12).unwrap().0.str_text, 40);
        let dict = dict.unwrap();
        assert_eq!(
            (dict.used, dict.keys, dict.values, dict.values_start),
            (16, 32, 40, 0)
        );
        assert_eq!(
            (
                dict.keys_log2_index_bytes,
                dict.keys_kind,
                dict.keys_entry_count,
                dict.keys_indices
            ),
            (9, 10, 24, 32)
        );
        assert_eq!(for_version(13).unwrap().1.unwrap().values_start, 8);
        assert!(for_version(10).unwrap().1.is_none());
        assert!(for_version(14).is_none());
    }
}
