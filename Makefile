# remote_dram — the two commands a newcomer needs:
#   make demo   installs what is missing, builds, and shows a writer and a reader process
#               sharing data through a server's DRAM over UCX on loopback
#   make test   installs what is missing, builds, and runs every test
CARGO ?= cargo
DEBIAN_PACKAGES := libclang-dev clang pkg-config g++ valgrind nlohmann-json3-dev libgtest-dev protobuf-compiler python3-venv libfabric-dev libfabric-bin prometheus tmux etcd-server openssl iproute2
PREFIX ?= /usr/local
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
MAJOR := $(firstword $(subst ., ,$(VERSION)))
export UCX_NET_DEVICES ?= lo
# UCX 1.22 unpacked by `make deps` (scripts/fetch-ucx.sh), or the system's with RDRAM_UCX=system.
UCX_PKG_CONFIG := $(if $(filter system,$(RDRAM_UCX)),pkg-config,PKG_CONFIG_PATH=$(CURDIR)/target/ucx/libucx/lib/pkgconfig pkg-config)

.PHONY: deps build test-build install-files demo test test-rust test-ffi test-gateway test-python python header install clean bench bench-peers device-bundle device-visit bench-python redis soak fuzz lint

deps:
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@[ "$(RDRAM_UCX)" = system ] || scripts/fetch-ucx.sh

build: deps
	$(CARGO) build --release

demo: build
	scripts/demo.sh target/release/rdram

test: lint test-rust test-ffi test-gateway test-python

# What every test runs: the tests' build, profile test-release (the release build's
# optimization without its whole-program LTO, which would link each test binary on its
# own for minutes): the library (rlib, cdylib, staticlib), the commands, the load
# generators. `make build` (release) is the same code linked as one program.
TEST_BUILD := target/test-release
test-build: deps
	$(CARGO) build --profile test-release

# Tests that skip what this machine cannot do list it in $(SKIPS), printed at the end.
SKIPS := $(CURDIR)/target/skipped-tests.txt
test-rust: test-build
	@rm -f $(SKIPS)
	RDRAM_TEST_SKIPS_FILE=$(SKIPS) $(CARGO) test --profile test-release -- --test-threads=2
	@if [ -s $(SKIPS) ]; then echo "== tests that skipped a part this machine cannot do:"; cat $(SKIPS); \
	else echo "== no test skipped anything"; fi

# remote_dram vs ucx_perftest vs Redis, over UCX tcp and shared memory (bench/compare);
# then remote_dram next to Mooncake Store (bench/peers).
bench: deps redis
	bench/compare
	bench/peers/run

# remote_dram next to Mooncake Store over shared memory and TCP (bench/peers/peers.py).
bench-peers: build
	bench/peers/run

# ucp_am_lat's round trip in the shapes of remote_dram's requests and replies, with
# receivers that read them (bench/am_shapes/am_shapes.c); bench/compare builds it.
target/release/am-shapes: bench/am_shapes/am_shapes.c
	@mkdir -p $(@D)
	$(CC) -O2 -Wall -o $@ $< $$($(UCX_PKG_CONFIG) --cflags --libs ucx) -Wl,-rpath,$$($(UCX_PKG_CONFIG) --variable=libdir ucx)

# The same comparison on a machine without Rust, UCX, libfabric or Redis (the 16-core GPU
# machine): packs .device-bundle for `bench/compare --device-bundle` (see bench/device-bundle).
device-bundle: deps redis
	bench/device-bundle

# Everything bench/device-visit runs on that machine in one call, compressed to fit it.
device-visit: deps redis
	bench/device-bundle --visit

# The Python client next to rdram-bench and redis-py (bench/python_client.py).
bench-python: build redis
	@[ -x target/venv-python/bin/python ] || python3 -m venv target/venv-python
	target/venv-python/bin/pip install -q --disable-pip-version-check numpy redis ./python
	target/venv-python/bin/python bench/python_client.py

redis:
	@dpkg -s redis-server redis-tools >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; }

# The kill soak (not in CI): writers and readers SIGKILLed every ~2 s against a real
# server, SOAK_SECS per transport (default 600; the four together take 40 minutes), with
# SOAK_SERVER_ARGS given to `rdram serve` (e.g. --stranded-endpoint-limit 8); then, per
# transport, a server's RSS after 300 clients SIGKILLed one after another. Then the
# cluster's chaos soak: members (R = 2) SIGKILLed, paused past their lease, joined and
# drained at random for CHAOS_SECS (default 300; CHAOS_SEED repeats a run) under load,
# once over each of CHAOS_TRANSPORTS (separated by "|"; "shm" is UCX shared memory, "tcp"
# UCX tcp; each transport's timing takes other paths: a loss once showed over libfabric only).
SOAK_SECS ?= 600
SOAK_TRANSPORTS ?= tcp,shm,fabric:tcp;ofi_rxm,fabric:shm
CHAOS_SECS ?= 300
CHAOS_TRANSPORTS ?= shm|tcp|fabric:tcp;ofi_rxm
soak: deps
	SOAK_SECS=$(SOAK_SECS) SOAK_TRANSPORTS="$(SOAK_TRANSPORTS)" SOAK_SERVER_ARGS="$(SOAK_SERVER_ARGS)" $(CARGO) test --release --test soak -- --ignored --exact soak --nocapture
	SOAK_TRANSPORTS="$(SOAK_TRANSPORTS)" $(CARGO) test --release --test soak -- --ignored --exact killed_clients_leave_no_memory --nocapture
	list='$(CHAOS_TRANSPORTS)'; IFS='|'; for t in $$list; do \
		[ "$$t" = shm ] && t=""; \
		CHAOS_SECS=$(CHAOS_SECS) CHAOS_SEED=$(CHAOS_SEED) CHAOS_TRANSPORT="$$t" $(CARGO) test --release --test cluster_chaos -- --ignored --exact chaos --nocapture || exit 1; \
	done

