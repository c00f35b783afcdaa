//! The transport suite over UCX's shared-memory transports (posix, sysv, cma).
mod common;
mod suite;

transport_suite!(common::SHM);
