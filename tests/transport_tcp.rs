//! The transport suite over UCX's tcp transport on loopback.
mod common;
mod suite;

transport_suite!(common::TCP);
