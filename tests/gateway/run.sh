#!/usr/bin/env bash
# Unmodified TensorStore from PyPI against `rdram gateway`, every actor its own process:
# an `rdram serve` server, the gateway, then writer, reader and kvstore-checker processes.
# Usage: tests/gateway/run.sh [path/to/rdram] [extra `rdram serve` arguments, e.g. the
#        transport: --transport fabric --provider "tcp;ofi_rxm"]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
RDRAM=${1:-$root/target/release/rdram}
shift || true
VENV=${RDRAM_TS_VENV:-$root/target/venv-tensorstore}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import tensorstore, numpy" 2>/dev/null; then
  echo "== creating $VENV with tensorstore and numpy from PyPI"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt"
fi
PY="$VENV/bin/python"

# shellcheck source=../../scripts/background.sh
source "$root/scripts/background.sh"

start server "$RDRAM" serve --listen 127.0.0.1:0 --workers 2 --memory 256MiB --hugepages off "$@"
head -1 "$work/server.log"
start gateway "$RDRAM" gateway --listen 127.0.0.1:0 --server "$server_addr" --engine-clients 4 --timeout-ms 5000
gateway=$gateway_addr
echo "== server $server_addr, gateway $gateway"

for step in write read kvstore; do
  echo "== $step (a separate process)"
  "$PY" "$here/ts_check.py" "$step" "$gateway"
done

if [ $# -eq 0 ]; then
  echo "== TensorStore through a gateway in front of a cluster on etcd"
  # shellcheck source=../../scripts/etcd.sh
  source "$root/scripts/etcd.sh"
  start_etcd
  cluster=etcd://$etcd/gateway
  "$RDRAM" cluster create "$cluster" >/dev/null
  start member1 "$RDRAM" serve --listen 127.0.0.1:0 --workers 1 --memory 128MiB --hugepages off --cluster "$cluster"
  start member2 "$RDRAM" serve --listen 127.0.0.1:0 --workers 1 --memory 128MiB --hugepages off --cluster "$cluster"
  start cluster_gateway "$RDRAM" gateway --listen 127.0.0.1:0 --server "$cluster" --engine-clients 4 --timeout-ms 5000
  for step in write read; do
    "$PY" "$here/ts_check.py" "$step" "$cluster_gateway_addr"
  done
fi

echo "== the server goes away"
kill -9 "$server_pid"
"$PY" "$here/ts_check.py" dead "$gateway"
kill -0 "$gateway_pid" || { cat "$work/gateway.log"; echo "the gateway died with its server"; exit 1; }
echo "gateway tests passed"
