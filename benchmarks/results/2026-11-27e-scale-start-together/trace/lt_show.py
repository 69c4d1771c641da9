import collections
import json
import statistics
import sys

KEY, TOP = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("trace", "LATEST")
for job in json.load(open(sys.argv[1])):
  n, recs = job["n"], job["recs"]
  for r in recs:
    r["trace"] = r[KEY]
  t0 = min(e[1] for r in recs for e in r["trace"] if e[0] == TOP)
  print(
    f"== n={n}: {TOP} max {max(e[2] - e[1] for r in recs for e in r['trace'] if e[0] == TOP) * 1e3:.0f} ms (t=0: first process entering)"
  )
  by = collections.defaultdict(list)
  for i, r in enumerate(recs):
    for name, a, b, c in r["trace"]:
      by[name].append((a - t0, b - t0, c, i))
  order = sorted(by, key=lambda k: min(x[0] for x in by[k]))
  for name in order:
    xs = by[name]
    st = sorted(x[0] for x in xs)
    en = sorted(x[1] for x in xs)
    last_start = max(xs, key=lambda x: x[0])
    print(
      f"  {name:32s} n={len(xs):4d} start {st[0] * 1e3:6.1f}-{st[-1] * 1e3:6.1f} (last p{last_start[3]}) end {en[0] * 1e3:6.1f}-{en[-1] * 1e3:6.1f} med dur {statistics.median(x[1] - x[0] for x in xs) * 1e3:6.1f}"
    )
  # p0 timeline
  print(
    "  p0:",
    [(nm, round((a - t0) * 1e3, 1), round((b - t0) * 1e3, 1)) for nm, a, b, c in recs[0]["trace"]][
      :60
    ],
  )
