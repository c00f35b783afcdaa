#!/usr/bin/env bash
# vLLM with LMCache and remote_dram as the remote KV-cache tier (docs/lmcache.md).
# Usage: examples/lmcache/vllm-serve.sh MODEL [SERVER]   (SERVER: HOST:PORT or etcd://HOST:PORT/NAME)
# Needs vllm, lmcache and remote_dram (pip install "./python[lmcache]") in this Python.
set -euo pipefail
model=${1:?usage: $0 MODEL [SERVER]}
server=${2:-127.0.0.1:7000}
here=$(cd "$(dirname "$0")" && pwd)
config=$(mktemp --suffix=.yaml)
trap 'rm -f "$config"' EXIT
sed "s|remote_dram://127.0.0.1:7000|remote_dram://$server|" "$here/remote_dram.yaml" > "$config"
LMCACHE_CONFIG_FILE=$config vllm serve "$model" \
  --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
