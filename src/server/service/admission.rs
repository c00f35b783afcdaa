//! Admission: a request's header decoded once, its session (the bootstrap's, or the
//! credential a transport worker issued in its place) checked, its inline key measured,
//! and member-only frames kept to members. A refusal keeps the request id when it could
//! be read, so that the sender still gets an answer.

use super::*;

impl Service {
    /// Decodes a request whose header and inline key arrived as `header` (UCX: the AM
    /// header), carrying the session of a connected client; returns it with that client.
    /// On failure, the request id to answer (when readable) and why.
    pub fn admit<'a>(&mut self, header: &'a [u8]) -> std::result::Result<(Request<'a>, u64), Refusal> {
        let (h, kind) = decoded(header).map_err(|e| self.refused(None, e))?;
        let client = self.client_of(h.session);
        let req = checked(header, h, kind, client.is_some()).map_err(|e| self.refused(Some(kind.op()), e))?;
        self.members_only(kind).map_err(|e| self.refused(Some(kind.op()), (Some(h.request_id), e)))?;
        Ok((req, client.unwrap_or(0)))
    }

    /// Like [`Service::admit`] for a transport that sends one message (header, inline key
    /// and payload back to back) and checks the credential it must carry itself (libfabric:
    /// the one the client's slot got at its hello). Returns the request and its payload.
    pub fn admit_message<'a>(
        &self,
        msg: &'a [u8],
        session: u64,
    ) -> std::result::Result<(Request<'a>, &'a [u8]), Refusal> {
        let (h, kind) = decoded(msg).map_err(|e| self.refused(None, e))?;
        let (header, payload) = msg.split_at((h.encoded_len() + inline_key_len(&h, kind.op())).min(msg.len()));
        let req = checked(header, h, kind, session != 0 && h.session == session)
            .map_err(|e| self.refused(Some(kind.op()), e))?;
        self.members_only(kind).map_err(|e| self.refused(Some(kind.op()), (Some(h.request_id), e)))?;
        Ok((req, payload))
    }

    /// Counts a request refused before it was served.
    #[cold]
    fn refused(&self, op: Option<Op>, (id, e): Refusal) -> Refusal {
        self.metrics.record(op, e.status, 0, 0, self.metrics.clock());
        (id, e)
    }
}

/// The request header at the start of `header`, decoded once and validated.
fn decoded(header: &[u8]) -> std::result::Result<(RequestHeader, Kind), Refusal> {
    RequestHeader::decode(header).map_err(|e| (e.request_id, Error::new(e.status, e.message)))
}

/// The rest of admission, for a decoded header: the session was live (`authorized`), and
/// the inline key is as long as the header says.
fn checked(header: &[u8], h: RequestHeader, kind: Kind, authorized: bool) -> std::result::Result<Request<'_>, Refusal> {
    let fail = |status, msg: String| Err((Some(h.request_id), Error::new(status, msg)));
    if !authorized {
        return fail(
            Status::AuthFailed,
            "request without a valid session: connect through the bootstrap handshake with the right token".into(),
        );
    }
    let inline = &header[h.encoded_len()..];
    let expected = inline_key_len(&h, kind.op());
    if inline.len() != expected {
        return fail(Status::Invalid, format!("header carries {} key bytes, expected {expected}", inline.len()));
    }
    Ok(Request { header: h, kind, inline })
}

/// How many key bytes travel right after the fixed header.
fn inline_key_len(h: &RequestHeader, op: Op) -> usize {
    match op {
        Op::Put | Op::Get | Op::Delete if h.flags & flags::KEY_IN_PAYLOAD == 0 => h.key_len as usize,
        _ => 0,
    }
}
