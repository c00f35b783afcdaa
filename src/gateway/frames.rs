//! Write and Read, the calls that carry values, served straight from and into HTTP/2
//! frames; [`Routes`] sends them here and every other call to tonic.
//!
//! tonic copies every received frame into its decode buffer (growing it by reallocation),
//! and a value streamed in several messages must then be joined: three copies of every
//! byte, 44 % of the gateway's CPU in a TensorStore write. Here a Write is decoded as its
//! frames arrive: the small fields with prost, and `value_part`'s bytes copied once, from
//! each frame straight into the value. No frame is kept: a kept frame keeps h2's whole
//! read buffer alive, and a client sending a byte per frame made the gateway hold ~64
//! times the bytes it counted. Going out, tonic encodes each message into a buffer of its
//! own, value and all (a fifth of the gateway's CPU in reads); here a ReadResponse goes
//! out as two frames, its encoded fields and the value bytes as the engine returned them,
//! which h2 writes from where they are.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::Frame;
use http_body_util::BodyExt;
use prost::encoding::{
    decode_key, decode_varint, encode_key, encode_varint, encoded_len_varint, key_len, DecodeContext, WireType,
};
use prost::Message;
use tonic::body::BoxBody;
use tonic::codegen::{http, BoxFuture, Service};
use tonic::service::interceptor::InterceptedService;
use tonic::Status as GrpcStatus;

use super::metrics::Method;
use super::pb::{self, kv_store_service_server::KvStoreServiceServer};
use super::service::{check_write_key, Gateway, ReplyStream, WriteValue};
use super::{TokenCheck, KEY_AND_FIELDS, MAX_MESSAGE};

/// The paths of `KvStoreService.Write` and `.Read`.
const WRITE_PATH: &str = "/tensorstore_grpc.kvstore.KvStoreService/Write";
const READ_PATH: &str = "/tensorstore_grpc.kvstore.KvStoreService/Read";
/// `WriteRequest.value_part`'s and `ReadResponse.value_part`'s field numbers
/// (tsgrpc_kvstore.proto, beside this file).
const WRITE_VALUE_PART: u32 = 3;
const READ_VALUE_PART: u32 = 4;
/// gRPC's message prefix: a compressed flag and a 4-byte big-endian length.
const PREFIX: usize = 5;

/// The gateway's gRPC service: Write and Read calls to this module, the rest to tonic's
/// generated server (which checks the token with the same [`TokenCheck`]).
#[derive(Clone)]
pub(crate) struct Routes {
    pub grpc: InterceptedService<KvStoreServiceServer<Gateway>, TokenCheck>,
    pub gateway: Arc<Gateway>,
    pub token: TokenCheck,
}

impl tonic::server::NamedService for Routes {
    const NAME: &'static str = pb::kv_store_service_server::SERVICE_NAME;
}

impl Service<http::Request<BoxBody>> for Routes {
    type Response = http::Response<BoxBody>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Service::<http::Request<BoxBody>>::poll_ready(&mut self.grpc, cx)
    }

    fn call(&mut self, request: http::Request<BoxBody>) -> Self::Future {
        let write = match request.uri().path() {
            WRITE_PATH => true,
            READ_PATH => false,
            _ => return Box::pin(self.grpc.call(request)),
        };
        let (gateway, token) = (self.gateway.clone(), self.token.clone());
        Box::pin(async move {
            let reply = async {
                token.verify(request.headers().get("authorization").and_then(|v| v.to_str().ok()))?;
                match request.headers().get("grpc-encoding").map(|v| v.as_bytes()) {
                    None | Some(b"identity") => {}
                    Some(other) => {
                        let other = String::from_utf8_lossy(other);
                        return Err(GrpcStatus::unimplemented(format!(
                            "the gateway takes uncompressed messages, not {other}"
                        )));
                    }
                }
                let body = request.into_body();
                if write {
                    let message = gateway.observed(Method::Write, serve_write(&gateway, body)).await?;
                    Ok(reply_body(Replies::new(Box::pin(tokio_stream::once(Ok(message))))))
                } else {
                    let read = read_request(body).await?;
                    let replies = gateway.observed_stream(Method::Read, gateway.serve_read(read)).await?;
                    Ok(reply_body(Replies::new(replies)))
                }
            };
            Ok(reply.await.unwrap_or_else(GrpcStatus::into_http))
        })
    }
}

