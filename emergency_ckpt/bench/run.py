"""Benchmarks emergency_ckpt against Orbax's two emergency checkpoint managers.

  python -m emergency_ckpt.bench [--mib-per-replica N] [--reps K] [--out DIR] [--quick]

On this machine, with the same train state and jobs for every manager (all
launched by emergency_ckpt.demo.launcher.run_job, the launcher the tests use):
  1. raw bounds: one 4-process job measuring memcpy, ramdisk write/read
     (each the faster of one thread and N = min(cpus, 8)), the peer
     restore's (the senders' read and a socket transfer between the same
     processes), persistent write and cold read of each process's exact bytes;
  2. per manager (emergency_ckpt, Orbax multislice, Orbax P2P): one main job
     (saves, then restores intact / after losing a slice / from persistent
     with the page cache evicted, on a 2x2 and a 4x1 mesh), then K restart
     jobs timing process spawn to restored state.
Writes <out>/results.json and <out>/results.md, prints the table, and logs
progress on stderr. Ramdisks live under /dev/shm, persistent directories
under /tmp; both are removed at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time

from emergency_ckpt.bench import figures, measure, report
from emergency_ckpt.bench.adapters import MANAGERS, OURS
from emergency_ckpt.bench.state import LAYOUTS, rows_per_leaf
from emergency_ckpt.bench.workers import SPAWN_ENV
from emergency_ckpt.demo.launcher import run_job

WORKERS = "emergency_ckpt.bench.workers"  # the jobs' target module
PROCESSES = 4
DEVICES_PER_PROCESS = 2
QUICK_MIB, QUICK_REPS = 4, 1
DEFAULT_MIB, DEFAULT_REPS = 512, 3

_T0 = time.monotonic()


def progress(msg: str) -> None:
  print(f"[bench {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class _Tail:
  """Echoes process 0's 'BENCH ...' log lines to stderr while a job runs."""

  def __init__(self, path: str, label: str):
    self._path, self._label = path, label
    self._stop = threading.Event()
    self._pos = 0
    self._thread = threading.Thread(target=self._run, daemon=True)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self._poll()

  def _run(self):
    while not self._stop.wait(0.5):
      self._poll()

  def _poll(self):
    try:
      with open(self._path, errors="replace") as f:
        f.seek(self._pos)
        text = f.read()
    except FileNotFoundError:
      return
    end = text.rfind("\n") + 1
    self._pos += len(text[:end].encode())
    for line in text[:end].splitlines():
      if line.startswith("BENCH "):
        progress(f"  {self._label}: {line[6:]}")


