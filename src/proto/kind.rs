//! What a request asks, decoded once from its op and flags ([`RequestHeader::decode`]):
//! the server matches on this instead of testing flags wherever it serves a request, and
//! a combination that names no request is refused at the door.
//!
//! [`RequestHeader::decode`]: super::RequestHeader::decode

use super::{flags, Op};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A client's write of a whole value (conditions, TTL).
    Put,
    /// A part of a value staged in parts ([`flags::STAGE`] with [`flags::HAS_RANGE`]); the
    /// empty part at its end commits it as a [`Kind::Put`].
    StagePart,
    /// Discards a value the sender's session staged in parts ([`flags::STAGE`] delete).
    StageDiscard,
    Get,
    Delete,
    DeleteRange,
    List,
    Stats,
    Abort,
    /// Members only, with a ticket: a replica's copy of a write its primary took, or a
    /// mover's copy of a key, installed under the generation it brings
    /// ([`flags::IMPORT`] put).
    Import,
    /// Members only, with a ticket: [`Kind::Import`] of a value the sender's session
    /// staged in parts ([`Kind::StagePart`]) as it reached the key's primary
    /// ([`flags::IMPORT`] put with [`flags::STAGE`], no range).
    ImportStaged,
    /// Members only, with a ticket: a delete copied to a replica, of the generation its
    /// primary deleted ([`flags::IMPORT`] delete).
    ImportDelete,
    /// Members only: a read for a copy, answering the key's TTL left too
    /// ([`flags::IMPORT`] get).
    CopyRead,
    /// Members only, with a ticket: a read that holds the key for its handover to another
    /// server ([`flags::MIGRATE`] get).
    HandoverHold,
    /// Members only, with a ticket: the end of a handover, deleting the key if it still
    /// holds the generation handed over ([`flags::MIGRATE`] delete with `IF_EQUAL`).
    HandoverEnd,
    /// Members only, with a ticket: a mover's copy of a key from this server's memory
    /// straight to the members named ([`flags::IMPORT`] get with [`flags::FORWARD`]).
    CopyOut,
    /// Members only, with a ticket: [`Kind::HandoverHold`], the key then copied straight
    /// to its new owner as [`Kind::CopyOut`] ([`flags::MIGRATE`] get with [`flags::FORWARD`]).
    HandOut,
}

impl Kind {
    /// The request an op with these flags is; Err says why the combination is none.
    pub fn of(op: Op, request_flags: u32) -> Result<Kind, String> {
        let member = request_flags & (flags::IMPORT | flags::MIGRATE);
        let staged = request_flags & flags::STAGE != 0;
        let ranged = request_flags & flags::HAS_RANGE != 0;
        if request_flags & flags::FORWARD != 0 {
            return match (op, member, staged || ranged) {
                (Op::Get, flags::IMPORT, false) => Ok(Kind::CopyOut),
                (Op::Get, flags::MIGRATE, false) => Ok(Kind::HandOut),
                _ => Err("only a member's whole read for a copy or a handover is forwarded (an IMPORT or MIGRATE get with FORWARD, no range)".into()),
            };
        }
        let kind = match (op, member, staged) {
            (Op::Put, 0, false) => Kind::Put,
            (Op::Put, 0, true) if ranged => Kind::StagePart,
            (Op::Put, 0, true) => {
                return Err("a staged put is a part of a value staged in parts: it carries a range (HAS_RANGE)".into())
            }
            (Op::Delete, 0, true) => Kind::StageDiscard,
            (Op::Get, 0, false) => Kind::Get,
            (Op::Delete, 0, false) => Kind::Delete,
            (Op::DeleteRange, 0, false) => Kind::DeleteRange,
            (Op::List, 0, false) => Kind::List,
            (Op::Stats, 0, false) => Kind::Stats,
            (Op::Abort, 0, false) => Kind::Abort,
            (Op::Put, flags::IMPORT, false) => Kind::Import,
            (Op::Put, flags::IMPORT, true) if !ranged => Kind::ImportStaged,
            (Op::Delete, flags::IMPORT, false) => Kind::ImportDelete,
            (Op::Get, flags::IMPORT, false) => Kind::CopyRead,
            (Op::Get, flags::MIGRATE, false) => Kind::HandoverHold,
            (Op::Delete, flags::MIGRATE, false) if request_flags & flags::IF_EQUAL != 0 => Kind::HandoverEnd,
            (Op::Delete, flags::MIGRATE, false) => {
                return Err("a handover's end names the generation handed over (IF_EQUAL)".into())
            }
            (_, _, true) if member != 0 => return Err("what members send each other is never staged".into()),
            _ => return Err(format!("{op:?} cannot carry flags {:#x}", member | (request_flags & flags::STAGE))),
        };
        Ok(kind)
    }

