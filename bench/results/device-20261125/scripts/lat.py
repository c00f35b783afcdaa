import sys, json
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
print(sys.argv[1], " ".join("%s p50 %.3f p99 %.2f" % (r["op"], r["p50_us"], r["p99_us"]) for r in rows))
