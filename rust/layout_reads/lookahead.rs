//! Look-ahead for walking wide modules (an expert list of 1024 children).
//!
//! Each child's `_modules` is found through a chain of objects that lie far apart in memory —
//! the module, its `__dict__`, the dict's values, the `_modules` dict, that dict's entries — and
//! walking one child after another waits for each link in turn. At each step of the walk, the
//! link chains of the children a few positions ahead are followed one link further than the
//! step before did, asking for each link's cache line: the misses of many children then
//! overlap instead of adding up. Children the walk does not enter are read for their names
//! alone, so then only the names ahead are asked for. A walk that keeps the modules it matches
//! (plan resolution) also asks for each child's own children: matched leaves are not entered,
//! and keeping one reads its object, which then is already in cache.
//!
//! The same chain gives the walk each module's `_modules` without a `getattr` call
//! (`modules_in_place`), where reading it gives what `getattr` gives: the class does not
//! override `__getattribute__` or define `_modules`, a `getattr` on an earlier instance found the
//! dict at that slot of its instance dict, and this instance's dict is split with `"_modules"`
//! as that slot's key. Anywhere else the walk asks `getattr`.
//!
//! The prefetches are hints: a prefetch never faults and no answer depends on one. The reads
//! that find the links follow CPython's object layout, so they run only where `layout_reads`
//! allows (its guards, switch and self-check), only on live objects borrowed from the dict being
//! walked, and only within the bounds that layout guarantees.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use pyo3::{ffi, intern, Python};

use super::DictOffsets;
use rustc_hash::FxHashMap;

/// A module with at least this many children is looked ahead over.
pub const WIDE: ffi::Py_ssize_t = 16;

/// The links from an object to the entries of a dict one of its attributes holds (a module's
/// `_modules` here, its `_parameters` in `presence.rs`), in the order they are followed.
#[derive(Clone, Copy)]
pub(crate) enum DictChain {
    /// The object itself and the word before it that points to its instance dict.
    Object,
    /// The object's instance dict.
    InstanceDict,
    /// The slot of the dict's values array that holds the attribute.
    Slot,
    /// The attribute's dict.
    Dict,
    /// That dict's keys, indices and entries.
    Entries,
}

impl DictChain {
    /// Whether following this link needs the attribute's slot, read through the object's class:
    /// the first two links must not read the object, whose line they are still asking for.
    fn needs_slot(self) -> bool {
        matches!(self, DictChain::Slot | DictChain::Dict | DictChain::Entries)
    }
}

/// What the walk asks for of a child ahead.
#[derive(Clone, Copy)]
enum Link {
    /// A link of the chain to the child's `_modules` entries (with the child's name).
    Modules(DictChain),
    /// The child's own children, when the walk records the modules it matches: a matched leaf
    /// (a projection) is not entered, so nothing else asks for it.
    Grandchildren,
}

/// How many children ahead of the walk each link is asked for. A step takes a few hundred
/// nanoseconds, so four steps between links give each miss time to arrive before the next link
/// is read from it; longer distances keep more lines in flight for nothing.
const LINKS: [(Link, usize); 6] = [
    (Link::Modules(DictChain::Object), 20),
    (Link::Modules(DictChain::InstanceDict), 16),
    (Link::Modules(DictChain::Slot), 12),
    (Link::Modules(DictChain::Dict), 8),
    (Link::Modules(DictChain::Entries), 4),
    (Link::Grandchildren, 2),
];

/// How many of a child's own children are asked for (a layer's expert has three projections).
const GRANDCHILDREN: usize = 8;

/// How many children ahead the walk asks for the name of a child it will not enter.
const NAME_DISTANCE: usize = 16;

/// `Py_TPFLAGS_MANAGED_DICT` (3.11+): the instance dict pointer sits before the object.
const MANAGED_DICT: std::os::raw::c_ulong = 1 << 4;
/// `DICT_KEYS_GENERAL`: entries that also store a hash (keys not all str).
const KIND_GENERAL: u8 = 0;

