"""Benchmark: restore onto fewer slices (issue 16), ours against Orbax P2P.

  python -m benchmarks.elastic --out DIR [--mib-per-replica N] [--reps K]
  (or `emergency-ckpt bench --elastic`)

Per manager (emergency_ckpt, Orbax's P2P emergency manager), one save job:
2 slices x 2 processes x 2 CPU devices (the benchmark's "2x2" layout, each
process a simulated host of its own): SAVES saves at steps that hit both
tiers of both managers, each waited for. Then slice 1 is gone for
good (hosts 2-3 and their ramdisks deleted) and K rounds of restart jobs,
one job per row and round, the rows interleaved in each round:

  ours_same         ours, 1 slice x 2 processes x 2 devices on hosts 0-1
                    (the saved slice shape): from the surviving ramdisks
  ours_reshard      ours, 1 slice x 4 processes x 1 device, 2 processes on
                    each of hosts 0-1 (another slice shape): resharded from
                    the surviving ramdisks (reshard.py, peer/reshard_stream.py)
  ours_persistent   ours, as ours_same with hosts 0-1's ramdisks wiped: the
                    persistent tier (the baseline of the 1x2x2 rows)
  ours_persistent_4x1  ours, as ours_reshard with the ramdisks wiped (the
                    baseline of the 1x4x1 rows)
  p2p_same          Orbax P2P, as ours_same (each process its own local
                    directory, as P2P needs)
  p2p_reshard       Orbax P2P, as ours_reshard (the first process of each
                    host gets the host's surviving directory, the second a
                    fresh one)
  p2p_persistent    Orbax P2P, as p2p_same with the ramdisks wiped

First the driver compiles emergency_ckpt to bytecode (measure.precompile()). Before
every job it resets hosts 0-1's ramdisks from a copy taken
after the save job (or wipes them) and evicts the persistent directory from
the page cache (a restart after a slice loss finds a cold persistent tier).
Each process reports process spawn -> jax.distributed ready -> manager
constructed -> restore() returned and arrays ready, the restored step, its
source, and its shards checked bit for bit against regenerated values
(state.mismatched_shards). Writes OUT/results.json and OUT/results.md.

Called by: the CLI (`emergency-ckpt bench --elastic`, cli/bench.py),
tests/test_bench_elastic.py; the job functions `save_job` and
`restart_job` run inside launcher.run_job's processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

from emergency_ckpt.bench import measure
from emergency_ckpt.demo.launcher import start_note

OURS, P2P = "emergency_ckpt", "orbax_p2p"
SAVES = 2  # ours keeps 2 local steps by default; both are on the ramdisks
SAVED_PROCESSES, SAVED_DEVICES, SAVED_SLICES = 4, 2, 2
SURVIVING_HOSTS = (0, 1)  # slice 0's hosts; slice 1's (2, 3) are gone
# restored topology -> (processes, devices per process); always one slice
TOPOLOGIES = {"1x2x2": (2, 2), "1x4x1": (4, 1)}
ROWS = {
  "ours_same": (OURS, "1x2x2", False),
  "ours_reshard": (OURS, "1x4x1", False),
  "ours_persistent": (OURS, "1x2x2", True),
  "ours_persistent_4x1": (OURS, "1x4x1", True),
  "p2p_same": (P2P, "1x2x2", False),
  "p2p_reshard": (P2P, "1x4x1", False),
  "p2p_persistent": (P2P, "1x2x2", True),
}
# each row's ratios divide by ours from the persistent tier on its topology
BASELINES = {"1x2x2": "ours_persistent", "1x4x1": "ours_persistent_4x1"}
LABELS = {
  "ours_same": "ours: same slice shape (1 slice x 2 proc x 2 dev), surviving ramdisks",
  "ours_reshard": "ours: another slice shape (1 slice x 4 proc x 1 dev), resharded from ramdisks",
  "ours_persistent": "ours: 1 slice x 2 proc x 2 dev, ramdisks wiped: persistent (baseline)",
  "ours_persistent_4x1": "ours: 1 slice x 4 proc x 1 dev, ramdisks wiped: persistent (baseline)",
  "p2p_same": "Orbax P2P: same slice shape (1 slice x 2 proc x 2 dev), surviving ramdisks",
  "p2p_reshard": "Orbax P2P: another slice shape (1 slice x 4 proc x 1 dev), surviving ramdisks",
  "p2p_persistent": "Orbax P2P: 1 slice x 2 proc x 2 dev, ramdisks wiped: persistent",
}
WORKER = "benchmarks.elastic"
DEFAULT_MIB, DEFAULT_REPS = 256, 3

_T0 = time.monotonic()


def step_of(k: int) -> int:
  """The k-th save's step: the benchmark's (every default interval divides it)."""
  return 1000 * (k + 1)


def progress(msg: str) -> None:
  print(f"[elastic {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- inside the jobs ---------------------------------------------------------
def local_dir(shm_root: str, manager: str, host: int, slot: int) -> str:
  """A process's local directory: ours shares the host's ramdisk folder among
  the processes on it (one subfolder per process inside, the library's
  layout); Orbax P2P keeps steps directly in its directory, so each process
  on a host gets its own (slot = its rank on the host)."""
  base = os.path.join(shm_root, manager, f"host_{host}")
  return base if manager == OURS else os.path.join(base, f"slot_{slot}")


def _layout(topology: str | None, mib: int):
  """The state's layout: the saved 2x2 one, or a one-slice restored one."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  from emergency_ckpt.bench import state as st  # noqa: PLC0415

  if topology is None:
    return st.make_layout("2x2", mib)
  devices = np.array(jax.devices()).reshape(1, -1)
  mesh = Mesh(devices, ("replica", "data"))
  return st.Layout(topology, mesh, 0, 1, st.rows_per_leaf(mib))


