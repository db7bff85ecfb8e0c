//! The error for Python text that Rust cannot read as UTF-8.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A `ValueError` for a str that is not valid UTF-8 (a lone surrogate), shown as Python writes it.
pub(crate) fn not_utf8_error(what: &str, text: &Bound<'_, PyAny>) -> PyErr {
    let shown = text.repr().map(|r| r.to_string());
    PyValueError::new_err(format!(
        "{what} is not valid UTF-8: {}",
        shown.as_deref().unwrap_or("?")
    ))
}