/// A Read's one request message.
async fn read_request(mut body: BoxBody) -> Result<pb::ReadRequest, GrpcStatus> {
    let mut decoder = ReadDecoder::default();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            decoder.push(data)?;
        }
    }
    decoder.finish()
}

/// Receives one Write stream and stores its value.
async fn serve_write(gateway: &Gateway, mut body: BoxBody) -> Result<pb::WriteResponse, GrpcStatus> {
    let mut decoder = WriteDecoder::new(gateway.new_value());
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            decoder.push(data)?;
        }
    }
    let (first, value) = decoder.finish()?;
    gateway.store(first.key, &first.generation_if_equal, value).await
}

/// A Read request body, decoded as its frames arrive.
pub(crate) struct ReadDecoder {
    messages: Messages,
    request: Option<pb::ReadRequest>,
}

impl Default for ReadDecoder {
    fn default() -> Self {
        ReadDecoder { messages: Messages::new(KEY_AND_FIELDS), request: None }
    }
}

impl ReadDecoder {
    pub(crate) fn push(&mut self, data: Bytes) -> Result<(), GrpcStatus> {
        self.messages.push(&data)?;
        while let Some(mut message) = self.messages.next()? {
            if self.request.is_some() {
                return Err(GrpcStatus::invalid_argument("a Read carries one request message"));
            }
            let request = pb::ReadRequest::decode(&mut message)
                .map_err(|e| GrpcStatus::internal(format!("malformed ReadRequest: {e}")))?;
            self.request = Some(request);
        }
        Ok(())
    }

    pub(crate) fn finish(self) -> Result<pb::ReadRequest, GrpcStatus> {
        self.messages.finish()?;
        self.request.ok_or_else(|| GrpcStatus::invalid_argument("a Read without its request message"))
    }
}

/// A Write stream decoded as its frames arrive: key and condition from its first message
/// (TensorStore repeats them in every message), the value from all of them. Value bytes
/// go straight from each frame into the value; no frame is held, so what a client makes
/// the gateway keep is the value (counted against the buffer budget) and at most one small
/// field of the message in progress ([`KEY_AND_FIELDS`]), however it cuts its frames.
pub(crate) struct WriteDecoder {
    /// Bytes of the message in progress not yet decoded: its prefix, or a field's key and
    /// length, or a small field whole. Never value bytes past the first few.
    head: BytesMut,
    /// Bytes of the message in progress not yet taken into `head` or the value; `None`
    /// between messages (the prefix not yet all in).
    message_left: Option<usize>,
    /// Bytes of the value part in progress still to come.
    part_left: usize,
    /// The small fields of the message in progress.
    fields: pb::WriteRequest,
    first: Option<pb::WriteRequest>,
    value: WriteValue,
}

/// The longest field key and length: two varints.
const FIELD_HEAD_MAX: usize = 20;

impl WriteDecoder {
    pub(crate) fn new(value: WriteValue) -> WriteDecoder {
        WriteDecoder {
            head: BytesMut::new(),
            message_left: None,
            part_left: 0,
            fields: Default::default(),
            first: None,
            value,
        }
    }

    /// Takes one frame's bytes. The bytes of a field not yet decoded count against the
    /// gateway's buffer budget, as the value's do.
    pub(crate) fn push(&mut self, mut data: Bytes) -> Result<(), GrpcStatus> {
        loop {
            if self.part_left > 0 {
                if data.is_empty() {
                    break;
                }
                let n = self.part_left.min(data.len());
                self.value.append(&data[..n]);
                data.advance(n);
                self.part_left -= n;
                self.taken(n);
                self.end_message_if_done()?;
                continue;
            }
            let Some(left) = self.message_left else {
                if data.is_empty() {
                    break;
                }
                self.take_into_head(&mut data, PREFIX);
                if self.head.len() == PREFIX {
                    self.start_message()?;
                }
                continue;
            };
            // A field: its key and length first (all of them, or what the message has).
            let want = FIELD_HEAD_MAX.min(self.head.len() + left);
            self.take_into_head(&mut data, want);
            if self.head.len() < want || !self.decode_field(&mut data)? {
                break; // more of it is in the next frames
            }
            self.end_message_if_done()?;
        }
        self.value.hold_also(self.head.len())
    }

    /// The first message (its key and condition) and the value.
    pub(crate) fn finish(self) -> Result<(pb::WriteRequest, WriteValue), GrpcStatus> {
        if self.message_left.is_some() || !self.head.is_empty() {
            return Err(GrpcStatus::internal("the request ended inside a message"));
        }
        let first = self.first.ok_or_else(|| GrpcStatus::invalid_argument("write stream had no message"))?;
        Ok((first, self.value))
    }

