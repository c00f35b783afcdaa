#!/usr/bin/env bash
# What replication costs where every host has one network link of a set speed, as in a
# deployment: PUT throughput through a cluster on etcd with R = 2 against R = 1, rounds
# alternating. A key's primary copies each write to its replica, so the value crosses
# the writer's link once whatever R is; a replica's copy takes the primary's outgoing
# link and the replica's incoming one, which the writer's puts do not use.
#
#   bench/replication_links.sh [SIZES]     SIZES: rdram-bench --sizes (default 8,1MiB)
#   env: RATE (each link's speed, each way; tc tbf, default 1gbit), TRANSPORT (fabric:
#        libfabric tcp;ofi_rxm, default | ucx-tcp: UCX tcp), DEPTHS (default "1 8 16"),
#        ROUNDS (default 3), SECONDS_EACH (default 4), SERVERS (default 3), CLIENT_SPIN_US
#        (the client's spin before it sleeps, rdram-bench --spin-us; default the
#        library's), BIN (default target/release), KEEP
#
# The hosts are network namespaces of this script's own (etcd, the client and SERVERS
# servers, default 3), each with one veth pair to a bridge in a "switch" namespace; tc's
# token bucket limits each host's link to RATE both ways (the host's side sends, the
# switch's side receives). Each server host runs two members: one of an R = 1 cluster and
# one of an R = 2 cluster (one worker each, sleeping when idle); one is measured at a
# time. Everything is removed at the end. Needs root and iproute2; builds nothing: run
# `make build` first. The link speed is kept well under what the CPUs move, so the links
# are what the figures measure (on 2 vCPUs, libfabric tcp moves about 1 GB/s).
set -euo pipefail
SIZES=${1:-8,1MiB}
BIN=$(realpath "${BIN:-target/release}")
RATE=${RATE:-1gbit}
TRANSPORT=${TRANSPORT:-fabric}
ROUNDS=${ROUNDS:-3}
work=$(mktemp -d)
[ -n "${KEEP:-}" ] && echo "logs in $work"
prefix=rdram-links-$$
servers=()
for i in $(seq "${SERVERS:-3}"); do servers+=("s$i"); done
hosts=(etcd client "${servers[@]}")
pids=()
declare -A server_pid
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  for ns in switch "${hosts[@]}"; do ip netns del "$prefix-$ns" 2>/dev/null || true; done
  [ -n "${KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
case $TRANSPORT in
  fabric) serve_transport=(--transport fabric --provider "tcp;ofi_rxm") ;;
  ucx-tcp)
    # UCX's tcp transport is a trusted-network opt-in (docs/security.md).
    export RDRAM_UCX_TCP=1 UCX_TLS=tcp,self UCX_NET_DEVICES=eth0
    serve_transport=()
    ;;
  *) echo "TRANSPORT: fabric or ucx-tcp" >&2; exit 2 ;;
esac
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/cluster-secret"
chmod 600 "$work/cluster-secret"
export RDRAM_CLUSTER_SECRET_FILE=$work/cluster-secret

# The net: a bridge in the switch namespace, a host namespace per name with eth0 on it.
# on HOST CMD...: runs CMD on HOST. Started in the background, a function's command is the
# child of a subshell that a kill of $! does not reach: those use `ip netns exec` directly.
on() { local host=$1; shift; ip netns exec "$prefix-$host" "$@"; }
addr() {
  local i
  for i in "${!hosts[@]}"; do
    if [ "${hosts[$i]}" = "$1" ]; then echo "10.97.0.$((i + 1))"; return; fi
  done
  return 1
}
ip netns add "$prefix-switch"
on switch ip link add br0 type bridge
on switch ip link set br0 up
for host in "${hosts[@]}"; do
  ip netns add "$prefix-$host"
  on switch ip link add "p-$host" type veth peer name eth0 netns "$prefix-$host"
  on switch ip link set "p-$host" master br0 up
  on "$host" ip link set lo up
  on "$host" ip addr add "$(addr "$host")/24" dev eth0
  on "$host" ip link set eth0 up
  # Segments of at most 16 KiB, so that the token bucket's burst (which must hold one)
  # lets little of a value through faster than RATE.
  on "$host" ip link set eth0 gso_max_size 16384
  on switch ip link set "p-$host" gso_max_size 16384
  on "$host" tc qdisc add dev eth0 root tbf rate "$RATE" burst 32kb latency 20ms
  on switch tc qdisc add dev "p-$host" root tbf rate "$RATE" burst 32kb latency 20ms
