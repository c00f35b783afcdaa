"""Unmodified TensorStore (PyPI wheel, driver tsgrpc_kvstore) against `rdram gateway`.

Each step runs as its own process (run.sh starts them one after another), so data written
by one is read back by another only through the gateway and the remote DRAM server:

  ts_check.py write ADDR      create and fill zarr v2, zarr v3, zarr v3 sharded, zarr v3 on ocdbt
  ts_check.py read ADDR       open them fresh, read back exactly; partial-chunk writes;
                              sharded inner-chunk reads; delete_existing
  ts_check.py kvstore ADDR    direct ts.KvStore operations and their edge cases
  ts_check.py dead ADDR       the server behind the gateway is gone: a quick error, no hang
"""

import sys
import time

import numpy as np
import tensorstore as ts

SHAPE = [8, 6, 4]
CHUNKS = [4, 3, 2]
# Retries kept small so that a failure surfaces in seconds, not TensorStore's ~15 min.
CONTEXT = {"tsgrpc_request_retries": {"max_retries": 1, "initial_delay": "0.1s", "max_delay": "0.2s"}}


def kvstore(addr, path):
    return {"driver": "tsgrpc_kvstore", "address": addr, "path": path, "timeout": "20s"}


def expected():
    i, j, k = np.indices(SHAPE)
    return (i * 100 + j * 10 + k).astype(np.float32)


def specs(addr):
    zarr3_meta = {"shape": SHAPE, "data_type": "float32",
                  "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": CHUNKS}}}
    sharded_meta = {"shape": SHAPE, "data_type": "float32",
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 6, 4]}},
                    "codecs": [{"name": "sharding_indexed", "configuration": {
                        "chunk_shape": [2, 3, 2],
                        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]}
    return {
        "zarr2": {"driver": "zarr", "kvstore": kvstore(addr, "z2/"),
                  "metadata": {"shape": SHAPE, "chunks": CHUNKS, "dtype": "<f4"}},
        "zarr3": {"driver": "zarr3", "kvstore": kvstore(addr, "z3/"), "metadata": zarr3_meta},
        "zarr3_sharded": {"driver": "zarr3", "kvstore": kvstore(addr, "z3s/"), "metadata": sharded_meta},
        "zarr3_ocdbt": {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": kvstore(addr, "oc/")},
                        "metadata": zarr3_meta},
    }


def context():
    return ts.Context(CONTEXT)


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}")


def write(addr):
    for name, spec in specs(addr).items():
        t = ts.open(spec, create=True, delete_existing=True, context=context()).result()
        t.write(expected()).result()
        check(np.array_equal(t.read().result(), expected()), f"{name}: written and read back by the writer")


def read(addr):
    for name, spec in specs(addr).items():
        open_spec = {k: v for k, v in spec.items() if k != "metadata"}
        t = ts.open(open_spec, open=True, context=context()).result()
        check(t.shape == tuple(SHAPE) and t.dtype == ts.float32, f"{name}: metadata from another process")
        check(np.array_equal(t.read().result(), expected()), f"{name}: every element read back exactly")

        if name == "zarr3_sharded":
            inner = ts.open(open_spec, open=True, context=context()).result()[0:2, 0:3, 0:2].read().result()
            check(np.array_equal(inner, expected()[0:2, 0:3, 0:2]), f"{name}: one inner chunk (shard index by byte range)")

        # A partial-chunk write is a read-modify-write with a conditional write.
        t[0:2, 0:2, 0] = -1
        want = expected()
        want[0:2, 0:2, 0] = -1
        fresh = ts.open(open_spec, open=True, context=context()).result()
        check(np.array_equal(fresh.read().result(), want), f"{name}: partial-chunk write seen by a fresh handle")

        # A chunk equal to the fill value becomes a delete.
        t[4:8, 3:6, 2:4] = 0
        want[4:8, 3:6, 2:4] = 0
        fresh = ts.open(open_spec, open=True, context=context()).result()
        check(np.array_equal(fresh.read().result(), want), f"{name}: fill-value chunk (a delete) read back")

    # delete_existing: the old chunks go (a DeleteRange), the new array is all fill value.
    spec = specs(addr)["zarr2"]
    t = ts.open(spec, create=True, delete_existing=True, context=context()).result()
    check(not t.read().result().any(), "zarr2: delete_existing leaves only fill values")
    keys = ts.KvStore.open(kvstore(addr, "z2/"), context=context()).result().list().result()
    check(keys == [b".zarray"], f"zarr2: delete_existing removed every chunk (left {keys})")


