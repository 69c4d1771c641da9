"""Goodput under random failures: how much of the wall time trained the model.

  python -m benchmarks.goodput [--seeds 1,2,3] [--intervals 1,5,20] [--auto]
      [--orbax] [--duration-s 180] [--mtbf-s 45] [--step-s 0.2] [--out F]

A real training job on this machine's CPUs: 2 slices x 1 process x 2 CPU
devices (one process per slice: a restart starts every process at once, each
importing jax and Orbax, and on a 2-core machine four of them would time the
cores' contention more than the checkpointer), one jax.distributed job
started with emergency_ckpt.demo.launcher
(benchmarks/goodput_job.py: a state of --mib MiB per slice, a fixed step
time of --step-s, a jitted add, an all-reduce over every device (the
processes step in lockstep, as a data-parallel job's do) and a sleep;
save(step) called every step,
the manager's intervals deciding; the persistent tier on a local disk
folder every --persistent-interval steps). Failures come at random: a
Poisson process of mean --mtbf-s seconds, seeded, so every configuration
of a seed meets the same failure times. At each failure the driver
SIGKILLs every process of the job (what a scheduler does when a host
fails: the whole job goes down) and starts it again at once; the new job
restores and trains on, until --duration-s have passed since the run's
start, when the driver stops it. Each process's ramdisk folder (/dev/shm)
survives the restarts here: the failure takes the job, not the host (a
lost host's ramdisk, restored from a peer slice, is the demo's and the
fault matrix's case).

Configurations, each run once per seed, interleaved within a seed:
emergency_ckpt at each local interval of --intervals; with --auto,
local.save_interval_steps="auto" (reported as not available where this
version's LocalTierOptions refuses it); with --orbax, Orbax's multislice
emergency manager (emergency_ckpt.bench.adapters) at each interval of
--intervals (slice 0 saves only to the persistent tier, slice 1 only to its
ramdisk, by Orbax's design).

Goodput = final step x step time / wall time: the steps the model holds at
the end, each worth one fixed step. The breakdown (stalls, restore and
start-up, redone work, other) comes from every process's own timeline
(benchmarks/goodput_account.py; the table shows the process with the least
productive time) and is cross-checked two ways: the productive time
measured step by step over the wall time ("check %"), and, for
emergency_ckpt, the productive time that `emergency-ckpt report`'s
event-log accounting (cli/goodput.py) finds in the same run's event logs,
over the same wall time ("report %"; the JSON also keeps the report's own
figure, whose wall time runs from the first event, the first manager's
construction, to the last). The two can differ: the report counts a
step's training only once a `progress` event carried it (at most every 10 s,
and at close()), so a SIGKILL loses up to that much from its count.

Prints a table per seed and the median over seeds; --out writes the JSON
(settings, machine, CPU count, date, every run with its incarnations).
Set EC_LAUNCHER_START=fork (or --start fork) to fork the job processes
from a server that imported jax once, instead of spawning fresh
interpreters (the default, as a scheduler's restart does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks import goodput_account as acct
from emergency_ckpt.demo.job_process import read_pid
from emergency_ckpt.demo.launcher import default_start, run_job

TARGET = "benchmarks.goodput_job:train"
OURS, ORBAX = "emergency_ckpt", "orbax_multislice"
NPROC = 2
PID_WAIT_S = 60.0  # a failure that comes while the job starts waits for its pids
RESTORE_WAIT_S = 180.0  # at the deadline, a job still restoring may finish it (untimed)
FINAL_GRACE_S = 0.3  # then a step that ended by the deadline gets its record written (untimed)


def config_name(manager: str, interval: int | str) -> str:
  return f"{'ours' if manager == OURS else 'orbax'}/{interval}"


def auto_unavailable() -> str | None:
  """Why local.save_interval_steps="auto" cannot run here (None: it can)."""
  import emergency_ckpt as ec  # noqa: PLC0415

  try:
    ec.LocalTierOptions(directory=tempfile.gettempdir(), save_interval_steps="auto")
  except Exception as e:  # noqa: BLE001 - any refusal means "not available"
    return f"{type(e).__name__}: {e}"
  return None


def configurations(intervals: list[int], auto: bool, orbax: bool) -> list[dict[str, Any]]:
  out = [{"manager": OURS, "local_interval": i} for i in intervals]
  if auto:
    out.append({"manager": OURS, "local_interval": "auto"})
  if orbax:
    out += [{"manager": ORBAX, "local_interval": i} for i in intervals]
  for c in out:
    c["config"] = config_name(c["manager"], c["local_interval"])
  return out


class _Job:
  """One incarnation: run_job in a thread, so the driver can kill it."""

  def __init__(self, args: dict, out_dir: str, start: str, timeout_s: float):
    self.out_dir = out_dir
    self.result = None
    self.error: BaseException | None = None
    self.launched = time.time()
    self._thread = threading.Thread(
      target=self._run, args=(args, start, timeout_s), name="goodput-job", daemon=True
    )
    self._thread.start()

  def _run(self, args: dict, start: str, timeout_s: float) -> None:
    try:
      self.result = run_job(
        TARGET, NPROC, args, out_dir=self.out_dir, start=start, timeout_s=timeout_s
      )
    except BaseException as e:  # noqa: BLE001 - reported by the driver
      self.error = e

  def alive(self) -> bool:
    return self._thread.is_alive()

  def wait(self, until: float) -> bool:
    """Blocks until unix time `until` or the job's end; True if it ended."""
    self._thread.join(max(0.0, until - time.time()))
    return not self._thread.is_alive()

  def kill(self) -> float:
    """SIGKILLs every process of the job (each leads its own session: its
    whole group), waits for run_job to reap them; returns when the signal
    went out (unix s)."""
    give_up = time.monotonic() + PID_WAIT_S
    pids: list[int | None] = [None] * NPROC
    while self.alive() and None in pids and time.monotonic() < give_up:
      pids = [read_pid(self.out_dir, i) for i in range(NPROC)]
      if None in pids:
        time.sleep(0.01)
    at = time.time()
    for pid in pids:
      if pid is None:
        continue
      try:
        os.killpg(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      except PermissionError:  # not a group leader after all: the process alone
        os.kill(pid, signal.SIGKILL)
    self._thread.join()
    return at

  def failure_text(self) -> str:
    if self.error is not None:
      return f"run_job raised {type(self.error).__name__}: {self.error}"
    r = self.result
    if r is None:
      return "no result"
    parts = [
      f"process {i} rc={r.returncodes[i]}: {(r.errors[i] or r.logs[i])[-1500:]}"
      for i in range(NPROC)
    ]
    detail = "\n".join(parts)
    return f"job ended on its own (timed_out={r.timed_out})\n{detail}"


def _read_timeline(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except ValueError:  # a line torn by the kill
        continue
  return out


def _restored_everywhere(timelines: list[str], inc: int) -> bool:
  return all(acct.restored_step(_read_timeline(p), inc) is not None for p in timelines)


def _report(events_dir: str, wall_s: float) -> dict[str, Any] | None:
  """`emergency-ckpt report`'s goodput of the run (its event logs)."""
  from emergency_ckpt.cli.report import summarize_events  # noqa: PLC0415
  from emergency_ckpt.core.telemetry import read_events  # noqa: PLC0415

  if not os.path.isdir(events_dir):
    return None
  events = read_events(events_dir)
  if not events:
    return None
  g = summarize_events(events)["goodput"]
  keys = ("goodput_pct", "wall_s", "productive_s", "stall_s", "restore_s", "startup_s")
  out = {k: g.get(k) for k in (*keys, "lost_s", "lost_steps", "down_s", "other_s", "process")}
  # the report counts every incarnation that ended without close(): the
  # last one too (the driver stops it with SIGKILL at the deadline)
  out["unclosed_incarnations"] = max((p["failures"] for p in g["per_process"]), default=None)
  out["productive_pct_of_run_wall"] = (
    100.0 * g["productive_s"] / wall_s if g.get("productive_s") is not None else None
  )
  return out


def one_run(config: dict, seed: int, a: argparse.Namespace, root: str) -> dict[str, Any]:
  """Runs one configuration against one seed's failures; returns its row."""
  work = os.path.join(root, f"seed{seed}", config["config"].replace("/", "-"))
  ramdisk = os.path.join(a.shm_root, f"seed{seed}", config["config"].replace("/", "-"))
  timelines = [os.path.join(work, "timeline", f"p{i}.jsonl") for i in range(NPROC)]
  failures = acct.failure_times(seed, a.mtbf_s, a.duration_s)
  job_args = {
    "manager": config["manager"],
    "local_interval": config["local_interval"],
    "persistent_interval": a.persistent_interval,
    "mib": a.mib,
    "step_s": a.step_s,
    "local_root": ramdisk,
    "persistent": os.path.join(work, "persistent"),
    "timeline": os.path.join(work, "timeline", "p{process}.jsonl"),
    "event_log": (
      os.path.join(work, "events", "events_{process}.jsonl") if config["manager"] == OURS else None
    ),
    "run_id": f"goodput-{seed}",
  }
  os.makedirs(job_args["persistent"], exist_ok=True)
  row: dict[str, Any] = {
    **{k: config[k] for k in ("config", "manager", "local_interval")},
    "persistent_interval": a.persistent_interval,
    "seed": seed,
    "available": True,
    "error": None,
    "failure_times_s": [round(f, 3) for f in failures],
  }
  t0 = time.time()
  deadline = t0 + a.duration_s
  windows: list[dict[str, Any]] = []
  begin, pending = t0, list(failures)
  waited = 0.0
  while True:
    inc = len(windows)
    job = _Job(
      {**job_args, "inc": inc},
      os.path.join(work, f"job_{inc}"),
      a.start,
      a.duration_s + RESTORE_WAIT_S + 600,
    )
    fail_at = t0 + pending[0] if pending else None
    stop_at = min(fail_at, deadline) if fail_at is not None else deadline
    if job.wait(stop_at):
      row["error"] = f"incarnation {inc}: {job.failure_text()}"
      windows.append({"inc": inc, "begin": begin, "end": time.time(), "killed": False})
      break
    if fail_at is not None and fail_at < deadline:
      pending.pop(0)
      end = job.kill()
      windows.append({"inc": inc, "begin": begin, "end": end, "killed": True})
      begin = end
      print(
        f"  {config['config']} seed {seed}: failure at {end - t0:.1f} s (incarnation {inc})",
        flush=True,
      )
      continue
    give_up = time.time() + RESTORE_WAIT_S  # the job's final step needs its restore
    while job.alive() and not _restored_everywhere(timelines, inc) and time.time() < give_up:
      time.sleep(0.05)
    waited = max(0.0, time.time() - deadline)
    time.sleep(FINAL_GRACE_S)
    if not job.alive():
      row["error"] = f"incarnation {inc}: {job.failure_text()}"
    job.kill()
    windows.append({"inc": inc, "begin": begin, "end": deadline, "killed": False})
    break
  records = [_read_timeline(p) for p in timelines]
  row["incarnations"] = [
    {
      "inc": w["inc"],
      "began_s": round(w["begin"] - t0, 3),
      "ended_s": round(w["end"] - t0, 3),
      "killed": w["killed"],
      "restored": [
        next(
          (
            {"step": r["step"], "source": r["source"], "ok": r["ok"]}
            for r in rec
            if r.get("inc") == w["inc"] and r.get("ev") == "restored"
          ),
          None,
        )
        for rec in records
      ],
    }
    for w in windows
  ]
  row["failures"] = sum(w["killed"] for w in windows)
  row["restores_ok"] = all(
    r is None or r["ok"] for inc in row["incarnations"] for r in inc["restored"]
  )
  row["waited_after_deadline_s"] = round(waited, 3)
  if row["error"]:
    return row
  wall = a.duration_s
  final = acct.final_step(records, windows[-1]["inc"], deadline)
  per_process = [acct.account_process(rec, windows, final) for rec in records]
  worst = min(range(NPROC), key=lambda p: per_process[p]["productive_s"])
  row.update(
    {
      "wall_s": wall,
      "final_step": final,
      "step_s": a.step_s,
      "goodput_pct": acct.goodput_pct(final, a.step_s, wall),
      "check_goodput_pct": 100.0 * per_process[worst]["productive_s"] / wall,
      "breakdown_process": worst,
      "breakdown": {k: per_process[worst][k] for k in (*acct.PARTS, "restore_s")},
      "per_process": per_process,
      "report": (
        _report(os.path.join(work, "events"), wall) if config["manager"] == OURS else None
      ),
    }
  )
  return row


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m benchmarks.goodput",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--seeds", default="1,2,3", help="failure schedules, comma-separated")
  p.add_argument("--intervals", default="1,5,20", help="local save intervals (steps)")
  p.add_argument("--auto", action="store_true", help='also local.save_interval_steps="auto"')
  p.add_argument("--orbax", action="store_true", help="also Orbax's multislice manager")
  p.add_argument("--duration-s", type=float, default=180.0, help="wall time per run")
  p.add_argument("--mtbf-s", type=float, default=45.0, help="mean time between failures")
  p.add_argument("--step-s", type=float, default=0.2, help="the fixed train step time")
  p.add_argument("--persistent-interval", type=int, default=100, help="persistent tier (steps)")
  p.add_argument("--mib", type=int, default=4, help="state MiB per slice")
  p.add_argument("--start", choices=("spawn", "fork"), default=None, help="job process start")
  p.add_argument("--shm-root", help="ramdisk folder (default: a fresh one under /dev/shm)")
  p.add_argument("--keep", action="store_true", help="keep the work folders")
  p.add_argument("--out", help="write the results as JSON here")
  a = p.parse_args(argv)
  a.start = a.start or default_start()
  if not a.mtbf_s > 0 or not a.duration_s > 0 or not a.step_s > 0:
    p.error("--duration-s, --mtbf-s and --step-s must be > 0")
  return a


def main(argv: list[str] | None = None) -> int:
  a = parse_args(argv)
  seeds, intervals = _ints(a.seeds), _ints(a.intervals)
  configs = configurations(intervals, a.auto, a.orbax)
  auto_why = auto_unavailable() if a.auto else None
  root = tempfile.mkdtemp(prefix="ec-goodput-")
  shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else None
  own_shm = a.shm_root is None
  a.shm_root = a.shm_root or tempfile.mkdtemp(prefix="ec-goodput-", dir=shm_base)
  started = datetime.datetime.now(datetime.timezone.utc)
  print(
    f"goodput: {len(configs)} configurations x {len(seeds)} seeds, {a.duration_s:g} s each;"
    f" step {a.step_s:g} s, MTBF {a.mtbf_s:g} s, start={a.start}; work {root}",
    flush=True,
  )
  rows: list[dict[str, Any]] = []
  try:
    for seed in seeds:
      for config in configs:
        if config["local_interval"] == "auto" and auto_why is not None:
          rows.append(
            {**config, "seed": seed, "available": False, "reason": auto_why, "error": None}
          )
          continue
        print(f"== seed {seed}, {config['config']}", flush=True)
        t = time.monotonic()
        row = one_run(config, seed, a, root)
        row["run_wall_s"] = round(time.monotonic() - t, 1)
        rows.append(row)
        if row["error"]:
          print(f"  ERROR: {row['error'][:3000]}", flush=True)
      mine = [r for r in rows if r["seed"] == seed]
      times = acct.failure_times(seed, a.mtbf_s, a.duration_s)
      print(f"\nseed {seed}: failures at {', '.join(f'{f:.1f}' for f in times) or 'none'} s")
      print(acct.table([[r["config"], *acct.row_cells(r)] for r in mine]) + "\n", flush=True)
  finally:
    if a.keep:
      print(f"work folders kept: {root} {a.shm_root}")
    else:
      shutil.rmtree(root, ignore_errors=True)
      if own_shm:
        shutil.rmtree(a.shm_root, ignore_errors=True)
  summary = acct.summarize(rows)
  print(f"median over {len(seeds)} seed(s)")
  print(acct.table([acct.summary_cells(s) for s in summary]), flush=True)
  if a.out:
    doc = {
      "study": "goodput",
      "date": started.strftime("%Y-%m-%d %H:%M UTC"),
      "machine": platform.node(),
      "platform": platform.platform(),
      "cpus": os.cpu_count(),
      "settings": {
        "seeds": seeds,
        "intervals": intervals,
        "auto": a.auto,
        "orbax": a.orbax,
        "duration_s": a.duration_s,
        "mtbf_s": a.mtbf_s,
        "step_s": a.step_s,
        "persistent_interval": a.persistent_interval,
        "mib_per_slice": a.mib,
        "topology": "2 slices x 1 process x 2 CPU devices",
        "start": a.start,
      },
      "failure_times_s": {str(s): acct.failure_times(s, a.mtbf_s, a.duration_s) for s in seeds},
      "rows": rows,
      "summary": summary,
    }
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)
  return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
