//! Write and Read, the calls that carry values, served straight from and into HTTP/2
//! frames; [`Routes`] sends them here and every other call to tonic.
//!
//! tonic copies every received frame into its decode buffer (growing it by reallocation),
//! and a value streamed in several messages must then be joined: three copies of every
//! byte, 44 % of the gateway's CPU in a TensorStore write. Here each frame is kept as h2
//! handed it over until its gRPC message is complete, the message's small fields are
//! decoded with prost, and its `value_part` is copied once, straight into the value.
//! Going out, tonic encodes each message into a buffer of its own, value and all (a fifth
//! of the gateway's CPU in reads); here a ReadResponse goes out as two frames, its encoded
//! fields and the value bytes as the engine returned them, which h2 writes from where they
//! are.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::Frame;
use http_body_util::BodyExt;
use prost::encoding::{decode_key, decode_varint, encode_key, encode_varint, encoded_len_varint, key_len, DecodeContext, WireType};
use prost::Message;
use tonic::body::BoxBody;
use tonic::codegen::{http, BoxFuture, Service};
use tonic::service::interceptor::InterceptedService;
use tonic::Status as GrpcStatus;

use super::metrics::Method;
use super::pb::{self, kv_store_service_server::KvStoreServiceServer};
use super::service::{check_write_key, Gateway, ReplyStream, WriteValue};
use super::{TokenCheck, MAX_MESSAGE};

/// The paths of `KvStoreService.Write` and `.Read`.
const WRITE_PATH: &str = "/tensorstore_grpc.kvstore.KvStoreService/Write";
const READ_PATH: &str = "/tensorstore_grpc.kvstore.KvStoreService/Read";
/// `WriteRequest.value_part`'s and `ReadResponse.value_part`'s field numbers
/// (proto/tsgrpc_kvstore.proto).
const WRITE_VALUE_PART: u32 = 3;
const READ_VALUE_PART: u32 = 4;
/// gRPC's message prefix: a compressed flag and a 4-byte big-endian length.
const PREFIX: usize = 5;
/// The longest ReadRequest taken: a key of the engine's longest and small fields.
const READ_REQUEST_LIMIT: usize = crate::proto::MAX_KEY_LEN + 4096;

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
                        return Err(GrpcStatus::unimplemented(format!("the gateway takes uncompressed messages, not {other}")));
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
        ReadDecoder { messages: Messages::new(READ_REQUEST_LIMIT), request: None }
    }
}

