#!/usr/bin/env bash
# Unpacks UCX 1.22 from PyPI's libucx-cu13 wheel (hash-pinned in ucx-requirements.txt) into
# target/ucx, and points its pkg-config files there. build.rs builds against it and sets
# the rpath, so nothing needs LD_LIBRARY_PATH.
#
# Why not Debian's UCX 1.13.1: it aborts a server (`ucp_request.c:684 ... got REP message`)
# when a client dies during connection set-up over tcp, and it has no CUDA support.
# To build against a system UCX instead (e.g. one with InfiniBand verbs, which the wheel
# leaves out): RDRAM_UCX=system.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-$(cd "$here/.." && pwd)/target/ucx}
stamp="$dest/.unpacked-$(sha256sum "$here/ucx-requirements.txt" | cut -c1-16)"

# UCX patches eight memory functions (mmap, munmap, ...) from a library constructor and
# waits 50 ms after each, so that threads already inside them can leave: 0.4 s before
# `main` of every process (`rdram get --version` took 0.41 s, 0.01 s without the wait).
# Processes that link UCX have a single thread when its constructors run, so the wait buys
# them nothing; only the environment or UCX's config file can change it that early. A
# program that dlopen()s this UCX while other threads run should set
# UCX_MEM_BISTRO_GRACE_DURATION=50ms (the environment wins over the file).
configure_ucx() {
  local conf="$dest/libucx/etc/ucx/ucx.conf"
  grep -q '^UCX_MEM_BISTRO_GRACE_DURATION=' "$conf" ||
    sed -i '1i # remote_dram (scripts/fetch-ucx.sh): no grace wait at start-up\nUCX_MEM_BISTRO_GRACE_DURATION=0\n' "$conf"
}
if [ -f "$stamp" ]; then
  configure_ucx
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== fetching UCX 1.22 (PyPI libucx-cu13) into $dest"
python3 -m venv "$tmp/venv"   # only for its pip
"$tmp/venv/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --require-hashes -r "$here/ucx-requirements.txt" -d "$tmp/wheel"
python3 -m zipfile -e "$tmp"/wheel/libucx_cu13-*.whl "$tmp/unpacked"
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$tmp/unpacked" "$dest"
prefix="$dest/libucx"
sed -i "s|^prefix *=.*|prefix = $prefix|" "$prefix"/lib/pkgconfig/*.pc
chmod +x "$prefix"/bin/*
configure_ucx
touch "$stamp"
