//! meshbind's Rust core: the FQN pattern engine, the module-tree walk, bulk plan checks and
//! diagnostics. `python/` is the binding layer: it converts arguments and maps errors. Besides
//! it, only the walk (`walk.rs`, `named_parameters.rs`) reads Python objects, through pyo3's safe
//! API and `layout_reads/`, which holds every `unsafe` block and every decision made from
//! CPython's internals (its object layout, a reference count). The other modules are plain Rust.

pub mod checks;
pub mod families;
#[cfg(feature = "test-hooks")]
mod hand_pruned_walk;
pub mod hits;
pub mod index_groups;
mod layout_reads;
pub mod matcher;
mod named_parameters;
pub mod names;
pub mod pattern;
mod python;
pub mod rematch;
pub mod rules;
pub mod same_keys;
pub mod selection;
pub mod sequence;
mod step_memo;
pub mod suggest;
mod utf8;
pub mod walk;

/// Compiling a plan and indexing a walk make many small allocations; mimalloc serves them far
/// faster than the system allocator (as pydantic-core does).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
