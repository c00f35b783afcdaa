#!/usr/bin/env python3
"""How many of a server's workers a closed loop of large PUTs keeps busy.

A PUT's bytes are pulled by the worker that owns its key (over cma its UCX reads the
client's buffer), so CLIENTS client threads, each with DEPTH puts in flight to keys spread
at random over WORKERS shards, sometimes queue two puts on one worker while another has
none. This simulates that loop with a fixed copy time per put, for the two ways a worker
can take the puts it has: one at a time (fifo), or sharing its time between them (shared:
UCX's cma copies 512 KiB segments in turn across endpoints, so a 1 MiB put is between the
two). Prints the mean number of busy workers, which bounds the speed-up over one worker.

    bench/routing_model.py [--workers 8] [--clients 8] [--depth 1,4]
"""
import argparse
import heapq
import random


def fifo(workers, puts_in_flight, completions, rng):
    free_at = [0.0] * workers
    ready = [(0.0, i) for i in range(puts_in_flight)]  # (when the client issues it, id)
    heapq.heapify(ready)
    end = 0.0
    for _ in range(completions):
        issued, i = heapq.heappop(ready)
        w = rng.randrange(workers)
        end = free_at[w] = max(issued, free_at[w]) + 1.0
        heapq.heappush(ready, (end, i))
    return completions / end


def shared(workers, puts_in_flight, completions, rng):
    # Remaining copy time of the puts each worker holds; a worker with n of them copies
    # each at 1/n of its rate.
    held = [[] for _ in range(workers)]
    for _ in range(puts_in_flight):
        held[rng.randrange(workers)].append(1.0)
    now, done = 0.0, 0
    while done < completions:
        step = min(min(h) * len(h) for h in held if h)
        now += step
        finished = 0
        for w, h in enumerate(held):
            if h:
                left = [r - step / len(h) for r in h]
                held[w] = [r for r in left if r > 1e-9]
                finished += len(left) - len(held[w])
        for _ in range(finished):  # each client sends its next put at once
            held[rng.randrange(workers)].append(1.0)
        done += finished
    return done / now


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--depth", default="1,4")
    p.add_argument("--completions", type=int, default=200_000)
    args = p.parse_args()
    print(f"{args.workers} workers, {args.clients} clients: mean busy workers (share of all)")
    for depth in map(int, args.depth.split(",")):
        n = args.clients * depth
        a, b = (f(args.workers, n, args.completions, random.Random(1)) for f in (fifo, shared))
        print(f"depth {depth}: one at a time {a:.2f} ({a / args.workers:.0%}), shared {b:.2f} ({b / args.workers:.0%})")


if __name__ == "__main__":
    main()
