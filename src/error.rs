//! One status enum for the whole crate (and, later, the C ABI): 0 is OK, positive values
//! are normal outcomes that are not errors, negative values are errors.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i8)]
pub enum Status {
    Ok = 0,
    /// The key does not exist (a normal result of get).
    Missing = 1,
    /// Conditional get: the generation matched `if_not_equal` (or not `if_equal`).
    Unchanged = 2,
    /// Conditional put/delete: the condition did not hold; nothing changed.
    ConditionFailed = 3,
    /// Cluster: the key moved to the server named in the payload while the cluster's view
    /// changes; the client asks there ([`crate::proto::flags::ASKING`]). Never returned to
    /// callers.
    Moved = 4,
    Invalid = -1,
    KeyTooLarge = -2,
    ValueTooLarge = -3,
    NoSpace = -4,
    OutOfRange = -5,
    AuthFailed = -6,
    VersionMismatch = -7,
    Unavailable = -8,
    Timeout = -9,
    Transport = -10,
    Io = -11,
    Internal = -12,
    WrongShard = -13,
    /// The caller's buffer is too small for the value; nothing was lost.
    BufferTooSmall = -14,
    /// A panic was caught at the C boundary.
    Panic = -15,
    /// A required pointer argument was NULL (C ABI).
    NullArgument = -16,
    /// Cluster: the request was routed with a view the server does not hold; the client
    /// refreshes its view and sends it again.
    ViewChanged = -17,
    /// Cluster: the key is being handed to another server this moment; the client sends
    /// the write again shortly.
    KeyMoving = -18,
}

impl Status {
    pub fn from_code(code: i8) -> Status {
        use Status::*;
        [Ok, Missing, Unchanged, ConditionFailed, Moved, Invalid, KeyTooLarge, ValueTooLarge, NoSpace, OutOfRange, AuthFailed,
         VersionMismatch, Unavailable, Timeout, Transport, Io, Internal, WrongShard, BufferTooSmall, Panic, NullArgument,
         ViewChanged, KeyMoving]
            .into_iter()
            .find(|s| *s as i8 == code)
            .unwrap_or(Internal)
    }

    /// The status as a metric label: the C ABI's name in lower case.
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Missing => "missing",
            Status::Unchanged => "unchanged",
            Status::ConditionFailed => "condition_failed",
            Status::Invalid => "invalid_argument",
            Status::KeyTooLarge => "key_too_large",
            Status::ValueTooLarge => "value_too_large",
            Status::NoSpace => "no_space",
            Status::OutOfRange => "out_of_range",
            Status::AuthFailed => "auth_failed",
            Status::VersionMismatch => "version_mismatch",
            Status::Unavailable => "unavailable",
            Status::Timeout => "timeout",
            Status::Transport => "transport",
            Status::Io => "io",
            Status::Internal => "internal",
            Status::WrongShard => "wrong_shard",
            Status::BufferTooSmall => "buffer_too_small",
            Status::Panic => "panic",
            Status::NullArgument => "null_argument",
            Status::Moved => "moved",
            Status::ViewChanged => "view_changed",
            Status::KeyMoving => "key_moving",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Missing => "key not found",
            Status::Unchanged => "generation unchanged",
            Status::ConditionFailed => "generation condition failed",
            Status::Invalid => "invalid argument",
            Status::KeyTooLarge => "key too large",
            Status::ValueTooLarge => "value too large",
            Status::NoSpace => "no space left in the shard's arena",
            Status::OutOfRange => "byte range out of range",
            Status::AuthFailed => "authentication failed",
            Status::VersionMismatch => "protocol version mismatch",
            Status::Unavailable => "server unavailable",
            Status::Timeout => "operation timed out",
            Status::Transport => "transport error",
            Status::Io => "I/O error",
            Status::Internal => "internal error",
            Status::WrongShard => "request sent to the wrong shard",
            Status::BufferTooSmall => "buffer too small for the value",
            Status::Panic => "internal panic caught at the C boundary",
            Status::NullArgument => "a required pointer argument is NULL",
            Status::Moved => "the key moved to another server",
            Status::ViewChanged => "the cluster's view changed",
            Status::KeyMoving => "the key is moving to another server",
        }
    }
}

/// An error: a status plus a message with the details.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Error { status, message: message.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "{}", self.status.describe())
        } else {
            write!(f, "{}: {}", self.status.describe(), self.message)
        }
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::new(Status::Io, e.to_string())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
