//! Batches: many puts or gets with up to `depth` requests in flight behind one wait, and
//! in a cluster the copies of a batch's writes to the other replicas, pipelined the same way.

use rustc_hash::FxHashMap;

use super::tunables::STREAM_PUT_MIN;
use super::*;

impl Client {
    /// Stores many values with up to `depth` requests in flight: one wait for many
    /// round trips. Results are per item, in order. In a cluster over UCX between hosts,
    /// the large values for keys with other replicas go first, each to its primary in
    /// parts that it streams on to the replicas (docs/cluster.md, "Large values go on
    /// while they arrive").
    pub fn put_many(&mut self, items: &[(&[u8], &[u8])], depth: usize) -> Vec<Result<u64>> {
        let mut results: Vec<Option<Result<u64>>> = (0..items.len()).map(|_| None).collect();
        self.put_many_streamed(items, &mut results);
        let whole: Vec<usize> = (0..items.len()).filter(|&i| results[i].is_none()).collect();
        let replies = self.pipelined(whole.len(), depth, |j| {
            let (key, value) = items[whole[j]];
            if value.len() as u64 > MAX_VALUE_LEN {
                return Err(Error::new(
                    Status::ValueTooLarge,
                    format!("{} bytes > limit {MAX_VALUE_LEN}", value.len()),
                ));
            }
            Ok((RequestHeader::new(Op::Put, 0, 0), key, value, Receive::Owned))
        });
        for (i, reply) in whole.into_iter().zip(replies) {
            results[i] = Some(reply.and_then(|reply| match reply.header.status() {
                Status::Ok => Ok(reply.header.generation),
                s => Err(error_of(s, &reply)),
            }));
        }
        results.into_iter().map(|r| r.expect("every item has an outcome")).collect()
    }

    /// The items of [`Client::put_many`] that [`Client::streams`]: their outcomes into
    /// `results`, but for those that go whole after all. A key that comes twice in the
    /// batch goes whole, in the batch's order.
    fn put_many_streamed(&mut self, items: &[(&[u8], &[u8])], results: &mut [Option<Result<u64>>]) {
        let large = |value: &[u8]| value.len() >= STREAM_PUT_MIN && value.len() as u64 <= MAX_VALUE_LEN;
        if self.cluster.is_none() || !items.iter().any(|(_, value)| large(value)) {
            return;
        }
        let mut times: FxHashMap<&[u8], u32> = FxHashMap::default();
        for (key, _) in items {
            *times.entry(key).or_default() += 1;
        }
        let opts = PutOptions::default();
        let mut streamed = Vec::new();
        let mut writes = Vec::new();
        for (i, &(key, value)) in items.iter().enumerate() {
            let eligible = large(value) && times[key] == 1 && check_key(key).is_ok();
            let server = eligible.then(|| self.streams(key, value.len(), &opts)).flatten();
            if let Some(server) = server {
                streamed.push(i);
                writes.push((key, value, server));
            }
        }
        for (i, outcome) in streamed.into_iter().zip(self.put_streamed_all(&writes, &opts)) {
            results[i] = outcome.map(|r| match r? {
                WriteResult::Written { generation } => Ok(generation),
                WriteResult::ConditionFailed => {
                    Err(Error::new(Status::Internal, "an unconditional put's condition failed"))
                }
            });
        }
    }

    /// Reads many values with up to `depth` requests in flight. `None`: missing.
    pub fn get_many(&mut self, keys: &[&[u8]], depth: usize) -> Vec<Result<Option<Value>>> {
        self.pipelined(keys.len(), depth, |i| Ok((RequestHeader::new(Op::Get, 0, 0), keys[i], &[], Receive::Owned)))
            .into_iter()
            .map(|r| {
                let reply = r?;
                match reply.header.status() {
                    Status::Ok => Ok(Some(Value {
                        generation: reply.header.generation,
                        size: reply.header.value_size,
                        data: reply.payload,
                    })),
                    Status::Missing => Ok(None),
                    s => Err(error_of(s, &reply)),
                }
            })
            .collect()
    }

    /// Deletes many keys with up to `depth` requests in flight; per key, whether it existed.
    pub fn delete_many(&mut self, keys: &[&[u8]], depth: usize) -> Vec<Result<bool>> {
        self.pipelined(keys.len(), depth, |i| Ok((RequestHeader::new(Op::Delete, 0, 0), keys[i], &[], Receive::Owned)))
            .into_iter()
            .map(|r| {
                let reply = r?;
                match reply.header.status() {
                    Status::Ok => Ok(reply.header.value_size != 0),
                    s => Err(error_of(s, &reply)),
                }
            })
            .collect()
    }