def kvstore_ops(addr):
    kv = ts.KvStore.open(kvstore(addr, "kvtest/"), context=context()).result()
    kv.delete_range(ts.KvStore.KeyRange()).result()

    r = kv.read("missing").result()
    check(r.state == "missing" and r.value == b"", "read of a missing key is 'missing', not an error")

    g1 = kv.write("a", b"hello world").result().generation
    check(len(g1) > 0, "write returns a generation")
    stale = kv.write("a", b"nope", if_equal=b"\x00\x01\x02\x03\x04\x05\x06\x07\x08").result()
    check(stale.generation == b"" and kv.read("a").result().value == b"hello world",
          "conditional write with a mismatching generation changes nothing")
    absent_only = kv.write("a", b"nope", if_equal=b"\x02").result()
    check(absent_only.generation == b"", "write-if-absent on an existing key fails")
    g2 = kv.write("a", b"hello again", if_equal=g1).result().generation
    check(g2 and g2 != g1 and kv.read("a").result().value == b"hello again", "conditional write with the right generation")
    g3 = kv.write("a", b"hello again").result().generation
    check(g3 != g2, "rewriting identical bytes still mints a new generation")

    same = kv.read("a", if_not_equal=g3).result()
    check(same.state == "unspecified" and same.stamp.generation == g3, "if_not_equal(current) answers 'unspecified'")
    changed = kv.read("a", if_not_equal=g2).result()
    check(changed.state == "value" and changed.value == b"hello again", "if_not_equal(old) returns the value")

    check(kv.read("a", byte_range=slice(2, 5)).result().value == b"llo", "byte range [2, 5)")
    check(kv.read("a", byte_range=slice(-5, None)).result().value == b"again", "suffix byte range (last 5)")
    check(kv.read("a", byte_range=slice(6, None)).result().value == b"again", "byte range to the end")
    try:
        kv.read("a", byte_range=slice(5, 100)).result()
        check(False, "out-of-range byte range raises")
    except ValueError as e:
        check("OUT_OF_RANGE" in str(e), f"out-of-range byte range is OUT_OF_RANGE ({e})")

    kv.write("empty", b"").result()
    r = kv.read("empty").result()
    check(r.state == "value" and r.value == b"", "a 0-byte value is a value, not missing")

    big = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    kv.write("big", big).result()
    check(kv.read("big").result().value == big, "a 3 MiB value round-trips (streamed in parts both ways)")

    for k in ["dir/x", "dir/y", "dir/z/w", "other"]:
        kv.write(k, k.encode()).result()
    listed = sorted(kv.list(ts.KvStore.KeyRange("dir/", "dir0"), strip_prefix_length=4).result())
    check(listed == [b"x", b"y", b"z/w"], f"list with a range and prefix stripping: {listed}")

    kv.delete_range(ts.KvStore.KeyRange("dir/", "dir0")).result()
    check(sorted(kv.list().result()) == [b"a", b"big", b"empty", b"other"], "delete_range removed exactly the range")

    g = kv.read("other").result().stamp.generation
    deleted = kv.write("other", None).result()  # a write of None is a Delete RPC
    check(deleted.generation == b"\x02" and kv.read("other").result().state == "missing", "delete answers 'no value'")
    del_stale = kv.write("a", None, if_equal=g).result()
    check(del_stale.generation == b"" and kv.read("a").result().state == "value",
          "conditional delete with a stale generation keeps the key")
    gone = kv.write("a", None, if_equal=kv.read("a").result().stamp.generation).result()
    check(gone.generation == b"\x02" and kv.read("a").result().state == "missing", "conditional delete with the current generation")


def dead(addr):
    kv = ts.KvStore.open(kvstore(addr, "kvtest/"), context=context()).result()
    start = time.monotonic()
    try:
        kv.read("a").result()
        check(False, "a read through a gateway whose server is gone fails")
    except ValueError as e:
        elapsed = time.monotonic() - start
        check(elapsed < 20, f"dead server: error after {elapsed:.1f} s: {str(e)[:160]}")


if __name__ == "__main__":
    step, addr = sys.argv[1], sys.argv[2]
    {"write": write, "read": read, "kvstore": kvstore_ops, "dead": dead}[step](addr)
    print(f"{step}: passed")
