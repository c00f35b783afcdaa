#!/usr/bin/env bash
# Builds the C11 and C++17 tests against an installed remote_dram (found through
# pkg-config under PREFIX) and runs them under valgrind, against real server processes.
# usage: ffi-tests/run.sh PREFIX
set -euo pipefail
PREFIX=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
export PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig LD_LIBRARY_PATH=$PREFIX/lib PATH=$PREFIX/bin:$PATH
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

echo "== building against $(pkg-config --modversion remote_dram) from $PREFIX"
flags=$(pkg-config --cflags --libs remote_dram)
for t in test_api writer reader threads embedded_server reconnect cluster_member; do
  cc -std=c11 -Wall -Wextra -Werror -g -I"$here" "$here/$t.c" -o "$work/$t" $flags -lpthread
done
c++ -std=c++17 -Wall -Wextra -Werror -g "$here/test_cpp.cpp" -o "$work/test_cpp" $flags
c++ -std=c++17 -Wall -Wextra -Werror -O1 -g "$here/kvstore_conformance_test.cpp" -o "$work/kvstore_conformance_test" $flags -lgtest -lgtest_main -lpthread
c++ -std=c++17 -Wall -Wextra -Werror -O1 -g "$here/../examples/remote_dram_example.cpp" -o "$work/remote_dram_example" $flags -lpthread

VALGRIND=(valgrind -q --error-exitcode=99 --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite
          --suppressions="$here/valgrind.supp")

# start_server LOGNAME ARGS... : runs a server (or any program printing "listening on ADDR")
# in the background and sets $addr.
start() {
  local log=$work/$1.log; shift
  "$@" >"$log" 2>&1 3>&- 4>&- &
  pids+=($!)
  for _ in $(seq 300); do grep -q "^listening on " "$log" && break; sleep 0.1; done
  addr=$(sed -n 's/^listening on //p' "$log" | head -1)
  [ -n "$addr" ] || { cat "$log"; echo "server did not start"; exit 1; }
}

run() { echo "-- $*"; "${VALGRIND[@]}" "$@"; }

start server rdram serve --listen 127.0.0.1:0 --workers 2 --memory 256MiB --hugepages off
server=$addr
start auth env RDRAM_AUTH_TOKEN=c-token rdram serve --listen 127.0.0.1:0 --workers 1 --memory 64MiB --hugepages off
auth=$addr
dead=127.0.0.1:$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

run "$work/test_api" "$server" "$auth" "$dead"
run "$work/writer" "$server"
run "$work/reader" "$server"
run "$work/threads" "$server"
run "$work/test_cpp" "$server"
run "$work/reconnect"

echo "-- README.md's C quick start, as it is printed, in a main() against the server"
# Its #include lines at file scope, the rest in main(), with the data it names declared;
# it must store "k" and read the same bytes back.
awk '/^```c$/{on=1; next} on && /^```$/{exit} on' "$here/../README.md" > "$work/readme.c.body"
{
  echo '#include <stdio.h>'
  echo '#include <string.h>'
  grep '^#include' "$work/readme.c.body"
  echo 'int main(void) {'
  echo '    const uint8_t data[] = "hello from the README"; size_t data_len = sizeof data;'
  echo '    uint8_t buf[64]; size_t buf_len = sizeof buf;'
  grep -v '^#include' "$work/readme.c.body" | sed "s/127.0.0.1:7000/$server/"
  echo '    return len == data_len && memcmp(buf, data, len) == 0 ? 0 : 1;'
  echo '}'
} > "$work/readme.c"
cc -std=c11 -Wall -Wextra -Werror -g "$work/readme.c" -o "$work/readme" $flags
run "$work/readme"