    /// Submits `n` requests (what `item` says of each: header, key, payload and where the
    /// reply goes; the key's length is filled in), keeping at most `depth` in flight,
    /// and collects the replies. In a cluster, a request that a view change or a lost
    /// server turned back is sent again on its own (see [`Client::call_key_into`]).
    pub(super) fn pipelined<'a>(
        &mut self,
        n: usize,
        depth: usize,
        item: impl Fn(usize) -> Result<(RequestHeader, &'a [u8], &'a [u8], Receive)>,
    ) -> Vec<Result<Reply>> {
        let mut results = self.pipelined_once(n, depth, &item);
        if self.cluster.is_some() {
            for (i, result) in results.iter_mut().enumerate() {
                let turned_back = match result {
                    Ok(r) => r.header.status().is_internal_to_clusters(),
                    Err(e) => e.status == Status::Unavailable,
                };
                let Ok((h, key, payload, receive)) = item(i) else { continue };
                if turned_back {
                    *result = check_key(key).and_then(|()| self.call_key_into(key, h, payload.into(), receive));
                }
            }
        }
        results
    }

    pub(super) fn pipelined_once<'a>(
        &mut self,
        n: usize,
        depth: usize,
        item: &impl Fn(usize) -> Result<(RequestHeader, &'a [u8], &'a [u8], Receive)>,
    ) -> Vec<Result<Reply>> {
        // Connected (anew, if a server was lost or the view changed) once for the whole
        // batch: a new connection while requests are in flight on the old one would lose them.
        if let Err(e) = self.live() {
            return (0..n).map(|_| Err(e.clone())).collect();
        }
        let submit = |c: &mut Self, i: usize| {
            let (h, key, payload, receive) = item(i)?;
            c.submit_batched(h, key, payload, receive)
        };
        let depth = depth.max(1);
        let mut results: Vec<Option<Result<Reply>>> = (0..n).map(|_| None).collect();
        let mut in_flight = std::collections::VecDeque::new();
        for i in 0..n {
            if in_flight.len() == depth {
                let (j, id) = in_flight.pop_front().unwrap();
                results[j] = Some(self.conn.wait(id));
            }
            match submit(self, i) {
                Ok(id) => in_flight.push_back((i, id)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        for (j, id) in in_flight {
            results[j] = Some(self.conn.wait(id));
        }
        results.into_iter().map(|r| r.unwrap()).collect()
    }

    /// Reads many values into the given buffers, with up to `depth` requests in flight.
    pub fn get_many_into(&mut self, keys: &[&[u8]], bufs: &mut [&mut [u8]], depth: usize) -> Vec<Result<GetInto>> {
        self.get_many_into_with(keys, &vec![GetOptions::default(); keys.len()], bufs, depth)
    }

    /// [`Client::get_many_into`] with options per key (conditions, byte ranges): a zero-length
    /// range into an empty buffer answers a value's size and generation without its bytes.
    pub fn get_many_into_with(
        &mut self,
        keys: &[&[u8]],
        opts: &[GetOptions],
        bufs: &mut [&mut [u8]],
        depth: usize,
    ) -> Vec<Result<GetInto>> {
        assert_eq!(keys.len(), bufs.len(), "one buffer per key");
        assert_eq!(keys.len(), opts.len(), "one set of options per key");
        let sinks: Vec<Sink> = bufs.iter_mut().map(|b| Sink::new(b)).collect();
        self.pipelined(keys.len(), depth, |i| Ok((get_header(&opts[i]), keys[i], &[], Receive::Into(sinks[i]))))
            .into_iter()
            .map(|r| get_into_result(r?))
            .collect()
    }

    /// Starts one request of a batch: keys travel inline, so batches take keys up to
    /// `INLINE_KEY_MAX`. In a cluster, a key whose primary's connection is lost goes where
    /// a single call's would ([`Client::target`]): a read to a live replica at once.
    pub(super) fn submit_batched(
        &mut self,
        mut h: RequestHeader,
        key: &[u8],
        payload: &[u8],
        receive: Receive,
    ) -> Result<u64> {
        let server = self.target(key, &mut h, None);
        self.submit_inline(h, key, payload, receive, server)
    }

    /// Starts a request of a batch on `server`, its key inline (up to `INLINE_KEY_MAX`).
    pub(super) fn submit_inline(
        &mut self,
        h: RequestHeader,
        key: &[u8],
        payload: &[u8],
        receive: Receive,
        server: usize,
    ) -> Result<u64> {
        check_key(key)?;
        if key.len() > INLINE_KEY_MAX {
            return Err(Error::new(
                Status::Invalid,
                format!("batched operations take keys up to {INLINE_KEY_MAX} bytes"),
            ));
        }
        self.submit_key(key, h, payload.into(), receive, server)
    }
}
