//! What clients and tools route on: a cluster's placement followed by a watch, and the
//! servers whose leases lapsed.

use super::etcd::{read_state, runtime, Connection};
use super::follower::{Follower, Members};
use super::tunables::MAX_LOST;
use super::*;

/// A cluster's placement as etcd says it is now, followed by a background watch.
/// [`Watch::revision`] is one atomic load: callers compare it with the revision of the
/// view they route on.
pub struct Watch {
    runtime: tokio::runtime::Runtime,
    url: ClusterUrl,
    /// The one connection to etcd, which the follower shares.
    etcd: Connection,
    view: Arc<Mutex<View>>,
    revision: Arc<AtomicI64>,
    lost: Arc<LostServers>,
}

/// Servers a cluster's placement named whose lease lapsed (dead, or stopped answering):
/// a client waiting on one gives up on it at once instead of at its timeout. A server
/// stays in the set after the placement moved on without it (a client may look only
/// then, with a request to it still in flight), until it registers again; the oldest go
/// first past [`MAX_LOST`]. A version (one atomic load) says when the set changed.
#[derive(Debug, Default)]
pub struct LostServers {
    version: std::sync::atomic::AtomicU64,
    nodes: Mutex<Vec<String>>,
}

impl LostServers {
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub fn contains(&self, node: &str) -> bool {
        self.nodes.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|n| n == node)
    }

    fn publish(&self, state: &ClusterState) {
        let Some(p) = &state.placement else { return };
        let live = |a: &String| state.members.iter().any(|m| m.address == *a);
        let mut nodes = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        let before = nodes.len();
        nodes.retain(|n| !live(n));
        let mut changed = nodes.len() != before;
        for a in p.members.iter().chain(p.next.iter().flatten()).filter(|a| !live(a)) {
            if !nodes.contains(a) {
                nodes.push(a.clone());
                changed = true;
            }
        }
        let over = nodes.len().saturating_sub(MAX_LOST);
        nodes.drain(..over);
        if changed {
            self.version.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Watch {
    /// Reads the placement (failing if etcd cannot be reached or the cluster does not
    /// exist) and starts watching it.
    pub fn start(url: &ClusterUrl) -> Result<Watch> {
        let runtime = runtime()?;
        let (etcd, state) = runtime.block_on(async {
            let etcd = Connection::open(url).await?;
            let state = read_state(&mut etcd.client().1, url).await?;
            state.settings.as_ref().ok_or_else(|| no_such_cluster(url))?;
            Ok::<_, Error>((etcd, state))
        })?;
        let view = Arc::new(Mutex::new(view_of(&state)));
        let revision = Arc::new(AtomicI64::new(state.placement_revision));
        let lost = Arc::new(LostServers::default());
        lost.publish(&state);
        let (shown, published, gone) = (view.clone(), revision.clone(), lost.clone());
        let publish = move |s: &ClusterState| {
            publish_view(&shown, &published, s);
            gone.publish(s);
            None
        };
        let follower = Follower {
            etcd: etcd.clone(),
            url: url.clone(),
            on_state: Box::new(publish),
            what: "routing on the last view",
            members: Members::default(),
        };
        runtime.spawn(follower.run());
        Ok(Watch { runtime, url: url.clone(), etcd, view, revision, lost })
    }

    /// Reads the placement from etcd now, not waiting for the watch: for a caller a server
    /// told that the view changed.
    pub fn refresh(&self) -> Result<()> {
        let mut client = self.etcd.client().1;
        let state = self.runtime.block_on(read_state(&mut client, &self.url))?;
        publish_view(&self.view, &self.revision, &state);
        self.lost.publish(&state);
        Ok(())
    }

    /// The servers of the placement whose lease lapsed, kept up to date.
    pub fn lost(&self) -> Arc<LostServers> {
        self.lost.clone()
    }

    /// The revision of the newest view.
    pub fn revision(&self) -> i64 {
        self.revision.load(Ordering::Acquire)
    }

    pub fn view(&self) -> View {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn url(&self) -> &ClusterUrl {
        &self.url
    }
}

/// Makes `state`'s placement the view, if it is newer than the one shown.
pub(super) fn publish_view(view: &Mutex<View>, revision: &AtomicI64, state: &ClusterState) {
    if state.placement.is_none() && state.placement_revision != 0 {
        return; // unreadable: routes on the last good view until a server writes it back
    }
    let fresh = view_of(state);
    let mut current = view.lock().unwrap_or_else(|e| e.into_inner());
    if *current != fresh && fresh.revision >= current.revision {
        *current = fresh;
        drop(current);
        revision.store(state.placement_revision, Ordering::Release);
    }
}

pub(super) fn view_of(state: &ClusterState) -> View {
    View { revision: state.placement_revision, placement: state.placement.clone().unwrap_or_default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(members: &[&str], placed: &[&str]) -> ClusterState {
        let names = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        ClusterState {
            members: members.iter().map(|a| Member { address: a.to_string(), ..Default::default() }).collect(),
            placement: Some(Placement { members: names(placed), ..Default::default() }),
            ..Default::default()
        }
    }

    /// A client that looks only after the placement moved on without a server whose lease
    /// lapsed still learns it was lost; once it registers again, it is not.
    #[test]
    fn a_lapsed_server_stays_lost_after_the_placement_moves_on_until_it_registers_again() {
        let lost = LostServers::default();
        lost.publish(&state(&["a", "b", "c"], &["a", "b", "c"]));
        assert!(!lost.contains("c"));
        let seen = lost.version();
        lost.publish(&state(&["a", "b"], &["a", "b", "c"]));
        lost.publish(&state(&["a", "b"], &["a", "b"]));
        assert!(lost.version() != seen && lost.contains("c"), "lost, seen only after the placement moved on");
        let seen = lost.version();
        lost.publish(&state(&["a", "b"], &["a", "b"]));
        assert_eq!(lost.version(), seen, "no change, no new version");
        lost.publish(&state(&["a", "b", "c"], &["a", "b"]));
        assert!(lost.version() != seen && !lost.contains("c"), "registered again");
    }
}