done

etcd_url=http://$(addr etcd):2379
ip netns exec "$prefix-etcd" etcd --name t --data-dir "$work/etcd" --log-level error \
  --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
  --listen-peer-urls "http://$(addr etcd):2380" --initial-advertise-peer-urls "http://$(addr etcd):2380" \
  --initial-cluster "t=http://$(addr etcd):2380" >"$work/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 200); do on client bash -c "exec 3<>/dev/tcp/$(addr etcd)/2379" 2>/dev/null && break; sleep 0.1; done
for r in 1 2; do
  on client "$BIN/rdram" cluster create "etcd://$(addr etcd):2379/r$r" --replicas $r >/dev/null
done
for host in "${servers[@]}"; do
  for r in 1 2; do
    log=$work/server-$host-r$r.log
    ip netns exec "$prefix-$host" "$BIN/rdram" serve --listen "$(addr "$host"):700$r" "${serve_transport[@]}" --workers 1 \
      --memory 512MiB --hugepages off --spin-us 0 --cluster "etcd://$(addr etcd):2379/r$r" >"$log" 2>&1 &
    pids+=($!)
    server_pid[$log]=$!
  done
done
for log in "${!server_pid[@]}"; do
  until grep -qs "^listening on" "$log"; do
    kill -0 "${server_pid[$log]}" 2>/dev/null || { echo "a server did not start:" >&2; tail -5 "$log" >&2; exit 1; }
    sleep 0.1
  done
done
settled() {
  on client "$BIN/rdram" cluster status "etcd://$(addr etcd):2379/r$1" | python3 -c '
import json, sys
p = json.load(sys.stdin)["placement"]
sys.exit(0 if p and len(p["members"]) == int(sys.argv[1]) and p["next"] is None else 1)' "${#servers[@]}"
}
for r in 1 2; do
  for _ in $(seq 300); do settled $r && break; sleep 0.1; done
  settled $r || { echo "the R = $r cluster never placed its ${#servers[@]} members"; exit 1; }
done

measure() {
  local out=$work/bench-r$1-d$2.json
  if ! on client "$BIN/rdram-bench" --server "etcd://$(addr etcd):2379/r$1" --poll adaptive --ops get,put \
    ${CLIENT_SPIN_US:+--spin-us "$CLIENT_SPIN_US"} --sizes "$SIZES" --depth "$2" --seconds "${SECONDS_EACH:-4}" --warmup 1 --json --out "$work/bench-out" \
    >"$out" 2>>"$work/bench.err"; then
    echo "rdram-bench failed (R = $1, depth $2):" >&2
    grep -v '^\[' "$work/bench.err" | tail -5 >&2
    exit 1
  fi
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("%s %s %s %.1f %.1f" % (r["op"], r["size"], r["mb_per_s"], r["p50_us"], r["p99_us"]))' "$out"
}
echo "links of $RATE each way, $TRANSPORT, ${#servers[@]} servers, one client; medians of $ROUNDS rounds:"
for depth in ${DEPTHS:-1 8 16}; do
  : >"$work/results"
  for round in $(seq "$ROUNDS"); do
    for r in 2 1; do
      measure $r "$depth" >"$work/round"
      sed "s/^/$r /" "$work/round" >>"$work/results"
    done
  done
  python3 - "$work/results" "$depth" <<'PYEOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
def col(rep, op, size, i):
    return [float(r[i]) for r in rows if r[0] == rep and r[1] == op and r[2] == size]
def med(rep, op, size, i):
    return statistics.median(col(rep, op, size, i))
for size in sorted({r[2] for r in rows}, key=int):
    mb2, mb1 = med("2", "put", size, 3), med("1", "put", size, 3)
    p2, p1, rtt = med("2", "put", size, 4), med("1", "put", size, 4), med("1", "get", size, 4)
    print("  depth %s, %s B PUT: R = 2 %.1f MB/s, p50 %.0f us | R = 1 %.1f MB/s, p50 %.0f us | R = 2 at %.0f %% of R = 1;"
          " GET p50 %.0f us, R = 2's PUT p50 %+.2f GETs over R = 1's" % (
        sys.argv[2], size, mb2, p2, mb1, p1, 100 * mb2 / mb1, rtt, (p2 - p1) / rtt))
    print("    rounds, R = 2 / R = 1 MB/s: %s / %s" % (
        ", ".join("%.1f" % v for v in col("2", "put", size, 3)), ", ".join("%.1f" % v for v in col("1", "put", size, 3))))
PYEOF
done
