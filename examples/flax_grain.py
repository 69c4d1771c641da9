"""flax nnx + optax + grain on 2 slices: lose a slice, resume bit-exactly.

`python -m examples.flax_grain` runs examples/flax_grain_trainer.py as real
multi-process jax.distributed CPU jobs (2 slices x --procs-per-slice
processes, 2 CPU devices each):

1. reference: --steps uninterrupted steps, no checkpoints;
2. checkpointed run: local saves every 5 steps (ramdisk folders under
   /dev/shm), persistent every 10; every process is SIGKILLed after step
   --crash-at;
3. slice 1's hosts are replaced: their ramdisk folders are wiped;
4. restart: every process restores (slice 0 from its ramdisk, slice 1 from
   slice 0), grain's iterator included, and trains to --steps.

Exits 0 only if the resumed losses equal the reference bit-for-bit, the
sources are right, and each process's iterator after restore is where the
crashed run saved it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from emergency_ckpt.testing.launcher import run_job

TARGET = "examples.flax_grain_trainer:train"
SLICES = 2


def _tmp(prefix: str, shm: bool) -> str:
  base = "/dev/shm" if shm and os.path.isdir("/dev/shm") else None
  return tempfile.mkdtemp(prefix=prefix, dir=base)


class Run:
  """The folders and jobs of one example run (ramdisks, persistent, traces)."""

  def __init__(self, *, steps: int, crash_at: int, procs_per_slice: int, timeout_s: float = 300):
    if not 0 < crash_at < steps:
      raise ValueError(f"need 0 < crash_at < steps, got crash_at={crash_at}, steps={steps}")
    self.steps, self.crash_at, self.timeout_s = steps, crash_at, timeout_s
    self.nproc = SLICES * procs_per_slice
    self.ramdisk_root = _tmp("ec-flax-ramdisk-", shm=True)  # one folder per simulated host
    self.work = _tmp("ec-flax-", shm=False)  # persistent dir, traces, job logs
    self.persistent = os.path.join(self.work, "persistent")
    self.trace_dir = os.path.join(self.work, "trace")
    self.wall_s: dict[str, float] = {}  # job name -> seconds
    self.crash_errors: list[str | None] = []

  def _args(self, name: str, **extra) -> dict:
    return {
      "name": name,
      "ramdisk_root": self.ramdisk_root,
      "persistent": self.persistent,
      "trace_dir": self.trace_dir,
      **extra,
    }

  def _job(self, name: str, args: dict):
    job = run_job(
      TARGET,
      self.nproc,
      args,
      devices_per_process=2,
      timeout_s=self.timeout_s,
      out_dir=os.path.join(self.work, f"job_{name}"),
    )
    self.wall_s[name] = round(job.wall_s, 1)
    return job

  def trace(self, name: str, process: int) -> dict[int, dict]:
    """step -> {"loss", "iterator"} as process `process` of job `name` logged it."""
    path = os.path.join(self.trace_dir, f"{name}_process_{process}.jsonl")
    out = {}
    if not os.path.exists(path):  # died before its first step
      return out
    with open(path) as f:
      for line in f:
        if line.endswith("\n"):  # a line cut by the kill is not a logged step
          rec = json.loads(line)
          out[rec["step"]] = rec
    return out

  def reference(self) -> list[dict]:
    """The uninterrupted run (no checkpoints); per-process results."""
    return self._job("reference", self._args("reference", until=self.steps)).check()

  def crash(self) -> list[int]:
    """The checkpointed run that dies after crash_at; its return codes.

    verify() checks from the traces that every process got to crash_at (a
    process may fail at the very end, when another one's death cuts it off:
    self.crash_errors keeps what it said)."""
    job = self._job(
      "crashed", self._args("crashed", until=self.steps, checkpoint=True, crash_at=self.crash_at)
    )
    if job.timed_out:
      raise AssertionError("the crashing job hung:\n" + "\n".join(x[-3000:] for x in job.logs))
    self.crash_errors = job.errors
    return job.returncodes

  def lost_slice_hosts(self) -> list[int]:
    return list(range(self.nproc // SLICES, self.nproc))  # slice 1

  def wipe_lost_slice(self) -> None:
    """Slice 1's hosts are replaced: their ramdisks come back empty."""
    for host in self.lost_slice_hosts():
      shutil.rmtree(os.path.join(self.ramdisk_root, f"host_{host}"), ignore_errors=True)

  def resume(self, fault: str | None = None, name: str = "resumed") -> list[dict]:
    """The restarted job: restore, then train to `steps`."""
    args = self._args(name, until=self.steps, checkpoint=True, fault=fault)
    return self._job(name, args).check()

  def cleanup(self) -> None:
    shutil.rmtree(self.ramdisk_root, ignore_errors=True)
    shutil.rmtree(self.work, ignore_errors=True)


