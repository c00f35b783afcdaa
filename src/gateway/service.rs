//! `tensorstore_grpc.kvstore.KvStoreService` over the engine, with the memory driver's
//! semantics (the reference TensorStore's client expects).

use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::OwnedSemaphorePermit;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status as GrpcStatus, Streaming};

use super::metrics::{Call, GatewayMetrics, Method};
use super::pb::{self, kv_store_service_server::KvStoreService, read_response::State};
use super::pool::EnginePool;
use super::wire::{generation_and_timestamp, status_of, Generation};
use crate::client::{
    ByteRange, DeleteResult, GetAtMost, GetOptions, GetResult, KeyRange, ListEntry, PutOptions, Value, WriteCondition,
    WriteResult,
};
use crate::proto::MAX_KEY_LEN;

/// Value bytes per streamed ReadResponse, as upstream sends them. Not more: the
/// TensorStore wheel on the 16-core host refuses any message over 4 MiB ("Received message
/// larger than max (4194338 vs. 4194304)"), so a 4 MiB chunk sent as one message fails.
const READ_CHUNK: usize = 1 << 20;
/// The most value bytes a Read fetches from the engine at once. A longer value (or range)
/// is read in windows of this size, so that one read holds at most one window whatever
/// the value's size, and the engine clients hold at most one window each while fetching.
const READ_WINDOW: usize = 8 << 20;
/// Key bytes per ListResponse batch, as upstream.
const LIST_BATCH_BYTES: usize = 16 << 10;

pub(crate) type ReplyStream<T> = Pin<Box<dyn Stream<Item = Result<T, GrpcStatus>> + Send>>;

/// A streamed reply with its call: the call is counted by how the stream ends (its first
/// error, OK at its end, or CANCELLED when it is dropped unfinished because the client
/// left), not when the stream starts.
struct Observed<T> {
    replies: ReplyStream<T>,
    call: Call,
}

impl<T> Stream for Observed<T> {
    type Item = Result<T, GrpcStatus>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let next = this.replies.as_mut().poll_next(cx);
        match &next {
            std::task::Poll::Ready(Some(Err(status))) => this.call.finish(status.code()),
            std::task::Poll::Ready(None) => this.call.finish(tonic::Code::Ok),
            _ => {}
        }
        next
    }
}

pub struct Gateway {
    pub engine: Arc<EnginePool>,
    /// Largest value a Write may stream (bytes buffered per request).
    pub max_value: usize,
    /// Bytes held for clients across all connections, in KiB permits: unfinished Write
    /// streams and Read replies not yet sent. Beyond it a call is refused with
    /// RESOURCE_EXHAUSTED (which TensorStore retries).
    pub buffered: Arc<tokio::sync::Semaphore>,
    pub metrics: Arc<GatewayMetrics>,
}

/// The unit of `Gateway::buffered`'s permits.
pub const BUFFER_PERMIT: usize = 1024;

/// The engine client checks keys too; a Write checks first so that a bad key is refused
/// before its value is buffered.
pub(crate) fn check_write_key(key: &[u8]) -> Result<(), GrpcStatus> {
    if key.len() > MAX_KEY_LEN {
        return Err(GrpcStatus::invalid_argument(format!("key of {} bytes exceeds {MAX_KEY_LEN}", key.len())));
    }
    if key.is_empty() {
        return Err(GrpcStatus::invalid_argument(
            "remote_dram keys are at least 1 byte: the empty key cannot be written",
        ));
    }
    Ok(())
}

/// A write or delete condition; `None` when it can never hold (a generation we never
/// minted), so the caller answers "condition failed" without touching the store.
pub(crate) fn write_condition(bytes: &[u8]) -> Option<WriteCondition> {
    match Generation::parse(bytes) {
        Generation::Unknown => Some(WriteCondition::None),
        Generation::NoValue => Some(WriteCondition::IfAbsent),
        Generation::Engine(g) => Some(WriteCondition::IfEqual(g)),
        Generation::Foreign => None,
    }
}

/// `[min, max)`; an empty max is unbounded.
pub(crate) fn key_range(r: pb::KeyRange) -> KeyRange {
    KeyRange { min: r.inclusive_min.to_vec(), max: (!r.exclusive_max.is_empty()).then(|| r.exclusive_max.to_vec()) }
}

