"""Benchmark: a persistent restore read once per job (issue 17), against every
process reading its own shards.

  python -m benchmarks.shared_read --out DIR [--mib-per-replica N]
      [--reps K] [--slices S] [--processes-per-slice P] [--readers 1,2]
  (or `emergency-ckpt bench --shared-read`)

A real fake-gcs-server (in memory) holds the persistent tier, behind the
recording proxy (tests.harness.gcs_proxy) that counts every byte
the jobs read from the bucket. One save job (S slices x P processes x 2 CPU
devices, jax.distributed) saves one step to both tiers. Then one restore job
on the same topology runs, K times after one untimed warm-up round, every
mode in a rotated order (interleaved, so drift hits every mode alike), each
with every ramdisk wiped (so every slice restores from the persistent tier)
and a fresh manager:

  per_process   persistent.shared_read false: each process reads its own
                shards (every slice reads the whole model)
  readers_R     persistent.shared_read true, shared_read_slices R: slices
                0..R-1 each read about 1/R of the shards, the rest of the
                job receives them over the stream transport (R = S: the
                split; R = 1: one slice reads all and serves the others)

Per mode and round: the restore() call's time on the slowest process (the
job restores when its last process does), the bytes the proxy relayed from
the bucket from manager construction to the last process's return (process 0
reads the proxy's counter between barriers), whether any process fell back
to its own read, and every restored shard checked bit for bit. Ratios are
the median over rounds of each round's mode / per_process. Writes
OUT/results.json and OUT/results.md, with the load average before and after.

Called by: the CLI (`emergency-ckpt bench --shared-read`, cli/bench.py),
tests/test_bench_shared_read.py; `save_job` and `restore_job` run inside
launcher.run_job's processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys
import tempfile
import time

from emergency_ckpt.bench import measure

WORKER = "benchmarks.shared_read"
STEP = 1000
DEVICES_PER_PROCESS = 2
DEFAULT_MIB, DEFAULT_REPS = 64, 3
PER_PROCESS = "per_process"
FELL_BACK = "shared read of persistent step"  # the restorer's warning on a fallback

_T0 = time.monotonic()


def progress(msg: str) -> None:
  print(f"[shared-read {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def mode_name(readers: int | None) -> str:
  return PER_PROCESS if readers is None else f"readers_{readers}"


# ---- inside the jobs ---------------------------------------------------------
def _layout(args: dict):
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  from emergency_ckpt.bench import state as st  # noqa: PLC0415

  slices = args["slices"]
  devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
  mesh = Mesh(devices.reshape(slices, -1), ("replica", "data"))
  me = jax.process_index()
  mine = [s for s in range(slices) if any(d.process_index == me for d in mesh.devices[s])]
  return st.Layout(f"{slices}-slices", mesh, mine[0], slices, st.rows_per_leaf(args["mib"]))


def _manager(args: dict, layout, readers: int | None = None):
  import jax  # noqa: PLC0415

  import emergency_ckpt as ec  # noqa: PLC0415

  me = jax.process_index()
  local = os.path.join(args["shm_root"], f"host_{me}")
  os.makedirs(local, mode=0o700, exist_ok=True)
  options = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=local),
    persistent=ec.PersistentTierOptions(
      directory=args["persistent"],
      shared_read=readers is not None,
      shared_read_slices=readers,
    ),
    host_id=f"sim-host-{me}",
    run_id="shared-read-bench",
  )
  return ec.CheckpointManager(options, mesh=layout.mesh)


def save_job(args: dict) -> dict:
  """Saves STEP to both tiers and waits until it is durable."""
  import jax  # noqa: PLC0415

  from emergency_ckpt.bench import state as st  # noqa: PLC0415
  from emergency_ckpt.bench.workers import _finish  # noqa: PLC0415

  layout = _layout(args)
  state = st.make_state(layout)
  t0 = time.perf_counter()
  with _manager(args, layout) as m:
    if not m.save(STEP, state, data_state={"step": STEP}):
      raise RuntimeError(f"step {STEP} was not saved")
    m.wait_until_finished()
  return _finish(
    {
      "pid": jax.process_index(),
      "bytes": st.bytes_per_process(state),
      "durable_s": time.perf_counter() - t0,
    }
  )


class _Warnings(logging.Handler):
  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    self.messages.append(record.getMessage())


def restore_job(args: dict) -> dict:
  """Every round, every mode (rotated order): ramdisk wiped, a fresh manager,
  restore() timed; process 0 reads the proxy's byte counter between barriers."""
  import jax  # noqa: PLC0415

  from emergency_ckpt.bench import state as st  # noqa: PLC0415
  from emergency_ckpt.bench.sync import barrier  # noqa: PLC0415
  from emergency_ckpt.bench.workers import _finish  # noqa: PLC0415
  from tests.harness.gcs_proxy import ProxyClient  # noqa: PLC0415

  me = jax.process_index()
  proxy = ProxyClient.from_env() if me == 0 else None
  layout = _layout(args)
  warnings = _Warnings()
  logging.getLogger("emergency_ckpt").addHandler(warnings)
  modes: list[int | None] = [None] + list(args["readers"])
  samples = []
  for rnd in range(-1, args["reps"]):  # round -1: warm-up, not reported
    shift = max(rnd, 0) % len(modes)
    for readers in modes[shift:] + modes[:shift]:
      shutil.rmtree(os.path.join(args["shm_root"], f"host_{me}"), ignore_errors=True)
      warnings.messages.clear()
      barrier("wiped")
      before = proxy.stats()["bytes_down"] if proxy else 0
      barrier("counted")
      t0 = time.perf_counter()
      with _manager(args, layout, readers) as m:
        t1 = time.perf_counter()
        r = m.restore(layout.abstract)
        jax.block_until_ready(r.state)
        t2 = time.perf_counter()
        barrier("restored")
        after = proxy.stats()["bytes_down"] if proxy else 0
      samples.append(
        {
          "round": rnd,
          "mode": mode_name(readers),
          "construct_s": t1 - t0,
          "restore_s": t2 - t1,
          "bytes_down": after - before if proxy else None,
          "step": int(r.step),
          "source": r.source,
          "fell_back": any(FELL_BACK in w for w in warnings.messages),
          "mismatched_shards": st.mismatched_shards(r.state, layout),
          "shards_checked": sum(len(a.addressable_shards) for a in r.state.values()),
        }
      )
      del r
  return _finish({"pid": me, "slice": layout.slice_index, "samples": samples})


