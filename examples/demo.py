"""The README's main job: a 2-slice CPU training run that loses a slice.

1. Reference: 40 uninterrupted steps, no checkpoints.
2. Checkpointed run: saves to every host's ramdisk every 5 steps and to the
   persistent directory every 20; stops at step 33 (a failure).
3. Slice 1's hosts are replaced: their ramdisk folders are wiped.
4. Restart: every process restores (slice 0 from its ramdisk, slice 1 from its
   peer slice), continues to step 40, and the losses must equal the
   reference bit-for-bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from emergency_ckpt.launcher import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "cpu_demo.yaml")
NPROC, SLICES = 4, 2


def _env(root: str) -> dict[int, dict[str, str]]:
  return {i: {"EC_DEMO_ROOT": root, "EC_HOST": str(i)} for i in range(NPROC)}


def _run(title: str, args: dict, root: str) -> list[dict]:
  print(f"== {title}", flush=True)
  job = run_job("examples.demo_trainer:train", NPROC, args, env=_env(root), timeout_s=300)
  return job.check()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--root", help="work folder (default: a fresh one under /dev/shm)")
  p.add_argument("--keep", action="store_true", help="keep the work folder")
  a = p.parse_args(argv)
  root = a.root or tempfile.mkdtemp(
    prefix="ec-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
  )
  try:
    ref = _run("reference run: 40 steps, no checkpoints", {"until": 40}, root)[0]["losses"]
    _run("checkpointed run: crashes after step 33", {"until": 33, "config": CONFIG}, root)
    for host in range(NPROC // SLICES, NPROC):  # slice 1 = processes 2, 3
      shutil.rmtree(os.path.join(root, "ramdisk", f"host_{host}"), ignore_errors=True)
    print(f"== slice 1 lost: wiped the ramdisks of hosts {list(range(NPROC // SLICES, NPROC))}")
    resumed = _run(
      "restart: restore, then train to step 40",
      {"until": 40, "config": CONFIG, "restore": True},
      root,
    )
    ok = True
    for r in resumed:
      info = r["restored"]
      print(
        f"process {r['process']} (slice {info['slice']}): restored step {info['step']} from"
        f" {info['source']}; data iterator at position {info['data_state']['iterator']['position']}"
      )
    losses = resumed[0]["losses"]
    print("step  resumed loss        reference loss      equal")
    for step in sorted(losses, key=int):
      same = losses[step] == ref[step]
      ok &= same
      print(
        f"{int(step):4d}  {losses[step]:<18.10g}  {ref[step]:<18.10g}  {'yes' if same else 'NO'}"
      )
    sources = sorted({(r["restored"]["slice"], r["restored"]["source"]) for r in resumed})
    ok &= sources == [(0, "local"), (1, "peer")]
    print("DEMO OK: resumed from the peer slice, loss curve bit-identical" if ok else "DEMO FAILED")
    return 0 if ok else 1
  finally:
    if not a.keep and not a.root:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
