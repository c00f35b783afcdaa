//! The transport suite over UCX's shared-memory transports (posix, sysv, cma).
mod common;
mod suite;

transport_suite!(common::SHM);

/// UCX only: over UCX the inline key travels in the active message's header.
#[test]
fn inline_keys_of_any_length_are_answered() {
    suite::inline_keys_of_any_length_are_answered(common::SHM)
}
