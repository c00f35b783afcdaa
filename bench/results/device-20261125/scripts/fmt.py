import sys, json, collections
# rdram-bench --json lines -> one line per (op,size); with --sum, totals over all lines
total = collections.Counter()
for line in (l for l in sys.stdin if l.startswith("{")):
    r = json.loads(line)
    total[(r["op"], r["size"])] += r["mb_per_s"]
    if "--sum" not in sys.argv:
        print(f"  {r['op']} {r['size']} {r['mb_per_s']:.0f} MB/s p50 {r['p50_us']:.1f} us")
if "--sum" in sys.argv:
    print("  sum:", {f"{op} {size}": round(v) for (op, size), v in total.items()}, "MB/s")
