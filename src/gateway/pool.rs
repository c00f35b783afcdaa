//! Engine clients for the async gRPC side: each [`Client`] lives on its own thread (it is
//! synchronous and single-threaded by design) and takes jobs from one shared queue, so up
//! to `threads` requests are in flight toward the servers at once.

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use tokio::sync::oneshot;

use crate::error::{Error, Result, Status};
use crate::{Client, ClientOptions};

/// A request for an engine thread: gets the thread's client, or why it has none.
type Job = Box<dyn FnOnce(Result<&mut Client>) + Send>;

pub struct EnginePool {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl EnginePool {
    /// Connects one client per thread. Fails if the servers cannot be reached now; later
    /// losses are reported per request, and the thread reconnects for the next one.
    pub fn connect(servers: &str, opts: &ClientOptions, threads: usize) -> Result<EnginePool> {
        // Unbounded: the gRPC server bounds the requests in flight (streams per connection).
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let client = Client::connect(servers, opts.clone())?;
            let (rx, servers, opts) = (rx.clone(), servers.to_string(), opts.clone());
            let handle = std::thread::Builder::new()
                .name(format!("gateway-engine-{i}"))
                .spawn(move || serve_jobs(client, &rx, &servers, &opts))
                .map_err(|e| Error::new(Status::Internal, format!("spawning engine thread: {e}")))?;
            handles.push(handle);
        }
        Ok(EnginePool { jobs: Some(tx), threads: handles })
    }

    /// Runs `f` on a free engine client and awaits its result.
    pub async fn run<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut Client) -> Result<R> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |client| {
            let _ = tx.send(client.and_then(f));
        });
        let jobs = self.jobs.as_ref().ok_or_else(|| Error::new(Status::Unavailable, "gateway shutting down"))?;
        jobs.send(job).map_err(|_| Error::new(Status::Unavailable, "gateway shutting down"))?;
        rx.await.map_err(|_| Error::new(Status::Internal, "engine thread ended during a request"))?
    }
}

impl Drop for EnginePool {
    fn drop(&mut self) {
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_jobs(client: Client, jobs: &Receiver<Job>, servers: &str, opts: &ClientOptions) {
    let mut client = Some(client);
    for job in jobs {
        if client.as_ref().is_none_or(|c| c.lost_a_server()) {
            client = None;
            match Client::connect(servers, opts.clone()) {
                Ok(c) => client = Some(c),
                Err(e) => {
                    job(Err(e));
                    continue;
                }
            }
        }
        job(Ok(client.as_mut().expect("connected above")));
    }
}
