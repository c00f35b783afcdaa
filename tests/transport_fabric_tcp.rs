//! The transport suite with servers on libfabric's `tcp;ofi_rxm` provider (loopback),
//! plus striping over several rails and the bench against a libfabric server.
mod common;
mod suite;

transport_suite!(common::FABRIC_TCP);

#[test]
fn striped_over_three_rails() {
    suite::striped_over_rails(common::FABRIC_TCP, 3)
}

#[test]
fn bench_against_a_fabric_server() {
    suite::bench_against_server(common::FABRIC_TCP)
}