def _adapter(args: dict, layout, host: int, slot: int):
  from emergency_ckpt.bench import adapters  # noqa: PLC0415

  name = args["manager"]
  here = local_dir(args["shm_root"], name, host, slot)
  persistent = os.path.join(args["disk_root"], name, "persistent")
  extra = {"host_id": f"sim-host-{host}"} if name == OURS else {}
  return adapters.make(name, layout, here, persistent, **extra)


def save_job(args: dict) -> dict:
  """Saved topology: 2 slices x 2 processes x 2 devices, process i on host i.
  SAVES saves of the benchmark's state, each waited for on both tiers."""
  import jax  # noqa: PLC0415

  from emergency_ckpt.bench import adapters  # noqa: PLC0415
  from emergency_ckpt.bench import state as st  # noqa: PLC0415
  from emergency_ckpt.bench.workers import _finish  # noqa: PLC0415

  me = jax.process_index()
  if args["manager"] != OURS:
    adapters.orbax_prerequisites()
  layout = _layout(None, args["mib"])
  state = st.make_state(layout)
  adapter = _adapter(args, layout, host=me, slot=0)
  adapter.prepare()
  steps = []
  for k in range(SAVES):
    t0 = time.perf_counter()
    if not adapter.save(step_of(k), state):
      raise RuntimeError(f"{args['manager']} did not save step {step_of(k)}")
    adapter.wait_all()
    steps.append({"step": step_of(k), "durable_s": time.perf_counter() - t0})
  adapter.close()
  return _finish(
    {
      "pid": me,
      "slice": layout.slice_index,
      "bytes": st.bytes_per_process(state),
      "saves": steps,
    }
  )


