#!/usr/bin/env bash
# Builds bench/kvstore_driver.cpp against an installed remote_dram (PREFIX, as `make
# install` lays it out) and runs it against a `rdram serve` of its own (1 worker,
# adaptive polling, UCX shared memory).
#   bench/kvstore_driver.sh PREFIX [SECONDS_PER_ROW]
#   env: HEADERS=DIR  compile with the C++ header from DIR instead (to compare versions)
set -euo pipefail
PREFIX=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
export PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig LD_LIBRARY_PATH=$PREFIX/lib
export UCX_TLS=${UCX_TLS:-posix,sysv,cma,self}
work=$(mktemp -d)
server=""
trap '[ -n "$server" ] && kill $server 2>/dev/null; rm -rf "$work"' EXIT
c++ -std=c++17 -O2 ${HEADERS:+-I"$HEADERS"} "$here/kvstore_driver.cpp" -o "$work/kvstore_driver" $(pkg-config --cflags --libs remote_dram) -lpthread
"$PREFIX/bin/rdram" serve --listen 127.0.0.1:0 --workers 1 --memory 512MiB >"$work/server.log" 2>&1 &
server=$!
until grep -q "^listening on" "$work/server.log"; do sleep 0.1; done
"$work/kvstore_driver" "$(sed -n 's/^listening on //p' "$work/server.log" | head -1)" "${2:-2}"