    pub fn op(self) -> Op {
        match self {
            Kind::Put | Kind::StagePart | Kind::Import | Kind::ImportStaged => Op::Put,
            Kind::Get | Kind::CopyRead | Kind::HandoverHold | Kind::CopyOut | Kind::HandOut => Op::Get,
            Kind::Delete | Kind::StageDiscard | Kind::ImportDelete | Kind::HandoverEnd => Op::Delete,
            Kind::DeleteRange => Op::DeleteRange,
            Kind::List => Op::List,
            Kind::Stats => Op::Stats,
            Kind::Abort => Op::Abort,
        }
    }

    /// Sent between a cluster's members only: refused from anyone else.
    pub fn members_only(self) -> bool {
        matches!(
            self,
            Kind::Import
                | Kind::ImportStaged
                | Kind::ImportDelete
                | Kind::CopyRead
                | Kind::HandoverHold
                | Kind::HandoverEnd
                | Kind::CopyOut
                | Kind::HandOut
        )
    }

    /// A read whose value goes to other members instead of back ([`flags::FORWARD`]).
    pub fn forwards(self) -> bool {
        matches!(self, Kind::CopyOut | Kind::HandOut)
    }

    /// A copy between members of a write its primary decided: it carries the generation
    /// the primary gave it, never a condition.
    pub fn is_import(self) -> bool {
        matches!(self, Kind::Import | Kind::ImportStaged | Kind::ImportDelete)
    }

    /// A write a client asks of the key's primary (a whole value, or a staged value's
    /// part, whose last one commits it).
    pub fn is_client_write(self) -> bool {
        matches!(self, Kind::Put | Kind::StagePart | Kind::Delete)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPS: [Op; 7] = [Op::Put, Op::Get, Op::Delete, Op::DeleteRange, Op::List, Op::Stats, Op::Abort];

    /// Every op and flag combination is one kind or refused, and a kind's op is the op it
    /// came from.
    #[test]
    fn every_combination_is_one_kind_or_refused() {
        let relevant = [flags::IMPORT, flags::MIGRATE, flags::STAGE, flags::HAS_RANGE, flags::IF_EQUAL, flags::FORWARD];
        let mut seen = std::collections::HashSet::new();
        for op in OPS {
            for mask in 0..1u32 << relevant.len() {
                let f = relevant.iter().enumerate().filter(|(i, _)| mask & 1 << i != 0).fold(0, |f, (_, b)| f | b);
                if let Ok(kind) = Kind::of(op, f) {
                    assert_eq!(kind.op(), op, "{op:?} {f:#x}");
                    seen.insert(format!("{kind:?}"));
                }
            }
        }
        assert_eq!(seen.len(), 17, "every kind comes from some combination: {seen:?}");
    }

    #[test]
    fn frames_that_are_no_request_are_refused() {
        assert!(Kind::of(Op::Put, flags::STAGE | flags::IMPORT | flags::HAS_RANGE).is_err());
        assert!(Kind::of(Op::Put, flags::STAGE).is_err(), "a whole value staged");
        assert!(Kind::of(Op::Delete, flags::MIGRATE).is_err(), "a handover's end without its generation");
        assert!(Kind::of(Op::Put, flags::MIGRATE).is_err());
        assert!(Kind::of(Op::List, flags::IMPORT).is_err());
        assert!(Kind::of(Op::Get, flags::IMPORT | flags::MIGRATE).is_err());
        assert_eq!(Kind::of(Op::Put, flags::IMPORT), Ok(Kind::Import));
        assert_eq!(Kind::of(Op::Put, flags::IMPORT | flags::STAGE), Ok(Kind::ImportStaged));
        assert!(Kind::of(Op::Delete, flags::IMPORT | flags::STAGE).is_err(), "only a put is committed so");
        assert!(Kind::of(Op::Get, flags::FORWARD).is_err(), "a client's read is never forwarded");
        assert!(Kind::of(Op::Put, flags::IMPORT | flags::FORWARD).is_err());
        assert!(Kind::of(Op::Get, flags::IMPORT | flags::FORWARD | flags::HAS_RANGE).is_err(), "only whole values");
        assert_eq!(Kind::of(Op::Get, flags::MIGRATE | flags::FORWARD), Ok(Kind::HandOut));
        assert!(Kind::Import.members_only() && !Kind::StagePart.members_only());
    }
}
