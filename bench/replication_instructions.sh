#!/usr/bin/env bash
# What a replicated write costs its servers in instructions, which a shared or small
# machine measures as well as a quiet one (its timings measure the scheduler): two cluster
# members with R = 2 under callgrind, one client putting 8 B values through them.
#
#   bench/replication_instructions.sh [PUTS]     PUTS: measured puts (default 10000)
#   env: BIN (default target/release), R (default 2), KEEP (keep the profiles)
#
# Per server it prints instructions per request served (`Service::answer`, which on a
# replica includes checking the copy's ticket), per turn of the write replicator (the
# worker's look for copies' answers, run once per pass while answers are due, with the
# copies' sends in it), and per ticket made and checked. The tickets' SHA-256 is left out
# of the first two: valgrind runs it in software (it hides the CPU's SHA extensions),
# where the CPU takes a few hundred nanoseconds. UCX shared memory; servers sleep when
# idle (--spin-us 0). Needs valgrind (Debian: apt-get install valgrind); builds nothing.
set -euo pipefail
PUTS=${1:-10000}
BIN=${BIN:-target/release}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 2; }
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_TLS=${UCX_TLS:-posix,sysv,cma,self}
work=$(mktemp -d)
[ -n "${KEEP:-}" ] && echo "profiles in $work"
pids=()
trap 'kill ${pids[*]} 2>/dev/null; wait 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
. "$(dirname "$0")/../scripts/etcd.sh"
start_etcd
cluster="etcd://$etcd/c"
"$BIN/rdram" cluster create "$cluster" --replicas "${R:-2}" >/dev/null
for n in a b; do
  # Instrumented from the measured puts on (callgrind_control -i on below).
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/$n.%p.out" \
    "$BIN/rdram" serve --listen 127.0.0.1:0 --workers 1 --memory 256MiB --hugepages off --spin-us 0 \
    --cluster "$cluster" >"$work/$n.log" 2>&1 &
  pids+=($!)
  until grep -qs "^listening on" "$work/$n.log"; do sleep 0.2; done
done
placed() {
  "$BIN/rdram" cluster status "$cluster" | python3 -c '
import json, sys
p = json.load(sys.stdin)["placement"]
sys.exit(0 if p and len(p["members"]) == 2 and p["next"] is None else 1)'
}
for _ in $(seq 100); do placed && break; sleep 0.2; done
placed || { echo "the cluster never placed both servers" >&2; exit 1; }
bench() {
  "$BIN/rdram-bench" --server "$cluster" --poll adaptive --ops put --sizes 8 --depth 1 --count "$1" \
    --warmup 0 --keys 1000 --json
}
# Connections between the servers made, the keys' extents reused: then measured.
bench 2000 >/dev/null
for p in "${pids[@]}"; do callgrind_control -i on "$p" >/dev/null; done
bench "$PUTS" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print("puts of 8 B, p50 %.0f us under valgrind" % r["p50_us"])'
for p in "${pids[@]}"; do
  callgrind_control -i off "$p" >/dev/null
  callgrind_control -d "$p" >/dev/null
done
sleep 1
for profile in "$work"/*.out.1; do
  callgrind_annotate --tree=caller --inclusive=yes --threshold=100 "$profile" 2>/dev/null | python3 -c '
import re, sys
# v0-mangled symbols demangle as <path::Type>::method: named as the legacy ones are.
text = re.sub(r"<(remote_dram::[\w:]*)>::", r"\1::", sys.stdin.read())
def cost(name):
    """Inclusive instructions of the function and the calls made to it (the largest of
    the entries callgrind lists it under, one per source file its inlined code names)."""
    best = (0, 0)
    for block in text.split("\n\n"):
        lines = block.splitlines()
        star = [l for l in lines if re.search(r"\s\*\s", l) and re.search(re.escape(name) + r"\s*(\[|$)", l)]
        if not star:
            continue
        incl = int(re.match(r"\s*([\d,]+)", star[0]).group(1).replace(",", ""))
        calls = sum(int(c.replace(",", "")) for l in lines if " < " in l for c in re.findall(r"\(([\d,]+)x\)", l))
        best = max(best, (incl, calls))
    return best
answer, requests = cost("remote_dram::server::service::Service::answer")
allows, checked = cost("remote_dram::auth::ClusterSecret::allows")
drive, turns = cost("remote_dram::cluster::replication::Replicator::drive")
ticket, made = cost("remote_dram::auth::ClusterSecret::ticket")
print("%s: %d requests, %.0f instructions each; %d replicator turns, %.0f each; %d tickets made, %d checked, %.0f each (SHA-256 in software)" % (
    sys.argv[1], requests, (answer - allows) / max(requests, 1), turns, (drive - ticket) / max(turns, 1),
    made, checked, (ticket + allows) / max(made + checked, 1)))' "$(basename "$profile" .out.1)"
done