    /// Moves bytes of `data` into `head` until it holds `want` (at most the message's).
    fn take_into_head(&mut self, data: &mut Bytes, want: usize) {
        let n = want.saturating_sub(self.head.len()).min(data.len());
        self.head.extend_from_slice(&data[..n]);
        data.advance(n);
        self.taken(n);
    }

    /// Counts `n` bytes of the message in progress as taken from its frames.
    fn taken(&mut self, n: usize) {
        if let Some(left) = self.message_left.as_mut() {
            *left -= n;
        }
    }

    /// `head` holds a whole prefix: a message begins.
    fn start_message(&mut self) -> Result<(), GrpcStatus> {
        if self.head.get_u8() != 0 {
            return Err(GrpcStatus::unimplemented("the gateway takes uncompressed messages"));
        }
        let len = self.head.get_u32() as usize;
        if len > MAX_MESSAGE {
            return Err(GrpcStatus::out_of_range(format!(
                "a message of {len} bytes exceeds the gateway's {MAX_MESSAGE} for this call"
            )));
        }
        self.message_left = Some(len);
        self.fields = pb::WriteRequest::default();
        self.end_message_if_done()
    }

    /// Decodes the field at the start of `head`, which holds its key and length (or the
    /// rest of the message, if shorter). A value part's bytes go to the value (the first
    /// few from `head`, the rest as they arrive); another field is decoded once `head`
    /// holds it whole, with bytes taken from `data` as needed. False: it is not all in yet.
    fn decode_field(&mut self, data: &mut Bytes) -> Result<bool, GrpcStatus> {
        let bad = |e: prost::DecodeError| GrpcStatus::internal(format!("malformed WriteRequest: {e}"));
        let mut rest = &self.head[..];
        let (tag, wire_type) = decode_key(&mut rest).map_err(bad)?;
        let key_len = self.head.len() - rest.len();
        if wire_type == WireType::LengthDelimited {
            let len = decode_varint(&mut rest).map_err(bad)?;
            let header = self.head.len() - rest.len();
            let in_message = rest.len() + self.message_left.unwrap_or(0);
            let len = usize::try_from(len).ok().filter(|&l| l <= in_message);
            let len =
                len.ok_or_else(|| GrpcStatus::internal("malformed WriteRequest: a field runs past its message"))?;
            if tag == WRITE_VALUE_PART {
                // A field given twice counts once, as its last occurrence (protobuf's rule).
                self.value.start_part(len)?;
                let now = len.min(rest.len());
                self.value.append(&rest[..now]);
                self.head.advance(header + now);
                self.part_left = len - now;
                return Ok(true);
            }
            if len > KEY_AND_FIELDS {
                return Err(GrpcStatus::invalid_argument(format!(
                    "a WriteRequest field of {len} bytes (field {tag}) exceeds the gateway's {KEY_AND_FIELDS}"
                )));
            }
            self.take_into_head(data, header + len);
            if self.head.len() < header + len {
                return Ok(false);
            }
        }
        // Varints and fixed-size fields fit in what `head` holds; a length-delimited one is
        // in whole (above). prost's own per-field decoding, as Message::decode runs it.
        let mut field = &self.head[key_len..];
        self.fields.merge_field(tag, wire_type, &mut field, DecodeContext::default()).map_err(bad)?;
        let used = self.head.len() - field.len();
        self.head.advance(used);
        Ok(true)
    }

    /// Ends the message in progress if all its bytes are decoded.
    fn end_message_if_done(&mut self) -> Result<(), GrpcStatus> {
        if self.message_left != Some(0) || self.part_left > 0 || !self.head.is_empty() {
            return Ok(());
        }
        self.message_left = None;
        if self.first.is_none() {
            check_write_key(&self.fields.key)?; // before more of the value is buffered
            self.first = Some(std::mem::take(&mut self.fields));
        }
        self.value.commit();
        Ok(())
    }
}

/// The gRPC messages of one small request body (a Read's), cut from its DATA frames as
/// they arrive. Frames are copied: a frame kept as h2 handed it over keeps h2's whole read
/// buffer alive, and a client sending a byte per frame would make the gateway hold ~64
/// times what it sent.
struct Messages {
    received: BytesMut,
    /// The length of the message being received, once its prefix is in.
    body: Option<usize>,
    /// The longest message taken.
    limit: usize,
}

