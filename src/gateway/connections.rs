//! The gateway's client connections: accepted with TCP_NODELAY, each holding one of
//! `--max-connections` places while it lives, closed if HTTP/2's preface does not come in
//! time, and an accept loop that survives running out of file descriptors.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// How long the accept loop pauses after a failed accept (out of fds: EMFILE).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How long an accepted connection may take to send HTTP/2's client preface.
const PREFACE_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2's client connection preface, `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
const PREFACE_LEN: usize = 24;
/// At most one "connections full" warning per this long (clients may reconnect in a loop).
const FULL_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// The connections the gateway accepts, each holding a place among `places`
/// (`--max-connections`) until tonic drops it: with none free, the connection just
/// accepted waits for one, the gateway accepts no more, and new clients wait in the listen
/// backlog. TCP_NODELAY is set on each (tonic's `tcp_nodelay` applies only to listeners it
/// binds itself). A failed accept is logged, paused on for [`ACCEPT_BACKOFF`] and not
/// passed on: tonic 0.12 ends its accept loop on every error but a few transient ones
/// (EMFILE is not one of them), and with it the gateway, so clients holding all its fds
/// could stop it.
pub(super) fn incoming(
    listener: tokio::net::TcpListener,
    places: Arc<tokio::sync::Semaphore>,
) -> impl tokio_stream::Stream<Item = std::io::Result<Counted>> {
    let (accepted, connections) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let mut last_warning: Option<std::time::Instant> = None;
        loop {
            let connection = match listener.accept().await {
                Ok((connection, _)) => connection,
                Err(e) => {
                    tracing::warn!("gateway: cannot accept ({e}); pausing {ACCEPT_BACKOFF:?}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let place = match places.clone().try_acquire_owned() {
                Ok(place) => place,
                Err(_) => {
                    if last_warning.is_none_or(|t| t.elapsed() >= FULL_WARNING_INTERVAL) {
                        tracing::warn!("gateway: every --max-connections place is held; accepting no more until a connection closes");
                        last_warning = Some(std::time::Instant::now());
                    }
                    let Ok(place) = places.clone().acquire_owned().await else { return };
                    place
                }
            };
            if let Err(e) = connection.set_nodelay(true) {
                tracing::warn!("gateway: cannot set TCP_NODELAY ({e})");
            }
            let preface_due = Some(Box::pin(tokio::time::sleep(PREFACE_TIMEOUT)));
            if accepted
                .send(Ok(Counted { connection, _place: place, preface_left: PREFACE_LEN, preface_due }))
                .await
                .is_err()
            {
                return; // tonic has stopped serving
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(connections)
}

/// An accepted connection and its place among `--max-connections`, given back when it is
/// dropped. Reads and writes go straight to the socket (vectored writes too: hyper gathers
/// HTTP/2 frames into one `writev`). A client that has not sent HTTP/2's preface within
/// [`PREFACE_TIMEOUT`] of its accept gets a read error, and hyper closes the connection, so
/// silent connections cannot keep every place.
pub(super) struct Counted {
    connection: tokio::net::TcpStream,
    _place: tokio::sync::OwnedSemaphorePermit,
    /// Preface bytes still to come; the deadline is dropped once they have.
    preface_left: usize,
    preface_due: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl tonic::transport::server::Connected for Counted {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.connection.connect_info()
    }
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.connection).poll_read(cx, buf);
        let Some(due) = this.preface_due.as_mut() else { return read };
        this.preface_left = this.preface_left.saturating_sub(buf.filled().len() - before);
        if this.preface_left == 0 {
            this.preface_due = None;
        } else if read.is_pending() && due.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no HTTP/2 preface within the gateway's deadline",
            )));
        }
        read
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().connection).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().connection).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.connection.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().connection).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().connection).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    /// Without TCP_NODELAY, a small frame (a window update, a reply's trailers) waits for the
    /// peer's delayed ACK whenever one is unacknowledged: two 4 MiB TensorStore writes at once
    /// went at less than half the speed of one at a time.
    #[tokio::test]
    async fn accepted_connections_send_small_frames_at_once() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let places = std::sync::Arc::new(tokio::sync::Semaphore::new(1));
        let mut accepted = std::pin::pin!(super::incoming(listener, places));
        let connection = accepted.next().await.unwrap().unwrap();
        assert!(connection.connection.nodelay().unwrap(), "an accepted gateway connection has Nagle's algorithm on");
    }
}