echo "-- embedded server in a C process, writer and reader as separate C processes"
mkfifo "$work/ctl"
exec 3<>"$work/ctl"  # the embedded server runs until this, its stdin's only writer, closes
start embedded bash -c "exec ${VALGRIND[*]} '$work/embedded_server' < '$work/ctl'"
embedded_pid=${pids[-1]}
run "$work/writer" "$addr"
run "$work/reader" "$addr"
exec 3>&-
status=0; wait "$embedded_pid" || status=$?
cat "$work/embedded.log"
[ "$status" = 0 ] || { echo "embedded server exited with status $status"; exit 1; }
echo "-- C++ kvstore driver: the shared conformance cases (GoogleTest)"
RDRAM_SERVER=$server RDRAM_CONFORMANCE_CASES=$here/../tests/conformance/cases.json "${VALGRIND[@]}" "$work/kvstore_conformance_test" --gtest_brief=1

echo "-- remote_dram_example as three processes: server, writer, reader"
start example "${VALGRIND[@]}" "$work/remote_dram_example" --mode=server --listen_addr=127.0.0.1:0
example_pid=${pids[-1]}
run "$work/remote_dram_example" --mode=writer --server_addr="$addr"
run "$work/remote_dram_example" --mode=reader --server_addr="$addr"
kill -TERM "$example_pid"
wait "$example_pid"
echo "-- a cluster on etcd: C writer and reader, then the C++ driver, given its etcd:// string"
# shellcheck source=../scripts/etcd.sh
source "$here/../scripts/etcd.sh"
start_etcd
cluster=etcd://$etcd/ffi
rdram cluster create "$cluster" >/dev/null
start member1 rdram serve --listen 127.0.0.1:0 --workers 1 --memory 128MiB --hugepages off --cluster "$cluster"
start member2 rdram serve --listen 127.0.0.1:0 --workers 1 --memory 128MiB --hugepages off --cluster "$cluster"
run "$work/writer" "$cluster"
run "$work/reader" "$cluster"
run "$work/remote_dram_example" --mode=writer --server_addr="$cluster"
run "$work/remote_dram_example" --mode=reader --server_addr="$cluster"
echo "-- an embedded server in a C process joins the cluster, serves, and drains"
placed() {  # placed N: the placement holds N members and no keys move
  rdram cluster status "$cluster" | python3 -c 'import json, sys; p = json.load(sys.stdin)["placement"]; sys.exit(0 if len(p["members"]) == int(sys.argv[1]) and p["next"] is None else 1)' "$1"
}
wait_placed() { for _ in $(seq 300); do placed "$1" && return 0; sleep 0.1; done; rdram cluster status "$cluster"; echo "$1 members were not placed"; exit 1; }
keys_of() { rdram stats --server "$1" | python3 -c 'import json, sys; print(json.load(sys.stdin)["keys"])'; }
wait_placed 2
mkfifo "$work/member-ctl"
exec 4<>"$work/member-ctl"  # the member drains on "drain", and stops when this closes
start member3 bash -c "exec '$work/cluster_member' '$cluster' < '$work/member-ctl'"
member3=$addr
member3_pid=${pids[-1]}
wait_placed 3
for i in $(seq 30); do rdram put --server "$cluster" "c/member/$i" "value $i" >/dev/null; done
held=$(keys_of "$member3")
[ "$held" -gt 0 ] || { echo "the C member holds none of 30 keys"; exit 1; }
echo drain >&4
for _ in $(seq 300); do grep -q '^drained$' "$work/member3.log" && break; sleep 0.1; done
grep -q '^drained$' "$work/member3.log" || { cat "$work/member3.log"; echo "the C member did not drain"; exit 1; }
placed 2 || { rdram cluster status "$cluster"; echo "the drained member is still placed"; exit 1; }
exec 4>&-
status=0; wait "$member3_pid" || status=$?
cat "$work/member3.log"
[ "$status" = 0 ] || { echo "the C member exited with status $status"; exit 1; }
for i in $(seq 30); do
  [ "$(rdram get --server "$cluster" "c/member/$i")" = "value $i" ] || { echo "c/member/$i lost in the drain"; exit 1; }
done
echo "the C member held $held of 30 keys; all 30 read back after it drained and stopped"
echo "== all C/C++ tests passed"
