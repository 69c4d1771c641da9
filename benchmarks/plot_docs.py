"""The docs site's benchmark figure: `docs/assets/bench-managers.png`.

Reads one result of `emergency-ckpt bench` (the results.json it writes) and
draws, per metric, emergency_ckpt against Orbax's multislice and P2P emergency
managers, with the raw bound of the machine where there is one. The PNG is
committed; rerun this only when the docs should show another run:

  python -m benchmarks.plot_docs BENCH_OUT/results.json [--out docs/assets/bench-managers.png]

The committed PNG was drawn from the run of 2026-11-28 20:50 UTC
(benchmarks/results/bench-512MiB.md, "2026-11-28 20:50-21:06 UTC: every manager, three runs").

Needs matplotlib (the test extra installs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "docs", "assets", "bench-managers.png")

# (metric key, label) in the order drawn: time metrics only, one axis (seconds)
METRICS = [
  ("save_stall_s", "save() stall"),
  ("save_durable_local_s", "durable locally"),
  ("save_durable_persistent_s", "durable on persistent"),
  ("restore_intact_s", "restore,\nall slices intact"),
  ("restore_lose_slice_s", "restore, slice 1\nlost (2x2)"),
  ("restore_lose_slice_4x1_s", "restore, slice 3\nlost (4x1)"),
  ("restore_persistent_cold_s", "restore from\npersistent, cold"),
  ("start_to_restored_s", "process spawn\nto restored"),
]
MANAGERS = [
  ("emergency_ckpt", "emergency_ckpt", "#1f77b4"),
  ("orbax_multislice", "Orbax multislice", "#ff7f0e"),
  ("orbax_p2p", "Orbax P2P", "#2ca02c"),
]


def _raw_bound(data: dict, key: str) -> float | None:
  """The raw bound of metric `key`, as the report's bound column gives it: the
  memcpy timed in emergency_ckpt's own job for the stall, else the raw-bounds
  job's figure."""
  own = data["results"]["emergency_ckpt"]["metrics"][key].get("bound")
  if isinstance(own, (int, float)):
    return own
  spec = next((m for m in data["metrics"] if m["key"] == key), None)
  bound = data["raw_bounds"].get(spec.get("raw_bound")) if spec else None
  value = bound.get("value") if isinstance(bound, dict) else bound
  return value if isinstance(value, (int, float)) else None


def plot(results: str, out: str) -> str:
  import matplotlib  # noqa: PLC0415 - optional dependency

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  with open(results) as f:
    data = json.load(f)
  config = data["config"]
  started = datetime.datetime.fromisoformat(config["started_at"])
  width = 0.8 / (len(MANAGERS) + 1)
  fig, ax = plt.subplots(figsize=(11, 5.2))
  xs = range(len(METRICS))
  for j, (name, label, color) in enumerate(MANAGERS):
    values = [data["results"][name]["metrics"][key]["value"] for key, _ in METRICS]
    ax.bar([x + j * width for x in xs], values, width, label=label, color=color)
  bounds = [_raw_bound(data, key) for key, _ in METRICS]
  ax.bar(
    [x + len(MANAGERS) * width for x in xs],
    [b or 0 for b in bounds],
    width,
    label="raw bound (same machine)",
    color="#bbbbbb",
  )
  ax.set_xticks([x + width * len(MANAGERS) / 2 for x in xs])
  ax.set_xticklabels([label for _, label in METRICS], fontsize=8)
  ax.set_yscale("log")
  ax.set_ylabel("seconds (median of reps, log scale)")
  mib = config["mib_per_replica"]
  per_process = config["bytes_per_process"]["2x2"] // 2**20
  ax.set_title(
    f"emergency_ckpt vs Orbax's emergency managers: {mib} MiB per replica,"
    f" {config['processes']} processes x {config['devices_per_process']} CPU devices"
    f" ({per_process} MiB per process in 2x2)\n{started:%Y-%m-%d %H:%M} UTC,"
    f" {config['cpus']} CPU cores, jax {config['versions']['jax']},"
    f" orbax-checkpoint {config['versions']['orbax-checkpoint']}",
    fontsize=10,
  )
  ax.grid(axis="y", which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(out), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("results", help="the results.json of an `emergency-ckpt bench` run")
  ap.add_argument("--out", default=DEFAULT_OUT, help="the PNG to write")
  args = ap.parse_args(argv)
  print(plot(args.results, args.out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
