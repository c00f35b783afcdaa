# start_etcd: an etcd server on free loopback ports with a data directory under $work;
# sets $etcd (HOST:PORT of its client port). Needs `start`, `$work` and `$pids` of the caller.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start_etcd() {
  local client peer
  client=$(free_port); peer=$(free_port)
  command -v etcd >/dev/null || { echo "etcd is not installed (make deps installs Debian's etcd-server)"; exit 1; }
  etcd --name t --data-dir "$work/etcd" --log-level error \
    --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "t=http://127.0.0.1:$peer" >"$work/etcd.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$client") 2>/dev/null && break; sleep 0.1; done
  etcd=127.0.0.1:$client
}