def restart_job(args: dict) -> dict:
  """One restarted job on `args['topology']` (one slice on hosts 0-1): times
  process spawn -> ready -> manager constructed -> restored, ready arrays,
  and checks every addressable shard bit for bit."""
  import jax  # noqa: PLC0415

  from emergency_ckpt.bench import state as st  # noqa: PLC0415
  from emergency_ckpt.bench.workers import SPAWN_ENV, _finish  # noqa: PLC0415

  ready_s = time.time() - float(os.environ[SPAWN_ENV])
  me, n = jax.process_index(), jax.process_count()
  per_host = n // len(SURVIVING_HOSTS)
  host, slot = SURVIVING_HOSTS[me // per_host], me % per_host
  layout = _layout(args["topology"], args["mib"])
  t0 = time.perf_counter()
  adapter = _adapter(args, layout, host, slot)
  t1 = time.perf_counter()
  restored, step, source = adapter.restore()
  jax.block_until_ready(restored)
  t2 = time.perf_counter()
  restored_s = time.time() - float(os.environ[SPAWN_ENV])
  detail = _p2p_detail(adapter) if args["manager"] == P2P else None
  adapter.close()
  bad = st.mismatched_shards(restored, layout)
  shards = sum(len(a.addressable_shards) for a in restored.values())
  return _finish(
    {
      "pid": me,
      "host": host,
      "ready_s": ready_s,
      "construct_s": t1 - t0,
      "restore_call_s": t2 - t1,
      "restore_s": t2 - t0,
      "restored_s": restored_s,
      "after_ready_s": restored_s - ready_s,
      "step": int(step),
      "source": source,
      "mismatched_shards": bad,
      "shards_checked": shards,
      "detail": detail,
    }
  )


def _p2p_detail(adapter) -> dict:
  """What Orbax P2P saw (private attributes, read after the timed restore):
  the newest step its registry finds complete on the new mesh (None sends
  every process to the persistent tier), the process index that wrote this
  process's local directory, and the steps it accepts as its own."""
  m = adapter._m  # noqa: SLF001
  stored, steps = m._local_manager.scan_stored_steps()  # noqa: SLF001
  return {
    "registry_complete_step": m._p2p.get_latest_complete_step(),  # noqa: SLF001
    "local_dir_written_by": stored,
    "local_dir_steps": list(steps),
    "own_local_steps": list(m._local_manager.all_steps()),  # noqa: SLF001
  }


# ---- the driver --------------------------------------------------------------
class Driver:
  """Runs the jobs (launcher.run_job) and keeps the simulated ramdisks."""

  def __init__(self, args: argparse.Namespace, shm_root: str, disk_root: str):
    self.args, self.shm_root, self.disk_root = args, shm_root, disk_root
    self.errors: dict[str, str] = {}
    self.retried: dict[str, str] = {}  # label: why its first attempt failed (Orbax's jobs)
    self.backup = os.path.join(shm_root, "backup")

  def job(self, label: str, target: str, processes: int, devices: int, job_args: dict):
    """(per-process results, None) or (None, error); logs kept on failure."""
    from emergency_ckpt.bench.run import _summarize  # noqa: PLC0415
    from emergency_ckpt.bench.workers import SPAWN_ENV  # noqa: PLC0415
    from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415

    job_dir = os.path.join(self.disk_root, "jobs", label)
    os.makedirs(job_dir, exist_ok=True)
    spawn = repr(time.time())
    res = run_job(
      f"{WORKER}:{target}",
      processes,
      job_args,
      devices_per_process=devices,
      timeout_s=self.args.job_timeout,
      env={i: {SPAWN_ENV: spawn} for i in range(processes)},
      out_dir=job_dir,
    )
    bad = [i for i, rc in enumerate(res.returncodes) if rc != 0]
    if not bad and not res.timed_out and all(r is not None for r in res.results):
      progress(f"{label}: done in {res.wall_s:.1f}s")
      return res.results, None
    error = _summarize(res, bad)
    self.errors[label] = error
    logs = os.path.join(self.args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    for i, text in enumerate(res.logs):
      with open(os.path.join(logs, f"{label}_process_{i}.txt"), "w") as f:
        f.write(text)
    progress(f"{label}: FAILED after {res.wall_s:.1f}s: {error} (logs in {logs})")
    return None, error

  def save(self, manager: str) -> tuple[list | None, str | None]:
    """The save job; then slice 1's hosts are deleted and hosts 0-1 backed up."""
    base = {"mib": self.args.mib_per_replica, "shm_root": self.shm_root}
    job_args = dict(base, disk_root=self.disk_root, manager=manager)
    label = f"{manager}-save"
    got, err = self.job(label, "save_job", SAVED_PROCESSES, SAVED_DEVICES, job_args)
    if got is None and manager != OURS and err.startswith("timed out"):
      # a hang in Orbax's code (as the main benchmark, emergency_ckpt/bench/run.py):
      # once more from empty folders; a hang of ours fails at once
      self.retried[label] = self.errors.pop(label)
      progress(f"{label}: retrying once (a hang in Orbax's code)")
      for root in (self.shm_root, self.disk_root):
        shutil.rmtree(os.path.join(root, manager), ignore_errors=True)
      got, err = self.job(label, "save_job", SAVED_PROCESSES, SAVED_DEVICES, job_args)
    if got is None:
      return None, err
    for host in range(SAVED_PROCESSES):
      src = os.path.join(self.shm_root, manager, f"host_{host}")
      if host in SURVIVING_HOSTS:
        shutil.copytree(src, os.path.join(self.backup, manager, f"host_{host}"), symlinks=True)
      shutil.rmtree(src)  # slice 1 gone for good; 0-1 reset before each job
    return got, None

  def reset(self, manager: str, wipe: bool) -> None:
    """Hosts 0-1's ramdisks as the save job left them (or empty), the
    persistent tier evicted from the page cache."""
    from emergency_ckpt.bench import measure as m  # noqa: PLC0415

    for host in SURVIVING_HOSTS:
      here = os.path.join(self.shm_root, manager, f"host_{host}")
      shutil.rmtree(here, ignore_errors=True)
      if wipe:
        m.reset_dir(here)
      else:
        shutil.copytree(os.path.join(self.backup, manager, f"host_{host}"), here, symlinks=True)
    m.evict_tree(os.path.join(self.disk_root, manager, "persistent"))

  def restart(self, row: str, rep: int) -> tuple[list | None, str | None]:
    manager, topology, wipe = ROWS[row]
    self.reset(manager, wipe)
    processes, devices = TOPOLOGIES[topology]
    job_args = {
      "mib": self.args.mib_per_replica,
      "shm_root": self.shm_root,
      "disk_root": self.disk_root,
      "manager": manager,
      "topology": topology,
    }
    return self.job(f"{row}-{rep}", "restart_job", processes, devices, job_args)


METRICS = {
  "spawn_to_restored_s": "process spawn to restored state",
  "restore_s": "manager construction + restore() to ready arrays",
  "restore_call_s": "restore() call to ready arrays",
  "ready_s": "process spawn to jax.distributed ready",
  "after_ready_s": "jax.distributed ready to restored state (manager import included)",
}


def row_figures(jobs: list[tuple[int, list[dict]]], expected_step: int) -> dict:
  """Per job: the slowest process's time (the job is restored when its last
  process is); over jobs: median, min, max. `jobs`: (rep, per-process results)."""
  out: dict = {"reps": [rep for rep, _ in jobs]}
  for key in METRICS:
    src = "restored_s" if key == "spawn_to_restored_s" else key
    out[key] = measure.spread([max(p[src] for p in job) for _, job in jobs])
  out["steps"] = sorted({p["step"] for _, job in jobs for p in job})
  out["sources"] = [sorted(p["source"] for p in job) for _, job in jobs]
  out["mismatched_shards"] = sum(p["mismatched_shards"] for _, job in jobs for p in job)
  out["shards_checked"] = sum(p["shards_checked"] for _, job in jobs for p in job)
  out["bit_exact"] = bool(jobs) and out["mismatched_shards"] == 0
  out["newest_step"] = bool(jobs) and out["steps"] == [expected_step]
  return out


def ratios(rows: dict, per_rep: dict[str, dict[int, list[dict]]]) -> dict:
  """Each row against the baseline of its topology (BASELINES) in the same
  round (interleaved jobs, so the machine's drift cancels): per-round
  ratios' median and spread, for spawn-to-restored and for manager
  construction + restore()."""
  out = {}
  for row in rows:
    base = per_rep.get(BASELINES[ROWS[row][1]], {})
    mine = per_rep.get(row, {})
    out[row] = {}
    for key, src in (("spawn_to_restored_s", "restored_s"), ("restore_s", "restore_s")):
      xs = [
        max(p[src] for p in mine[r]) / max(p[src] for p in base[r])
        for r in sorted(mine)
        if r in base
      ]
      out[row][key] = measure.spread(xs)
  return out


def _counts(sources) -> str:
  """'local x3, peer x1' for one job's per-process sources."""
  got: dict[str, int] = {}
  for src in sources:
    got[src] = got.get(src, 0) + 1
  return ", ".join(f"{k} x{v}" for k, v in sorted(got.items()))


def markdown(doc: dict) -> str:
  """The results table (written to results.md and printed)."""
  cfg = doc["config"]
  lines = [
    f"# Restore onto fewer slices: {cfg['mib_per_replica']} MiB per replica,"
    f" {cfg['reps']} round(s), {cfg['cpus']} CPUs, started {cfg['started_at']}"
    f" (load average {cfg.get('loadavg_start')} at start, {cfg.get('loadavg_end')} at end)",
    "",
    f"Saved: {SAVED_SLICES} slices x {SAVED_PROCESSES // SAVED_SLICES} processes x"
    f" {SAVED_DEVICES} CPU devices, steps {', '.join(str(step_of(k)) for k in range(SAVES))}"
    " (both tiers). Slice 1's hosts then gone for good; every job restarts on hosts 0-1."
    " Times: the slowest process of each job; median [min-max] over rounds. Ratios: to"
    " ours from the persistent tier on the same topology in the same round (`ours_persistent`,"
    " `ours_persistent_4x1`), median [min-max] of the per-round ratios.",
    "",
    "| row | spawn to restored | vs baseline | ready to restored | construct + restore()"
    " | vs baseline | restore() call | step | source (per process) | bit-exact |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]

  def cell(s: dict) -> str:
    if s["median"] is None:
      return "-"
    return f"{s['median']:.3f} s [{s['min']:.3f}-{s['max']:.3f}]"

  def xcell(s: dict) -> str:
    if s["median"] is None:
      return "-"
    return f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"

  for row, fig in doc["rows"].items():
    label = f"`{row}`: {LABELS[row]}"
    if fig.get("error"):
      lines.append(f"| {label} | did not run: {fig['error']} | | | | | | | | |")
      continue
    r = doc["ratios"][row]
    # Orbax P2P's adapter labels say "(slice 0 reads) + broadcast", true of
    # its multi-slice persistent path; on one slice every process reads its
    # own shards, so the table keeps the first word (JSON: the full label).
    sources = sorted({_counts(s.split(" (")[0] for s in srcs) for srcs in fig["sources"]})
    exact = "yes" if fig["bit_exact"] else f"NO ({fig['mismatched_shards']} shards)"
    lines.append(
      f"| {label} | {cell(fig['spawn_to_restored_s'])} | {xcell(r['spawn_to_restored_s'])}"
      f" | {cell(fig['after_ready_s'])} | {cell(fig['restore_s'])} | {xcell(r['restore_s'])} | {cell(fig['restore_call_s'])}"
      f" | {', '.join(map(str, fig['steps']))} | {'; '.join(sources)} | {exact} |"
    )
  if doc["errors"]:
    lines += ["", "Failed jobs:", ""]
    lines += [f"- `{k}`: {v}" for k, v in doc["errors"].items()]
  if doc.get("retried"):
    lines += ["", "Run twice (the first attempt hung in Orbax's code):", ""]
    lines += [f"- `{k}`: {v}" for k, v in doc["retried"].items()]
  for note in [*doc.get("notes", []), start_note()]:
    if note:
      lines += ["", note]
  return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m benchmarks.elastic", description=__doc__.split("\n")[0]
  )
  p.add_argument("--mib-per-replica", type=int, default=DEFAULT_MIB, help=f"default {DEFAULT_MIB}")
  p.add_argument("--reps", type=int, default=DEFAULT_REPS, help=f"rounds, default {DEFAULT_REPS}")
  p.add_argument("--out", default="bench_elastic", help="output folder (default bench_elastic/)")
  p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of the rows")
  p.add_argument("--shm-root", default="/dev/shm", help="where the simulated ramdisks go")
  p.add_argument("--persistent-root", default="/tmp", help="where persistent dirs go (local disk)")
  p.add_argument("--job-timeout", type=float, default=None, help="seconds per job (default scaled)")
  p.add_argument("--keep", action="store_true", help="keep the ramdisk and persistent dirs")
  args = p.parse_args(argv)
  args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
  unknown = set(args.rows) - set(ROWS)
  if unknown:
    p.error(f"unknown rows {sorted(unknown)}; choose from {list(ROWS)}")
  missing = {BASELINES[ROWS[r][1]] for r in args.rows} - set(args.rows)
  if missing:
    p.error(f"the rows must include their baselines {sorted(missing)}")
  if args.reps < 1:
    p.error("--reps must be >= 1")
  from emergency_ckpt.bench.state import rows_per_leaf  # noqa: PLC0415

  try:
    rows_per_leaf(args.mib_per_replica)
  except ValueError as e:
    p.error(str(e))
  args.job_timeout = args.job_timeout or 150 + 0.3 * args.mib_per_replica
  return args


def _loadavg() -> list[float] | None:
  """The machine's 1/5/15-minute load averages (others' jobs share it)."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def main(argv=None) -> int:
  """Runs the benchmark; 0 when every row of ours ran, restored the newest
  step and was bit-exact (Orbax's rows are reported, whatever they do)."""
  from emergency_ckpt.bench.run import _versions  # noqa: PLC0415

  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  shm_root = tempfile.mkdtemp(prefix="ecbench-elastic-", dir=args.shm_root)
  disk_root = tempfile.mkdtemp(prefix="ecbench-elastic-", dir=args.persistent_root)
  driver = Driver(args, shm_root, disk_root)
  precompiled = measure.precompile()
  load_start = _loadavg()
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  progress(f"{args.mib_per_replica} MiB per replica, {args.reps} round(s), rows {args.rows}")
  saves: dict[str, list | None] = {}
  per_rep: dict[str, dict[int, list[dict]]] = {row: {} for row in args.rows}
  row_errors: dict[str, list[str]] = {row: [] for row in args.rows}
  try:
    for manager in (OURS, P2P):
      if any(ROWS[r][0] == manager for r in args.rows):
        saves[manager], err = driver.save(manager)
        if err:
          for row in args.rows:
            if ROWS[row][0] == manager:
              row_errors[row].append(f"save job failed: {err}")
    for rep in range(args.reps):
      for row in args.rows:
        if saves.get(ROWS[row][0]) is None:
          continue
        got, err = driver.restart(row, rep)
        if got is None:
          row_errors[row].append(err)
        else:
          per_rep[row][rep] = got
  finally:
    if not args.keep:
      shutil.rmtree(shm_root, ignore_errors=True)
      shutil.rmtree(disk_root, ignore_errors=True)

  expected = step_of(SAVES - 1)
  rows: dict[str, dict] = {}
  for row in args.rows:
    fig = row_figures(sorted(per_rep[row].items()), expected)
    manager, topology, wipe = ROWS[row]
    fig.update(manager=manager, topology=topology, ramdisks_wiped=wipe, label=LABELS[row])
    if not per_rep[row]:
      fig["error"] = row_errors[row][0] if row_errors[row] else "no job ran"
    fig["job_errors"] = row_errors[row]
    rows[row] = fig
  doc = {
    "config": {
      "mib_per_replica": args.mib_per_replica,
      "reps": args.reps,
      "saved": {
        "slices": SAVED_SLICES,
        "processes": SAVED_PROCESSES,
        "devices_per_process": SAVED_DEVICES,
        "steps": [step_of(k) for k in range(SAVES)],
      },
      "restored": {
        t: {"slices": 1, "processes": p, "devices_per_process": d}
        for t, (p, d) in TOPOLOGIES.items()
      },
      "expected_step": expected,
      "baselines": BASELINES,
      "precompiled": precompiled,
      "loadavg_start": load_start,
      "cpus": os.cpu_count(),
      "versions": _versions(),
      "started_at": started,
      "wall_s": time.monotonic() - _T0,
      "loadavg_end": _loadavg(),
    },
    "metrics": METRICS,
    "saves": saves,
    "rows": rows,
    "ratios": ratios(rows, per_rep),
    "per_rep": {row: {str(k): v for k, v in reps.items()} for row, reps in per_rep.items()},
    "errors": driver.errors,
    "retried": driver.retried,
  }
  json_path = os.path.join(args.out, "results.json")
  md_path = os.path.join(args.out, "results.md")
  with open(json_path, "w") as f:
    json.dump(doc, f, indent=1)
  table = markdown(doc)
  with open(md_path, "w") as f:
    f.write(table)
  print(table)
  progress(f"wrote {json_path} and {md_path}")
  ours_ok = all(
    not rows[r].get("error") and rows[r]["bit_exact"] and rows[r]["newest_step"]
    for r in args.rows
    if ROWS[r][0] == OURS
  )
  return 0 if ours_ok else 1


if __name__ == "__main__":
  sys.exit(main())
