//! Recovery: rails whose endpoints failed are replaced by fresh ones under new addresses;
//! the retired ones keep what their peers may still be reading until a grace period ends.

use super::*;

impl FabricShardWorker {
    /// Replaces the endpoints (rails) with new ones under a new address, which the
    /// bootstrap hands out and tells connected clients of (they reconnect). Stored data is
    /// kept.
    ///
    /// Why: libfabric 1.17's shm sender of a message too large to copy inline waits for
    /// the receiver's answer in one queue of its own region, read strictly in order. A
    /// receiver that died (or stopped) before answering holds up every later large send
    /// to anyone for good: a client killed during a 3 MiB GET left the shard unable to send
    /// any large value again. Nothing in libfabric's API clears that queue.
    ///
    /// The old rails are never progressed again: reads of client memory in flight stop
    /// there (their puts fail and free their extents), replies are dropped. What peers may
    /// still read through them (reply buffers, pinned extents) is kept for
    /// [`FABRIC_RETIRED_GRACE`].
    pub(super) fn replace_rails(&mut self) -> Result<()> {
        tracing::error!(
            "shard {}: a client left with large messages in flight, which stalls every later large send of libfabric's shm; \
             replacing the shard's endpoints: clients reconnect, stored data is kept",
            self.service.index()
        );
        let rails = Rails::open(&self.provider, Some(self.listen), self.rails.eps.len())?;
        let arena = self.service.arena();
        let arena_mr = rails.register(arena.base(), arena.len(), RemoteAccess::None)?;
        let recv_slab = recv_slab();
        let recv_mr = rails.register(recv_slab.as_ptr(), recv_slab.len(), RemoteAccess::None)?;
        let address = wire::encode_addresses(&rails.addresses()?);

        let old_rails = std::mem::replace(&mut self.rails, rails);
        let mut regions =
            vec![std::mem::replace(&mut self.arena_mr, arena_mr), std::mem::replace(&mut self.recv_mr, recv_mr)];
        let old_slab = std::mem::replace(&mut self.recv_slab, recv_slab);
        let (mut buffers, mut pinned) = (Vec::new(), Vec::new());
        for buf in self.reply_pool.drain(..) {
            regions.extend(buf.mr);
        }
        for op in self.ops.drain() {
            match op {
                WorkerOp::Recv { .. } => {}
                WorkerOp::Reply { msg, .. } => {
                    regions.extend(msg.mr);
                    buffers.push(msg.bytes);
                }
                WorkerOp::Data { pinned: extent, _owned, temp_mr, .. } => {
                    pinned.extend(extent);
                    regions.extend(temp_mr);
                    buffers.push(_owned);
                }
                WorkerOp::ReadPut { put, .. } => {
                    self.scratch.clear();
                    let _ = self.service.finish_put(put, false, &mut self.scratch);
                }
                WorkerOp::ReadPayload { temp_mr, buf, .. } => {
                    regions.extend(temp_mr);
                    buffers.push(buf);
                }
            }
        }
        self.retired.push(Retired {
            rails: old_rails,
            regions,
            _buffers: buffers,
            _recv_slab: old_slab,
            pinned,
            since: Instant::now(),
        });
        // Every client goes: their addresses were in the old endpoints' address vectors.
        for peer in self.peers.iter_mut().filter(|p| p.is_some()) {
            *peer = None;
        }
        self.free_slots = (0..self.peers.len() as u32).rev().collect();
        self.service.set_named_clients(0);
        self.reads.clear();
        self.sends.clear();
        self.backlog.clear();
        self.unresponsive.clear();
        for buf in 0..RECV_BUFS {
            self.post_recv(buf)?;
        }
        self.address.set(address);
        self.service.metrics().worker_replaced();
        Ok(())
    }

    /// Closes retired rails once their grace has passed (all of them with `all`),
    /// unpinning what their peers could still read.
    pub(super) fn retire_expired(&mut self, all: bool) {
        if self.retired.is_empty() {
            return;
        }
        let (expired, kept): (Vec<Retired>, Vec<Retired>) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition(|r| all || r.since.elapsed() >= FABRIC_RETIRED_GRACE);
        self.retired = kept;
        for r in expired {
            for extent in &r.pinned {
                self.service.unpin(*extent);
            }
            for mr in r.regions {
                r.rails.deregister(mr);
            }
        }
    }
}
