//! Generates Rust bindings for the system's UCX (libucx-dev) with bindgen.
//! The crates.io `ucx-sys` does not build, so we bind the headers pkg-config finds.

use std::{env, path::PathBuf};

fn main() {
    let ucx = pkg_config::Config::new()
        .atleast_version("1.12")
        .probe("ucx")
        .expect("UCX development files not found: install libucx-dev (make deps)");
    // pkg-config's ucx.pc lists ucs/uct/ucp; make sure ucp is linked.
    println!("cargo:rustc-link-lib=ucp");
    println!("cargo:rustc-link-lib=ucs");

    let mut builder = bindgen::Builder::default()
        .header_contents("ucx_wrapper.h", "#include <ucp/api/ucp.h>\n")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().expect("bindgen failed on ucp.h");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("ucx_bindings.rs");
    bindings.write_to_file(out).expect("write ucx bindings");
    println!("cargo:rerun-if-changed=build.rs");
}
