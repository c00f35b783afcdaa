//! The UCX that `make deps` unpacks is found through an rpath, as for the library's own
//! binaries: remote_dram's build script says where (empty with RDRAM_UCX=system).
fn main() {
    for dir in std::env::var("DEP_UCP_RPATH").unwrap_or_default().split(':').filter(|d| !d.is_empty()) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    println!("cargo:rerun-if-env-changed=DEP_UCP_RPATH");
}
