"""Shared by the restart tests (elastic, reshard, redundancy): a saved run's
folders, copies of them, wiping hosts, restarting, and a one-line summary.

Runs save steps 1-5 (local every step, 3 kept; persistent every 3rd) with
each process on a "host" of its own: the folder host_<i> under local_root.
"""

from __future__ import annotations

import os
import shutil

from emergency_ckpt.demo.launcher import run_job


def save_run(root: str, processes: int, slices: int, **extra) -> dict:
  """Saves steps 1-5 in a fresh job; returns the run's args."""
  args = {
    "slices": slices,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "persistent"),
    "steps": [1, 2, 3, 4, 5],
    "persistent_interval": 3,
    "local_keep": 3,
    **extra,
  }
  saved = run_job("tests.scenarios:save_steps", processes, args, timeout_s=240).check()
  return {**args, "overlap": sorted({r["overlap"] for r in saved}, key=str)}


def copy_run(saved: dict, dest: str) -> dict:
  """A copy of a saved run's folders under `dest` (a test damages its own)."""
  args = dict(saved)
  for key in ("local_root", "persistent"):
    args[key] = os.path.join(dest, os.path.basename(saved[key]))
    shutil.copytree(saved[key], args[key], symlinks=True)
  return args


def wipe_hosts(args: dict, *hosts: int) -> None:
  """The hosts' ramdisks are gone (replaced machines)."""
  for host in hosts:
    shutil.rmtree(os.path.join(args["local_root"], f"host_{host}"))


def process_dir(args: dict, host: int, process: int | None = None) -> str:
  process = host if process is None else process
  return os.path.join(args["local_root"], f"host_{host}", "test-run", f"process_{process}")


def restart(args: dict, processes: int, slices: int, **job) -> dict[int, dict]:
  """Restores the newest step, then saves 6-8 (elastic_scenarios); {process: result}."""
  args = dict(args, slices=slices, then_save=[6, 7, 8])
  results = run_job(
    "tests.elastic_scenarios:restore_then_save", processes, args, timeout_s=240, **job
  ).check()
  return {r["process"]: r for r in results}


def outcome(got: dict[int, dict]) -> dict[int, tuple]:
  """{process: (restored step, source, bit mismatches)}."""
  return {p: (r["step"], r["source"], r["bad"]) for p, r in got.items()}


def describe(got: dict[int, dict]) -> str:
  """What the fault matrix records of a restart."""
  return (
    "restored (step, source): "
    + ", ".join(f"p{p} ({r['step']}, {r['source']})" for p, r in sorted(got.items()))
    + f"; bit mismatches: {sum(len(r['bad']) for r in got.values())}"
  )
