//! The transport suite with servers on libfabric's `shm` provider, plus striping over
//! several rails.
mod common;
mod suite;

transport_suite!(common::FABRIC_SHM);

#[test]
fn departed_clients_free_their_slots() {
    suite::departed_clients_free_their_slots(common::FABRIC_SHM)
}

#[test]
fn striped_over_three_rails() {
    suite::striped_over_rails(common::FABRIC_SHM, 3)
}
