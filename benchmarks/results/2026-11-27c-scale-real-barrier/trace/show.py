import collections
import json
import statistics
import sys

d = json.load(open(sys.argv[1]))
for run in d:
  recs = run["recs"]
  n = run["n"]
  # times from each process's own restore() start
  rows = collections.defaultdict(list)
  for p, r in enumerate(recs):
    tr = r["trace"]
    R = [e for e in tr if e[0] == "RESTORE"][-1]
    t0 = R[2]
    for lab, arg, s, e, c in tr:
      if s < t0:
        continue
      key = lab + ":" + "".join(ch for ch in arg if not ch.isdigit())[:24]
      rows[key].append((s - t0, e - t0, c, p))
  print(
    f"n={n} restore max {max(r['restore_s'] for r in recs):.3f} med {statistics.median(r['restore_s'] for r in recs):.3f} cpu max {max(r['restore_cpu_s'] for r in recs):.3f}"
  )
  for k, v in sorted(rows.items(), key=lambda kv: min(x[0] for x in kv[1])):
    st = [x[0] for x in v]
    en = [x[1] for x in v]
    du = [x[1] - x[0] for x in v]
    cp = [x[2] for x in v]
    print(
      f"  {k:40s} n={len(v):3d} start {min(st):.3f}-{max(st):.3f} end {min(en):.3f}-{max(en):.3f} dur med {statistics.median(du):.3f} max {max(du):.3f} cpu med {statistics.median(cp) * 1e3:.1f}ms max {max(cp) * 1e3:.1f}ms (p{max(v, key=lambda x: x[2])[3]})"
    )
