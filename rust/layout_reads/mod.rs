//! Every read of CPython's object layout, in one place: the guards that allow them, the
//! `MESHBIND_NO_LAYOUT_READS` switch that turns them off, and the self-check that confirms each
//! offset on objects built here before any is used.
//!
//! The reads are a speed path only. Where the layout is not one meshbind knows (another
//! version, a 32-bit or big-endian machine), where the switch is set, or where the self-check
//! finds any offset disagreeing with what the public C API says of the same object, every caller
//! takes the public C API instead, with the same results. The decision is made once per process,
//! silently; `status()` says which it was.

mod children;
mod list_texts;
mod lookahead;
#[allow(dead_code)] // the mirrored structs exist for their field offsets
mod offsets;
mod presence;

pub(crate) use children::{has_other_holders, Children, Step};
pub(crate) use list_texts::{list_strs, list_texts, ListTexts, COMPACT_ASCII};
pub(crate) use lookahead::{DictChain, Lookahead, SlotTable, WIDE};
pub(crate) use offsets::{DictOffsets, TextOffsets};
pub(crate) use presence::modules_lacking;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};
use pyo3::{ffi, intern};

/// The environment variable that routes every layout read through the public C API.
pub const SWITCH: &str = "MESHBIND_NO_LAYOUT_READS";

/// The offsets in use, confirmed by the self-check.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub text: TextOffsets,
    /// `None` where dicts are not read in place: 3.10, or a machine other than x86-64, where the
    /// look-ahead's prefetches (which these reads serve) ask for nothing.
    pub dict: Option<DictOffsets>,
}

static DECISION: PyOnceLock<Result<Layout, String>> = PyOnceLock::new();

