//! The native half of the `remote_dram` Python package (PyO3, abi3): the Rust client and
//! embedded server. `remote_dram/__init__.py` loads UCX first and re-exports these.

mod buffer;
mod client;
mod errors;
mod server;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::PyClient>()?;
    m.add_class::<client::Entry>()?;
    m.add_class::<server::PyServer>()?;
    m.add("PROTOCOL_VERSION", remote_dram::proto::PROTOCOL_VERSION)?;
    Ok(())
}
