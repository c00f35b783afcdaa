# remote_dram — the two commands a newcomer needs:
#   make demo   installs what is missing, builds, and shows a writer and a reader process
#               sharing data through a server's DRAM over UCX on loopback
#   make test   installs what is missing, builds, and runs every test
CARGO ?= cargo
DEBIAN_PACKAGES := libucx-dev ucx-utils libclang-dev clang pkg-config
export UCX_NET_DEVICES ?= lo

.PHONY: deps build demo test clean

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

test: deps
	$(CARGO) test --release -- --test-threads=2

clean:
	$(CARGO) clean