/// A Read's engine options, and whether its if-equal can never hold (then only the key's
/// existence and generation are fetched).
pub(crate) fn read_options(r: &pb::ReadRequest) -> (GetOptions, bool) {
    let range = r.byte_range.map(|b| ByteRange { start: b.inclusive_min, end: b.exclusive_max.unwrap_or(-1) });
    let mut opts = GetOptions { range, ..Default::default() };
    match Generation::parse(&r.generation_if_not_equal) {
        Generation::Engine(g) => opts.if_not_equal = Some(g),
        // A present key's generation always differs from these.
        Generation::Unknown | Generation::NoValue | Generation::Foreign => {}
    }
    let never_equal = match Generation::parse(&r.generation_if_equal) {
        Generation::Engine(g) => {
            opts.if_equal = Some(g);
            false
        }
        Generation::Unknown => false,
        // No present key matches: only its existence and generation are needed.
        Generation::NoValue | Generation::Foreign => true,
    };
    if never_equal {
        opts.range = Some(ByteRange { start: 0, end: 0 });
    }
    (opts, never_equal)
}

fn read_response(state: State, g: Generation, bound: Option<&pb::Timestamp>, part: Bytes) -> pb::ReadResponse {
    pb::ReadResponse {
        status: None,
        generation_and_timestamp: Some(generation_and_timestamp(g, bound)),
        state: state as i32,
        value_part: part,
    }
}

/// A value's bytes as ReadResponses of up to [`READ_CHUNK`] bytes. Every message repeats
/// state and generation: the client takes them from each message while its gathered bytes
/// are still empty.
fn value_messages(
    data: Bytes,
    generation: u64,
    bound: Option<&pb::Timestamp>,
) -> impl Iterator<Item = pb::ReadResponse> + '_ {
    let chunks = data.len().div_ceil(READ_CHUNK).max(1);
    (0..chunks).map(move |i| {
        let part = data.slice((i * READ_CHUNK).min(data.len())..((i + 1) * READ_CHUNK).min(data.len()));
        read_response(State::Value, Generation::Engine(generation), bound, part)
    })
}

/// ListResponses of about [`LIST_BATCH_BYTES`] of keys each, `strip` bytes cut from each
/// key's front.
fn list_batches(entries: Vec<ListEntry>, strip: usize) -> Vec<pb::ListResponse> {
    let mut batches = Vec::new();
    let mut batch = pb::ListResponse::default();
    let mut batch_bytes = 0;
    for e in entries {
        let key = Bytes::from(e.key);
        let key = key.slice(strip.min(key.len())..);
        batch_bytes += key.len();
        batch.entry.push(pb::list_response::Entry { key, size: e.size as i64 });
        if batch_bytes >= LIST_BATCH_BYTES {
            batches.push(std::mem::take(&mut batch));
            batch_bytes = 0;
        }
    }
    if !batch.entry.is_empty() {
        batches.push(batch);
    }
    batches
}

/// One window of a value read in windows: exactly `range`, or UNAVAILABLE when the value
/// is no longer at `generation`.
async fn fetch_window(
    engine: &EnginePool,
    key: Bytes,
    generation: u64,
    range: Range<u64>,
) -> Result<Bytes, GrpcStatus> {
    let want = (range.end - range.start) as usize;
    let range = ByteRange { start: range.start as i64, end: range.end as i64 };
    let opts = GetOptions { if_equal: Some(generation), range: Some(range), ..Default::default() };
    match engine.run(move |c| c.get_with(&key, &opts)).await.map_err(|e| status_of(&e))? {
        GetResult::Value(v) if v.data.len() == want => Ok(Bytes::from(v.data)),
        GetResult::Value(v) => {
            Err(GrpcStatus::internal(format!("the engine answered {} bytes for a window of {want}", v.data.len())))
        }
        GetResult::Unchanged { .. } | GetResult::Missing => {
            Err(GrpcStatus::unavailable("the value changed while the gateway streamed it; read it again"))
        }
    }
}

/// Takes `permits` (of [`BUFFER_PERMIT`] bytes) of the buffer budget, or refuses the call
/// when it is spent.
fn hold(buffered: &Arc<tokio::sync::Semaphore>, permits: usize) -> Result<Option<OwnedSemaphorePermit>, GrpcStatus> {
    if permits == 0 {
        return Ok(None);
    }
    let permits = u32::try_from(permits).unwrap_or(u32::MAX);
    buffered.clone().try_acquire_many_owned(permits).map(Some).map_err(|_| {
        GrpcStatus::resource_exhausted(
            "the gateway's buffer for unfinished writes and unsent reads is full (rdram gateway --max-buffered); retry",
        )
    })
}

