//! Rust errors as the Python exceptions of `remote_dram.errors` (one class per status).

use pyo3::prelude::*;
use remote_dram::error::{Error, Status};

/// The exception for `err`: `remote_dram.errors._from_status` picks the class.
pub fn to_py(py: Python<'_>, err: Error) -> PyErr {
    let errors = match py.import("remote_dram.errors") {
        Ok(m) => m,
        Err(e) => return e,
    };
    match errors.call_method1("_from_status", (err.status as i8, err.to_string())) {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

/// `BufferTooSmall` carrying the size the buffer must have.
pub fn buffer_too_small(py: Python<'_>, have: usize, needed: usize) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let class = py.import("remote_dram.errors")?.getattr("BufferTooSmall")?;
        let message =
            format!("{}: the buffer holds {have} bytes, the value needs {needed}", Status::BufferTooSmall.describe());
        Ok(PyErr::from_value(class.call1((message, py.None(), needed))?))
    };
    build().unwrap_or_else(|e| e)
}

pub fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    to_py(py, Error::new(Status::Invalid, message))
}

/// Marks which item of a batch failed (`.index`) and says so in the message.
pub fn in_batch(py: Python<'_>, err: Error, index: usize) -> PyErr {
    let err = to_py(py, Error::new(err.status, format!("item {index}: {}", err.message)));
    let _ = err.value(py).setattr("index", index);
    err
}
