//! Engine clients for the async gRPC side: each [`Client`] lives on its own thread (it is
//! synchronous and single-threaded by design) and takes jobs from one shared queue, so up
//! to `threads` requests are in flight toward the servers at once.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use tokio::sync::oneshot;

use crate::error::{Error, Result, Status};
use crate::{Client, ClientOptions};

/// A request for an engine thread: gets the thread's client, or why it has none.
type Job = Box<dyn FnOnce(Result<&mut Client>) + Send>;

pub struct EnginePool {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    /// Jobs sent and not yet done.
    in_flight: Arc<AtomicUsize>,
}

/// What each engine thread needs to pick its clients' spin: an engine client waiting on its
/// request spins ([`ClientOptions::spin`]) before it sleeps, which pays while there are CPUs
/// to spare; with more requests in flight than the gateway has CPUs, spinning threads take
/// turns the others' replies and the gRPC threads need, so they sleep at once. With 16
/// 4 KiB calls in flight on two CPUs, spinning every wait cost about half the gateway's
/// throughput; one call at a time, and 4 MiB chunks, gained nothing from sleeping.
struct SpinPolicy {
    in_flight: Arc<AtomicUsize>,
    cpus: usize,
}

impl SpinPolicy {
    /// The spin for a job now, given the one the clients were configured with.
    fn spin_now(&self, spin: Duration) -> Duration {
        if self.in_flight.load(Relaxed) > self.cpus {
            Duration::ZERO
        } else {
            spin
        }
    }
}

impl EnginePool {
    /// Connects one client per thread. Fails if the servers cannot be reached now; later
    /// losses are reported per request, and the thread reconnects for the next one.
    pub fn connect(servers: &str, opts: &ClientOptions, threads: usize) -> Result<EnginePool> {
        // Unbounded: the gRPC server bounds the requests in flight (streams per connection).
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let client = Client::connect(servers, opts.clone())?;
            let (rx, servers, opts) = (rx.clone(), servers.to_string(), opts.clone());
            let policy = SpinPolicy { in_flight: in_flight.clone(), cpus };
            let handle = std::thread::Builder::new()
                .name(format!("gateway-engine-{i}"))
                .spawn(move || serve_jobs(client, &rx, &servers, &opts, &policy))
                .map_err(|e| Error::new(Status::Internal, format!("spawning engine thread: {e}")))?;
            handles.push(handle);
        }
        Ok(EnginePool { jobs: Some(tx), threads: handles, in_flight })
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
        self.in_flight.fetch_add(1, Relaxed);
        if jobs.send(job).is_err() {
            self.in_flight.fetch_sub(1, Relaxed);
            return Err(Error::new(Status::Unavailable, "gateway shutting down"));
        }
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

fn serve_jobs(client: Client, jobs: &Receiver<Job>, servers: &str, opts: &ClientOptions, policy: &SpinPolicy) {
    let mut client = Some(client);
    for job in jobs {
        serve_job(&mut client, job, servers, opts, policy);
        policy.in_flight.fetch_sub(1, Relaxed);
    }
}

fn serve_job(client: &mut Option<Client>, job: Job, servers: &str, opts: &ClientOptions, policy: &SpinPolicy) {
    if client.as_ref().is_none_or(|c| c.lost_a_server()) {
        *client = None;
        match Client::connect(servers, opts.clone()) {
            Ok(c) => *client = Some(c),
            Err(e) => return job(Err(e)),
        }
    }
    let c = client.as_mut().expect("connected above");
    c.set_spin(policy.spin_now(opts.spin));
    job(Ok(c));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_clients_spin_only_while_the_requests_in_flight_have_cpus_to_spare() {
        let policy = SpinPolicy { in_flight: Arc::new(AtomicUsize::new(0)), cpus: 2 };
        for (in_flight, spin) in [(1, 50), (2, 50), (3, 0), (16, 0)] {
            policy.in_flight.store(in_flight, Relaxed);
            assert_eq!(
                policy.spin_now(Duration::from_micros(50)),
                Duration::from_micros(spin),
                "{in_flight} in flight on 2 CPUs"
            );
        }
    }
}