class Runner:
  def __init__(self, args: argparse.Namespace, shm_root: str, disk_root: str, on_job=None):
    self.args = args
    self.shm_root = shm_root
    self.disk_root = disk_root
    self.errors: dict[str, str] = {}
    self.retried: dict[str, str] = {}  # label: why its first attempt failed
    self.on_job = on_job or (lambda label, status, wall_s, error: None)

  def job(self, label: str, target: str, job_args: dict, timeout_s: float, *, retry=None):
    """Runs one 4-process job; (per-process results, None) or (None, error).
    `retry`, for Orbax's jobs only: a function that clears the job's folders;
    a job that timed out is then run once more (recorded in `retried`, its
    first attempt's logs kept). Ours never gets one: a hang of ours fails."""
    got, error = self._attempt(label, target, job_args, timeout_s)
    if got is None and retry is not None and error.startswith("timed out"):
      self.retried[label] = error
      del self.errors[label]
      logs = os.path.join(self.args.out, "logs")
      for name in os.listdir(logs):
        if name.startswith(f"{label}_process_"):
          os.replace(os.path.join(logs, name), os.path.join(logs, f"attempt1_{name}"))
      progress(f"{label}: retrying once (a hang in Orbax's code; first attempt's logs kept)")
      retry()
      got, error = self._attempt(label, target, job_args, timeout_s)
    return got, error

  def _attempt(self, label: str, target: str, job_args: dict, timeout_s: float):
    job_dir = os.path.join(self.disk_root, "jobs", label)
    os.makedirs(job_dir, exist_ok=True)
    progress(f"{label}: starting ({target.split(':')[1]}, timeout {timeout_s:.0f}s)")
    self.on_job(label, "start", None, None)
    with _Tail(os.path.join(job_dir, "log_0.txt"), label):
      spawn = repr(time.time())
      res = run_job(
        target,
        PROCESSES,
        job_args,
        devices_per_process=DEVICES_PER_PROCESS,
        timeout_s=timeout_s,
        env={i: {SPAWN_ENV: spawn} for i in range(PROCESSES)},
        out_dir=job_dir,
      )
    bad = [i for i, rc in enumerate(res.returncodes) if rc != 0]
    if not bad and not res.timed_out and all(r is not None for r in res.results):
      progress(f"{label}: done in {res.wall_s:.1f}s")
      self.on_job(label, "done", res.wall_s, None)
      return res.results, None
    error = _summarize(res, bad)
    self.errors[label] = error
    logs = os.path.join(self.args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    for i, text in enumerate(res.logs):
      with open(os.path.join(logs, f"{label}_process_{i}.txt"), "w") as f:
        f.write(text)
    progress(f"{label}: FAILED after {res.wall_s:.1f}s: {error} (logs in {logs})")
    self.on_job(label, "failed", res.wall_s, error)
    return None, error


def _summarize(res, bad: list[int]) -> str:
  """One line on why a job failed: the first process that failed by itself
  (its error's last line), and for a timeout also where each process still
  running last reported progress (the logs hold their stacks)."""
  killed = [i for i in bad if res.timed_out and res.returncodes[i] == -signal.SIGKILL]
  failed = [i for i in bad if i not in killed]
  if not failed and not res.timed_out:  # every rc 0 but a result missing
    failed = list(range(len(res.returncodes)))
  parts = []
  for i in failed:
    text = res.errors[i] or res.logs[i]  # no result file: the log's tail
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    if lines:
      parts.append(f"process {i} rc={res.returncodes[i]}: {lines[-1][:300]}")
      break
  if res.timed_out:
    where = {i: _last_progress(res.logs[i]) for i in killed}
    parts.append(
      f"timed out after {res.wall_s:.0f}s with processes {killed} still running"
      + "".join(f"; {i} last at {w!r}" for i, w in where.items() if w)
    )
  return "; ".join(parts) or f"processes {bad} exited with {[res.returncodes[i] for i in bad]}"


def _last_progress(log: str) -> str:
  """The last 'BENCH ...' progress line of a process's log, or ''."""
  lines = [ln[6:].strip() for ln in (log or "").splitlines() if ln.startswith("BENCH ")]
  return lines[-1] if lines else ""


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m emergency_ckpt.bench", description=__doc__.split("\n")[0]
  )
  p.add_argument("--mib-per-replica", type=int, default=None, help=f"default {DEFAULT_MIB}")
  p.add_argument("--reps", type=int, default=None, help=f"default {DEFAULT_REPS}")
  p.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
  p.add_argument(
    "--quick", action="store_true", help=f"{QUICK_MIB} MiB, {QUICK_REPS} rep (for the test suite)"
  )
  p.add_argument("--managers", default=",".join(MANAGERS), help="comma-separated subset")
  p.add_argument("--shm-root", default="/dev/shm", help="where the simulated ramdisks go")
  p.add_argument("--persistent-root", default="/tmp", help="where persistent dirs go (local disk)")
  p.add_argument("--job-timeout", type=float, default=None, help="seconds per job (default scaled)")
  p.add_argument("--keep", action="store_true", help="keep the ramdisk and persistent dirs")
  p.add_argument(
    "--peer-integrity",
    choices=("mac", "crc"),
    default="mac",
    help="emergency_ckpt's peer.integrity (default mac, the library's default)",
  )
  args = p.parse_args(argv)
  args.mib_per_replica = args.mib_per_replica or (QUICK_MIB if args.quick else DEFAULT_MIB)
  args.reps = args.reps or (QUICK_REPS if args.quick else DEFAULT_REPS)
  args.managers = [m.strip() for m in args.managers.split(",") if m.strip()]
  unknown = set(args.managers) - set(MANAGERS)
  if unknown:
    p.error(f"unknown managers {sorted(unknown)}; choose from {list(MANAGERS)}")
  if args.reps < 1:
    p.error("--reps must be >= 1")
  try:
    rows_per_leaf(args.mib_per_replica)
  except ValueError as e:
    p.error(str(e))
  return args


def _versions() -> dict[str, str]:
  out = {"python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy"):
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = "?"
  return out


