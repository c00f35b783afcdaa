//! Generates Rust bindings for UCX with bindgen, the C header
//! with cbindgen, libfabric bindings (bindgen + a C shim), and the gateway's gRPC code
//! with tonic-build.
//! The crates.io `ucx-sys` does not build, so we bind the headers pkg-config finds.

use std::{env, path::PathBuf};

fn main() {
    // Versioned SONAME for libremote_dram.so (the ABI major).
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,-soname,libremote_dram.so.{}",
        env::var("CARGO_PKG_VERSION_MAJOR").unwrap()
    );
    let ucx = probe_ucx();

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
    let mut shim = cc::Build::new();
    shim.file("src/transport/ucx/shim.c").warnings(true);
    for path in &ucx.include_paths {
        // UCX's own headers do not build warning-free under -Wextra: not ours to fix.
        shim.flag(format!("-isystem{}", path.display()));
    }
    shim.compile("rdram_ucx_shim");
    println!("cargo:rerun-if-changed=src/transport/ucx/shim.c");
    // What older UCX (Debian's 1.13, with RDRAM_UCX=system) lacks, the code does without.
    println!("cargo::rustc-check-cfg=cfg(ucx_ep_query_transports)");
    if bindings.to_string().contains("UCP_EP_ATTR_FIELD_TRANSPORTS") {
        println!("cargo:rustc-cfg=ucx_ep_query_transports");
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("ucx_bindings.rs");
    bindings.write_to_file(out).expect("write ucx bindings");
    generate_fabric_bindings();
    generate_c_header();
    if env::var_os("CARGO_FEATURE_GATEWAY").is_some() {
        generate_grpc();
    }
    println!("cargo:rerun-if-changed=build.rs");
}

/// UCX 1.22 as `make deps` unpacks it into target/ucx (scripts/fetch-ucx.sh), or the
/// system's with RDRAM_UCX=system. The unpacked one is found through an rpath, so the
/// binaries, the tests and libremote_dram.so run without LD_LIBRARY_PATH.
fn probe_ucx() -> pkg_config::Library {
    println!("cargo:rerun-if-env-changed=RDRAM_UCX");
    let unpacked = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("target/ucx/libucx/lib/pkgconfig");
    let use_unpacked = env::var("RDRAM_UCX").as_deref() != Ok("system");
    if use_unpacked {
        if !unpacked.exists() {
            panic!(
                "UCX 1.22 not found in target/ucx: run `make deps` (or set RDRAM_UCX=system to use the system's UCX)"
            );
        }
        println!("cargo:rerun-if-changed={}", unpacked.display());
        let path = env::var("PKG_CONFIG_PATH").map(|p| format!("{}:{p}", unpacked.display()));
        env::set_var("PKG_CONFIG_PATH", path.unwrap_or_else(|_| unpacked.display().to_string()));
    }
    let ucx = pkg_config::Config::new()
        .atleast_version("1.12")
        .probe("ucx")
        .expect("UCX development files not found: run `make deps` (or install libucx-dev for RDRAM_UCX=system)");
    // pkg-config's ucx.pc lists ucs/uct/ucp; make sure ucp is linked.
    println!("cargo:rustc-link-lib=ucp");
    println!("cargo:rustc-link-lib=ucs");
    if use_unpacked {
        for dir in &ucx.link_paths {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        }
        // For the binaries of packages that depend on this one (bench/build.rs reads it
        // as DEP_UCP_RPATH): link arguments do not pass to dependents.
        let dirs: Vec<String> = ucx.link_paths.iter().map(|d| d.display().to_string()).collect();
        println!("cargo:rpath={}", dirs.join(":"));
    }
    ucx
}

/// libfabric (libfabric-dev) via bindgen; its many static inline calls go through a small
/// C shim compiled here (the crates.io libfabric-sys does not build against 1.17).
fn generate_fabric_bindings() {
    let fabric = pkg_config::Config::new()
        .atleast_version("1.17")
        // Headers only: the shim opens libfabric.so.1 on first use (see shim.c).
        .cargo_metadata(false)
        .probe("libfabric")
        .expect("libfabric development files not found: install libfabric-dev (make deps)");
    let shim = "src/transport/fabric/shim";
    let mut cc = cc::Build::new();
    cc.file(format!("{shim}.c")).warnings(true);
    for path in &fabric.include_paths {
        cc.include(path);
    }
    cc.compile("rdram_fabric_shim");
    let mut builder = bindgen::Builder::default()
        .header(format!("{shim}.h"))
        .allowlist_function("rdram_fi_.*")
        .allowlist_type("fi_.*|fid_.*")
        .allowlist_var("FI_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for path in &fabric.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().expect("bindgen failed on the libfabric headers");
    bindings
        .write_to_file(PathBuf::from(env::var("OUT_DIR").unwrap()).join("fabric_bindings.rs"))
        .expect("write fabric bindings");
    println!("cargo:rerun-if-changed=src/transport/fabric/shim.c");
    println!("cargo:rerun-if-changed=src/transport/fabric/shim.h");
}

/// The tsgrpc gateway's messages and service, from TensorStore's schema beside the gateway
/// (src/gateway/tsgrpc_kvstore.proto; tonic-build runs protoc).
fn generate_grpc() {
    tonic_build::configure()
        .bytes(["."])
        .compile_protos(&["src/gateway/tsgrpc_kvstore.proto"], &["src/gateway"])
        .expect("protoc failed on src/gateway/tsgrpc_kvstore.proto (install protobuf-compiler: make deps)");
    println!("cargo:rerun-if-changed=src/gateway/tsgrpc_kvstore.proto");
}

/// Generates the C header from src/ffi/ into OUT_DIR; `make header` copies it to
/// include/remote_dram.h and a test fails when the committed copy differs.
fn generate_c_header() {
    let crate_dir = env::var("CARGO_MANIFEST_DIR").unwrap();
    let config = cbindgen::Config::from_file(PathBuf::from(&crate_dir).join("cbindgen.toml")).expect("cbindgen.toml");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("remote_dram.h");
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen failed on src/ffi")
        .write_to_file(&out);
    println!("cargo:rustc-env=RDRAM_GENERATED_HEADER={}", out.display());
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
}
