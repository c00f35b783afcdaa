#!/usr/bin/env bash
# The Python package's tests: `pip install ./python` into target/venv-python (PyPI's
# maturin builds the extension), then pytest against real `rdram serve` processes and
# embedded servers over UCX tcp, UCX shared memory and libfabric tcp;ofi_rxm.
# Usage: python/tests/run.sh [path/to/rdram]
# RDRAM_TEST_TORCH=0 leaves PyPI's torch out, RDRAM_TEST_LMCACHE=0 LMCache (their tests
# then skip, saying why; LMCache not installing otherwise fails the run). LMCache's tests
# (ours, then LMCache's own tests/v1/test_connector.py through lmcache_suite.py) run once,
# over shared memory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export RDRAM_BIN=$(realpath "${1:-$root/target/release/rdram}")
VENV=${RDRAM_PY_VENV:-$root/target/venv-python}
PIP=(--disable-pip-version-check -q)

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import pytest, numpy" 2>/dev/null; then
  echo "== creating $VENV with pytest and numpy from PyPI"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install "${PIP[@]}" -r "$here/requirements.txt"
fi
if [ "${RDRAM_TEST_TORCH:-1}" != 0 ] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "== installing PyTorch from PyPI into $VENV (for remote_dram.torch's tests)"
  "$VENV/bin/pip" install "${PIP[@]}" -r "$here/requirements-torch.txt" \
    || { [ -n "${CI:-}" ] && [ "${CI}" != false ] && { echo "== PyTorch could not be installed, and CI must run its tests"; exit 1; }
         echo "== PyTorch could not be installed: its tests will be skipped"; }
fi

if [ "${RDRAM_TEST_LMCACHE:-1}" != 0 ] && ! "$VENV/bin/python" -c "import lmcache" 2>/dev/null; then
  echo "== installing LMCache from PyPI into $VENV (for remote_dram.lmcache's tests)"
  "$VENV/bin/pip" install "${PIP[@]}" -r "$here/requirements-lmcache.txt"
fi

echo "== pip install ./python"
# Built in the main crate's target/ with the tests' profile (test-release: no whole-program
# LTO), as `make test-rust` builds: its compiled dependencies are reused, and the release
# build (`make build`, `make python`'s wheel) is left as it was, not rebuilt for the
# extension's feature set.
export CARGO_TARGET_DIR=$root/target MATURIN_PEP517_ARGS="--profile test-release"
"$VENV/bin/python" -c "import libucx" 2>/dev/null || "$VENV/bin/pip" install "${PIP[@]}" "$root/python"   # with its dependencies, once
"$VENV/bin/pip" install "${PIP[@]}" --force-reinstall --no-deps "$root/python"

cd "$here"
for transport in tcp shm "fabric:tcp;ofi_rxm"; do
  echo "== pytest over $transport"
  RDRAM_TEST_TRANSPORT=$transport "$VENV/bin/python" -m pytest -q -rs --durations=5 -p no:cacheprovider --ignore=test_lmcache.py
done
echo "== pytest test_lmcache.py over shm"
RDRAM_TEST_TRANSPORT=shm "$VENV/bin/python" -m pytest -q -rs --durations=5 -p no:cacheprovider test_lmcache.py
if "$VENV/bin/python" -c "import lmcache" 2>/dev/null; then
  echo "== LMCache 0.5.6's own connector tests over shm (lmcache_suite.py)"
  RDRAM_TEST_TRANSPORT=shm "$VENV/bin/python" lmcache_suite.py -p no:warnings
fi
