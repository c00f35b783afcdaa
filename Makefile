# remote_dram — the two commands a newcomer needs:
#   make demo   installs what is missing, builds, and shows a writer and a reader process
#               sharing data through a server's DRAM over UCX on loopback
#   make test   installs what is missing, builds, and runs every test
CARGO ?= cargo
DEBIAN_PACKAGES := libucx-dev ucx-utils libclang-dev clang pkg-config g++ valgrind nlohmann-json3-dev libgtest-dev protobuf-compiler python3-venv libfabric-dev libfabric-bin
PREFIX ?= /usr/local
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
MAJOR := $(firstword $(subst ., ,$(VERSION)))
export UCX_NET_DEVICES ?= lo

.PHONY: deps build demo test test-rust test-ffi test-gateway header install clean bench

deps:
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

build: deps
	$(CARGO) build --release

demo: build
	scripts/demo.sh target/release/rdram

test: test-rust test-ffi test-gateway

test-rust: deps
	$(CARGO) test --release -- --test-threads=2

# remote_dram vs ucx_perftest vs Redis, over UCX tcp and shared memory (bench/compare).
bench: deps
	@dpkg -s redis-server redis-tools >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; }
	bench/compare

# Unmodified TensorStore (PyPI, in target/venv-tensorstore) through `rdram gateway`, in
# front of a server on UCX, then of one on libfabric.
test-gateway: build
	tests/gateway/run.sh target/release/rdram
	tests/gateway/run.sh target/release/rdram --transport fabric --provider "tcp;ofi_rxm"

# C and C++ programs built against the installed header and library (via pkg-config),
# run under valgrind.
test-ffi: deps
	$(MAKE) install PREFIX=$(CURDIR)/target/ffi-prefix
	ffi-tests/run.sh $(CURDIR)/target/ffi-prefix

# Regenerates include/remote_dram.h from src/ffi/ (cbindgen runs in build.rs).
header:
	$(CARGO) build --release
	cp "$$(ls -t target/release/build/remote_dram-*/out/remote_dram.h | head -1)" include/remote_dram.h

install: build
	install -d $(PREFIX)/lib/pkgconfig $(PREFIX)/include $(PREFIX)/bin
	install -m 755 target/release/libremote_dram.so $(PREFIX)/lib/libremote_dram.so.$(VERSION)
	ln -sf libremote_dram.so.$(VERSION) $(PREFIX)/lib/libremote_dram.so.$(MAJOR)
	ln -sf libremote_dram.so.$(MAJOR) $(PREFIX)/lib/libremote_dram.so
	install -m 644 target/release/libremote_dram.a $(PREFIX)/lib/libremote_dram.a
	install -m 644 include/remote_dram.h include/remote_dram_kvstore.hpp $(PREFIX)/include/
	install -m 755 target/release/rdram target/release/rdram-bench $(PREFIX)/bin/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' remote_dram.pc.in > $(PREFIX)/lib/pkgconfig/remote_dram.pc

clean:
	$(CARGO) clean
