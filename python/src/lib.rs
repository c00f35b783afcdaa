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
    m.add_function(wrap_pyfunction!(_pose_as_device, m)?)?;
    Ok(())
}

/// For tests on machines without a GPU: from now on the client takes
/// `[addr, addr+length)` (host memory of the caller's) for CUDA device memory, and moves
/// it only through a posing device's copies (`remote_dram::gpu::posing`). Call it before
/// anything else in the process uses the client; False when that is too late.
#[pyfunction]
fn _pose_as_device(addr: usize, length: usize) -> bool {
    match remote_dram::gpu::posing::install() {
        Some(posing) => {
            posing.pose(addr, length);
            true
        }
        None => false,
    }
}
