"""XOR set-up at scale: the library's `Collectives.assign` against the all-gather it replaced.

What it measures: the collective that `local.redundancy: xor` runs once per manager to cut a
slice's processes into XOR groups, with K simulated processes in ONE slice (one machine each,
label `m<i>`, `redundancy_group_size` 8) against a real JAX coordination service. It drives the
scale benchmark's exchange simulation (benchmarks/scale_exchange.py, rounds "xor set-up" and
"xor set-up (all-gather)"): K clients spread over 2 worker processes, one thread per simulated
process, all released at once. Per K: wall time from the release to the last process's return
(median of --reps after a warm-up), calls per process, bytes received per process and bytes the
service sent; then the growth exponent over K = 64..1,024. Results: benchmarks/results/redundancy-xor.md.

  python -m benchmarks.tools.xor_setup OUT.json [--ks 16,64,256,1024] [--reps 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import math

from benchmarks import scale_exchange as se


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.tools.xor_setup")
  p.add_argument("out", help="JSON file for the points")
  p.add_argument("--ks", default="16,64,256,1024", help="process counts (one slice)")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--workers", type=int, default=2, help="worker processes holding the clients")
  a = p.parse_args(argv)
  ks = [int(k) for k in a.ks.split(",")]
  points: dict[str, list] = {}
  with se._switch_interval(se.SWITCH_INTERVAL_S):  # noqa: SLF001
    for k in ks:
      sim = se.Simulation(k, timeout_s=300, workers=a.workers)
      try:
        for what in se.XOR_ROUNDS:
          points.setdefault(what, []).append(
            se._exchange_point(sim, se._rounds(sim, what, a.reps), [0])  # noqa: SLF001
          )
      finally:
        sim.close()
  doc: dict = {"ks": ks, "reps": a.reps, "points": points}
  fit = [k for k in ks if k >= 64]
  for what, pts in points.items():
    if len(fit) >= 2:
      walls = {p["k"]: p["wall_s"] for p in pts}
      slope = math.log(walls[fit[-1]] / walls[fit[0]]) / math.log(fit[-1] / fit[0])
      doc.setdefault("exponent", {})[what] = slope
      print(f"{what}: exponent {fit[0]}-{fit[-1]} {slope:.2f}")
    else:
      print(f"{what}:")
    for p in pts:
      print(
        f"  K={p['k']:5d} wall {p['wall_s'] * 1e3:8.1f} ms  calls/process {p['calls_per_process_min']}-"
        f"{p['calls_per_process_max']}  bytes received per process median"
        f" {p['bytes_received_per_process']:.0f} max {p['bytes_received_per_process_max']:.0f}"
        f"  service sends {p['service_bytes_sent'] / 1e6:.2f} MB"
      )
  with open(a.out, "w") as f:
    json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main()
