//! Walking an `nn.Module` tree through its `_modules` dictionaries, matching a pattern set on
//! the way (one walk; every alias of a shared module is a candidate; a module is keyed
//! by its first FQN in `named_modules()` order).
//!
//! The walk is iterative (deep trees cannot overflow the stack), preorder like `named_modules()`,
//! and descends into a shared module once per alias but never into its own ancestor: a cycle is
//! recorded instead. With pruning on, it enters no subtree that no pattern can reach.

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyType};
use rustc_hash::FxHashMap;

use crate::layout_reads::{has_other_holders, Children, Lookahead, Step, WIDE};
use crate::matcher::{DfaState, MatchError, Matcher};
use crate::names::NameTable;
use crate::step_memo::StepMemo;
use crate::utf8::not_utf8_error;

/// Every FQN a walk visited (or every name given offline), what each one is, and what matched.
#[derive(Default)]
pub struct TreeIndex {
    pub names: NameTable,
    /// The module each name denotes (an index into `modules`; offline, each name is its own).
    pub name_module: Vec<u32>,
    /// One entry per distinct module, in first-visit order (empty offline).
    pub modules: Vec<Py<PyAny>>,
    /// The name under which each module was first visited.
    pub module_first_name: Vec<u32>,
    pub module_class: Vec<u32>,
    pub classes: Vec<Py<PyType>>,
    /// `(alias, ancestor)`: the FQN `alias` names the module at `ancestor`, one of its own ancestors.
    pub cycles: Vec<(String, String)>,
    /// Matches in walk order: `(name index, pattern index)`.
    pub hits: Vec<(u32, u32)>,
    /// Whether every FQN of the tree is recorded: a full walk, or an index of names that dropped none.
    pub complete: bool,
    /// Whether a module a pruned walk kept, or one it entered on the way to them, may have an
    /// alias it did not visit: when met, something besides its parent's `_modules` held it (an
    /// alias of an ancestor is an alias of every module below it). A full walk visits every alias.
    pub may_share_matches: bool,
    /// The parameters of the modules the walk entered, when it was asked to read them.
    pub parameters: ParameterIndex,
}

/// Parameter FQNs (`layers.0.mlp.experts.gate_up_proj`) met in the walk, each under every FQN of
/// the module holding it, in `named_parameters(remove_duplicate=False)` order. A parameter's name
/// holds no `.`, so its module's FQN is its own up to the last `.`.
#[derive(Default)]
pub struct ParameterIndex {
    /// Whether the walk read the parameters at all.
    pub read: bool,
    pub names: NameTable,
    /// The parameter object behind each name.
    pub objects: Vec<Py<PyAny>>,
    /// Matches: `(parameter name index, pattern index)`.
    pub hits: Vec<(u32, u32)>,
}

impl TreeIndex {
    /// The indices of the modules whose class index is one of `classes`, in tree order.
    pub fn modules_of_classes(&self, classes: &[u32]) -> Vec<u32> {
        let mut wanted = vec![false; self.classes.len()];
        for &class in classes {
            if let Some(slot) = wanted.get_mut(class as usize) {
                *slot = true;
            }
        }
        (0..self.module_class.len() as u32)
            .filter(|&m| wanted[self.module_class[m as usize] as usize])
            .collect()
    }
}

pub enum WalkError {
    Python(PyErr),
    Match(MatchError),
}

impl From<PyErr> for WalkError {
    fn from(e: PyErr) -> Self {
        WalkError::Python(e)
    }
}

impl From<MatchError> for WalkError {
    fn from(e: MatchError) -> Self {
        WalkError::Match(e)
    }
}

/// A module being walked: its `_modules` dict, where its iteration stands, and its FQN's state.
struct Frame<'py> {
    children: Children<'py>,
    name_end: usize,
    identity: usize,
    /// The DFA state after this module's FQN and the `.` its children's names follow.
    child_state: Option<DfaState>,
    /// Whether the walk entered the last child it met here: while it does, the look-ahead asks
    /// for the links to the children's own children, otherwise only for the children's names.
    entering: bool,
}

/// What a walk records. A full walk indexes every FQN, module and class (plan resolution needs
/// them all to find family modules); a pruned walk records only the FQNs that match, enters no
/// subtree that no pattern can reach, and reads no module object it does not enter (beyond the
/// look-ahead's hints, which run only while the walk is entering a wide module's children);
/// `PrunedModules` prunes the same way and also indexes the module and class behind each match.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum WalkMode {
    Full,
    Pruned,
    PrunedModules,
}

struct Walker<'m, 'a> {
    matcher: &'m mut Matcher<'a>,
    mode: WalkMode,
    /// Whether each entered module's `_parameters` are read and matched too.
    parameters: bool,
    index: TreeIndex,
    module_ids: FxHashMap<usize, u32>,
    class_ids: FxHashMap<usize, u32>,
    scratch: Vec<u32>,
}

