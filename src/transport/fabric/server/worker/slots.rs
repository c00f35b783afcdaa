//! Client slots: a hello takes a slot (credential, address, client), requests name their
//! slot and credential, and a departed or unresponsive client's slot is freed with what it held.

use super::*;

impl FabricShardWorker {
    pub(super) fn on_hello(&mut self, at: usize, len: usize) {
        let hello = match Hello::decode(&self.recv_slab[at..at + len]) {
            Ok(h) => h,
            Err(e) => return debug!("shard {}: {e}", self.service.index()),
        };
        // Only a session the bootstrap issued (after the token check) to a client still
        // connected gets a slot, bound to that client: it dies with its connection.
        let client_id = match self.service.client_of(hello.session) {
            Some(c) if hello.addresses.len() == self.rails.eps.len() => c,
            // Without a valid session we do not even learn the sender's address.
            _ => return debug!("shard {}: hello refused (bad session or rail count)", self.service.index()),
        };
        self.forget_departed();
        // One slot per client: a repeated hello replaces the earlier one.
        if let Some(old) = self.peers.iter().position(|p| p.as_ref().is_some_and(|p| p.client_id == client_id)) {
            self.forget(old as u32);
        }
        let mut addrs = Vec::with_capacity(hello.addresses.len());
        for (ep, a) in self.rails.eps.iter().zip(&hello.addresses) {
            match ep.insert_peer(a) {
                Ok(p) => addrs.push(p),
                Err(e) => return warn!("shard {}: {e}", self.service.index()),
            }
        }
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.peers.push(None);
            (self.peers.len() - 1) as u32
        });
        let mut random = [0u8; 8];
        if let Err(e) = getrandom::getrandom(&mut random) {
            return warn!("shard {}: no randomness for a credential: {e}", self.service.index());
        }
        let credential = u64::from_le_bytes(random) | 1;
        self.peers[slot as usize] = Some(Peer { addrs, credential, client_id, joining: None });
        // Requests carry the credential as their session: values staged in parts live
        // under it, as long as the client's bootstrap session does.
        self.service.open_session(credential, client_id);
        self.service.set_named_clients(self.service.named_clients().unwrap_or(0) + 1);
        let mut header = ReplyHeader::new(hello.hello_id, Status::Ok);
        header.generation = slot as u64;
        header.value_size = credential;
        self.scratch.clear();
        self.reply(Client { slot, id: client_id }, Answer::Owned(header), None);
    }

    /// The slot's credential and the client holding it.
    pub(super) fn holder(&self, slot: u32) -> Option<(u64, u64)> {
        self.peers.get(slot as usize).and_then(|p| p.as_ref()).map(|p| (p.credential, p.client_id))
    }

    /// Whether `to`'s client still holds its slot.
    pub(super) fn holds(&self, to: Client) -> bool {
        self.holder(to.slot).is_some_and(|(_, id)| id == to.id)
    }

    pub(super) fn forget(&mut self, slot: u32) {
        if let Some(peer) = self.peers.get_mut(slot as usize).and_then(Option::take) {
            let orphans: Vec<u64> = self.sends.keys().filter(|k| k.0 == peer.client_id).map(|k| k.1).collect();
            for request in orphans {
                self.orphan_send(peer.client_id, request);
            }
            for (ep, a) in self.rails.eps.iter().zip(peer.addrs) {
                let _ = ep.remove_peer(a);
            }
            self.service.close_session(peer.credential);
            self.free_slots.push(slot);
            self.service.set_named_clients(self.service.named_clients().unwrap_or(0).saturating_sub(1));
        }
    }

    /// Frees the slots of clients whose bootstrap connection closed. Runs when idle and
    /// before each hello, so the slot table never grows past the clients alive.
    pub(super) fn forget_departed(&mut self) {
        for client in self.service.take_departed() {
            self.freed.freed();
            if self.large_sends_to(client) {
                self.replace_due = true;
            }
            self.backlog.forget(client);
            self.unresponsive.remove(&client);
            self.deferred.retain(|_, to| to.id != client);
            for slot in 0..self.peers.len() as u32 {
                if self.peers[slot as usize].as_ref().is_some_and(|p| p.client_id == client) {
                    self.forget(slot);
                }
            }
        }
    }

    /// After a send that failed because the client took nothing (see `unresponsive`).
    pub(super) fn note_unresponsive(&mut self, client: u64, e: &Error) {
        if e.status == Status::Unavailable && self.unresponsive.insert(client) {
            info!("shard {}: client {client} takes no replies ({}); dropping its requests and replies until it reconnects", self.service.index(), e.message);
            // Over shm its stuck large sends hold up everyone's (see `replace_rails`).
            self.replace_due |= self.large_sends_to(client);
        }
    }
}
