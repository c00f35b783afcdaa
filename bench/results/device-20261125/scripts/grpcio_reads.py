"""4 MiB reads through the gateway with grpcio (gRPC core's chttp2, as TensorStore's client),
under different client-side HTTP/2 settings: one read at a time, and 16 at once."""
import sys, time, statistics, os
from concurrent.futures import ThreadPoolExecutor
import grpc
sys.path.insert(0, os.path.dirname(__file__))
import tsgrpc_kvstore_pb2 as pb, tsgrpc_kvstore_pb2_grpc as pbg

addr = sys.argv[1]
variants = {
    "grpc defaults": [],
    "no BDP probe, 64 KiB windows": [("grpc.http2.bdp_probe", 0)],
    "lookahead 16 MiB": [("grpc.http2.lookahead_bytes", 16 << 20)],
}
val = os.urandom(4 << 20)
opts_common = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
for name, opts in variants.items():
    ch = grpc.insecure_channel(addr, options=opts_common + opts)
    stub = pbg.KvStoreServiceStub(ch)
    def write(k):
        parts = [val[i:i + (1 << 20)] for i in range(0, len(val), 1 << 20)]
        return stub.Write(iter([pb.WriteRequest(key=k, value_part=p) for p in parts]))
    def read(k):
        n = 0
        for r in stub.Read(pb.ReadRequest(key=k)):
            n += len(r.value_part)
        assert n == len(val), n
    keys = [f"g/{i}".encode() for i in range(32)]
    for k in keys:
        write(k)
    for k in keys[:4]:
        read(k)
    lat = []
    for k in keys:
        t = time.perf_counter(); read(k); lat.append(time.perf_counter() - t)
    with ThreadPoolExecutor(16) as ex:
        t = time.perf_counter(); list(ex.map(read, keys * 2)); par = time.perf_counter() - t
    wl = []
    for k in keys[:16]:
        t = time.perf_counter(); write(k); wl.append(time.perf_counter() - t)
    print(f"{name:32s} read one at a time p50 {statistics.median(lat)*1e3:.2f} ms ({len(val)/statistics.median(lat)/1e6:.0f} MB/s); "
          f"16 at once {64*len(val)/par/1e6:.0f} MB/s; write one at a time p50 {statistics.median(wl)*1e3:.2f} ms")
    ch.close()
