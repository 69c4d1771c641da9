"""The XOR set-up's collective at K simulated processes in one slice (one
machine each, groups of 8), against a real coordination service: the
library's Collectives.assign (since 52af22d) beside the all-gather it
replaced. Uses the scale benchmark's simulation (bench/scale_exchange.py:
K clients in 2 worker processes, one thread each, released at once).

  .venv/bin/python benchmarks/results/2026-11-26e-xor-setup/measure.py OUT.json
"""

import json
import math
import sys

from emergency_ckpt.bench import scale_exchange as se

KS = (16, 64, 256, 1024)
REPS = 3


def main(out: str) -> None:
  points = {}
  with se._switch_interval(se.SWITCH_INTERVAL_S):
    for k in KS:
      sim = se.Simulation(k, timeout_s=300, workers=2)
      try:
        for what in se.XOR_ROUNDS:
          points.setdefault(what, []).append(
            se._exchange_point(sim, se._rounds(sim, what, REPS), [0])
          )
      finally:
        sim.close()
  doc = {"ks": KS, "reps": REPS, "points": points}
  for what, pts in points.items():
    walls = [p["wall_s"] for p in pts]
    slope = math.log(walls[-1] / walls[1]) / math.log(KS[-1] / KS[1])
    doc.setdefault("exponent_64_1024", {})[what] = slope
    print(f"{what}: exponent 64-1024 {slope:.2f}")
    for p in pts:
      print(
        f"  K={p['k']:5d} wall {p['wall_s'] * 1e3:8.1f} ms  calls/process {p['calls_per_process_min']}-"
        f"{p['calls_per_process_max']}  bytes received per process median"
        f" {p['bytes_received_per_process']:.0f} max {p['bytes_received_per_process_max']:.0f}"
        f"  service sends {p['service_bytes_sent'] / 1e6:.2f} MB"
      )
  with open(out, "w") as f:
    json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
