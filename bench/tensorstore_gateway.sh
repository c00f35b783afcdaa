#!/usr/bin/env bash
# zarr through `rdram gateway` on a machine with cores to spare: a server, a gateway and
# TensorStore (bench/tensorstore_throughput.py), each pinned to cores of its own, so that
# none of the three takes CPU from another.
#
#   bench/tensorstore_gateway.sh [RDRAM]          # RDRAM defaults to target/release/rdram
#
# Settings (environment), defaults for 16 cores:
#   SERVER_CORES=0,1,2,3   one worker per core        GATEWAY_CORES=4-9    TS_CORES=10-15
#   ENGINE_CLIENTS=16      POLL=adaptive              MIB=1024  CHUNK_MIB=4  REPEAT=3
#   SERVE_ARGS=""          more `rdram serve` arguments (e.g. --transport fabric --provider shm)
#   PY=python3             a python with tensorstore and numpy (target/venv-tensorstore here)
#   LOAD=…                 rdram-gateway-load (default: beside RDRAM), run after TensorStore
# UCX_TLS picks the UCX transport as usual (e.g. posix,sysv,cma,self, or tcp with RDRAM_UCX_TCP=1).
# On the GPU machine: source .device-bundle's paths first (bench/compare --device-bundle
# shows which), and pass .device-bundle/bin/rdram.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
RDRAM=${1:-$root/target/release/rdram}
LOAD=${LOAD:-$(dirname "$RDRAM")/rdram-gateway-load}
SERVER_CORES=${SERVER_CORES:-0,1,2,3}
GATEWAY_CORES=${GATEWAY_CORES:-4-9}
TS_CORES=${TS_CORES:-10-15}
ENGINE_CLIENTS=${ENGINE_CLIENTS:-16}
POLL=${POLL:-adaptive}
PY=${PY:-python3}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
workers=$(tr ',' '\n' <<<"$SERVER_CORES" | wc -l)

# shellcheck source=../scripts/background.sh
source "$root/scripts/background.sh"

# shellcheck disable=SC2086  # SERVE_ARGS is a list of arguments
start server taskset -c "$SERVER_CORES" "$RDRAM" serve --listen 127.0.0.1:0 --workers "$workers" \
  --cores "$SERVER_CORES" --memory "$(( ${MIB:-1024} * 3 + 1024 ))MiB" --poll "$POLL" ${SERVE_ARGS:-}
start gateway taskset -c "$GATEWAY_CORES" "$RDRAM" gateway --listen 127.0.0.1:0 --server "$server_addr" \
  --engine-clients "$ENGINE_CLIENTS"
echo "server $server_addr (cores $SERVER_CORES, poll $POLL, UCX_TLS=${UCX_TLS:-default} ${SERVE_ARGS:-}), gateway $gateway_addr (cores $GATEWAY_CORES, $ENGINE_CLIENTS engine clients), TensorStore on cores $TS_CORES"
taskset -c "$TS_CORES" "$PY" "$root/bench/tensorstore_throughput.py" "$gateway_addr" --mib "${MIB:-1024}" \
  --chunk-mib "${CHUNK_MIB:-4}" --repeat "${REPEAT:-3}" --cpu-of "gateway=$gateway_pid" --cpu-of "server=$server_pid"
# The same gateway under a gRPC client of our own on TensorStore's cores: what the gateway
# serves, apart from what TensorStore's client takes of it.
if [ -x "$LOAD" ]; then
  echo
  echo "the gateway alone (rdram-gateway-load on cores $TS_CORES, ${CHUNK_MIB:-4} MiB values):"
  taskset -c "$TS_CORES" "$LOAD" --gateway "$gateway_addr" --size "${CHUNK_MIB:-4}MiB" --seconds 2
fi