/// A Write's value as its messages arrive: one buffer, grown fourfold at a time (a value of
/// four parts is copied once more at most, not at each part), its bytes counted against
/// the gateway's buffer budget until it is dropped.
pub(crate) struct WriteValue {
    data: Vec<u8>,
    /// The bytes of the messages decoded so far; a message's part goes after them.
    committed: usize,
    max_value: usize,
    buffered: Arc<tokio::sync::Semaphore>,
    held: Option<OwnedSemaphorePermit>,
}

impl WriteValue {
    pub(crate) fn new(max_value: usize, buffered: Arc<tokio::sync::Semaphore>) -> WriteValue {
        WriteValue { data: Vec::new(), committed: 0, max_value, buffered, held: None }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.data
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.data.capacity()
    }

    /// Begins the current message's part, of `len` bytes (replacing what an earlier part
    /// field of the same message left: protobuf keeps the last one). Room for all of it is
    /// made now and its length counted against the budget now, so memory follows what the
    /// fields declare (grown fourfold at most), not how frames are cut; its bytes are copied
    /// once as they arrive.
    pub(crate) fn start_part(&mut self, len: usize) -> Result<(), GrpcStatus> {
        self.data.truncate(self.committed);
        let end = self.committed.saturating_add(len);
        if end > self.max_value {
            return Err(GrpcStatus::invalid_argument(format!(
                "value exceeds the gateway's limit of {} bytes (rdram gateway --max-value)",
                self.max_value
            )));
        }
        self.hold_up_to(end)?;
        if end > self.data.capacity() {
            // Fourfold: a value of four parts is copied once more at most, not at each part.
            let grown = end.max(self.data.capacity().saturating_mul(4)).min(self.max_value);
            self.data.reserve_exact(grown - self.data.len());
        }
        Ok(())
    }

    /// Appends bytes of the current part as they arrive (within the length it began with).
    pub(crate) fn append(&mut self, bytes: &[u8]) {
        debug_assert!(self.data.len() + bytes.len() <= self.data.capacity(), "start_part made room for the part");
        self.data.extend_from_slice(bytes);
    }

    /// Counts `pending` bytes received and not yet decoded against the budget, beside the
    /// value's.
    pub(crate) fn hold_also(&mut self, pending: usize) -> Result<(), GrpcStatus> {
        self.hold_up_to(self.data.len() + pending)
    }

    /// Holds budget for `bytes` in all (what is held already included).
    fn hold_up_to(&mut self, bytes: usize) -> Result<(), GrpcStatus> {
        let have = self.held.as_ref().map_or(0, |p| p.num_permits());
        if let Some(more) = hold(&self.buffered, bytes.div_ceil(BUFFER_PERMIT).saturating_sub(have))? {
            match self.held.as_mut() {
                Some(h) => h.merge(more),
                None => self.held = Some(more),
            }
        }
        Ok(())
    }

    /// Ends the current message: its part stays.
    pub(crate) fn commit(&mut self) {
        self.committed = self.data.len();
    }
}

#[tonic::async_trait]
impl KvStoreService for Gateway {
    type ReadStream = ReplyStream<pb::ReadResponse>;
    type ListStream = ReplyStream<pb::ListResponse>;

    /// Never called: [`super::frames::Routes`] sends Read's value into HTTP/2 frames itself.
    async fn read(&self, _: Request<pb::ReadRequest>) -> Result<Response<Self::ReadStream>, GrpcStatus> {
        Err(GrpcStatus::internal("Read is routed to the gateway's frame encoder"))
    }

    /// Never called: [`super::frames::Routes`] serves Write from its HTTP/2 frames.
    async fn write(&self, _: Request<Streaming<pb::WriteRequest>>) -> Result<Response<pb::WriteResponse>, GrpcStatus> {
        Err(GrpcStatus::internal("Write is routed to the gateway's frame decoder"))
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Result<Response<pb::DeleteResponse>, GrpcStatus> {
        self.observed(Method::Delete, self.serve_delete(request)).await
    }

    async fn list(&self, request: Request<pb::ListRequest>) -> Result<Response<Self::ListStream>, GrpcStatus> {
        self.observed_stream(Method::List, self.serve_list(request.into_inner())).await.map(Response::new)
    }
}

impl Gateway {
    /// Runs one unary call, counted in the metrics: in flight while it runs, then by its
    /// code (CANCELLED if the client left before the answer).
    pub(crate) async fn observed<T>(
        &self,
        method: Method,
        serve: impl std::future::Future<Output = Result<T, GrpcStatus>>,
    ) -> Result<T, GrpcStatus> {
        let mut call = self.metrics.call(method);
        let result = serve.await;
        call.finish(result.as_ref().map_or_else(|s| s.code(), |_| tonic::Code::Ok));
        result
    }