/// The layout to read in place, or `None`: take the public C API.
pub fn layout(py: Python<'_>) -> Option<&'static Layout> {
    decision(py).as_ref().ok()
}

/// `"on"`, or `"off: <why>"`.
pub fn status(py: Python<'_>) -> String {
    match decision(py) {
        Ok(layout) if layout.dict.is_some() => "on".to_owned(),
        Ok(_) => "on (list and str reads; dicts through the C API on this interpreter)".to_owned(),
        Err(why) => format!("off: {why}"),
    }
}

fn decision(py: Python<'_>) -> &'static Result<Layout, String> {
    DECISION.get_or_init(py, || {
        if switched_off() {
            return Err(format!("{SWITCH} is set"));
        }
        let layout = known(py)?;
        self_check(py, &layout)?;
        Ok(layout)
    })
}

fn switched_off() -> bool {
    std::env::var_os(SWITCH).is_some_and(|value| !value.is_empty() && value != "0")
}

/// The guards, all of them: a 64-bit little-endian machine, a default (GIL) CPython of a version
/// whose layout is mirrored in `offsets.rs`; dicts only on x86-64 from 3.11.
pub fn known(py: Python<'_>) -> Result<Layout, String> {
    if !cfg!(target_pointer_width = "64") {
        return Err("not a 64-bit machine".to_owned());
    }
    if !cfg!(target_endian = "little") {
        return Err("not a little-endian machine (the str state bits are read as a little-endian bit field)".to_owned());
    }
    let version = py.version_info();
    let known = (version.major == 3)
        .then(|| offsets::for_version(version.minor))
        .flatten();
    let Some((text, dict)) = known else {
        return Err(format!(
            "CPython {}.{} has no known layout",
            version.major, version.minor
        ));
    };
    let dict = dict.filter(|_| cfg!(target_arch = "x86_64"));
    Ok(Layout { text, dict })
}

/// The known offsets with the one named `field` moved one word on (`managed_dict`: one word
/// farther from the object), for the tests of the self-check; `None` for a name it does not know.
#[cfg(feature = "test-hooks")]
pub fn perturbed(py: Python<'_>, field: &str) -> Result<Option<Layout>, String> {
    let mut layout = known(py)?;
    let text = &mut layout.text;
    let slot = match field {
        "list_items" => &mut text.list_items,
        "str_length" => &mut text.str_length,
        "str_state" => &mut text.str_state,
        "str_text" => &mut text.str_text,
        _ => {
            let Some(dict) = layout.dict.as_mut() else {
                return Ok(None);
            };
            match field {
                "dict_used" => &mut dict.used,
                "dict_keys" => &mut dict.keys,
                "keys_entry_count" => &mut dict.keys_entry_count,
                "managed_dict" => &mut dict.managed_dict_words_before,
                _ => return Ok(None),
            }
        }
    };
    *slot += if field == "managed_dict" { 1 } else { 8 };
    Ok(Some(layout))
}

/// Confirms every offset of `layout` on objects built here, against what the public C API says
/// of them; the first disagreement is the error. A pointer is checked before it is followed.
pub fn self_check(py: Python<'_>, layout: &Layout) -> Result<(), String> {
    check_texts(py, &layout.text).map_err(|why| format!("self-check: {why}"))?;
    if let Some(dict) = &layout.dict {
        check_dicts(py, dict).map_err(|why| format!("self-check: {why}"))?;
    }
    Ok(())
}

/// Its first byte reads as neither compact nor ASCII if taken for a state (`M`: bit 5 clear).
const ASCII_PROBE: &str = "Meshbind layout probe: ascii text";
const WIDE_PROBE: &str = "meshbind layout probe: non-ascii \u{e9}";

fn failed(what: &str) -> impl Fn(PyErr) -> String + '_ {
    move |error| format!("{what}: {error}")
}

/// A pointer that may be followed: not null, not in the first pages, aligned to a word.
fn plausible(pointer: *const u8) -> bool {
    pointer as usize >= 1 << 16 && pointer as usize % std::mem::align_of::<usize>() == 0
}

/// # Safety
/// `base + offset` must lie inside a live object.
unsafe fn word_at(base: *const u8, offset: usize) -> *const u8 {
    *(base.add(offset) as *const *const u8)
}

fn check_texts(py: Python<'_>, text: &TextOffsets) -> Result<(), String> {
    let list = PyList::new(py, [ASCII_PROBE, WIDE_PROBE]).map_err(failed("building a list"))?;
    // SAFETY: the list object is larger than any offset of `TextOffsets` but the text's.
    let items = unsafe { word_at(list.as_ptr() as *const u8, text.list_items) };
    if !plausible(items) {
        return Err("a list's item array is not where the layout says".to_owned());
    }
    for index in 0..2 {
        // SAFETY: the array pointer passed the check above; the list holds two items.
        let read = unsafe { *(items as *const *mut ffi::PyObject).add(index) };
        if read != items_read(&list, index) {
            return Err(format!(
                "list item {index} read in place is not PyList_GetItem's"
            ));
        }
    }
    let ascii = items_read(&list, 0);
    // SAFETY: the item is a live str, larger than its header.
    let (length, state) = unsafe {
        let base = ascii as *const u8;
        (
            word_at(base, text.str_length) as usize,
            *base.add(text.str_state).cast::<u32>(),
        )
    };
    if length != ASCII_PROBE.len() {
        return Err(format!(
            "an ASCII str's length reads {length}, not {}",
            ASCII_PROBE.len()
        ));
    }
    // Compact, ASCII, and of kind 1 (one byte per character).
    if state & COMPACT_ASCII != COMPACT_ASCII || (state >> 2) & 0b111 != 1 {
        return Err("an ASCII str's state does not read compact and ASCII".to_owned());
    }
    // SAFETY: the list is not changed, and no Python code runs, while the texts are read.
    let texts = unsafe { ListTexts::with_offsets(&list, *text) };
    if texts.ascii(0) != Some(ASCII_PROBE) {
        return Err("an ASCII str's length, state or text is not where the layout says".to_owned());
    }
    if texts.ascii(1).is_some() {
        return Err("a non-ASCII str reads as ASCII".to_owned());
    }
    Ok(())
}

/// Item `index` of `list`, through the API.
fn items_read(list: &Bound<'_, PyList>, index: usize) -> *mut ffi::PyObject {
    // SAFETY: the caller's index is in bounds.
    unsafe { ffi::PyList_GetItem(list.as_ptr(), index as ffi::Py_ssize_t) }
}

fn check_dicts(py: Python<'_>, offsets: &DictOffsets) -> Result<(), String> {
    let children = PyDict::new(py);
    for (key, value) in [("alpha", 1), ("beta", 2), ("gamma", 3)] {
        children
            .set_item(key, value)
            .map_err(failed("building a dict"))?;
    }
    check_combined(&children, offsets)?;
    // A class whose instances keep their attributes in a managed dict, as `nn.Module` does.
    let bases = PyTuple::new(py, [py.get_type::<pyo3::types::PyAny>()])
        .map_err(failed("building a class"))?;
    let class = py
        .get_type::<PyType>()
        .call1(("MeshbindLayoutProbe", bases, PyDict::new(py)))
        .map_err(failed("building a class"))?;
    let probe = class.call0().map_err(failed("building an instance"))?;
    probe
        .setattr("_parameters", PyDict::new(py))
        .map_err(failed("setting an attribute"))?;
    probe
        .setattr(intern!(py, "_modules"), &children)
        .map_err(failed("setting an attribute"))?;
    // Reading `__dict__` makes the dict, as `nn.Module.__setattr__` does for every module.
    let instance_dict = probe
        .getattr("__dict__")
        .map_err(failed("reading __dict__"))?;
    let mut lookahead = Lookahead::with_offsets(Some(*offsets));
    // SAFETY: the probe is alive.
    let read = unsafe { lookahead.instance_dict(probe.as_ptr()) };
    if read != Some(instance_dict.as_ptr() as *const u8) {
        return Err("a managed instance dict is not where the layout says".to_owned());
    }
    // SAFETY: the dict pointer was confirmed just above.
    let used = unsafe { word_at(instance_dict.as_ptr() as *const u8, offsets.used) } as usize;
    if used != 2 {
        return Err(format!("an instance dict's item count reads {used}, not 2"));
    }
    lookahead.learn(&probe, &children);
    let in_place = lookahead.modules_in_place(&probe, intern!(py, "_modules"));
    if in_place.map(|dict| dict.as_ptr()) != Some(children.as_ptr()) {
        return Err("an instance's _modules read in place is not what getattr gives".to_owned());
    }
    Ok(())
}

/// A str-keyed combined dict: its item count, keys and entries as `PyDict_Next` gives them.
fn check_combined(dict: &Bound<'_, PyDict>, offsets: &DictOffsets) -> Result<(), String> {
    let base = dict.as_ptr() as *const u8;
    // SAFETY: every offset of the dict's own fields lies inside it.
    let (used, keys, values) = unsafe {
        (
            word_at(base, offsets.used) as usize,
            word_at(base, offsets.keys),
            word_at(base, offsets.values),
        )
    };
    if used != dict.len() {
        return Err(format!(
            "a dict's item count reads {used}, not {}",
            dict.len()
        ));
    }
    if !values.is_null() || !plausible(keys) {
        return Err("a combined dict's keys and values are not where the layout says".to_owned());
    }
    let lookahead = Lookahead::with_offsets(Some(*offsets));
    // SAFETY: a live dict whose keys pointer passed the check above.
    let Some((entries, count)) = (unsafe { lookahead.str_entries(base) }) else {
        return Err("a str-keyed dict's keys read as general keys".to_owned());
    };
    if count != dict.len() {
        return Err(format!(
            "a dict's entry count reads {count}, not {}",
            dict.len()
        ));
    }
    for (index, (key, value)) in dict.iter().enumerate() {
        // SAFETY: `index` is below the entry count just confirmed.
        let (read_key, read_value) = unsafe {
            let entry = entries.add(index * offsets.entry_size);
            (word_at(entry, 0), word_at(entry, offsets.entry_value))
        };
        if read_key != key.as_ptr() as *const u8 || read_value != value.as_ptr() as *const u8 {
            return Err(format!(
                "dict entry {index} read in place is not PyDict_Next's"
            ));
        }
    }
    Ok(())
}
