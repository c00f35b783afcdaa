//! One status enum for the whole crate: 0 is OK, positive values are normal outcomes that
//! are not errors, negative values are errors. Each status is written once, in the table
//! below: its code, its name (the C ABI's `RDRAM_*` and Python's `Status` in upper case,
//! metric labels as they are) and what it means. `tests/header.rs` checks the C header,
//! Python's `remote_dram.errors` and the C++ driver against it.

use std::fmt;

macro_rules! statuses {
    ($($(#[$doc:meta])* $variant:ident = $code:literal, $label:literal, $describe:literal;)*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(i8)]
        pub enum Status {
            $($(#[$doc])* $variant = $code,)*
        }

        impl Status {
            /// Every status, in the table's order.
            pub const ALL: &'static [Status] = &[$(Status::$variant),*];

            /// The status of a code from the wire; an unknown code is `Internal`.
            pub fn from_code(code: i8) -> Status {
                match code {
                    $($code => Status::$variant,)*
                    _ => Status::Internal,
                }
            }

            /// The status's name in lower case: a metric label, and the C ABI's
            /// `RDRAM_*` and Python's `Status` names in upper case.
            pub fn label(self) -> &'static str {
                match self {
                    $(Status::$variant => $label,)*
                }
            }

            pub fn describe(self) -> &'static str {
                match self {
                    $(Status::$variant => $describe,)*
                }
            }
        }
    };
}

statuses! {
    Ok = 0, "ok", "ok";
    /// The key does not exist (a normal result of get).
    Missing = 1, "missing", "key not found";
    /// Conditional get: the generation matched `if_not_equal` (or not `if_equal`).
    Unchanged = 2, "unchanged", "generation unchanged";
    /// Conditional put/delete: the condition did not hold; nothing changed.
    ConditionFailed = 3, "condition_failed", "generation condition failed";
    /// Cluster: the key moved to the server named in the payload while the cluster's view
    /// changes; the client asks there ([`crate::proto::flags::ASKING`]). Never returned to
    /// callers.
    Moved = 4, "moved", "the key moved to another server";
    Invalid = -1, "invalid_argument", "invalid argument";
    KeyTooLarge = -2, "key_too_large", "key too large";
    ValueTooLarge = -3, "value_too_large", "value too large";
    NoSpace = -4, "no_space", "no space left in the shard's arena";
    OutOfRange = -5, "out_of_range", "byte range out of range";
    AuthFailed = -6, "auth_failed", "authentication failed";
    VersionMismatch = -7, "version_mismatch", "protocol version mismatch";
    Unavailable = -8, "unavailable", "server unavailable";
    Timeout = -9, "timeout", "operation timed out";
    Transport = -10, "transport", "transport error";
    Io = -11, "io", "I/O error";
    Internal = -12, "internal", "internal error";
    WrongShard = -13, "wrong_shard", "request sent to the wrong shard";
    /// The caller's buffer is too small for the value; nothing was lost.
    BufferTooSmall = -14, "buffer_too_small", "buffer too small for the value";
    /// A panic was caught at the C boundary.
    Panic = -15, "panic", "internal panic caught at the C boundary";
    /// A required pointer argument was NULL (C ABI).
    NullArgument = -16, "null_argument", "a required pointer argument is NULL";
    /// Cluster: the request was routed with a view the server does not hold; the client
    /// refreshes its view and sends it again.
    ViewChanged = -17, "view_changed", "the cluster's view changed";
    /// Cluster: the key is being handed to another server this moment; the client sends
    /// the write again shortly.
    KeyMoving = -18, "key_moving", "the key is moving to another server";
    /// Cluster: the key's last write is being copied to its replicas, and no client reads
    /// it before every replica holds it; the client asks again shortly.
    Replicating = -19, "replicating", "the key's last write is being copied to its replicas";
    /// The shard holds as many values staged in parts, or keys in handovers, as it takes
    /// at once: a bound, not an outage; the sender sends the value whole, or waits.
    NoRoom = -20, "no_room", "the shard holds as many staged values or handovers as it takes";
}

impl Status {
    /// Statuses the client settles itself (cluster view changes) and never returns: the
    /// C ABI and Python have no name for them.
    pub fn is_internal_to_clusters(self) -> bool {
        matches!(self, Status::Moved | Status::ViewChanged | Status::KeyMoving | Status::Replicating)
    }

    /// The gRPC status code (as TensorStore and absl number them) for this status: the one
    /// table the gateway and the C++ driver (through `rdram_status_grpc_code`) both use.
    /// TensorStore retries DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNAVAILABLE and INTERNAL
    /// with backoff, so those are kept for conditions that can pass; permanent problems
    /// get codes it does not retry. Outcomes that are not errors map to OK.
    pub fn grpc_code(self) -> i32 {
        use grpc_code::*;
        match self {
            Status::Ok | Status::Missing | Status::Unchanged | Status::ConditionFailed => OK,
            Status::Invalid
            | Status::KeyTooLarge
            | Status::ValueTooLarge
            | Status::BufferTooSmall
            | Status::NullArgument => INVALID_ARGUMENT,
            Status::OutOfRange => OUT_OF_RANGE,
            Status::NoSpace | Status::NoRoom => RESOURCE_EXHAUSTED,
            Status::AuthFailed => UNAUTHENTICATED,
            Status::VersionMismatch => FAILED_PRECONDITION,
            Status::Unavailable
            | Status::Transport
            | Status::Io
            | Status::ViewChanged
            | Status::KeyMoving
            | Status::Replicating
            | Status::Moved => UNAVAILABLE,
            // A key routed to a shard that does not own it will not route differently on a
            // retry (the layouts disagree): a permanent error, not one to retry for minutes.
            Status::WrongShard => FAILED_PRECONDITION,
            Status::Timeout => DEADLINE_EXCEEDED,
            Status::Internal | Status::Panic => INTERNAL,
        }
    }
}

/// gRPC's canonical status codes, the ones [`Status::grpc_code`] gives.
pub mod grpc_code {
    pub const OK: i32 = 0;
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const FAILED_PRECONDITION: i32 = 9;
    pub const OUT_OF_RANGE: i32 = 11;
    pub const INTERNAL: i32 = 13;
    pub const UNAVAILABLE: i32 = 14;
    pub const UNAUTHENTICATED: i32 = 16;
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
