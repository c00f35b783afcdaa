//! `remote_dram.Server`: a server running inside the Python process. Clients (in this
//! process or others) still reach it over the real transport, through its address.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyString;
use remote_dram::cli::parse_size;
use remote_dram::server::{Server, ServerConfig, TransportChoice};
use remote_dram::store::Mode;

use crate::errors::{invalid, to_py};

/// A remote_dram server embedded in this process.
///
/// ``Server(listen="127.0.0.1:0", memory="1GiB", workers=1)`` starts one on a free
/// port; ``.address`` is what clients connect to. ``memory`` (bytes, or a size such as
/// ``"512MiB"``) is split evenly over ``workers`` shards. ``mode="cache"`` evicts
/// least-recently-used values when full instead of answering ``NoSpace``.
/// ``transport`` is ``"auto"``, ``"ucx"`` or ``"fabric"`` (libfabric, with
/// ``provider`` such as ``"tcp;ofi_rxm"``, ``"shm"`` or ``"efa"``). With ``auth_token``
/// set, clients must present it.
///
/// ``stop()`` (or leaving the ``with`` block) ends transfers in flight, closes every
/// client's endpoints, then frees the memory.
#[pyclass(module = "remote_dram", name = "Server", frozen)]
pub struct PyServer {
    server: Mutex<Option<Server>>,
    /// `host:port` for clients.
    #[pyo3(get)]
    address: String,
    /// The transport the workers use, as the server describes it.
    #[pyo3(get)]
    transport: String,
}

#[pymethods]
impl PyServer {
    #[new]
    #[pyo3(
        text_signature = "(listen='127.0.0.1:0', *, memory='1GiB', workers=1, mode='store', transport='auto', provider=None, auth_token=None)"
    )]
    #[pyo3(signature = (listen="127.0.0.1:0".to_string(), *, memory=None, workers=1, mode="store", transport="auto", provider=None, auth_token=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: String,
        memory: Option<&Bound<'_, PyAny>>,
        workers: usize,
        mode: &str,
        transport: &str,
        provider: Option<String>,
        auth_token: Option<String>,
    ) -> PyResult<Self> {
        let memory = match memory {
            None => 1 << 30,
            Some(m) if m.is_instance_of::<PyString>() => {
                parse_size(&m.extract::<String>()?).map_err(|e| invalid(py, format!("memory: {e}")))?
            }
            Some(m) => m.extract::<u64>()?,
        };
        let mode = match mode {
            "store" => Mode::Store,
            "cache" => Mode::Cache,
            other => return Err(invalid(py, format!("mode must be \"store\" or \"cache\", not {other:?}"))),
        };
        let transport = TransportChoice::parse(transport, provider.as_deref(), 1).map_err(|e| to_py(py, e))?;
        let cfg = ServerConfig { listen, workers, memory, mode, transport, auth_token, ..ServerConfig::default() };
        let server = py.detach(|| Server::start(cfg)).map_err(|e| to_py(py, e))?;
        let address = server.local_addr().to_string();
        let transport = server.info().transport.clone();
        Ok(PyServer { server: Mutex::new(Some(server)), address, transport })
    }

    /// Stops the server: transfers in flight end, endpoints close, memory is freed.
    /// Stopping twice is fine.
    fn stop(&self, py: Python<'_>) {
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(server) = server {
            py.detach(move || server.stop());
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> bool {
        self.stop(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("remote_dram.Server(address={:?}, transport={:?})", self.address, self.transport)
    }
}