/// Asks for the cache line holding `address`.
#[inline(always)]
pub fn prefetch(address: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch(address as *const i8, _MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

/// Reads the pointer-sized word `offset` bytes into `base`.
///
/// # Safety
/// `base + offset` must lie inside a live object.
#[inline(always)]
unsafe fn word(base: *const u8, offset: usize) -> *const u8 {
    *(base.add(offset) as *const *const u8)
}

/// Per class: which slot of an instance dict's values array holds one attribute (`None`: not
/// found), remembering the class asked for last (a walk meets one class many times in a row).
#[derive(Default)]
pub(crate) struct SlotTable {
    slots: FxHashMap<usize, Option<usize>>,
    last_class: usize,
    last_slot: Option<usize>,
}

impl SlotTable {
    pub(crate) fn get(&mut self, class: usize) -> Option<usize> {
        if class != self.last_class {
            self.last_class = class;
            self.last_slot = self.slots.get(&class).copied().flatten();
        }
        self.last_slot
    }

    /// The slot `link` needs of `object`'s class (`None` also for a link that reads none: see
    /// `DictChain::needs_slot`).
    ///
    /// # Safety
    /// `object` must be alive.
    #[inline(always)]
    pub(crate) unsafe fn for_link(
        &mut self,
        link: DictChain,
        object: *mut ffi::PyObject,
    ) -> Option<usize> {
        if link.needs_slot() {
            self.get(ffi::Py_TYPE(object) as usize)
        } else {
            None
        }
    }

    pub(crate) fn knows(&self, class: usize) -> bool {
        self.slots.contains_key(&class)
    }

    pub(crate) fn insert(&mut self, class: usize, slot: Option<usize>) {
        self.slots.insert(class, slot);
        self.last_class = 0;
    }
}

/// Follows the links from a child module to its `_modules` dict, ahead of the walk (and, through
/// `follow`, any object's chain to a dict attribute: see `presence.rs`).
pub struct Lookahead {
    /// Where dicts keep their fields, when `layout_reads` allows reading them (else nothing is
    /// read or asked for, and `modules_in_place` always answers `None`).
    offsets: Option<DictOffsets>,
    /// Which slot holds `_modules`, per class.
    modules_slot: SlotTable,
    /// Whether the walk reads the modules it matches (then their objects are asked for too).
    reads_matches: bool,
}

impl Lookahead {
    pub fn new(py: Python<'_>) -> Self {
        Self::with_offsets(super::layout(py).and_then(|layout| layout.dict))
    }

    /// A look-ahead reading dicts with `offsets` (the self-check's, before they are confirmed).
    pub(super) fn with_offsets(offsets: Option<DictOffsets>) -> Self {
        Lookahead {
            offsets,
            modules_slot: SlotTable::default(),
            reads_matches: false,
        }
    }

    /// Also asks for the objects of the children's children (see `Link::Grandchildren`).
    pub fn reading_matches(mut self) -> Self {
        self.reads_matches = true;
        self
    }

    /// The instance dict of `object`, when its class keeps one where the layout says.
    ///
    /// # Safety
    /// `object` must be alive.
    pub(super) unsafe fn instance_dict(&self, object: *mut ffi::PyObject) -> Option<*const u8> {
        let offsets = self.offsets.as_ref()?;
        if ffi::PyType_GetFlags(ffi::Py_TYPE(object)) & MANAGED_DICT == 0 {
            return None;
        }
        let dict = *(object as *const *const u8).sub(offsets.managed_dict_words_before);
        // 3.12 tags a pointer to bare values (no dict made yet) with its low bit.
        (!dict.is_null() && dict as usize & 1 == 0).then_some(dict)
    }

    /// The values array of a split dict (`None` for a combined one).
    ///
    /// # Safety
    /// `dict` must be a live dict.
    unsafe fn values_of(&self, dict: *const u8) -> Option<*const *const u8> {
        let offsets = self.offsets.as_ref()?;
        let values = word(dict, offsets.values);
        (!values.is_null()).then(|| values.add(offsets.values_start) as *const *const u8)
    }

    /// Where `object`'s value at `slot` of its split instance dict sits, the slot checked against
    /// the dict's item count (a split dict's values array holds at least that many).
    ///
    /// # Safety
    /// `object` must be alive.
    #[inline(always)]
    unsafe fn slot_value(
        &self,
        object: *mut ffi::PyObject,
        slot: usize,
    ) -> Option<*const *const u8> {
        let dict = self.instance_dict(object)?;
        let values = self.values_of(dict)?;
        (slot < self.used(dict)).then(|| values.add(slot))
    }

    /// The `_modules` dict of `object`, found through the layout.
    ///
    /// # Safety
    /// `object` must be alive.
    unsafe fn modules_dict(&mut self, object: *mut ffi::PyObject) -> Option<*const u8> {
        let slot = self.modules_slot.get(ffi::Py_TYPE(object) as usize)?;
        let modules = *self.slot_value(object, slot)?;
        (!modules.is_null() && ffi::PyDict_Check(modules as *mut ffi::PyObject) != 0)
            .then_some(modules)
    }

    /// Learns, from a module just entered, which values slot holds its class's `_modules`: only
    /// for a class whose `_modules` a `getattr` takes from the instance dict (no class attribute
    /// of that name, `object.__getattribute__`), so that reading the slot gives what `getattr`
    /// gives.
    ///
    /// `modules` is the dict `getattr(object, "_modules")` gave.
    pub fn learn(&mut self, object: &Bound<'_, PyAny>, modules: &Bound<'_, PyDict>) {
        let class = object.get_type().as_ptr() as usize;
        if self.modules_slot.knows(class) {
            return;
        }
        // SAFETY: `object` is alive.
        let slot = plain_getattr(object)
            .then(|| unsafe { self.slot_holding(object.as_ptr(), modules.as_ptr()) });
        self.modules_slot.insert(class, slot.flatten());
    }

    /// Which slot of `object`'s split instance dict holds `value` (`None`: none, or no such dict).
    ///
    /// # Safety
    /// `object` must be alive.
    pub(crate) unsafe fn slot_holding(
        &self,
        object: *mut ffi::PyObject,
        value: *mut ffi::PyObject,
    ) -> Option<usize> {
        let dict = self.instance_dict(object)?;
        let values = self.values_of(dict)?;
        (0..self.used(dict)).find(|&slot| *values.add(slot) == value as *const u8)
    }

    /// The `_modules` dict of `object` read in place, as `getattr(object, "_modules")` would
    /// give it (`None`: ask `getattr`): its class was learned, and this instance's dict is split
    /// with `name` (the interned `"_modules"`) as the key of the class's slot.
    ///
    /// Another `name` than the interned string finds nothing (the keys are compared by identity).
    pub fn modules_in_place<'py>(
        &mut self,
        object: &Bound<'py, PyAny>,
        name: &Bound<'py, PyString>,
    ) -> Option<Bound<'py, PyDict>> {
        // SAFETY: `object` is alive; what is read of it lies within its layout's bounds.
        let found = unsafe { self.modules_dict_named(object.as_ptr(), name.as_ptr())? };
        // SAFETY: a live dict, held by the object's instance dict.
        let dict = unsafe { Bound::from_borrowed_ptr(object.py(), found) };
        dict.cast_into::<PyDict>().ok()
    }

    /// `modules_in_place` on raw pointers.
    ///
    /// # Safety
    /// `object` must be alive.
    unsafe fn modules_dict_named(
        &mut self,
        object: *mut ffi::PyObject,
        name: *mut ffi::PyObject,
    ) -> Option<*mut ffi::PyObject> {
        let slot = self.modules_slot.get(ffi::Py_TYPE(object) as usize)?;
        let dict = self.instance_dict(object)?;
        let values = self.values_of(dict)?;
        let (entries, entry_count) = self.keys_entries(dict)?;
        let holds_name = slot < entry_count
            && slot < self.used(dict)
            && word(entries, slot * self.offsets.as_ref()?.entry_size) == name as *const u8;
        let modules = *values.add(slot) as *mut ffi::PyObject;
        (holds_name && !modules.is_null() && ffi::PyDict_Check(modules) != 0).then_some(modules)
    }

    /// Asks for what the walk will read of the children ahead of `position` (the walk's
    /// `PyDict_Next` position) in `dict`, a module's `_modules`. While the walk enters them, the
    /// links of the children `LINKS` ahead: each child's farther links were asked for on earlier
    /// steps, so each link has arrived before the next is read. Otherwise only their names.
    /// Every read is bounded by the dict's entry count, whatever `position` is.
    pub fn ahead(&mut self, dict: &Bound<'_, PyDict>, position: ffi::Py_ssize_t, entering: bool) {
        // SAFETY: `dict` is a live dict.
        unsafe { self.ahead_of(dict.as_ptr(), position, entering) }
    }

    /// `ahead` on a raw pointer.
    ///
    /// # Safety
    /// `dict` must be a live dict.
    unsafe fn ahead_of(
        &mut self,
        dict: *mut ffi::PyObject,
        position: ffi::Py_ssize_t,
        entering: bool,
    ) {
        let Some((entries, entry_count)) = self.str_entries(dict as *const u8) else {
            return;
        };
        let entry_size = self.offsets.as_ref().map_or(0, |o| o.entry_size);
        let entry = |distance: usize| {
            let index = position as usize + distance;
            (index < entry_count).then(|| entries.add(index * entry_size))
        };
        if !entering {
            if let Some(entry) = entry(NAME_DISTANCE) {
                prefetch(word(entry, 0));
            }
            return;
        }
        for (link, distance) in LINKS {
            let Some(entry) = entry(distance) else {
                continue;
            };
            let (key, child) = (word(entry, 0), word(entry, entry_size / 2));
            // A deleted entry has no value.
            if !child.is_null() {
                self.fetch(link, child as *mut ffi::PyObject, key);
            }
        }
    }

    /// The entries of a combined, str-keyed dict, and how many there are.
    ///
    /// # Safety
    /// `dict` must be a live dict.
    pub(super) unsafe fn str_entries(&self, dict: *const u8) -> Option<(*const u8, usize)> {
        // A split table's positions are not entry indices; module dicts are never split.
        if !word(dict, self.offsets.as_ref()?.values).is_null() {
            return None;
        }
        self.keys_entries(dict)
    }

    /// The entries of a dict's str-keyed keys object (`None` for general keys), and how many.
    ///
    /// # Safety
    /// `dict` must be a live dict.
    unsafe fn keys_entries(&self, dict: *const u8) -> Option<(*const u8, usize)> {
        let offsets = self.offsets.as_ref()?;
        let keys = word(dict, offsets.keys);
        if *keys.add(offsets.keys_kind) == KIND_GENERAL {
            return None;
        }
        let index_bytes = 1 << *keys.add(offsets.keys_log2_index_bytes);
        let entries = keys.add(offsets.keys_indices + index_bytes);
        Some((entries, word(keys, offsets.keys_entry_count) as usize))
    }

    /// A dict's item count (`ma_used`).
    ///
    /// # Safety
    /// `dict` must be a live dict, and `offsets` known.
    unsafe fn used(&self, dict: *const u8) -> usize {
        self.offsets
            .as_ref()
            .map_or(0, |o| word(dict, o.used) as usize)
    }

    /// Prefetches `link` of `child`'s chain.
    ///
    /// # Safety
    /// `child` and `key` must be alive; the links before `link` were asked for already.
    #[inline(always)]
    unsafe fn fetch(&mut self, link: Link, child: *mut ffi::PyObject, key: *const u8) {
        match link {
            Link::Modules(chain) => {
                if let DictChain::Object = chain {
                    prefetch(key);
                }
                let slot = self.modules_slot.for_link(chain, child);
                // The header, indices and entries of a dict of a few children.
                self.follow(chain, child, slot, 3);
            }
            Link::Grandchildren => {
                if !self.reads_matches {
                    return;
                }
                let Some(modules) = self.modules_dict(child) else {
                    return;
                };
                if let Some((entries, count)) = self.str_entries(modules) {
                    let (size, value) = self
                        .offsets
                        .as_ref()
                        .map_or((0, 0), |o| (o.entry_size, o.entry_value));
                    for index in 0..count.min(GRANDCHILDREN) {
                        prefetch(word(entries.add(index * size), value));
                    }
                }
            }
        }
    }

    /// Asks for `link` of the chain from `object` to the dict held at `slot` of its instance dict
    /// (`None`: not known, or not needed by the link: see `SlotTable::for_link`), reading the
    /// links before it, which earlier steps asked for; of the dict's keys, `entry_lines` lines.
    ///
    /// # Safety
    /// `object` must be alive.
    #[inline(always)]
    pub(crate) unsafe fn follow(
        &self,
        link: DictChain,
        object: *mut ffi::PyObject,
        slot: Option<usize>,
        entry_lines: usize,
    ) {
        let Some(offsets) = self.offsets.as_ref() else {
            return;
        };
        let value = || slot.and_then(|slot| self.slot_value(object, slot));
        match link {
            DictChain::Object => {
                let at = object as *const u8;
                prefetch(at.wrapping_sub(8 * (offsets.managed_dict_words_before + 1)));
                prefetch(at);
            }
            DictChain::InstanceDict => {
                if let Some(dict) = self.instance_dict(object) {
                    prefetch(dict);
                    prefetch(dict.wrapping_add(offsets.values));
                }
            }
            DictChain::Slot => {
                if let Some(value) = value() {
                    prefetch(value as *const u8);
                }
            }
            DictChain::Dict => {
                // Not yet known to be a dict (its type is on the line being asked for).
                if let Some(value) = value() {
                    prefetch(*value);
                    prefetch((*value).wrapping_add(offsets.keys));
                }
            }
            DictChain::Entries => {
                if let Some(value) = value() {
                    let dict = *value as *mut ffi::PyObject;
                    if !dict.is_null() && ffi::PyDict_Check(dict) != 0 {
                        let keys = word(dict as *const u8, offsets.keys);
                        for line in 0..entry_lines {
                            prefetch(keys.wrapping_add(64 * line));
                        }
                    }
                }
            }
        }
    }
}

/// Whether `getattr(object, "_modules")` reads the instance dict: the class has no attribute of
/// that name (no descriptor to prefer) and does not override `__getattribute__`.
fn plain_getattr(object: &Bound<'_, PyAny>) -> bool {
    let py = object.py();
    let class = object.get_type();
    let default = py
        .get_type::<pyo3::types::PyAny>()
        .getattr(intern!(py, "__getattribute__"));
    let own = class.getattr(intern!(py, "__getattribute__"));
    let inherited = matches!((own, default), (Ok(own), Ok(default)) if own.is(&default));
    inherited && !class.hasattr(intern!(py, "_modules")).unwrap_or(true)
}
