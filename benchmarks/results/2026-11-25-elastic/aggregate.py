"""Pools this folder's three runs (run1-3/results.json of
`python -m emergency_ckpt.bench.elastic --mib-per-replica 256 --reps 5`) into
the tables of README.md: per row, each run's median and the median [min-max]
over all 15 rounds, of the times and of the per-round ratios to ours from the
persistent tier on the same topology; then each row's per-process sources.

  python benchmarks/results/2026-11-25-elastic/aggregate.py benchmarks/results/2026-11-25-elastic
"""

import json
import statistics
import sys

base = sys.argv[1]
runs = [json.load(open(f"{base}/run{i}/results.json")) for i in (1, 2, 3)]
rows = list(runs[0]["rows"])


def fmt(xs, unit="s"):
  if not xs:
    return "-"
  m = statistics.median(xs)
  return (
    f"{m:.3f} [{min(xs):.3f}-{max(xs):.3f}]"
    if unit == "s"
    else f"{m:.2f}x [{min(xs):.2f}-{max(xs):.2f}]"
  )


print(
  "| row | metric | run 1 median | run 2 median | run 3 median | all rounds: median [min-max] |"
)
print("| --- | --- | --- | --- | --- | --- |")
for row in rows:
  for key in ("spawn_to_restored_s", "after_ready_s", "restore_s", "restore_call_s"):
    per = [r["rows"][row][key]["samples"] for r in runs]
    print(
      f"| `{row}` | {key} | "
      + " | ".join(f"{statistics.median(p):.3f}" if p else "-" for p in per)
      + f" | {fmt(sum(per, []))} |"
    )
  for key in ("spawn_to_restored_s", "restore_s"):
    per = [r["ratios"][row][key]["samples"] for r in runs]
    print(
      f"| `{row}` | {key} / baseline | "
      + " | ".join(f"{statistics.median(p):.2f}x" if p else "-" for p in per)
      + f" | {fmt(sum(per, []), 'x')} |"
    )
print()
print("Ours against Orbax P2P on the same topology, per round (interleaved jobs):")
print()
print("| ours / P2P | metric | run 1 | run 2 | run 3 | all rounds: median [min-max] |")
print("| --- | --- | --- | --- | --- | --- |")
for ours, p2p in (("ours_same", "p2p_same"), ("ours_reshard", "p2p_reshard")):
  for key, src in (("spawn_to_restored_s", "restored_s"), ("restore_s", "restore_s")):
    per = []
    for r in runs:
      a, b = r["per_rep"][ours], r["per_rep"][p2p]
      per.append(
        [max(p[src] for p in a[k]) / max(p[src] for p in b[k]) for k in sorted(a) if k in b]
      )
    print(
      f"| `{ours}` / `{p2p}` | {key} | "
      + " | ".join(f"{statistics.median(p):.2f}x" if p else "-" for p in per)
      + f" | {fmt(sum(per, []), 'x')} |"
    )
print()
for row in rows:
  srcs = {}
  for r in runs:
    for job in r["per_rep"][row].values():
      k = ", ".join(f"p{p['pid']}:{p['source'].split(' (')[0]}" for p in job)
      srcs[k] = srcs.get(k, 0) + 1
  exact = all(r["rows"][row]["bit_exact"] and r["rows"][row]["newest_step"] for r in runs)
  n = sum(len(r["per_rep"][row]) for r in runs)
  checked = sum(r["rows"][row]["shards_checked"] for r in runs)
  print(
    f"- `{row}`: {n} jobs, bit-exact and newest step in all: {exact} ({checked} shards checked); sources: {srcs}"
  )
print()
for i, r in enumerate(runs, 1):
  c = r["config"]
  print(
    f"run {i}: started {c['started_at']}, wall {c['wall_s']:.0f} s, load average"
    f" {c.get('loadavg_start')} -> {c.get('loadavg_end')}, errors {r['errors']}"
  )
