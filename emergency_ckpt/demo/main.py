"""The README's main job: a 2-slice CPU training run that loses a slice.

1. Reference: 40 uninterrupted steps, no checkpoints.
2. Checkpointed run: saves to every host's ramdisk every 5 steps and to the
   persistent directory every 20; stops at step 33 (a failure).
3. Slice 1's hosts are replaced: their ramdisk folders are wiped.
4. Restart: every process restores (slice 0 from its ramdisk, slice 1 from its
   peer slice), continues to step 40, and the losses must equal the
   reference bit-for-bit.

4 processes x 2 CPU devices on this machine (emergency_ckpt.demo.launcher).
Work folder: ROOT/ramdisk/host_<i> (each simulated host's local tier),
ROOT/persistent, ROOT/events (the manager's event logs, for `emergency-ckpt
report`); kept with --root or --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import os
import shutil
import sys
import tempfile

from emergency_ckpt.demo.launcher import run_job

TRAINER = "emergency_ckpt.demo.trainer:train"
NPROC, SLICES = 4, 2


def _env(root: str) -> dict[int, dict[str, str]]:
  return {i: {"EC_DEMO_ROOT": root, "EC_HOST": str(i)} for i in range(NPROC)}


def _run(title: str, args: dict, root: str) -> list[dict]:
  print(f"== {title}", flush=True)
  job = run_job(TRAINER, NPROC, args, env=_env(root), timeout_s=300)
  return job.check()


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The demo's options, on its own parser and on `emergency-ckpt demo`'s."""
  p.add_argument("--root", help="work folder, kept (default: a fresh one under /dev/shm)")
  p.add_argument("--keep", action="store_true", help="keep the work folder")
  p.add_argument(
    "--config",
    help="checkpoint config (default: the packaged cpu_demo.yaml, the same as configs/ has)",
  )


def main(argv=None) -> int:
  """`python -m emergency_ckpt.demo [--root DIR] [--keep] [--config FILE]`."""
  p = argparse.ArgumentParser(
    prog="python -m emergency_ckpt.demo",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_arguments(p)
  a = p.parse_args(argv)
  return run(a.root, keep=a.keep, config=a.config)


def run(root: str | None = None, *, keep: bool = False, config: str | None = None) -> int:
  """Runs the demo in `root` (kept; default a fresh folder, removed unless
  `keep`) with checkpoint config `config` (default the packaged one); 0 if
  the resumed run matches the reference bit-for-bit."""
  work = os.path.abspath(
    root
    or tempfile.mkdtemp(prefix="ec-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
  )
  with contextlib.ExitStack() as stack:
    config = config or stack.enter_context(
      importlib.resources.as_file(importlib.resources.files(__package__) / "cpu_demo.yaml")
    )
    try:
      ok = _demo(work, os.path.abspath(config))
    finally:
      if not keep and not root:
        shutil.rmtree(work, ignore_errors=True)
  if keep or root:
    print(
      f"work folder kept: {work}\n"
      f"  emergency-ckpt inspect {work}/persistent {work}/ramdisk/host_0\n"
      f"  emergency-ckpt report {work}/events"
    )
  return 0 if ok else 1


def _demo(root: str, config: str) -> bool:
  ckpt = {"config": config, "event_log": os.path.join(root, "events", "events_{process}.jsonl")}
  ref = _run("reference run: 40 steps, no checkpoints", {"until": 40}, root)[0]["losses"]
  _run("checkpointed run: crashes after step 33", {"until": 33, **ckpt}, root)
  for host in range(NPROC // SLICES, NPROC):  # slice 1 = processes 2, 3
    shutil.rmtree(os.path.join(root, "ramdisk", f"host_{host}"), ignore_errors=True)
  print(f"== slice 1 lost: wiped the ramdisks of hosts {list(range(NPROC // SLICES, NPROC))}")
  resumed = _run(
    "restart: restore, then train to step 40", {"until": 40, "restore": True, **ckpt}, root
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
    print(f"{int(step):4d}  {losses[step]:<18.10g}  {ref[step]:<18.10g}  {'yes' if same else 'NO'}")
  sources = sorted({(r["restored"]["slice"], r["restored"]["source"]) for r in resumed})
  ok &= sources == [(0, "local"), (1, "peer")]
  print("DEMO OK: resumed from the peer slice, loss curve bit-identical" if ok else "DEMO FAILED")
  return ok


if __name__ == "__main__":
  sys.exit(main())
