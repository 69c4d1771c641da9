"""Scale benchmark stage: real jax.distributed jobs, latest_step() and a peer restore.

  python -m benchmarks.scale_real [--processes 16,64] [--total-mib 64]
                                            [--per-slice 4] [--wipe 2] [--out FILE]

For each process count N, two real jobs of N processes (one CPU device each,
launched by emergency_ckpt.demo.launcher on this machine), mesh
(replica=slices, data=N/slices), default 4 processes per slice (16 = 4 slices
x 4, 64 = 16 x 4):

  save job     every process saves step 1 to its simulated host's ramdisk
               (<shm_root>/n<N>/host_<i>; the process's host identity is
               "sim-host-<i>", as every process of a real job of this shape
               runs on a host of its own) with the persistent tier on
               <root>/n<N>/persistent (interval 1: the primary slice uploads
               step 1 too), then waits until it is durable.
  restart job  the processes of the last `wipe_slices` slices come up with an
               empty ramdisk (their folder removed before any manager exists);
               every process imports Orbax (timed apart: the manager imports it
               lazily, a per-process CPU cost), builds a manager, then, each
               started on every process at one instant (bench.sync.
               start_together: a barrier, then a sleep until a time process 0
               publishes, since a barrier alone lets process 0 go last, up to
               94 ms after the first at 64 processes on 2 cores, and the
               first timed their wait for it; `start_late_s`: how late each
               process woke past that instant), calls latest_step()
               (1 + `latest_reps` times: the first is what a restart pays,
               `latest_step_again_s` the median of the others) and restore():
               the intact slices read their own ramdisk, the wiped ones receive
               the step from peer slices. Each process times its own call,
               then waits at one more barrier (untimed) before it checks the
               restored values, closes its manager and exits: without it, the
               processes that finished first did that work while the others
               still restored, and on this machine's few cores it delayed
               them (a per-phase trace of the 64-process job, 2026-11-27:
               the slowest restore() ended 1.98 and 2.15 s after the start
               without it, 1.12 and 1.13 s with it). The library's own
               background work after restore() (Orbax's set-up, the next
               save's staging buffer) still runs beside the slower restores.

The total bytes are the same at every N: `total_mib` is what the whole job
holds (every slice's copy of the state, summed over processes), so the state
is total/slices bytes and each process holds total/N. Restored values are
compared bit-for-bit with what was saved (not timed).

Per N: the max over processes of each call's wall time (what the job waits
for) and the median; the same for the Orbax import and the manager's
construction; the two jobs' wall times (spawn to exit); where each process
restored from. `ratio_<last>_<first>`: each figure at the largest N over
the smallest. With `job_reps` R > 1 the sizes run R times in turn (N1, N2,
N1, N2, ...: every pair under the same conditions), each figure is the
median over the R reps (`reps_max`: every rep's max), and each ratio the
median of the R per-rep ratios (`reps`: each one, of the max): the spread
between runs minutes apart on a shared machine (4.2x-6.2x for one figure
in four runs of one rep) is wider than a target's margin.

The worker functions live here (not in tests/) so that an installed wheel can
run the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from emergency_ckpt.demo import launcher

PROCESSES_PER_SLICE = 4
DEFAULT_PROCESS_COUNTS = (16, 64)
DEFAULT_TOTAL_MIB = 64.0
DEFAULT_WIPE_SLICES = 2
STEP = 1
COLUMNS = 256  # float32 columns of the state's one large leaf
TIMED = ("manager_init_s", "latest_step_s", "latest_step_again_s", "restore_s")
# CPU seconds of the process (all its threads) in the first latest_step() and
# in restore(): what each process spends, apart from waiting for the others
CPU = ("latest_step_cpu_s", "restore_cpu_s")
WORKERS = "benchmarks.scale_real"  # by name: `python -m` runs this file as __main__


# ---- inside the jobs ---------------------------------------------------------
def _mesh(slices: int):
  import jax  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  return Mesh(np.array(jax.devices()).reshape(slices, -1), ("replica", "data"))


def _host_dir(args: dict) -> str:
  import jax  # noqa: PLC0415

  return os.path.join(args["shm_root"], f"host_{jax.process_index()}")


def _options(args: dict):
  import jax  # noqa: PLC0415

  import emergency_ckpt as ec  # noqa: PLC0415

  return ec.CheckpointManagerOptions(
    host_id=f"sim-host-{jax.process_index()}",
    local=ec.LocalTierOptions(directory=_host_dir(args), save_interval_steps=1, max_to_keep=2),
    persistent=ec.PersistentTierOptions(
      directory=args["persistent"], save_interval_steps=1, max_to_keep=2
    ),
    replica_axis="replica",
    run_id="scale-real",
    collective_timeout_s=args["collective_timeout_s"],
    state_commit_timeout_s=args["collective_timeout_s"],
  )


def _values(rows: int) -> np.ndarray:
  """The global value of the large leaf: every 32-bit pattern distinct-ish
  (NaN payloads, denormals, -0.0 included), as float32."""
  bits = np.arange(rows * COLUMNS, dtype=np.uint64) * np.uint64(2654435761)
  return (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32).reshape(rows, COLUMNS).view(np.float32)


def _shardings(mesh):
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  return {"w": NamedSharding(mesh, P("data", None)), "count": NamedSharding(mesh, P())}


def _state(mesh, rows: int) -> dict:
  import jax  # noqa: PLC0415

  w = _values(rows)
  count = np.asarray(STEP * 7 + 1, dtype=np.int32)
  sh = _shardings(mesh)
  return {
    "w": jax.make_array_from_callback(w.shape, sh["w"], lambda idx: w[idx]),
    "count": jax.make_array_from_callback((), sh["count"], lambda idx: count[idx]),
  }


def _abstract(mesh, rows: int) -> dict:
  import jax  # noqa: PLC0415

  sh = _shardings(mesh)
  return {
    "w": jax.ShapeDtypeStruct((rows, COLUMNS), np.float32, sharding=sh["w"]),
    "count": jax.ShapeDtypeStruct((), np.int32, sharding=sh["count"]),
  }


def _bit_exact(state: dict, rows: int) -> bool:
  want = {"w": _values(rows), "count": np.asarray(STEP * 7 + 1, dtype=np.int32)}
  for name, arr in state.items():
    for shard in arr.addressable_shards:
      got = np.asarray(shard.data)
      exp = want[name][shard.index]
      if got.dtype != exp.dtype or got.tobytes() != exp.tobytes():
        return False
  return True


def _data_state() -> dict:
  import jax  # noqa: PLC0415

  return {"pos": STEP * 1000 + jax.process_index(), "tag": f"p{jax.process_index()}"}


def save_worker(args: dict) -> dict:
  """Job 1, every process: saves step 1 on both tiers and waits."""
  import emergency_ckpt as ec  # noqa: PLC0415

  t0 = time.monotonic()
  mesh = _mesh(args["slices"])
  with ec.CheckpointManager(_options(args), mesh=mesh) as mngr:
    saved = mngr.save(STEP, _state(mesh, args["rows"]), data_state=_data_state())
    mngr.wait_until_finished()
    slice_index = mngr.topology.slice_index
  return {"saved": bool(saved), "slice": slice_index, "elapsed_s": time.monotonic() - t0}


def restart_worker(args: dict) -> dict:
  """Job 2, every process: wipes its ramdisk if its slice is among
  args['wipe'], then times the Orbax import, the manager's construction,
  latest_step() (1 + args['latest_reps'] times) and restore(), each started
  on every process at one instant (bench.sync.start_together)."""
  import emergency_ckpt as ec  # noqa: PLC0415
  from emergency_ckpt.bench.sync import barrier, start_together  # noqa: PLC0415
  from emergency_ckpt.cluster.topology import topology_from_mesh  # noqa: PLC0415

  mesh = _mesh(args["slices"])
  slice_index = topology_from_mesh(mesh, "replica").slice_index
  if slice_index in args["wipe"]:
    shutil.rmtree(_host_dir(args), ignore_errors=True)  # a replaced host
  abstract = _abstract(mesh, args["rows"])
  t = time.monotonic()
  import orbax.checkpoint  # noqa: F401, PLC0415 - the manager imports it: time it apart

  out: dict[str, Any] = {"slice": slice_index, "import_orbax_s": time.monotonic() - t}
  barrier("scale-real-ready")
  t = time.monotonic()
  mngr = ec.CheckpointManager(_options(args), mesh=mesh)
  out["manager_init_s"] = time.monotonic() - t
  try:
    again, cpu, late = [], [], []
    for rep in range(1 + args["latest_reps"]):
      late.append(start_together(f"scale-real-latest-{rep}"))
      t, c = time.monotonic(), time.process_time()
      latest = mngr.latest_step()
      again.append(time.monotonic() - t)
      cpu.append(time.process_time() - c)
    out["latest_step_cpu_s"] = cpu[0]
    out["latest_step_s"] = again[0]
    out["latest_step_again_s"] = statistics.median(again[1:]) if again[1:] else again[0]
    late.append(start_together("scale-real-restore"))
    out["start_late_s"] = max(late)
    t, c = time.monotonic(), time.process_time()
    r = mngr.restore(abstract)
    out["restore_s"] = time.monotonic() - t
    out["restore_cpu_s"] = time.process_time() - c
    # Untimed: nobody checks, closes or exits while others still restore
    # (on 2 cores that work delayed the last restores: module docstring).
    barrier("scale-real-restored")
    out.update(
      latest=latest,
      step=r.step,
      source=r.source,
      data_state_ok=r.data_state == _data_state(),
      bit_exact=_bit_exact(r.state, args["rows"]),
    )
  finally:
    mngr.close()
  return out


# ---- the driver --------------------------------------------------------------
def _summary(values: Sequence[float]) -> dict[str, float]:
  return {"max": max(values), "median": statistics.median(values)}


def _progress(msg: str) -> None:
  print(f"scale_real: {msg}", file=sys.stderr, flush=True)


def measure_one(
  n: int,
  *,
  slices: int,
  total_bytes: int,
  wipe_slices: int,
  root: str,
  shm_root: str,
  timeout_s: float,
  collective_timeout_s: float,
  latest_reps: int,
) -> dict[str, Any]:
  """Both jobs at `n` processes (see the module docstring); the figures."""
  if n % slices or slices <= wipe_slices:
    raise ValueError(f"{n} processes in {slices} slices, {wipe_slices} wiped: not a valid job")
  per_slice = n // slices
  state_bytes = total_bytes // slices
  rows = max(per_slice, state_bytes // (4 * COLUMNS) // per_slice * per_slice)
  wipe = list(range(slices - wipe_slices, slices))
  args = {
    "slices": slices,
    "rows": rows,
    "wipe": wipe,
    "shm_root": os.path.join(shm_root, f"n{n}"),
    "persistent": os.path.join(root, f"n{n}", "persistent"),
    "collective_timeout_s": collective_timeout_s,
    "latest_reps": latest_reps,
  }
  try:
    _progress(f"{n} processes: save job")
    save = launcher.run_job(
      f"{WORKERS}:save_worker", n, args, devices_per_process=1, timeout_s=timeout_s
    )
    saved = save.check()
    if not all(r["saved"] for r in saved):
      raise AssertionError(f"step {STEP} not saved everywhere: {saved}")
    _progress(f"{n} processes: restart job (slices {wipe} wiped)")
    restart = launcher.run_job(
      f"{WORKERS}:restart_worker", n, args, devices_per_process=1, timeout_s=timeout_s
    )
    recs = restart.check()
  finally:
    shutil.rmtree(args["shm_root"], ignore_errors=True)
    shutil.rmtree(os.path.dirname(args["persistent"]), ignore_errors=True)
  bad = [
    i
    for i, r in enumerate(recs)
    if r["step"] != STEP
    or r["latest"] != STEP
    or not r["bit_exact"]
    or not r["data_state_ok"]
    or r["source"] != ("peer" if r["slice"] in wipe else "local")
  ]
  if bad:
    raise AssertionError(f"restore wrong on processes {bad}: {[recs[i] for i in bad]}")
  sources: dict[str, int] = {}
  for r in recs:
    sources[r["source"]] = sources.get(r["source"], 0) + 1
  out: dict[str, Any] = {
    "processes": n,
    "slices": slices,
    "processes_per_slice": per_slice,
    "wiped_slices": wipe,
    "total_bytes": rows * COLUMNS * 4 * slices,
    "bytes_per_process": rows * COLUMNS * 4 // per_slice,
    "restored_step": STEP,
    "sources": dict(sorted(sources.items())),
    "bit_exact": True,
    "save_job_wall_s": save.wall_s,
    "restart_job_wall_s": restart.wall_s,
  }
  for key in ("import_orbax_s", "start_late_s", *TIMED, *CPU):
    out[key] = _summary([r[key] for r in recs])
  return out


def measure_real_jobs(
  process_counts: Sequence[int] = DEFAULT_PROCESS_COUNTS,
  *,
  total_mib: float = DEFAULT_TOTAL_MIB,
  slices_of: dict[int, int] | None = None,
  wipe_slices: int = DEFAULT_WIPE_SLICES,
  root: str | None = None,
  shm_root: str | None = None,
  timeout_s: float = 600,
  collective_timeout_s: float = 300,
  latest_reps: int = 3,
  job_reps: int = 1,
) -> dict[str, Any]:
  """For each process count, a real job saves a step and a second one (with
  `wipe_slices` slices' ramdisks wiped) times latest_step() and restore() on
  every process (see the module docstring). `total_mib`: the whole job's
  bytes, the same at every count; `slices_of[n]`: slices at n processes
  (default n / 4); `root`: the persistent tier's folder (default: a fresh
  temporary one); `shm_root`: the simulated ramdisks' (default: a fresh one
  on /dev/shm); `latest_reps`: latest_step() calls after the first;
  `job_reps`: how many times every size runs, in turn (figures: medians
  over reps; see the module docstring). Returns {"<n>": figures, ...,
  "ratio_<last>_<first>": {figure: {"max": ..., "median": ..., "reps":
  [...]}}}, JSON-able."""
  from emergency_ckpt.bench import measure  # noqa: PLC0415

  precompiled = measure.precompile()  # the jobs import bytecode, as from a wheel
  counts = list(process_counts)
  made = []
  if root is None:
    root = tempfile.mkdtemp(prefix="ec-scale-real-")
    made.append(root)
  if shm_root is None:
    shm_root = tempfile.mkdtemp(
      prefix="ec-scale-real-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    made.append(shm_root)
  total_bytes = int(total_mib * 2**20)
  per: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
  try:
    for rep in range(job_reps):
      for n in counts:
        if job_reps > 1:
          _progress(f"{n} processes: rep {rep + 1} of {job_reps}")
        slices = (slices_of or {}).get(n, max(1, n // PROCESSES_PER_SLICE))
        per[n].append(
          measure_one(
            n,
            slices=slices,
            total_bytes=total_bytes,
            wipe_slices=wipe_slices,
            root=root,
            shm_root=shm_root,
            timeout_s=timeout_s,
            collective_timeout_s=collective_timeout_s,
            latest_reps=latest_reps,
          )
        )
  finally:
    for path in made:
      shutil.rmtree(path, ignore_errors=True)
  out: dict[str, Any] = {str(n): _over_reps(per[n]) for n in counts}
  for n in counts:
    out[str(n)]["precompiled"] = precompiled
  if len(counts) > 1:
    lo, hi = per[counts[0]], per[counts[-1]]
    ratios: dict[str, Any] = {}
    for key in (*TIMED, *CPU):
      each = {
        s: [h[key][s] / q[key][s] if q[key][s] > 0 else None for h, q in zip(hi, lo)]
        for s in ("max", "median")
      }
      ratios[key] = {s: _median_of(v) for s, v in each.items()} | {"reps": each["max"]}
    out[f"ratio_{counts[-1]}_{counts[0]}"] = ratios
  return out


def _median_of(values: list[float | None]) -> float | None:
  """The median of the values that are not None (None if there are none)."""
  known = [v for v in values if v is not None]
  return statistics.median(known) if known else None


def _over_reps(reps: list[dict[str, Any]]) -> dict[str, Any]:
  """One size's figures over its reps: each timed figure's max and median
  are the medians over reps, `reps_max` every rep's max; the rest from
  the first rep (the same in every rep: each is checked in measure_one)."""
  out = dict(reps[0])
  out["reps"] = len(reps)
  for key in ("import_orbax_s", "start_late_s", *TIMED, *CPU):
    out[key] = {
      "max": statistics.median(r[key]["max"] for r in reps),
      "median": statistics.median(r[key]["median"] for r in reps),
      "reps_max": [r[key]["max"] for r in reps],
    }
  for key in ("save_job_wall_s", "restart_job_wall_s"):
    out[key] = statistics.median(r[key] for r in reps)
  return out


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--processes", default=",".join(map(str, DEFAULT_PROCESS_COUNTS)))
  p.add_argument("--total-mib", type=float, default=DEFAULT_TOTAL_MIB)
  p.add_argument("--per-slice", type=int, default=PROCESSES_PER_SLICE)
  p.add_argument("--wipe", type=int, default=DEFAULT_WIPE_SLICES)
  p.add_argument("--reps", type=int, default=1, help="runs of every size, in turn")
  p.add_argument("--out", help="also write the JSON here")
  a = p.parse_args(argv)
  counts = [int(x) for x in a.processes.split(",") if x]
  got = measure_real_jobs(
    counts,
    total_mib=a.total_mib,
    slices_of={n: max(1, n // a.per_slice) for n in counts},
    wipe_slices=a.wipe,
    job_reps=a.reps,
  )
  text = json.dumps(got, indent=2)
  print(text)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