/// How many walks this process made: the tests hold a whole `meshbind check` to one.
#[cfg(feature = "test-hooks")]
pub static WALKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Walks the tree under `root`, matching every FQN it reaches.
pub fn walk_tree(
    root: &Bound<'_, PyAny>,
    matcher: &mut Matcher<'_>,
    mode: WalkMode,
    parameters: bool,
) -> Result<TreeIndex, WalkError> {
    #[cfg(feature = "test-hooks")]
    WALKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut walker = Walker {
        matcher,
        mode,
        parameters,
        index: TreeIndex {
            complete: mode == WalkMode::Full,
            parameters: ParameterIndex {
                read: parameters,
                ..ParameterIndex::default()
            },
            ..TreeIndex::default()
        },
        module_ids: FxHashMap::default(),
        class_ids: FxHashMap::default(),
        scratch: Vec::new(),
    };
    walker.run(root)?;
    Ok(walker.index)
}

impl Walker<'_, '_> {
    fn run(&mut self, root: &Bound<'_, PyAny>) -> Result<(), WalkError> {
        let py = root.py();
        let modules_attr = intern!(py, "_modules");
        let mut fqn = String::new();
        let start = self.matcher.start()?;
        let root_identity = root.as_ptr() as usize;
        self.record(root_identity, Some(root), &fqn, start)?;
        // The root's children follow no separator: their names start the FQN.
        let mut lookahead = match self.mode {
            WalkMode::Pruned => Lookahead::new(py),
            WalkMode::Full | WalkMode::PrunedModules => Lookahead::new(py).reading_matches(),
        };
        let mut stack = vec![enter(
            root,
            modules_attr,
            &mut lookahead,
            &fqn,
            root_identity,
            start,
        )?];
        if self.parameters {
            self.visit_parameters(root, &fqn, start)?;
        }
        let mut on_path = rustc_hash::FxHashSet::default();
        on_path.insert(root_identity);
        let mut memo = StepMemo::default();
        loop {
            let depth = stack.len();
            let Some(frame) = stack.last_mut() else {
                break;
            };
            let wide = frame.children.size() >= WIDE;
            if wide {
                let children = &frame.children;
                lookahead.ahead(children.dict(), children.position(), frame.entering);
            }
            let (name_end, parent_state) = (frame.name_end, frame.child_state);
            // The entry is lent by the frame: until it is dropped no Python code runs, and what
            // the walk keeps of the child (its identity, an owned reference) is taken before.
            let (key, child) = match frame.children.next_entry() {
                Step::Entry(key, child) => (key, child),
                Step::Changed => {
                    return Err(PyRuntimeError::new_err(format!(
                        "the children of '{}' changed during the walk",
                        &fqn[..name_end]
                    ))
                    .into())
                }
                Step::End => {
                    if let Some(done) = stack.pop() {
                        on_path.remove(&done.identity);
                    }
                    continue;
                }
            };
            if child.is_none() {
                continue;
            }
            let key = key.cast::<PyString>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "module '{}' has a child whose name is not a str",
                    &fqn[..name_end]
                ))
            })?;
            let key = key.to_str().map_err(|_| {
                let what = format!("the name of a child of module '{}'", &fqn[..name_end]);
                not_utf8_error(&what, key.to_owned().as_any())
            })?;
            let mut state = parent_state;
            fqn.truncate(name_end);
            if depth > 1 {
                fqn.push('.');
            }
            if !self.matcher.is_current(state) {
                // The DFA cache was cleared since the parent's state was saved: recompute it.
                let restart = self.matcher.start()?;
                state = self.matcher.advance(restart, fqn.as_bytes())?;
            }
            fqn.push_str(key);
            // A wide module's children have names of their own (`0` … `1023`); a narrow one's
            // recur under its cousins (`gate_proj`), so their steps are remembered.
            let below;
            (state, below) = if wide {
                self.matcher.advance_name(state, key.as_bytes())?
            } else {
                memo.step(self.matcher, state, key)?
            };
            let identity = child.as_ptr() as usize;
            let descend = self.mode == WalkMode::Full || self.matcher.may_reach(&fqn, below, true);
            frame.entering = descend;
            let recorded =
                self.mode == WalkMode::Full || self.matcher.may_reach(&fqn, state, false);
            if self.mode == WalkMode::PrunedModules
                && (recorded || descend)
                && !self.index.may_share_matches
            {
                self.index.may_share_matches = has_other_holders(&child);
            }
            // A pruned walk records a child's name alone: its object is read only when kept or entered.
            let kept = (recorded && self.mode != WalkMode::Pruned) || descend;
            let child = kept.then(|| child.to_owned());
            if recorded {
                self.record(identity, child.as_ref(), &fqn, state)?;
            }
            if on_path.contains(&identity) {
                let ancestor = stack
                    .iter()
                    .find(|f| f.identity == identity)
                    .map_or(0, |f| f.name_end);
                self.index
                    .cycles
                    .push((fqn.clone(), fqn[..ancestor].to_owned()));
                continue;
            }
            if let (true, Some(child)) = (descend, child) {
                let frame = enter(&child, modules_attr, &mut lookahead, &fqn, identity, below)?;
                stack.push(frame);
                if self.parameters {
                    self.visit_parameters(&child, &fqn, below)?;
                }
                on_path.insert(identity);
            }
        }
        Ok(())
    }

    /// Matches the parameters of `module` (entered at `fqn`, `state` the DFA state after `fqn.`),
    /// recording each (a pruned walk: each that matches) under `fqn`.
    fn visit_parameters(
        &mut self,
        module: &Bound<'_, PyAny>,
        fqn: &str,
        state: Option<DfaState>,
    ) -> Result<(), WalkError> {
        let py = module.py();
        let parameters = module
            .getattr(intern!(py, "_parameters"))
            .map_err(|_| not_a_module(module, fqn))?;
        let parameters = parameters
            .cast_into::<PyDict>()
            .map_err(|e| not_a_module(&e.into_inner(), fqn))?;
        if parameters.is_empty() {
            return Ok(());
        }
        let mut state = state;
        if !self.matcher.is_current(state) {
            let restart = self.matcher.start()?;
            let prefix = if fqn.is_empty() {
                String::new()
            } else {
                format!("{fqn}.")
            };
            state = self.matcher.advance(restart, prefix.as_bytes())?;
        }
        let mut name = String::with_capacity(fqn.len() + 16);
        for (key, value) in parameters.iter() {
            if value.is_none() {
                continue;
            }
            let key = key.cast_into::<PyString>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "module '{fqn}' has a parameter whose name is not a str"
                ))
            })?;
            let key = key.to_str()?;
            name.clear();
            if !fqn.is_empty() {
                name.push_str(fqn);
                name.push('.');
            }
            name.push_str(key);
            let after = self.matcher.advance(state, key.as_bytes())?;
            self.scratch.clear();
            self.matcher.finish(&name, after, &mut self.scratch)?;
            if self.mode != WalkMode::Full && self.scratch.is_empty() {
                continue;
            }
            let parameter = self.index.parameters.names.push(&name);
            self.index.parameters.objects.push(value.unbind());
            let hits = self.scratch.iter().map(|&p| (parameter, p));
            self.index.parameters.hits.extend(hits);
        }
        Ok(())
    }

    /// Records `fqn` (a name of the module at `identity`) and its matches. A pruned walk records
    /// only names that match.
    fn record(
        &mut self,
        identity: usize,
        module: Option<&Bound<'_, PyAny>>,
        fqn: &str,
        state: Option<DfaState>,
    ) -> Result<(), WalkError> {
        self.scratch.clear();
        self.matcher.finish(fqn, state, &mut self.scratch)?;
        if self.mode == WalkMode::Pruned && self.scratch.is_empty() {
            return Ok(());
        }
        let name = self.index.names.push(fqn);
        self.index
            .hits
            .extend(self.scratch.iter().map(|&p| (name, p)));
        if let (true, Some(module)) = (self.mode != WalkMode::Pruned, module) {
            let next = self.index.modules.len() as u32;
            let module_index = *self.module_ids.entry(identity).or_insert(next);
            if module_index == next {
                self.index.modules.push(module.clone().unbind());
                self.index.module_first_name.push(name);
                let class = module.get_type();
                let next_class = self.index.classes.len() as u32;
                let class_index = *self
                    .class_ids
                    .entry(class.as_ptr() as usize)
                    .or_insert(next_class);
                if class_index == next_class {
                    self.index.classes.push(class.unbind());
                }
                self.index.module_class.push(class_index);
            }
            self.index.name_module.push(module_index);
        }
        Ok(())
    }
}