impl Messages {
    fn new(limit: usize) -> Messages {
        Messages { received: BytesMut::new(), body: None, limit }
    }

    fn push(&mut self, data: &[u8]) -> Result<(), GrpcStatus> {
        if self.received.len() + data.len() > PREFIX + self.limit {
            return Err(GrpcStatus::out_of_range(format!(
                "a message longer than the gateway's {} for this call",
                self.limit
            )));
        }
        self.received.extend_from_slice(data);
        Ok(())
    }

    /// The next complete message, if all its bytes are in.
    fn next(&mut self) -> Result<Option<Bytes>, GrpcStatus> {
        if self.body.is_none() {
            if self.received.len() < PREFIX {
                return Ok(None);
            }
            if self.received.get_u8() != 0 {
                return Err(GrpcStatus::unimplemented("the gateway takes uncompressed messages"));
            }
            let len = self.received.get_u32() as usize;
            if len > self.limit {
                return Err(GrpcStatus::out_of_range(format!(
                    "a message of {len} bytes exceeds the gateway's {} for this call",
                    self.limit
                )));
            }
            self.body = Some(len);
        }
        match self.body {
            Some(len) if self.received.len() >= len => {
                self.body = None;
                Ok(Some(self.received.split_to(len).freeze()))
            }
            _ => Ok(None),
        }
    }

    /// At the end of the body: nothing may be left over.
    fn finish(&self) -> Result<(), GrpcStatus> {
        match (self.body, self.received.len()) {
            (None, 0) => Ok(()),
            _ => Err(GrpcStatus::internal("the request ended inside a message")),
        }
    }
}

/// A reply body: each message as gRPC frames (the value part of a ReadResponse in
/// a frame of its own, without a copy), then the call's status as trailers.
struct Replies<T> {
    replies: ReplyStream<T>,
    /// The value part of the message whose other fields just went out.
    value: Option<Bytes>,
    done: bool,
}

impl<T> Replies<T> {
    fn new(replies: ReplyStream<T>) -> Self {
        Replies { replies, value: None, done: false }
    }
}

/// A message that [`Replies`] can send, its bytes field `value_part` (if it has one)
/// apart from the rest.
trait Reply: Message + Sized {
    /// Takes the value part out of the message: its field number and bytes.
    fn take_value(&mut self) -> Option<(u32, Bytes)>;
}

impl Reply for pb::ReadResponse {
    fn take_value(&mut self) -> Option<(u32, Bytes)> {
        Some((READ_VALUE_PART, std::mem::take(&mut self.value_part))).filter(|(_, v)| !v.is_empty())
    }
}

impl Reply for pb::WriteResponse {
    fn take_value(&mut self) -> Option<(u32, Bytes)> {
        None
    }
}

/// `message` as the frames of one gRPC message: its prefix and fields, then its value's
/// bytes as they are (protobuf takes fields in any order).
fn encode<T: Reply>(mut message: T) -> (Bytes, Option<Bytes>) {
    let value = message.take_value();
    let value_len = value.as_ref().map_or(0, |(tag, v)| key_len(*tag) + encoded_len_varint(v.len() as u64) + v.len());
    let fields = message.encoded_len();
    let mut head = BytesMut::with_capacity(PREFIX + fields + 16);
    head.put_u8(0);
    head.put_u32((fields + value_len) as u32);
    message.encode(&mut head).expect("the buffer holds the message");
    if let Some((tag, v)) = &value {
        encode_key(*tag, WireType::LengthDelimited, &mut head);
        encode_varint(v.len() as u64, &mut head);
    }
    (head.freeze(), value.map(|(_, v)| v))
}