# ---- the driver --------------------------------------------------------------
def _load() -> str:
  try:
    with open("/proc/loadavg") as f:
      return " ".join(f.read().split()[:3])
  except OSError:
    return "unknown"


def summarize(jobs: list[dict], model_bytes: int, modes: list[str]) -> dict:
  """Per mode: restore time (slowest process per round), bytes from the
  bucket and their ratio to the model, the per-round ratios to per_process,
  and whether every restore was bit-exact from the persistent tier."""
  rounds = sorted({s["round"] for job in jobs for s in job["samples"] if s["round"] >= 0})
  by = {}  # (round, mode) -> the processes' samples
  for job in jobs:
    for s in job["samples"]:
      if s["round"] >= 0:
        by.setdefault((s["round"], s["mode"]), []).append(s)
  out = {}
  for mode in modes:
    times = [max(s["restore_s"] for s in by[(r, mode)]) for r in rounds]
    nbytes = [
      next(s["bytes_down"] for s in by[(r, mode)] if s["bytes_down"] is not None) for r in rounds
    ]
    base_t = [max(s["restore_s"] for s in by[(r, PER_PROCESS)]) for r in rounds]
    samples = [s for r in rounds for s in by[(r, mode)]]
    out[mode] = {
      "restore_s": measure.spread(times),
      "bytes_down": measure.spread(nbytes),
      "bytes_vs_model": measure.spread([b / model_bytes for b in nbytes]),
      "time_vs_per_process": measure.spread([t / b for t, b in zip(times, base_t)]),
      "bit_exact": all(s["mismatched_shards"] == 0 for s in samples),
      "shards_checked": sum(s["shards_checked"] for s in samples),
      "sources": sorted({s["source"] for s in samples}),
      "steps": sorted({s["step"] for s in samples}),
      "fell_back": sum(s["fell_back"] for s in samples),
    }
  return out


LABELS = {
  PER_PROCESS: "per-process read (every slice reads the model)",
}


def _label(mode: str, slices: int) -> str:
  if mode in LABELS:
    return LABELS[mode]
  r = int(mode.split("_")[1])
  if r == slices:
    return f"shared read, split: each of {slices} slices reads 1/{slices}"
  if r == 1:
    return "shared read, one reader: slice 0 reads all, serves the others"
  return f"shared read, {r} of {slices} slices read 1/{r} each"