impl ReadDecoder {
    pub(crate) fn push(&mut self, data: Bytes) -> Result<(), GrpcStatus> {
        self.messages.push(data);
        while let Some(mut message) = self.messages.next()? {
            if self.request.is_some() {
                return Err(GrpcStatus::invalid_argument("a Read carries one request message"));
            }
            let request = pb::ReadRequest::decode(&mut message).map_err(|e| GrpcStatus::internal(format!("malformed ReadRequest: {e}")))?;
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
/// (TensorStore repeats them in every message), the value from all of them.
pub(crate) struct WriteDecoder {
    messages: Messages,
    first: Option<pb::WriteRequest>,
    value: WriteValue,
}

impl WriteDecoder {
    pub(crate) fn new(value: WriteValue) -> WriteDecoder {
        WriteDecoder { messages: Messages::new(MAX_MESSAGE), first: None, value }
    }

    /// Takes one frame's bytes. Those of a message not yet complete count against the
    /// gateway's buffer budget, as the value's bytes do.
    pub(crate) fn push(&mut self, data: Bytes) -> Result<(), GrpcStatus> {
        self.messages.push(data);
        while let Some(mut message) = self.messages.next()? {
            let mut head = pb::WriteRequest::default();
            decode(&mut message, &mut head, &mut self.value)?;
            if self.first.is_none() {
                check_write_key(&head.key)?; // before more of its value is buffered
                self.first = Some(head);
            }
            self.value.commit();
        }
        self.value.hold_also(self.messages.pending())
    }

    /// The first message (its key and condition) and the value.
    pub(crate) fn finish(self) -> Result<(pb::WriteRequest, WriteValue), GrpcStatus> {
        self.messages.finish()?;
        let first = self.first.ok_or_else(|| GrpcStatus::invalid_argument("write stream had no message"))?;
        Ok((first, self.value))
    }
}

/// Decodes one WriteRequest from `message`: its value part is copied to the end of `value`,
/// everything else into `head`.
fn decode(message: &mut impl Buf, head: &mut pb::WriteRequest, value: &mut WriteValue) -> Result<(), GrpcStatus> {
    let bad = |e: prost::DecodeError| GrpcStatus::internal(format!("malformed WriteRequest: {e}"));
    while message.has_remaining() {
        let (tag, wire_type) = decode_key(message).map_err(bad)?;
        if tag == WRITE_VALUE_PART && wire_type == WireType::LengthDelimited {
            let len = decode_varint(message).map_err(bad)?;
            let len = usize::try_from(len).ok().filter(|&l| l <= message.remaining());
            let len = len.ok_or_else(|| GrpcStatus::internal("malformed WriteRequest: value_part runs past its message"))?;
            // A field given twice counts once, as its last occurrence (protobuf's rule).
            value.copy_part(message, len)?;
        } else {
            // prost's own per-field decoding (what Message::decode runs for each field).
            head.merge_field(tag, wire_type, message, DecodeContext::default()).map_err(bad)?;
        }
    }
    Ok(())
}

/// The gRPC messages of one request body, cut from its DATA frames as they arrive. A
/// message's bytes stay in the frames h2 received them in (no copy) until it is complete.
struct Messages {
    frames: Frames,
    /// The length of the message being received, once its prefix is in.
    body: Option<usize>,
    /// The longest message taken.
    limit: usize,
}

impl Messages {
    fn new(limit: usize) -> Messages {
        Messages { frames: Frames::default(), body: None, limit }
    }

    fn push(&mut self, data: Bytes) {
        self.frames.push(data);
    }

    /// Bytes received and not yet taken as messages.
    fn pending(&self) -> usize {
        self.frames.remaining()
    }

    /// The next complete message, if all its bytes are in.
    fn next(&mut self) -> Result<Option<bytes::buf::Take<&mut Frames>>, GrpcStatus> {
        if self.body.is_none() {
            if self.frames.remaining() < PREFIX {
                return Ok(None);
            }
            if self.frames.get_u8() != 0 {
                return Err(GrpcStatus::unimplemented("the gateway takes uncompressed messages"));
            }
            let len = self.frames.get_u32() as usize;
            if len > self.limit {
                return Err(GrpcStatus::out_of_range(format!("a message of {len} bytes exceeds the gateway's {} for this call", self.limit)));
            }
            self.body = Some(len);
        }
        match self.body {
            Some(len) if self.frames.remaining() >= len => {
                self.body = None;
                Ok(Some((&mut self.frames).take(len)))
            }
            _ => Ok(None),
        }
    }

    /// At the end of the body: nothing may be left over.
    fn finish(&self) -> Result<(), GrpcStatus> {
        match (self.body, self.frames.remaining()) {
            (None, 0) => Ok(()),
            _ => Err(GrpcStatus::internal("the request ended inside a message")),
        }
    }
}

/// Received bytes not yet decoded, in the frames they came in.
#[derive(Default)]
struct Frames {
    parts: VecDeque<Bytes>,
    len: usize,
}

impl Frames {
    fn push(&mut self, data: Bytes) {
        if !data.is_empty() {
            self.len += data.len();
            self.parts.push_back(data);
        }
    }
}

impl Buf for Frames {
    fn remaining(&self) -> usize {
        self.len
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map_or(&[], |b| b)
    }

    fn advance(&mut self, mut n: usize) {
        assert!(n <= self.len, "advance past the received bytes");
        self.len -= n;
        while n > 0 {
            let front = self.parts.front_mut().expect("len counts the parts' bytes");
            if n < front.len() {
                front.advance(n);
                return;
            }
            n -= front.len();
            self.parts.pop_front();
        }
    }

    /// Keys and generations come out as slices of their frame when they lie in one.
    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        match self.parts.front_mut() {
            Some(front) if front.len() >= len => {
                self.len -= len;
                let out = front.split_to(len);
                if front.is_empty() {
                    self.parts.pop_front();
                }
                out
            }
            _ => {
                let mut out = BytesMut::with_capacity(len);
                out.put((&mut *self).take(len));
                out.freeze()
            }
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

    /// Messages cut anywhere across frames come out whole, in order, without a copy of
    /// a part that lies in one frame.
    #[test]
    fn messages_are_cut_from_frames_split_anywhere() {
        let encoded: Vec<u8> = (0..3u8)
            .flat_map(|i| {
                let m = pb::WriteRequest { key: Bytes::from(vec![b'k'; 3]), generation_if_equal: Bytes::new(), value_part: Bytes::from(vec![i; 1000]) };
                let mut out = vec![0u8];
                out.extend_from_slice(&(m.encoded_len() as u32).to_be_bytes());
                out.extend_from_slice(&m.encode_to_vec());
                out
            })
            .collect();
        for cut in [1, 4, 5, 6, 7, 333, 1000, encoded.len()] {
            let mut messages = Messages::new(MAX_MESSAGE);
            let mut got = Vec::new();
            for piece in encoded.chunks(cut) {
                messages.push(Bytes::copy_from_slice(piece));
                while let Some(mut m) = messages.next().unwrap() {
                    got.push(pb::WriteRequest::decode(&mut m).unwrap());
                }
            }
            messages.finish().unwrap();
            assert_eq!(got.len(), 3, "cut {cut}");
            for (i, m) in got.iter().enumerate() {
                assert_eq!((m.key.as_ref(), m.value_part.as_ref()), (&b"kkk"[..], &vec![i as u8; 1000][..]), "cut {cut}");
            }
        }
        let mut compressed = Messages::new(MAX_MESSAGE);
        compressed.push(Bytes::from_static(&[1, 0, 0, 0, 0]));
        assert_eq!(compressed.next().err().map(|e| e.code()), Some(tonic::Code::Unimplemented));

        let mut truncated = Messages::new(MAX_MESSAGE);
        truncated.push(Bytes::copy_from_slice(&encoded[..encoded.len() - 1]));
        while let Some(mut m) = truncated.next().unwrap() {
            m.advance(m.remaining());
        }
        assert!(truncated.finish().is_err());
    }

    /// A part given twice in one message counts once, as the last (protobuf's rule); fields
    /// the gateway does not know are skipped; parts of later messages are appended; the
    /// limit counts the whole value.
    #[test]
    fn parts_follow_protobufs_rules_and_the_limit() {
        let mut first = pb::WriteRequest { key: Bytes::from_static(b"key"), value_part: Bytes::from_static(b"dropped"), ..Default::default() }.encode_to_vec();
        first.extend_from_slice(&pb::WriteRequest { value_part: Bytes::from_static(b"abc"), ..Default::default() }.encode_to_vec());
        prost::encoding::uint64::encode(9, &77, &mut first); // an unknown field
        let second = pb::WriteRequest { key: Bytes::from_static(b"key"), value_part: Bytes::from_static(b"defg"), ..Default::default() }.encode_to_vec();

        let budget = Arc::new(tokio::sync::Semaphore::new(1024));
        let mut value = WriteValue::new(7, budget.clone());
        let mut head = pb::WriteRequest::default();
        decode(&mut &first[..], &mut head, &mut value).unwrap();
        value.commit();
        assert_eq!((head.key.as_ref(), value.bytes()), (&b"key"[..], &b"abc"[..]));
        decode(&mut &second[..], &mut pb::WriteRequest::default(), &mut value).unwrap();
        value.commit();
        assert_eq!(value.bytes(), b"abcdefg");
        assert_eq!(budget.available_permits(), 1023, "7 bytes hold one permit");
        let err = decode(&mut &second[..], &mut pb::WriteRequest::default(), &mut value).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        drop(value);
        assert_eq!(budget.available_permits(), 1024, "the budget comes back");
    }

    /// The bytes of a message still arriving count against the buffer budget, and a Read's
    /// request may not be longer than a key and its small fields.
    #[test]
    fn unfinished_messages_count_and_reads_are_short() {
        let budget = Arc::new(tokio::sync::Semaphore::new(4));
        let mut write = WriteDecoder::new(WriteValue::new(1 << 20, budget.clone()));
        let mut start = vec![0u8];
        start.extend_from_slice(&(64u32 << 10).to_be_bytes());
        start.extend_from_slice(&[0x1a; 3000]);
        write.push(Bytes::from(start)).unwrap();
        assert_eq!(budget.available_permits(), 1, "3 KiB of an unfinished message hold 3 permits");
        let err = write.push(Bytes::from(vec![0u8; 2000])).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        drop(write);
        assert_eq!(budget.available_permits(), 4);

        let mut read = ReadDecoder::default();
        let mut long = vec![0u8];
        long.extend_from_slice(&(READ_REQUEST_LIMIT as u32 + 1).to_be_bytes());
        assert_eq!(read.push(Bytes::from(long)).unwrap_err().code(), tonic::Code::OutOfRange);
    }
}