impl<T: Reply> http_body::Body for Replies<T> {
    type Data = Bytes;
    type Error = GrpcStatus;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, GrpcStatus>>> {
        let this = self.get_mut();
        if let Some(value) = this.value.take() {
            return Poll::Ready(Some(Ok(Frame::data(value))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        let status = match std::task::ready!(this.replies.as_mut().poll_next(cx)) {
            Some(Ok(message)) => {
                let (head, value) = encode(message);
                this.value = value;
                return Poll::Ready(Some(Ok(Frame::data(head))));
            }
            Some(Err(status)) => status,
            None => GrpcStatus::new(tonic::Code::Ok, ""),
        };
        this.done = true;
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            trailers.insert("grpc-status", http::HeaderValue::from(tonic::Code::Internal as i32));
        }
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }
}

/// The HTTP response of a call whose reply is `body`.
fn reply_body<T: Reply + Send + 'static>(body: Replies<T>) -> http::Response<BoxBody> {
    let mut response = http::Response::new(tonic::body::boxed(body));
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paths_are_the_generated_services() {
        assert_eq!(WRITE_PATH, format!("/{}/Write", pb::kv_store_service_server::SERVICE_NAME));
        assert_eq!(READ_PATH, format!("/{}/Read", pb::kv_store_service_server::SERVICE_NAME));
    }

    /// `messages` as a gRPC request body.
    fn body(messages: &[pb::WriteRequest]) -> Vec<u8> {
        messages
            .iter()
            .flat_map(|m| {
                let mut out = vec![0u8];
                out.extend_from_slice(&(m.encoded_len() as u32).to_be_bytes());
                out.extend_from_slice(&m.encode_to_vec());
                out
            })
            .collect()
    }

    /// A write body cut into frames anywhere decodes to its first message and the whole
    /// value; so does a small body for `Messages` (a Read's).
    #[test]
    fn messages_are_decoded_from_frames_cut_anywhere() {
        let messages: Vec<_> = (0..3u8)
            .map(|i| pb::WriteRequest {
                key: Bytes::from(vec![b'k'; 3]),
                generation_if_equal: Bytes::from_static(b"g"),
                value_part: Bytes::from(vec![i; 1000]),
            })
            .collect();
        let encoded = body(&messages);
        let whole: Vec<u8> = (0..3u8).flat_map(|i| vec![i; 1000]).collect();
        for cut in [1, 2, 4, 5, 6, 7, 19, 20, 21, 333, 1000, encoded.len()] {
            let budget = Arc::new(tokio::sync::Semaphore::new(64));
            let mut write = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
            for piece in encoded.chunks(cut) {
                write.push(Bytes::copy_from_slice(piece)).unwrap();
            }
            let (first, value) = write.finish().unwrap();
            assert_eq!(
                (first.key.as_ref(), first.generation_if_equal.as_ref(), first.value_part.len()),
                (&b"kkk"[..], &b"g"[..], 0),
                "cut {cut}"
            );
            assert_eq!(value.bytes(), &whole[..], "cut {cut}");

            let mut small = Messages::new(MAX_MESSAGE);
            let mut got = Vec::new();
            for piece in encoded.chunks(cut) {
                small.push(piece).unwrap();
                while let Some(mut m) = small.next().unwrap() {
                    got.push(pb::WriteRequest::decode(&mut m).unwrap());
                }
            }
            small.finish().unwrap();
            assert_eq!(got, messages, "cut {cut}");
        }
        let budget = Arc::new(tokio::sync::Semaphore::new(64));
        let mut compressed = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
        assert_eq!(
            compressed.push(Bytes::from_static(&[1, 0, 0, 0, 0])).err().map(|e| e.code()),
            Some(tonic::Code::Unimplemented)
        );
        let mut truncated = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
        truncated.push(Bytes::copy_from_slice(&encoded[..encoded.len() - 1])).unwrap();
        assert!(truncated.finish().is_err());
        let mut past = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
        let mut short = encoded[..PREFIX + 8].to_vec();
        short[1..PREFIX].copy_from_slice(&7u32.to_be_bytes()); // the key field runs past the message
        assert_eq!(past.push(Bytes::from(short)).err().map(|e| e.code()), Some(tonic::Code::Internal));
        let mut small = Messages::new(MAX_MESSAGE);
        small.push(&[1, 0, 0, 0, 0]).unwrap();
        assert_eq!(small.next().err().map(|e| e.code()), Some(tonic::Code::Unimplemented));
    }

    /// A part given twice in one message counts once, as the last (protobuf's rule); fields
    /// the gateway does not know are skipped; parts of later messages are appended; the
    /// limit counts the whole value.
    #[test]
    fn parts_follow_protobufs_rules_and_the_limit() {
        let mut first = pb::WriteRequest {
            key: Bytes::from_static(b"key"),
            value_part: Bytes::from_static(b"dropped"),
            ..Default::default()
        }
        .encode_to_vec();
        first.extend_from_slice(
            &pb::WriteRequest { value_part: Bytes::from_static(b"abc"), ..Default::default() }.encode_to_vec(),
        );
        prost::encoding::uint64::encode(9, &77, &mut first); // an unknown field
        let second = pb::WriteRequest {
            key: Bytes::from_static(b"key"),
            value_part: Bytes::from_static(b"defg"),
            ..Default::default()
        }
        .encode_to_vec();
        let framed = |m: &[u8]| [&[0u8][..], &(m.len() as u32).to_be_bytes(), m].concat();

        let budget = Arc::new(tokio::sync::Semaphore::new(1024));
        let mut write = WriteDecoder::new(WriteValue::new(7, budget.clone()));
        write.push(Bytes::from(framed(&first))).unwrap();
        assert_eq!(write.value.bytes(), b"abc");
        write.push(Bytes::from(framed(&second))).unwrap();
        assert_eq!(write.value.bytes(), b"abcdefg");
        assert_eq!(budget.available_permits(), 1023, "7 bytes hold one permit");
        let err = write.push(Bytes::from(framed(&second))).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        drop(write);
        assert_eq!(budget.available_permits(), 1024, "the budget comes back");
    }

    /// A value part counts against the buffer budget from its start, a field not yet
    /// decoded as its bytes arrive; a Read's request may not be longer than a key and its
    /// small fields.
    #[test]
    fn unfinished_messages_count_and_reads_are_short() {
        let framed_part = |len: u32, have: usize| {
            let mut m = vec![0u8];
            m.extend_from_slice(&(1 + encoded_len_varint(u64::from(len)) as u32 + len).to_be_bytes());
            m.push(0x1a); // value_part
            prost::encoding::encode_varint(u64::from(len), &mut m);
            m.extend(std::iter::repeat_n(7, have));
            m
        };
        let budget = Arc::new(tokio::sync::Semaphore::new(4));
        let mut write = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
        write.push(Bytes::from(framed_part(3000, 30))).unwrap();
        assert_eq!(budget.available_permits(), 1, "a 3,000-byte part holds 3 permits as it begins");
        drop(write);
        let mut write = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
        let err = write.push(Bytes::from(framed_part(64 << 10, 30))).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        drop(write);
        let mut key = vec![0u8];
        key.extend_from_slice(&(6003u32).to_be_bytes());
        key.extend_from_slice(&[0x0a, 0xf0, 0x2e]); // key, 6,000 bytes
        key.extend_from_slice(&[b'k'; 3000]);
        let mut write = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
        write.push(Bytes::from(key)).unwrap();
        assert_eq!(budget.available_permits(), 1, "3 KiB of a key still arriving hold 3 permits");
        let err = write.push(Bytes::from(vec![b'k'; 2000])).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        drop(write);
        assert_eq!(budget.available_permits(), 4);

        let mut read = ReadDecoder::default();
        let mut long = vec![0u8];
        long.extend_from_slice(&(KEY_AND_FIELDS as u32 + 1).to_be_bytes());
        assert_eq!(read.push(Bytes::from(long)).unwrap_err().code(), tonic::Code::OutOfRange);
        let request = pb::ReadRequest { key: Bytes::from_static(b"some/key"), ..Default::default() }.encode_to_vec();
        let mut slow = ReadDecoder::default();
        for byte in [&[0u8][..], &(request.len() as u32).to_be_bytes(), &request].concat() {
            slow.push(Bytes::copy_from_slice(&[byte])).unwrap();
        }
        assert_eq!(slow.finish().unwrap().key.as_ref(), b"some/key");
    }

    /// A value sent a byte per frame holds the value and nothing per frame: frames are not
    /// kept (each would keep h2's read buffer alive), and the budget counts the buffer.
    #[test]
    fn tiny_frames_hold_only_their_bytes() {
        let value = vec![5u8; 100_000];
        let encoded = body(&[pb::WriteRequest {
            key: Bytes::from_static(b"k"),
            value_part: Bytes::from(value.clone()),
            ..Default::default()
        }]);
        let budget = Arc::new(tokio::sync::Semaphore::new(1024));
        let mut write = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
        for (i, byte) in encoded.iter().enumerate() {
            write.push(Bytes::copy_from_slice(&[*byte])).unwrap();
            assert!(write.head.len() <= FIELD_HEAD_MAX && write.value.bytes().len() <= i, "byte {i}");
            let counted = (1024 - budget.available_permits()) * super::super::service::BUFFER_PERMIT;
            assert!(
                write.value.capacity() <= counted,
                "byte {i}: {} bytes of buffer, {counted} counted",
                write.value.capacity()
            );
        }
        let (_, got) = write.finish().unwrap();
        assert_eq!(got.bytes(), &value[..]);
    }
}
