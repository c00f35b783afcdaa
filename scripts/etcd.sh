# start_etcd: an etcd server on free loopback ports with a data directory under $work;
# sets $etcd (HOST:PORT of its client port), and the secret the cluster members started
# here share (RDRAM_CLUSTER_SECRET_FILE, unless set). Needs `$work` and `$pids` of the caller.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start_etcd() {
  local client peer attempt pid
  command -v etcd >/dev/null || { echo "etcd is not installed (make deps installs Debian's etcd-server)"; exit 1; }
  if [ -z "${RDRAM_CLUSTER_SECRET_FILE:-}" ]; then
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/cluster-secret"
    chmod 600 "$work/cluster-secret"
    export RDRAM_CLUSTER_SECRET_FILE="$work/cluster-secret"
  fi
  # Ports are found free, then handed to etcd: another process may take one in between
  # (or both picks be one port). etcd then exits, and starts again on new ports.
  for attempt in 1 2 3; do
    client=$(free_port); peer=$(free_port)
    [ "$peer" = "$client" ] && continue
    etcd --name t --data-dir "$work/etcd-$attempt" --log-level error \
      --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
      --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
      --initial-cluster "t=http://127.0.0.1:$peer" >"$work/etcd.log" 2>&1 &
    pid=$!
    pids+=($pid)
    for _ in $(seq 200); do
      kill -0 $pid 2>/dev/null || break
      (exec 3<>"/dev/tcp/127.0.0.1/$client") 2>/dev/null && { etcd=127.0.0.1:$client; return 0; }
      sleep 0.1
    done
  done
  echo "etcd did not start (see $work/etcd.log)"; exit 1
}
