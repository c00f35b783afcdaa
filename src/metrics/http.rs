//! The `/metrics` endpoint: a small HTTP/1 server (hyper) on a thread of its own, so
//! that a scrape never runs on a shard worker.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::registry::Registry;
use tracing::{debug, warn};

use crate::error::{Error, Result, Status};

/// Connections served at once, and from one source address. A new connection past either
/// bound closes the oldest one (of its address, else of all): idle connections held open
/// cannot keep a scraper out, which sends its request as soon as it connects.
const MAX_CONNECTIONS: usize = 16;
const MAX_CONNECTIONS_PER_SOURCE: usize = 4;
/// A request's headers must arrive within this; a connection lives at most
/// `CONNECTION_LIFETIME` (a scraper reconnects), so no peer holds a slot for ever.
const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
const CONNECTION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(120);
/// How long the accept loop pauses after a failed accept (out of fds: EMFILE).
const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running `/metrics` endpoint; stopped when dropped.
pub struct Endpoint {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Endpoint {
    /// Serves `collector`'s metrics at `http://listen/metrics`.
    pub fn start(listen: &str, collector: Box<dyn Collector>) -> Result<Endpoint> {
        let mut registry = Registry::default();
        registry.register_collector(collector);
        let registry = Arc::new(registry);
        let listener = std::net::TcpListener::bind(listen)
            .map_err(|e| Error::new(Status::Io, format!("--metrics {listen}: {e}")))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let thread = std::thread::Builder::new().name("rdram-metrics".into()).spawn(move || {
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => return warn!("metrics endpoint: {e}"),
                };
                tokio::select! {
                    _ = stopped => {}
                    _ = accept_loop(listener, registry) => {}
                }
            })
        })?;
        Ok(Endpoint { addr, stop: Some(stop), thread: Some(thread) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An open connection: where from, and how to close it.
struct Open {
    id: u64,
    source: std::net::IpAddr,
    task: tokio::task::AbortHandle,
}

type OpenList = Arc<std::sync::Mutex<Vec<Open>>>;

/// Takes a connection off the list when its task ends, or is aborted.
struct Listed(OpenList, u64);

impl Drop for Listed {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).retain(|o| o.id != self.1);
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, registry: Arc<Registry>) {
    let open: OpenList = Arc::default();
    for id in 0u64.. {
        let (stream, peer) = match listener.accept().await {
            Ok(connection) => connection,
            Err(e) => {
                // Out of fds (or memory): retrying at once would spin this thread and free none.
                debug!("metrics endpoint: cannot accept ({e}); pausing {ACCEPT_BACKOFF:?}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let registry = registry.clone();
        let listed = Listed(open.clone(), id);
        let mut list = open.lock().unwrap_or_else(|e| e.into_inner());
        let oldest_of_source = || list.iter().position(|o| o.source == peer.ip());
        let from_source = list.iter().filter(|o| o.source == peer.ip()).count();
        let evict = if from_source >= MAX_CONNECTIONS_PER_SOURCE {
            oldest_of_source()
        } else {
            (list.len() >= MAX_CONNECTIONS).then_some(0)
        };
        if let Some(i) = evict {
            // At debug: a connection flood must not become a log flood.
            debug!("metrics endpoint: connections at their limit; closing the oldest, from {}", list[i].source);
            list.remove(i).task.abort();
        }
        let task = tokio::spawn(async move {
            let _listed = listed;
            let service = hyper::service::service_fn(move |req| answer(req, registry.clone()));
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
        });
        list.push(Open { id, source: peer.ip(), task: task.abort_handle() });
    }
}

async fn answer(
    req: Request<hyper::body::Incoming>,
    registry: Arc<Registry>,
) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
    let response = |status: StatusCode, content_type: &str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_str(content_type).expect("a valid header value"),
        );
        r
    };
    if req.uri().path() != "/metrics" {
        return Ok(response(StatusCode::NOT_FOUND, "text/plain", "metrics are at /metrics\n".into()));
    }
    // Prometheus asks for OpenMetrics; everything else (curl, promtool) gets the classic
    // text format.
    let openmetrics = req
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    let mut body = String::new();
    Ok(match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) if openmetrics => response(StatusCode::OK, OPENMETRICS, body),
        Ok(()) => response(StatusCode::OK, PROMETHEUS_TEXT, prometheus_text(&body)),
        Err(_) => response(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "encoding the metrics failed\n".into()),
    })
}

/// OpenMetrics text as the classic Prometheus text format (0.0.4): a counter's HELP and
/// TYPE name its `_total` samples, and there is no `# EOF`.
fn prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn counters_are_named_by_their_samples_in_the_text_format() {
        let om = "# HELP a_requests Requests.\n# TYPE a_requests counter\na_requests_total{x=\"1\"} 3\n# HELP g A gauge.\n# TYPE g gauge\ng 1\n# EOF\n";
        assert_eq!(
            super::prometheus_text(om),
            "# HELP a_requests_total Requests.\n# TYPE a_requests_total counter\na_requests_total{x=\"1\"} 3\n# HELP g A gauge.\n# TYPE g gauge\ng 1\n"
        );
    }
}