def markdown(doc: dict) -> str:
  c = doc["config"]
  lines = [
    f"# Shared persistent read: {c['slices']} slices x {c['processes_per_slice']} processes x"
    f" {DEVICES_PER_PROCESS} devices, {c['mib_per_replica']} MiB per replica",
    "",
    f"{doc['started']}, {c['reps']} rounds (+1 warm-up), modes interleaved in one job;"
    f" load average before {doc['load_before']}, after {doc['load_after']};"
    f" wall {doc['wall_s']:.0f} s. Model {c['model_bytes']} bytes. Time: restore() on the"
    " slowest process; bytes: relayed from fake-gcs-server by the proxy per restore"
    " (metadata, state JSON and listings included). Ratios: median of per-round ratios.",
    "",
    "| mode | restore s (median, min-max) | time / per-process | bytes from bucket |"
    " bytes / model | bit-exact | fell back |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for mode, row in doc["rows"].items():
    t, ratio, b, bm = (
      row["restore_s"],
      row["time_vs_per_process"],
      row["bytes_down"],
      row["bytes_vs_model"],
    )
    lines.append(
      f"| `{mode}`: {_label(mode, c['slices'])} | {t['median']:.3f} ({t['min']:.3f}-"
      f"{t['max']:.3f}) | {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}) |"
      f" {b['median']:,.0f} | {bm['median']:.2f}x | {row['bit_exact']} | {row['fell_back']} |"
    )
  if doc["errors"]:
    lines += ["", "Errors:", ""] + [f"- {k}: {v}" for k, v in doc["errors"].items()]
  return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m benchmarks.shared_read")
  p.add_argument("--out", required=True)
  p.add_argument("--mib-per-replica", type=int, default=DEFAULT_MIB)
  p.add_argument("--reps", type=int, default=DEFAULT_REPS)
  p.add_argument("--slices", type=int, default=2)
  p.add_argument("--processes-per-slice", type=int, default=2)
  p.add_argument(
    "--readers",
    default=None,
    help="comma-separated reader-slice counts to compare (default: S and 1)",
  )
  p.add_argument("--job-timeout", type=float, default=600)
  p.add_argument("--keep", action="store_true", help="keep the scratch folder")
  a = p.parse_args(argv)
  if a.slices < 2:
    p.error("--slices must be at least 2")
  readers = [a.slices, 1] if a.readers is None else [int(x) for x in a.readers.split(",")]
  if any(not 1 <= r <= a.slices for r in readers):
    p.error(f"--readers must be within 1..{a.slices}")
  a.readers = list(dict.fromkeys(readers))
  return a


def main(argv: list[str] | None = None) -> int:
  from emergency_ckpt.bench import measure  # noqa: PLC0415
  from emergency_ckpt.bench.run import _summarize  # noqa: PLC0415
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415
  from tests.harness import gcs_server  # noqa: PLC0415
  from tests.harness.gcs_proxy import GcsProxy  # noqa: PLC0415

  a = parse_args(argv)
  measure.precompile()  # the jobs import bytecode, as from a wheel
  os.makedirs(a.out, exist_ok=True)
  gcs_server.client_defaults()
  started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  load_before = _load()
  processes = a.slices * a.processes_per_slice
  modes = [PER_PROCESS] + [mode_name(r) for r in a.readers]
  model_bytes = a.mib_per_replica * 2**20
  errors: dict[str, str] = {}
  rows: dict = {}
  scratch = tempfile.mkdtemp(prefix="ec-shared-read-", dir="/dev/shm")
  t0 = time.monotonic()
  try:
    with (
      gcs_server.GcsServer(log_dir=scratch) as server,
      GcsProxy(server.url) as proxy,
    ):
      bucket = server.create_bucket()
      env = dict(gcs_server.CLIENT_ENV, **proxy.env)
      job_args = {
        "mib": a.mib_per_replica,
        "slices": a.slices,
        "shm_root": os.path.join(scratch, "ramdisk"),
        "persistent": f"gs://{bucket}/run",
        "reps": a.reps,
        "readers": a.readers,
      }
      jobs = {}
      for label, target in (("save", "save_job"), ("restore", "restore_job")):
        progress(f"{label} job: {processes} processes")
        res = run_job(
          f"{WORKER}:{target}",
          processes,
          job_args,
          devices_per_process=DEVICES_PER_PROCESS,
          timeout_s=a.job_timeout,
          env={i: env for i in range(processes)},
          out_dir=os.path.join(scratch, "jobs", label),
        )
        bad = [i for i, rc in enumerate(res.returncodes) if rc != 0]
        if bad or res.timed_out or any(r is None for r in res.results):
          errors[label] = _summarize(res, bad)
          logs = os.path.join(a.out, "logs")
          os.makedirs(logs, exist_ok=True)
          for i, text in enumerate(res.logs):
            with open(os.path.join(logs, f"{label}_process_{i}.txt"), "w") as f:
              f.write(text)
          progress(f"{label}: FAILED: {errors[label]} (logs in {logs})")
          break
        jobs[label] = res.results
        progress(f"{label} job done in {res.wall_s:.1f}s")
      if "restore" in jobs:
        rows = summarize(jobs["restore"], model_bytes, modes)
  finally:
    if not a.keep:
      shutil.rmtree(scratch, ignore_errors=True)
  doc = {
    "started": started,
    "load_before": load_before,
    "load_after": _load(),
    "wall_s": time.monotonic() - t0,
    "config": {
      "mib_per_replica": a.mib_per_replica,
      "model_bytes": model_bytes,
      "reps": a.reps,
      "slices": a.slices,
      "processes_per_slice": a.processes_per_slice,
      "devices_per_process": DEVICES_PER_PROCESS,
      "readers": a.readers,
      "expected_step": STEP,
    },
    "rows": rows,
    "errors": errors,
  }
  with open(os.path.join(a.out, "results.json"), "w") as f:
    json.dump(doc, f, indent=1)
  if rows:
    text = markdown(doc)
    with open(os.path.join(a.out, "results.md"), "w") as f:
      f.write(text)
    print(text)
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