def verify(run: Run, reference: list[dict], returncodes: list[int], resumed: list[dict]) -> dict:
  """Compares the resumed job with the reference and the crashed run's traces.

  Returns a JSON-able summary; summary["problems"] is empty iff all is well."""
  problems = []
  ref = {int(k): v for k, v in reference[0]["losses"].items()}
  if any(rc == 0 for rc in returncodes):
    problems.append(f"the crashed run did not die: return codes {returncodes}")
  crashed = [run.trace("crashed", i) for i in range(run.nproc)]
  for i, tr in enumerate(crashed):
    if max(tr, default=0) != run.crash_at:
      err = (run.crash_errors[i] or "")[-2000:] if i < len(run.crash_errors) else ""
      problems.append(f"process {i} of the crashed run logged up to {max(tr, default=0)} {err}")
    if any(rec["loss"] != ref[s] for s, rec in tr.items()):
      problems.append(f"process {i}: crashed run differs from the reference before the crash")
  processes = []
  for r in sorted(resumed, key=lambda r: r["process"]):
    info = r["restored"] or {}
    step = info.get("step")
    saved = crashed[r["process"]].get(step, {}).get("iterator") if step else None
    processes.append(
      {
        "process": r["process"],
        "slice": r["slice"],
        "restored_step": step,
        "source": info.get("source"),
        "iterator_saved_by_crashed_run": saved,
        "iterator_in_checkpoint": info.get("saved_iterator"),
        "iterator_after_restore": info.get("iterator_after_restore"),
      }
    )
    if step is None:
      problems.append(f"process {r['process']} did not restore")
      continue
    if not info["iterator_after_restore"] == info["saved_iterator"] == saved:
      problems.append(
        f"process {r['process']}: data iterator after restore {info['iterator_after_restore']}"
        f" != saved at step {step} {saved}"
      )
    losses = {int(k): v for k, v in r["losses"].items()}
    if sorted(losses) != list(range(step + 1, run.steps + 1)):
      problems.append(f"process {r['process']} trained steps {sorted(losses)}")
    bad = [s for s in sorted(losses) if losses[s] != ref.get(s)]
    if bad:
      problems.append(f"process {r['process']}: resumed losses differ at steps {bad}")
  steps = {p["restored_step"] for p in processes}
  if len(steps) != 1:
    problems.append(f"processes restored different steps: {sorted(steps, key=str)}")
  expected = {0: "local", 1: "peer"}
  for p in processes:
    if p["source"] != expected[p["slice"]]:
      problems.append(f"process {p['process']} (slice {p['slice']}) restored from {p['source']}")
  step = processes[0]["restored_step"] if processes else None
  resumed0 = {int(k): v for k, v in resumed[0]["losses"].items()} if resumed else {}
  return {
    "ok": not problems,
    "problems": problems,
    "crash_at": run.crash_at,
    "restored_step": step,
    "job_wall_s": dict(run.wall_s),
    "processes": processes,
    "losses": [
      {"step": s, "resumed": resumed0.get(s), "reference": ref[s]} for s in sorted(resumed0)
    ],
  }


def print_summary(summary: dict) -> None:
  print(f"crashed after step {summary['crash_at']}; restored step {summary['restored_step']}")
  for p in summary["processes"]:
    print(
      f"  process {p['process']} (slice {p['slice']}): from {p['source']}; iterator"
      f" {p['iterator_after_restore']} (crashed run saved {p['iterator_saved_by_crashed_run']})"
    )
  print("  step  resumed loss      reference loss    equal")
  for row in summary["losses"]:
    same = row["resumed"] == row["reference"]
    print(
      f"  {row['step']:4d}  {row['resumed']:<16.10g}  {row['reference']:<16.10g}  {'yes' if same else 'NO'}"
    )
  print("  job wall times (s): " + ", ".join(f"{k} {v}" for k, v in summary["job_wall_s"].items()))
  for problem in summary["problems"]:
    print(f"PROBLEM: {problem}")
  print(
    "FLAX+GRAIN EXAMPLE OK: slice 1 resumed from its peer, loss curve bit-identical"
    if summary["ok"]
    else "FLAX+GRAIN EXAMPLE FAILED"
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--steps", type=int, default=24)
  p.add_argument("--crash-at", type=int, default=18)
  p.add_argument("--procs-per-slice", type=int, default=1, choices=(1, 2))
  p.add_argument(
    "--fault",
    choices=("fresh-iterator",),
    help="break the restart on purpose (fresh-iterator: do not restore the data iterator);"
    " the example must then fail",
  )
  p.add_argument("--keep", action="store_true", help="keep the work folders")
  p.add_argument("--json", help="also write the summary to this file")
  a = p.parse_args(argv)
  run = Run(steps=a.steps, crash_at=a.crash_at, procs_per_slice=a.procs_per_slice)
  try:
    print(f"== reference: {a.steps} steps, {run.nproc} processes, no checkpoints", flush=True)
    reference = run.reference()
    print(f"== checkpointed run: dies after step {a.crash_at}", flush=True)
    returncodes = run.crash()
    run.wipe_lost_slice()
    print(f"== slice 1 lost: wiped the ramdisks of hosts {run.lost_slice_hosts()}", flush=True)
    print(f"== restart: restore, then train to step {a.steps}", flush=True)
    resumed = run.resume(fault=a.fault)
    summary = verify(run, reference, returncodes, resumed)
    print_summary(summary)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if summary["ok"] else 1
  finally:
    if a.keep:
      print(f"kept {run.ramdisk_root} and {run.work}")
    else:
      run.cleanup()


if __name__ == "__main__":
  sys.exit(main())