    /// Runs one call with a streamed reply, counted in the metrics: in flight until its
    /// stream ends, then by how it ended (see [`Observed`]).
    pub(crate) async fn observed_stream<T: Send + 'static>(
        &self,
        method: Method,
        serve: impl std::future::Future<Output = Result<ReplyStream<T>, GrpcStatus>>,
    ) -> Result<ReplyStream<T>, GrpcStatus> {
        let mut call = self.metrics.call(method);
        match serve.await {
            Ok(replies) => Ok(Box::pin(Observed { replies, call })),
            Err(status) => {
                call.finish(status.code());
                Err(status)
            }
        }
    }

    pub(crate) async fn serve_read(&self, r: pb::ReadRequest) -> Result<ReplyStream<pb::ReadResponse>, GrpcStatus> {
        let (opts, never_equal) = read_options(&r);
        let bound = r.staleness_bound;
        let only = |state, g| -> ReplyStream<pb::ReadResponse> {
            let message = read_response(state, g, bound.as_ref(), Bytes::new());
            Box::pin(tokio_stream::once(Ok(message)))
        };
        if r.key.is_empty() {
            return Ok(only(State::Missing, Generation::NoValue)); // the engine stores no empty key
        }
        let key = r.key.clone();
        let first =
            self.engine.run(move |c| c.get_at_most(&key, &opts, READ_WINDOW)).await.map_err(|e| status_of(&e))?;
        match first {
            GetAtMost::Got(GetResult::Missing) => Ok(only(State::Missing, Generation::NoValue)),
            GetAtMost::Got(GetResult::Value(v)) if !never_equal => {
                // A client that does not take its reply would otherwise make the gateway
                // keep the value for as long as the stream stays open.
                let held = hold(&self.buffered, v.data.len().div_ceil(BUFFER_PERMIT))?;
                self.metrics.sent_bytes.fetch_add(v.data.len() as u64, Relaxed);
                let messages: Vec<_> = value_messages(Bytes::from(v.data), v.generation, bound.as_ref()).collect();
                // Held while the reply stream lives (dropped once sent, or when the client goes).
                let replies = tokio_stream::iter(messages).map(move |m| {
                    let _held = &held;
                    m
                });
                Ok(Box::pin(replies.map(Ok)))
            }
            GetAtMost::Got(GetResult::Unchanged { generation } | GetResult::Value(Value { generation, .. })) => {
                Ok(only(State::Unspecified, Generation::Engine(generation)))
            }
            // A never-equal read asks for no bytes, so only a value read gets here.
            GetAtMost::TooLong { len, generation, size } => {
                let asked = r.byte_range.map_or(ByteRange { start: 0, end: -1 }, |b| ByteRange {
                    start: b.inclusive_min,
                    end: b.exclusive_max.unwrap_or(-1),
                });
                let (start, end) = asked.resolve(size).map_err(|e| status_of(&e))?;
                debug_assert_eq!(end - start, len as u64);
                Ok(self.read_in_windows(r.key, generation, start..end, bound))
            }
        }
    }

