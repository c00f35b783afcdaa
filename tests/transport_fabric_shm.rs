//! The transport suite with servers on libfabric's `shm` provider, plus departed clients
//! and striping over several rails.
mod common;
mod suite;

fabric_suite!(common::FABRIC_SHM);