/// A frame over the children of `module`. Its `_modules` is read in place where the look-ahead
/// knows where it lies (a `getattr` per module is a sixth of a walk), else with `getattr`.
fn enter<'py>(
    module: &Bound<'py, PyAny>,
    modules_attr: &Bound<'py, PyString>,
    lookahead: &mut Lookahead,
    fqn: &str,
    identity: usize,
    child_state: Option<DfaState>,
) -> PyResult<Frame<'py>> {
    let children = match lookahead.modules_in_place(module, modules_attr) {
        Some(dict) => Ok(dict),
        None => {
            let children = module
                .getattr(modules_attr)
                .map_err(|_| not_a_module(module, fqn))?;
            let children = children.cast_into::<PyDict>();
            if let Ok(dict) = &children {
                lookahead.learn(module, dict);
            }
            children
        }
    }
    .map_err(|e| not_a_module(&e.into_inner(), fqn))?;
    Ok(Frame {
        children: Children::new(children),
        entering: true,
        name_end: fqn.len(),
        identity,
        child_state,
    })
}

fn not_a_module(object: &Bound<'_, PyAny>, fqn: &str) -> PyErr {
    let type_name = object
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    PyTypeError::new_err(format!(
        "expected an nn.Module at {fqn:?}, got an object of type {type_name} without a _modules dict"
    ))
}