# Formatting as rustfmt.toml says (`cargo fmt --all` applies it), then clippy over the
# workspace (library, binaries, tests, the Python package, the load generators), warnings
# as errors, then the library's docs with private items (their links name paths: a moved
# or renamed item fails). make test runs it first.
lint: deps
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	# The library without the command's parts (Cargo.toml's features), as a C user may build it.
	$(CARGO) clippy --release --lib --no-default-features -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --lib --document-private-items

# libFuzzer over every target in fuzz/ (cargo-fuzz, nightly), FUZZ_RUNS inputs each,
# starting from the committed corpus (new inputs go to fuzz/corpus-work/, ignored).
FUZZ_RUNS ?= 10000000
FUZZ_TARGETS := request_header bootstrap_line fabric_hello gateway_request shard_request ucx_request
fuzz: deps
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz
	@rustup toolchain list | grep -q nightly || { echo "make fuzz needs a nightly toolchain: rustup toolchain install nightly"; exit 1; }
	cd fuzz && export LD_LIBRARY_PATH=$(CURDIR)/target/ucx/libucx/lib && for t in $(FUZZ_TARGETS); do \
		mkdir -p corpus-work/$$t && \
		cargo +nightly fuzz run -O $$t corpus-work/$$t corpus/$$t -- -runs=$(FUZZ_RUNS) -rss_limit_mb=4096 -print_final_stats=1 || exit 1; \
	done

# Unmodified TensorStore (PyPI, in target/venv-tensorstore) through `rdram gateway`, in
# front of a server on UCX, then of one on libfabric.
test-gateway: test-build
	tests/gateway/run.sh $(TEST_BUILD)/rdram
	tests/gateway/run.sh $(TEST_BUILD)/rdram --transport fabric --provider "tcp;ofi_rxm"

# The Python package (python/): pip-installed into target/venv-python, then pytest over
# UCX tcp, UCX shared memory and libfabric tcp;ofi_rxm.
test-python: test-build
	python/tests/run.sh $(TEST_BUILD)/rdram

# The Python package as a wheel in target/wheels (abi3: CPython 3.9 and later).
python: deps
	@[ -x target/venv-build/bin/maturin ] || { python3 -m venv target/venv-build && target/venv-build/bin/pip install -q --disable-pip-version-check "maturin>=1.7,<2"; }
	cd python && CARGO_TARGET_DIR=$(CURDIR)/target ../target/venv-build/bin/maturin build --release -o ../target/wheels

# C and C++ programs built against the installed header and library (via pkg-config),
# run under valgrind.
test-ffi: test-build
	$(MAKE) install-files BUILT=$(TEST_BUILD) PREFIX=$(CURDIR)/target/ffi-prefix
	ffi-tests/run.sh $(CURDIR)/target/ffi-prefix

# Regenerates include/remote_dram.h from src/ffi/ (cbindgen runs in build.rs).
header:
	$(CARGO) build --release
	cp "$$(ls -t target/release/build/remote_dram-*/out/remote_dram.h | head -1)" include/remote_dram.h

install: build
	$(MAKE) install-files BUILT=target/release PREFIX=$(PREFIX)

# What `make install` installs, from the build in BUILT (test-ffi installs the tests' build).
BUILT ?= target/release
install-files:
	install -d $(PREFIX)/lib/pkgconfig $(PREFIX)/include $(PREFIX)/bin
	install -m 755 $(BUILT)/libremote_dram.so $(PREFIX)/lib/libremote_dram.so.$(VERSION)
	ln -sf libremote_dram.so.$(VERSION) $(PREFIX)/lib/libremote_dram.so.$(MAJOR)
	ln -sf libremote_dram.so.$(MAJOR) $(PREFIX)/lib/libremote_dram.so
	install -m 644 $(BUILT)/libremote_dram.a $(PREFIX)/lib/libremote_dram.a
	install -m 644 include/remote_dram.h include/remote_dram_kvstore.hpp $(PREFIX)/include/
	install -m 755 $(BUILT)/rdram $(BUILT)/rdram-bench $(PREFIX)/bin/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' -e "s|@UCX_LIBDIR@|$$($(UCX_PKG_CONFIG) --variable=libdir ucx)|" \
		remote_dram.pc.in > $(PREFIX)/lib/pkgconfig/remote_dram.pc

clean:
	$(CARGO) clean
