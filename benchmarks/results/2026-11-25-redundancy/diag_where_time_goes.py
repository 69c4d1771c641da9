"""Diagnostic behind diag.md (not part of the benchmark): runs
emergency_ckpt.bench.redundancy's job (partner only, lost-host restores
only, 3 reps) with timers wrapped around library functions by
monkeypatching, and prints per process the median and max of each.

  PYTHONPATH=<this folder>:<checkout> python diag_where_time_goes.py 256 OUT_DIR
"""

from __future__ import annotations

import collections
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from emergency_ckpt.peer import partner as partner_lib
from emergency_ckpt.peer import reshard_stream

from emergency_ckpt import local_read, local_tier
from emergency_ckpt import shards as shards_lib
from emergency_ckpt.bench import redundancy

TIMERS = collections.defaultdict(list)
PHASE = {"now": "save"}


def _timed(label, fn):
  @functools.wraps(fn)
  def wrapper(*a, **k):
    t0 = time.perf_counter()
    try:
      return fn(*a, **k)
    finally:
      TIMERS[f"{PHASE['now']}:{label()}"].append(time.perf_counter() - t0)

  return wrapper


def _patch() -> None:
  def thread() -> str:
    return threading.current_thread().name[:14]

  local_read.read_step = _timed(lambda: f"read_step[{thread()}]", local_read.read_step)
  partner_lib.Receiver._store = _timed(lambda: "receiver_store_total", partner_lib.Receiver._store)
  partner_lib.send = _timed(lambda: "sender_send_total", partner_lib.send)
  reshard_stream.transfer = _timed(lambda: "reshard_transfer_total", reshard_stream.transfer)
  reshard_stream._pull_all = _timed(lambda: "reshard_pull_all", reshard_stream._pull_all)
  reshard_stream.merged = _timed(lambda: "reshard_merged", reshard_stream.merged)
  shards_lib.assemble_buffer = _timed(lambda: "assemble_buffer", shards_lib.assemble_buffer)
  local_tier.LocalTier.read_copy = _timed(lambda: "read_copy", local_tier.LocalTier.read_copy)


def main_lost_only(args: dict) -> dict:
  """In the job: bench_main with timers, lost-host restores only."""
  import emergency_ckpt as ec  # noqa: PLC0415

  _patch()
  redundancy.VARIANTS = ("lost_host",)
  orig = ec.CheckpointManager.restore

  def restore(self, *a, **k):
    PHASE["now"] = "restore"
    return orig(self, *a, **k)

  ec.CheckpointManager.restore = restore
  out = redundancy.bench_main(args)
  out["timers"] = {k: [round(x, 4) for x in v] for k, v in TIMERS.items()}
  return out


def _run(mib: float, out: str) -> None:
  from emergency_ckpt.testing.launcher import run_job  # noqa: PLC0415

  os.makedirs(out, exist_ok=True)
  shm = tempfile.mkdtemp(prefix="ec-rbdiag-", dir="/dev/shm")
  disk = tempfile.mkdtemp(prefix="ec-rbdiag-")
  args = {
    "out": out,
    "shm_root": shm,
    "disk_root": disk,
    "rows": redundancy.rows_per_leaf(mib),
    "reps": 3,
    "fg_iters": 1,
    "schemes": ["partner"],
  }
  try:
    job = run_job(
      "diag_where_time_goes:main_lost_only", 4, args, timeout_s=900, out_dir=f"{out}/job"
    )
    res = job.check()
  finally:
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
  with open(os.path.join(out, "diag.json"), "w") as f:
    json.dump(res, f)
  for p in res:
    print("process", p["process"])
    for k, v in sorted(p["timers"].items()):
      print(f"  {k:45s} n={len(v):3d} median={statistics.median(v):.3f} max={max(v):.3f}")
    rs = [r for r in p["restores"] if r["rep"] >= 0]
    print("  restores", [round(r["total_s"], 3) for r in rs], [r["source"] for r in rs])


if __name__ == "__main__":
  _run(float(sys.argv[1]), sys.argv[2])