    /// Streams `range` of a value longer than [`READ_WINDOW`] one window at a time, each
    /// fetched once the previous one is handed to gRPC, and each pinned to `generation`:
    /// an overwrite or delete meanwhile ends the stream with UNAVAILABLE (TensorStore then
    /// reads again from the start) rather than with a mix of two values.
    fn read_in_windows(
        &self,
        key: Bytes,
        generation: u64,
        range: Range<u64>,
        bound: Option<pb::Timestamp>,
    ) -> ReplyStream<pb::ReadResponse> {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let (engine, buffered, metrics) = (self.engine.clone(), self.buffered.clone(), self.metrics.clone());
        tokio::spawn(async move {
            let mut at = range.start;
            while at < range.end {
                let end = (at + READ_WINDOW as u64).min(range.end);
                // Taken before the fetch, given back once the window is handed on.
                let window = match hold(&buffered, (end - at).div_ceil(BUFFER_PERMIT as u64) as usize) {
                    Ok(held) => fetch_window(&engine, key.clone(), generation, at..end).await.map(|data| (data, held)),
                    Err(refused) => Err(refused),
                };
                let (data, _held) = match window {
                    Ok(w) => w,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                metrics.sent_bytes.fetch_add(data.len() as u64, Relaxed);
                for message in value_messages(data, generation, bound.as_ref()) {
                    if tx.send(Ok(message)).await.is_err() {
                        return; // the client went
                    }
                }
                at = end;
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }

    /// An empty value for a Write stream to fill, within `--max-value` and the buffer budget.
    pub(crate) fn new_value(&self) -> WriteValue {
        WriteValue::new(self.max_value, self.buffered.clone())
    }

    /// Stores a Write's value under `generation_if_equal`'s condition.
    pub(crate) async fn store(
        &self,
        key: Bytes,
        generation_if_equal: &[u8],
        value: WriteValue,
    ) -> Result<pb::WriteResponse, GrpcStatus> {
        let Some(condition) = write_condition(generation_if_equal) else {
            return Ok(pb::WriteResponse {
                status: None,
                generation_and_timestamp: Some(generation_and_timestamp(Generation::Unknown, None)),
            });
        };
        let total = value.bytes().len();
        // The budget is held until the engine has the value (the closure owns it).
        let result = self
            .engine
            .run(move |c| c.put_with(&key, value.bytes(), &PutOptions { condition, ttl: None }))
            .await
            .map_err(|e| status_of(&e))?;
        self.metrics.received_bytes.fetch_add(total as u64, Relaxed);
        let g = match result {
            WriteResult::Written { generation } => Generation::Engine(generation),
            WriteResult::ConditionFailed => Generation::Unknown,
        };
        Ok(pb::WriteResponse { status: None, generation_and_timestamp: Some(generation_and_timestamp(g, None)) })
    }

    async fn serve_delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, GrpcStatus> {
        let r = request.into_inner();
        // Decided by presence: a range delete may legitimately start at the empty key, and
        // deleting the empty key is a single-key delete.
        let g = match (r.range, r.key) {
            (Some(range), _) => {
                let range = key_range(range);
                self.engine.run(move |c| c.delete_range(&range)).await.map_err(|e| status_of(&e))?;
                Generation::Unknown
            }
            (None, Some(key)) => {
                match write_condition(&r.generation_if_equal) {
                    None => Generation::Unknown,
                    // The engine stores no empty key: it is absent, whatever is asked.
                    Some(WriteCondition::None | WriteCondition::IfAbsent) if key.is_empty() => Generation::NoValue,
                    Some(WriteCondition::IfEqual(_)) if key.is_empty() => Generation::Unknown,
                    Some(condition) => {
                        match self
                            .engine
                            .run(move |c| c.delete_with(&key, condition))
                            .await
                            .map_err(|e| status_of(&e))?
                        {
                            DeleteResult::Deleted { .. } => Generation::NoValue,
                            DeleteResult::ConditionFailed => Generation::Unknown,
                        }
                    }
                }
            }
            (None, None) => return Err(GrpcStatus::invalid_argument("delete needs a key or a range")),
        };
        Ok(Response::new(pb::DeleteResponse {
            status: None,
            generation_and_timestamp: Some(generation_and_timestamp(g, None)),
        }))
    }

    /// Streams the listing page by page (one engine reply, at most 1 MiB of keys, at a
    /// time; each counted against `--max-buffered` until handed on), so a List of a large
    /// key space holds one page, not every key. Pages come shard by shard, which is not
    /// key order: TensorStore takes List entries in any order.
    async fn serve_list(&self, r: pb::ListRequest) -> Result<ReplyStream<pb::ListResponse>, GrpcStatus> {
        let range = key_range(r.range.unwrap_or_default());
        let strip = usize::try_from(r.strip_prefix_length).unwrap_or(usize::MAX);
        let first = {
            let range = range.clone();
            self.engine.run(move |c| c.list_page(&range, None)).await.map_err(|e| status_of(&e))?
        };
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let (engine, buffered) = (self.engine.clone(), self.buffered.clone());
        tokio::spawn(async move {
            let mut page = Ok(first);
            loop {
                let (entries, next) = match page {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = tx.send(Err(status_of(&e))).await;
                        return;
                    }
                };
                let held =
                    match hold(&buffered, entries.iter().map(|e| e.key.len()).sum::<usize>().div_ceil(BUFFER_PERMIT)) {
                        Ok(held) => held,
                        Err(refused) => {
                            let _ = tx.send(Err(refused)).await;
                            return;
                        }
                    };
                for batch in list_batches(entries, strip) {
                    if tx.send(Ok(batch)).await.is_err() {
                        return; // the client went
                    }
                }
                drop(held);
                let Some(cursor) = next else { return };
                let range = range.clone();
                page = engine.run(move |c| c.list_page(&range, Some(&cursor))).await;
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}
