//! `remote_dram.Server`: a server running inside the Python process. Clients (in this
//! process or others) still reach it over the real transport, through its address.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyString;
use remote_dram::auth::ClusterSecret;
use remote_dram::cli::parse_size;
use remote_dram::cluster::member::{ClusterMember, MemberConfig};
use remote_dram::cluster::tunables::DEFAULT_LEASE_TTL;
use remote_dram::cluster::ClusterUrl;
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
/// With ``cluster="etcd://HOST:PORT/NAME"`` the server joins that cluster as a member
/// (its ``listen`` address must be one clients can reach). ``cluster_secret_file`` names
/// the file holding the secret the cluster's servers share (default: the
/// ``RDRAM_CLUSTER_SECRET_FILE`` environment variable); ``lease_ttl`` (seconds) is how
/// long its registration outlives its last word with etcd; ``rebalance_rate`` (bytes per
/// second, or a size such as ``"1GiB"``) bounds how fast it hands keys over. ``drain()``
/// hands every key over to the other servers; ``stop()`` leaves the cluster first.
///
/// ``stop()`` (or leaving the ``with`` block) ends transfers in flight, closes every
/// client's endpoints, then frees the memory.
#[pyclass(module = "remote_dram", name = "Server", frozen)]
pub struct PyServer {
    server: Mutex<Option<Server>>,
    /// Its membership of a cluster, when it joined one.
    member: Option<Arc<ClusterMember>>,
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
        text_signature = "(listen='127.0.0.1:0', *, memory='1GiB', workers=1, mode='store', transport='auto', provider=None, auth_token=None, cluster=None, cluster_secret_file=None, lease_ttl=None, rebalance_rate='1GiB')"
    )]
    #[pyo3(signature = (listen="127.0.0.1:0".to_string(), *, memory=None, workers=1, mode="store", transport="auto", provider=None, auth_token=None, cluster=None, cluster_secret_file=None, lease_ttl=None, rebalance_rate=None))]
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
        cluster: Option<String>,
        cluster_secret_file: Option<String>,
        lease_ttl: Option<f64>,
        rebalance_rate: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let memory = size(py, memory, 1 << 30, "memory")?;
        let mode = match mode {
            "store" => Mode::Store,
            "cache" => Mode::Cache,
            other => return Err(invalid(py, format!("mode must be \"store\" or \"cache\", not {other:?}"))),
        };
        let transport = TransportChoice::parse(transport, provider.as_deref(), 1).map_err(|e| to_py(py, e))?;
        let ucx_tcp = remote_dram::server::ucx_tcp_opted_in_by_env();
        let cfg =
            ServerConfig { listen, workers, memory, mode, transport, auth_token, ucx_tcp, ..ServerConfig::default() };
        let (server, member) = match cluster {
            Some(url) => {
                let url = ClusterUrl::parse(&url)
                    .map_err(|e| to_py(py, e))?
                    .ok_or_else(|| invalid(py, "cluster takes etcd://HOST:PORT[,HOST:PORT...]/NAME"))?;
                let secret_file = cluster_secret_file
                    .or_else(|| std::env::var("RDRAM_CLUSTER_SECRET_FILE").ok())
                    .ok_or_else(|| {
                        invalid(py, "a cluster member needs the cluster's secret: cluster_secret_file or RDRAM_CLUSTER_SECRET_FILE")
                    })?;
                let lease_ttl = match lease_ttl {
                    None => DEFAULT_LEASE_TTL,
                    Some(s) if s.is_finite() && s >= 1.0 => Duration::from_secs_f64(s),
                    Some(s) => return Err(invalid(py, format!("lease_ttl is at least 1 second, not {s}"))),
                };
                let member = MemberConfig {
                    url,
                    lease_ttl,
                    secret: ClusterSecret::from_file(&secret_file).map_err(|e| to_py(py, e))?,
                    auth_token: None,
                    rebalance_rate: size(py, rebalance_rate, 1 << 30, "rebalance_rate")?,
                };
                let (server, member) =
                    py.detach(|| ClusterMember::start_server(cfg, member)).map_err(|e| to_py(py, e))?;
                (server, Some(Arc::new(member)))
            }
            None => (py.detach(|| Server::start(cfg)).map_err(|e| to_py(py, e))?, None),
        };
        let address = server.local_addr().to_string();
        let transport = server.info().transport.clone();
        Ok(PyServer { server: Mutex::new(Some(server)), member, address, transport })
    }

    /// Hands every key of this cluster member over to the other servers, and returns
    /// (the seconds it took) once the cluster's placement no longer has this server; it
    /// keeps serving until ``stop()``. Raises ``Unavailable`` when no other server can
    /// take the keys, ``Timeout`` after ``timeout`` seconds (the handover goes on until
    /// the stop), ``InvalidArgument`` for a server that is not a cluster member, or stopped.
    #[pyo3(signature = (timeout=30.0))]
    fn drain(&self, py: Python<'_>, timeout: f64) -> PyResult<f64> {
        let member =
            self.member.clone().ok_or_else(|| invalid(py, "this server is not a cluster member (cluster=)"))?;
        if self.server.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            return Err(invalid(py, "the server is stopped"));
        }
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(invalid(py, format!("timeout must be a number of seconds, not {timeout}")));
        }
        let took = py.detach(|| member.drain_within(Duration::from_secs_f64(timeout))).map_err(|e| to_py(py, e))?;
        Ok(took.as_secs_f64())
    }

    /// Stops the server: transfers in flight end, endpoints close, memory is freed.
    /// Stopping twice is fine.
    fn stop(&self, py: Python<'_>) {
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(server) = server {
            let member = self.member.clone();
            py.detach(move || {
                // Out of the member set first, so that clients stop routing here.
                if let Some(member) = member {
                    member.leave();
                }
                server.stop()
            });
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

/// A size given as bytes or as a string such as "512MiB"; `default` when not given.
fn size(py: Python<'_>, v: Option<&Bound<'_, PyAny>>, default: u64, what: &str) -> PyResult<u64> {
    match v {
        None => Ok(default),
        Some(m) if m.is_instance_of::<PyString>() => {
            parse_size(&m.extract::<String>()?).map_err(|e| invalid(py, format!("{what}: {e}")))
        }
        Some(m) => m.extract::<u64>(),
    }
}