def main(argv=None, on_job=None) -> int:
  """Runs the benchmark; returns the exit status. `on_job(label, status,
  wall_s, error)`, if given, is called as each job starts ("start") and ends
  ("done" or "failed"); labels: "raw", "<manager>-main", "<manager>-restart-<k>"
  (restarts only after a successful main job)."""
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  mib, reps = args.mib_per_replica, args.reps
  shm_root = tempfile.mkdtemp(prefix="ecbench-", dir=args.shm_root)
  disk_root = tempfile.mkdtemp(prefix="ecbench-", dir=args.persistent_root)
  runner = Runner(args, shm_root, disk_root, on_job)
  base = {
    "mib": mib,
    "reps": reps,
    "shm_root": shm_root,
    "disk_root": disk_root,
    "peer_integrity": args.peer_integrity,
  }
  scale = mib * reps
  # --quick: a hang is cut short so that a retried job still fits the smoke
  # test's budget; the full size scales with the bytes saved.
  t_main = args.job_timeout or (150 if args.quick else 240 + 0.5 * scale)
  t_small = args.job_timeout or (100 if args.quick else 150 + 0.15 * scale)
  progress(
    f"{mib} MiB per replica, {reps} rep(s), managers {args.managers};"
    f" ramdisks under {shm_root}, persistent under {disk_root}"
  )
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  precompiled = measure.precompile()  # as an installed wheel: the jobs import bytecode
  results: dict[str, dict] = {}
  ready: list[float] = []  # restart jobs' spawn-to-ready, pooled into the bound
  try:
    raw, raw_error = runner.job("raw", f"{WORKERS}:raw_bounds", base, t_small)
    if raw is None:
      progress(f"raw bounds failed ({raw_error}); nothing to compare against")
      return 1
    for name in MANAGERS:
      if name not in args.managers:
        main_res, main_err, restarts, restart_errors = None, "skipped (--managers)", [], []
      else:
        job_args = dict(base, manager=name)

        def clear(name=name):
          shutil.rmtree(os.path.join(shm_root, name), ignore_errors=True)
          shutil.rmtree(os.path.join(disk_root, name), ignore_errors=True)

        retry = None if name == OURS else clear
        main_res, main_err = runner.job(
          f"{name}-main", f"{WORKERS}:manager_main", job_args, t_main, retry=retry
        )
        restarts, restart_errors = [], []
        if main_res is not None:
          for k in range(reps):
            got, err = runner.job(
              f"{name}-restart-{k}", f"{WORKERS}:manager_restart", job_args, t_small
            )
            if got is None:
              restart_errors.append(err)
            else:
              restarts.append(got)
        clear()
      metrics, extras = figures.manager_figures(name, main_res, main_err, restarts, restart_errors)
      results[name] = {"metrics": metrics, "extras": extras}
      ready.extend(figures.restart_ready(restarts))
  finally:
    if not args.keep:
      shutil.rmtree(shm_root, ignore_errors=True)
      shutil.rmtree(disk_root, ignore_errors=True)

  raw_figs = figures.raw_figures(raw, ready)
  doc = {
    "config": {
      "mib_per_replica": mib,
      "reps": reps,
      "quick": args.quick,
      "peer_integrity": args.peer_integrity,
      "processes": PROCESSES,
      "devices_per_process": DEVICES_PER_PROCESS,
      "layouts": {k: {"slices": s, "devices_per_slice": d} for k, (s, d) in LAYOUTS.items()},
      "bytes_per_process": {
        name: max(p["layouts"][name]["bytes"] for p in raw) for name in LAYOUTS
      },
      "cpus": os.cpu_count(),
      "versions": _versions(),
      "started_at": started,
      "precompiled": precompiled,
      "wall_s": time.monotonic() - _T0,
    },
    "metrics": [
      {"key": mt.key, "label": mt.label, "unit": mt.unit, "raw_bound": mt.bound}
      for mt in figures.METRICS
    ],
    "raw_bounds": raw_figs,
    "results": results,
    "ratios": figures.ratios(raw_figs, results),
    "errors": runner.errors,
    "retried": runner.retried,
  }
  json_path = os.path.join(args.out, "results.json")
  md_path = os.path.join(args.out, "results.md")
  with open(json_path, "w") as f:
    json.dump(doc, f, indent=1)
  table = report.markdown(doc)
  with open(md_path, "w") as f:
    f.write(table)
  print(table)
  progress(f"wrote {json_path} and {md_path}")
  return 1 if any(k.startswith(f"{OURS}-") for k in runner.errors) else 0


if __name__ == "__main__":
  sys.exit(main())
