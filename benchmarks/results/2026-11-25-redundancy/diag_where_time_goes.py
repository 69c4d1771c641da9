"""Diagnostic only (not committed): bench_main with timers around the partner
send's phases and the partner restore's phases (monkeypatched wrappers)."""
import threading, time, functools, collections
from emergency_ckpt import local_read, local_tier, shards as shards_lib
from emergency_ckpt.peer import partner as partner_lib, reshard_stream, stream
from emergency_ckpt import redundancy as red_lib
from emergency_ckpt.bench import redundancy

T = collections.defaultdict(list)
PHASE = {"now": "save"}

def timed(label_fn, fn):
  @functools.wraps(fn)
  def w(*a, **k):
    t0 = time.perf_counter()
    try:
      return fn(*a, **k)
    finally:
      T[f"{PHASE['now']}:{label_fn()}"].append(time.perf_counter() - t0)
  return w

thr = lambda: threading.current_thread().name
local_read.read_step = timed(lambda: f"read_step[{thr()[:14]}]", local_read.read_step)
partner_lib.Receiver._store = timed(lambda: "receiver_store_total", partner_lib.Receiver._store)
partner_lib.send = timed(lambda: "sender_send_total", partner_lib.send)
reshard_stream.transfer = timed(lambda: "reshard_transfer_total", reshard_stream.transfer)
reshard_stream._pull_all = timed(lambda: "reshard_pull_all", reshard_stream._pull_all)
reshard_stream.merged = timed(lambda: "reshard_merged", reshard_stream.merged)
shards_lib.assemble_buffer = timed(lambda: "assemble_buffer", shards_lib.assemble_buffer)
local_tier.LocalTier.read_copy = timed(lambda: "read_copy", local_tier.LocalTier.read_copy)
_orig_restore = None

def main(args):
  import emergency_ckpt as ec
  orig = ec.CheckpointManager.restore
  def restore(self, *a, **k):
    PHASE["now"] = "restore"
    return orig(self, *a, **k)
  ec.CheckpointManager.restore = restore
  out = redundancy.bench_main(args)
  out["timers"] = {k: [round(x, 4) for x in v] for k, v in T.items()}
  return out

def main_lost_only(args):
  redundancy.VARIANTS = ("lost_host",)
  return main(args)

if __name__ == "__main__":
  import json, os, shutil, sys, tempfile
  from emergency_ckpt.testing.launcher import run_job
  mib = float(sys.argv[1]); out = sys.argv[2]
  os.makedirs(out, exist_ok=True)
  shm = tempfile.mkdtemp(prefix="ec-rbdiag-", dir="/dev/shm"); disk = tempfile.mkdtemp(prefix="ec-rbdiag-")
  args = {"out": out, "shm_root": shm, "disk_root": disk, "rows": redundancy.rows_per_leaf(mib),
          "reps": 3, "fg_iters": 1, "schemes": ["partner"]}
  try:
    res = run_job("rbdiag:main_lost_only", 4, args, timeout_s=900, out_dir=os.path.join(out, "job")).check()
  finally:
    shutil.rmtree(shm, ignore_errors=True); shutil.rmtree(disk, ignore_errors=True)
  json.dump(res, open(os.path.join(out, "diag.json"), "w"))
  import statistics as S
  for p in res:
    print("process", p["process"])
    for k, v in sorted(p["timers"].items()):
      print(f"  {k:45s} n={len(v):3d} median={S.median(v):.3f} max={max(v):.3f}")
    rs = [r for r in p["restores"] if r["rep"] >= 0]
    print("  restores", [round(r["total_s"], 3) for r in rs], [r["source"] for r in rs])
