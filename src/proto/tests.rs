use super::*;

#[test]
fn request_header_round_trips_and_rejects_bad_fields() {
    let mut h = RequestHeader::new(Op::Put, 42, 7);
    h.flags = flags::IF_EQUAL | flags::HAS_TTL;
    h.if_equal = 99;
    h.key_len = 5;
    h.ttl_or_limit = 1000;
    let mut buf = [0u8; REQUEST_HEADER_LEN];
    h.encode(&mut buf);
    let (d, op) = RequestHeader::decode(&buf).unwrap();
    assert_eq!((d, op), (h, Kind::Put));

    let mut bad = buf;
    bad[2] = PROTOCOL_VERSION + 1;
    let e = RequestHeader::decode(&bad).unwrap_err();
    assert_eq!((e.status, e.request_id), (Status::VersionMismatch, Some(42)));
    let mut bad = buf;
    bad[3] = 200;
    assert_eq!(RequestHeader::decode(&bad).unwrap_err().status, Status::Invalid);
    let mut bad = buf;
    bad[64..68].copy_from_slice(&(MAX_KEY_LEN as u32 + 1).to_le_bytes());
    assert_eq!(RequestHeader::decode(&bad).unwrap_err().status, Status::KeyTooLarge);
    assert_eq!(RequestHeader::decode(&buf[..10]).unwrap_err().request_id, None);
    // A put's aux_len is its value's alignment: below VALUE_ALIGN; other single-key
    // ops carry none.
    let mut aligned = buf;
    aligned[68..72].copy_from_slice(&(VALUE_ALIGN as u32 - 1).to_le_bytes());
    assert_eq!(RequestHeader::decode(&aligned).unwrap().0.aux_len, VALUE_ALIGN as u32 - 1);
    let mut bad = buf;
    bad[68..72].copy_from_slice(&(VALUE_ALIGN as u32).to_le_bytes());
    assert_eq!(RequestHeader::decode(&bad).unwrap_err().status, Status::Invalid);
    let mut get = RequestHeader::new(Op::Get, 43, 7);
    get.key_len = 5;
    get.aux_len = 1;
    get.encode(&mut bad);
    assert_eq!(RequestHeader::decode(&bad).unwrap_err().status, Status::Invalid);
}

#[test]
fn short_form_carries_what_it_may_and_decodes_alike() {
    let mut put = RequestHeader::new(Op::Put, 42, 7);
    put.key_len = 48;
    put.aux_len = 3;
    let mut buf = [0u8; REQUEST_HEADER_LEN];
    assert_eq!(put.encode_short(&mut buf), SHORT_REQUEST_HEADER_LEN);
    let (d, op) = RequestHeader::decode(&buf[..SHORT_REQUEST_HEADER_LEN]).unwrap();
    assert_eq!((d, op), (RequestHeader { flags: flags::SHORT_FORM, ..put }, Kind::Put));
    assert_eq!(d.encoded_len(), SHORT_REQUEST_HEADER_LEN);
    // The bytes after it are the key's, not header fields.
    buf[SHORT_REQUEST_HEADER_LEN..].fill(0xff);
    assert_eq!(RequestHeader::decode(&buf).unwrap().0, d);
    assert_eq!(RequestHeader::decode(&buf[..SHORT_REQUEST_HEADER_LEN - 1]).unwrap_err().status, Status::Invalid);
    // Validation is the same: a key too long is refused in either form.
    let mut long = put;
    long.key_len = MAX_KEY_LEN as u32 + 1;
    long.encode_short(&mut buf);
    assert_eq!(RequestHeader::decode(&buf[..SHORT_REQUEST_HEADER_LEN]).unwrap_err().status, Status::KeyTooLarge);
    // A condition, a range or a TTL needs the full form.
    let mut conditional = RequestHeader::new(Op::Get, 43, 7);
    conditional.flags = flags::IF_NOT_EQUAL;
    conditional.if_not_equal = 5;
    conditional.key_len = 1;
    let mut list = RequestHeader::new(Op::List, 44, 7);
    list.key_len = 1;
    list.ttl_or_limit = 10;
    for mut h in [conditional, list] {
        h.flags |= flags::SHORT_FORM; // not trusted: the full form clears it
        assert_eq!(h.encode_short(&mut buf), REQUEST_HEADER_LEN);
        h.flags &= !flags::SHORT_FORM;
        let (d, _) = RequestHeader::decode(&buf).unwrap();
        assert_eq!((d, d.encoded_len()), (h, REQUEST_HEADER_LEN));
    }
}

#[test]
fn compact_replies_say_everything_or_are_not_used() {
    let mut buf = [0u8; REPLY_HEADER_LEN];
    let mut hit = ReplyHeader::new(42, Status::Ok);
    hit.generation = 7;
    hit.value_size = 8;
    // A whole small value: 20 bytes, its size the payload's length.
    assert_eq!(hit.encode_compact(8, &mut buf), COMPACT_REPLY_LEN);
    assert_eq!(ReplyHeader::decode_compact(&buf[..COMPACT_REPLY_LEN], 8).unwrap(), hit);
    // No payload (a put's answer): 24 bytes, the size in 32 bits.
    let mut put = hit;
    put.value_size = u32::MAX as u64;
    assert_eq!(put.encode_compact(0, &mut buf), COMPACT_EMPTY_REPLY_LEN);
    assert_eq!(ReplyHeader::decode_compact(&buf[..COMPACT_EMPTY_REPLY_LEN], 0).unwrap(), put);
    // What a compact form cannot say goes in full: a byte range of a value, error text,
    // more to come, a size past 32 bits, a payload sent apart (libfabric).
    let mut more = ReplyHeader::new(43, Status::Ok);
    more.more = 1;
    let mut apart = hit;
    apart.payload_len = 8;
    let mut huge = put;
    huge.value_size = 1 << 40;
    for (h, payload) in [(hit, 4), (ReplyHeader::new(44, Status::Invalid), 12), (more, 0), (huge, 0), (apart, 0)] {
        assert_eq!(h.encode_compact(payload, &mut buf), REPLY_HEADER_LEN);
        assert_eq!(ReplyHeader::decode_compact(&buf, payload).unwrap(), h);
    }
    // The payload's length must fit the form: a 24-byte one with a payload, or another
    // length, is refused; so is another version.
    hit.encode_compact(8, &mut buf);
    assert!(ReplyHeader::decode_compact(&buf[..COMPACT_EMPTY_REPLY_LEN], 8).is_err());
    assert!(ReplyHeader::decode_compact(&buf[..COMPACT_REPLY_LEN + 1], 8).is_err());
    buf[2] = PROTOCOL_VERSION + 1;
    assert!(ReplyHeader::decode_compact(&buf[..COMPACT_REPLY_LEN], 8).unwrap_err().contains("version mismatch"));
}

#[test]
fn list_entries_round_trip() {
    let mut out = Vec::new();
    encode_list_entry(&mut out, b"a", 1);
    encode_list_entry(&mut out, b"", 0);
    encode_list_entry(&mut out, b"xyz", 1 << 40);
    let e = decode_list_entries(&out).unwrap();
    assert_eq!(e, vec![(b"a".to_vec(), 1), (vec![], 0), (b"xyz".to_vec(), 1 << 40)]);
    assert!(decode_list_entries(&out[..out.len() - 1]).is_err());
}
