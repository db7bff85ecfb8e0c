//! meshbind's Rust core: the FQN pattern engine, the module-tree walk, bulk plan checks and
//! diagnostics. `python.rs` is the only file that knows about Python.

pub mod checks;
pub mod families;
pub mod index_groups;
mod layout_reads;
pub mod matcher;
mod named_parameters;
pub mod names;
pub mod pattern;
mod presence;
mod python;
pub mod selection;
pub mod sequence;
mod step_memo;
pub mod suggest;
pub mod walk;

/// Compiling a plan and indexing a walk make many small allocations; mimalloc serves them far
/// faster than the system allocator (as pydantic-core does).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
