"""flax nnx + optax + grain on 2 slices: lose a slice, resume bit-exactly;
or (--shrink) lose a slice for good and resume on one slice.

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

`python -m examples.flax_grain --shrink` (issue 16: fewer slices):

1. reference and checkpointed run as above, with elastic data: the dataset
   is cut into 2 x --procs-per-slice logical shards for the whole run, one
   grain iterator each (the trainer's ShardedDataIterator; each process
   reads its own); the crashed run dies once its saves in flight are
   durable, so the restored step is fixed;
2. slice 1 is gone for good: its ramdisks are wiped and its hosts are not
   in the next job;
3. restart as ONE slice (--procs-per-slice processes on slice 0's hosts,
   replica axis 1): each process restores the newest step from its own
   ramdisk (source "local"; with the defaults step 15, while the persistent
   tier holds step 10), and restore(..., data_state_remap=remap_data_shards)
   turns the saved processes' iterator states into the new processes' (each
   reads twice the shards now, each shard where it stopped).

Exits 0 only if the resumed job feeds, step for step, exactly the examples
(ids, in order) the reference fed, so the crashed run's steps up to the
restored one plus the resumed steps consumed what the reference consumed,
none skipped or repeated, and it resumed at the same global example count
(batches drawn x global batch); and the resumed losses are finite and within
float32 rounding (relative 1e-5) of the reference's. Not bit-for-bit: one
slice sums each gradient over 2 devices where two slices summed it over 4,
and float addition is not associative (a 1-slice run differs from the
2-slice one by 1 ulp by step 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

from emergency_ckpt.demo.launcher import run_job

TARGET = "examples.flax_grain_trainer:train"
SLICES = 2


def _tmp(prefix: str, shm: bool) -> str:
  base = "/dev/shm" if shm and os.path.isdir("/dev/shm") else None
  return tempfile.mkdtemp(prefix=prefix, dir=base)


class Run:
  """The folders and jobs of one example run (ramdisks, persistent, traces)."""

  def __init__(
    self,
    *,
    steps: int,
    crash_at: int,
    procs_per_slice: int,
    timeout_s: float = 300,
    elastic: bool = False,
  ):
    """elastic: every job reads the data as SLICES * procs_per_slice logical
    shards (the trainer's ShardedDataIterator), so the run may restart on
    fewer processes (resume_on_one_slice)."""
    if not 0 < crash_at < steps:
      raise ValueError(f"need 0 < crash_at < steps, got crash_at={crash_at}, steps={steps}")
    self.steps, self.crash_at, self.timeout_s = steps, crash_at, timeout_s
    self.procs_per_slice = procs_per_slice
    self.nproc = SLICES * procs_per_slice
    self.data_shards = self.nproc if elastic else None
    self.ramdisk_root = _tmp("ec-flax-ramdisk-", shm=True)  # one folder per simulated host
    self.work = _tmp("ec-flax-", shm=False)  # persistent dir, traces, job logs
    self.persistent = os.path.join(self.work, "persistent")
    self.trace_dir = os.path.join(self.work, "trace")
    self.wall_s: dict[str, float] = {}  # job name -> seconds
    self.crash_errors: list[str | None] = []

  def _args(self, name: str, **extra) -> dict:
    data = {"data_shards": self.data_shards} if self.data_shards else {}
    return {
      "name": name,
      "ramdisk_root": self.ramdisk_root,
      "persistent": self.persistent,
      "trace_dir": self.trace_dir,
      **data,
      **extra,
    }

  def _job(self, name: str, args: dict, nproc: int | None = None):
    job = run_job(
      TARGET,
      nproc or self.nproc,
      args,
      devices_per_process=2,
      timeout_s=self.timeout_s,
      out_dir=os.path.join(self.work, f"job_{name}"),
    )
    self.wall_s[name] = round(job.wall_s, 1)
    return job

  def trace(self, name: str, process: int) -> dict[int, dict]:
    """step -> {"loss", "iterator", "ids"} as process `process` of job `name`
    logged it."""
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

  def crash(self, settle: bool = False) -> list[int]:
    """The checkpointed run that dies after crash_at; its return codes.

    verify() checks from the traces that every process got to crash_at (a
    process may fail at the very end, when another one's death cuts it off:
    self.crash_errors keeps what it said). `settle`: the job dies only once
    its saves in flight are durable, so the newest save before crash_at is
    the restored step (else a save that was still committing loses it to the
    one before: tens of milliseconds of margin here)."""
    args = self._args("crashed", until=self.steps, checkpoint=True, crash_at=self.crash_at)
    job = self._job("crashed", dict(args, settle=True) if settle else args)
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

  def global_ids(self, name: str, processes: int) -> dict[int, list[int]]:
    """step -> the ids of the examples job `name` fed at that step, in global
    batch order (process 0's rows first); steps every process logged."""
    traces = [self.trace(name, i) for i in range(processes)]
    steps = set.intersection(*(set(t) for t in traces)) if traces else set()
    return {s: [x for t in traces for x in t[s]["ids"]] for s in sorted(steps)}

  def resume(self, fault: str | None = None, name: str = "resumed") -> list[dict]:
    """The restarted job: restore, then train to `steps`."""
    args = self._args(name, until=self.steps, checkpoint=True, fault=fault)
    return self._job(name, args).check()

  def resume_on_one_slice(self, fault: str | None = None, name: str = "shrunk") -> list[dict]:
    """The job restarts as one slice: slice 0's processes (same indices, on
    the same hosts, so each finds its ramdisk), a replica axis of 1. Needs
    an elastic run (the data state is remapped onto the new process count).
    Call wipe_lost_slice() first: slice 1's hosts are gone for good."""
    if not self.data_shards:
      raise ValueError("resume_on_one_slice() needs Run(elastic=True)")
    args = self._args(name, until=self.steps, checkpoint=True, fault=fault, slices=1)
    return self._job(name, args, nproc=self.procs_per_slice).check()

  def snapshot(self, dest: str) -> None:
    """Copies the ramdisks and the persistent folder to `dest` (put_back()
    restores them: restart twice from the same files)."""
    shutil.copytree(self.ramdisk_root, os.path.join(dest, "ramdisk"), symlinks=True)
    shutil.copytree(self.persistent, os.path.join(dest, "persistent"), symlinks=True)

  def put_back(self, src: str) -> None:
    """The ramdisks and persistent folder as snapshot(src) saved them."""
    shutil.rmtree(self.ramdisk_root)
    shutil.rmtree(self.persistent)
    shutil.copytree(os.path.join(src, "ramdisk"), self.ramdisk_root, symlinks=True)
    shutil.copytree(os.path.join(src, "persistent"), self.persistent, symlinks=True)

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


def verify_shrink(
  run: Run,
  reference: list[dict],
  returncodes: list[int],
  resumed: list[dict],
  *,
  name: str = "shrunk",
  rtol: float = 1e-5,
) -> dict:
  """Checks a restart onto one slice (Run.resume_on_one_slice, job `name`)
  against the uninterrupted 2-slice reference and the crashed run's traces.

  The examples: at every step the resumed job feeds exactly the example ids,
  in global batch order, that the reference fed at that step; so the crashed
  run's steps 1..restored plus the resumed steps consumed the reference's
  examples, step for step, none skipped or repeated. Each process's data
  state after restore holds, for each shard it now reads, the state the
  crashed run's owner of that shard saved at the restored step, and has
  drawn restored-step batches (the global example count: x global batch).
  The losses: finite, and within `rtol` (relative) of the reference's (not
  bit-for-bit: see the module docstring).

  Returns a JSON-able summary; summary["problems"] is empty iff all is well."""
  problems = []
  ref = {int(k): v for k, v in reference[0]["losses"].items()}
  ref_ids = run.global_ids("reference", run.nproc)
  if sorted(ref_ids) != list(range(1, run.steps + 1)):
    problems.append(f"the reference logged steps {sorted(ref_ids)}")
  if any(rc == 0 for rc in returncodes):
    problems.append(f"the crashed run did not die: return codes {returncodes}")
  crashed = [run.trace("crashed", i) for i in range(run.nproc)]
  for i, tr in enumerate(crashed):
    if max(tr, default=0) != run.crash_at:
      err = (run.crash_errors[i] or "")[-2000:] if i < len(run.crash_errors) else ""
      problems.append(f"process {i} of the crashed run logged up to {max(tr, default=0)} {err}")
    if any(rec["loss"] != ref[s] for s, rec in tr.items()):
      problems.append(f"process {i}: crashed run differs from the reference before the crash")
  crashed_ids = run.global_ids("crashed", run.nproc)
  if any(crashed_ids[s] != ref_ids.get(s) for s in crashed_ids):
    problems.append("the crashed run fed other examples than the reference")

  new_count = len(resumed)
  processes = []
  for r in sorted(resumed, key=lambda r: r["process"]):
    info = r["restored"] or {}
    step = info.get("step")
    # What this process must read on: shard s (of the S the run has) goes to
    # new process s * new_count // S, with the state its old reader saved.
    expected = None
    if step is not None:
      shards = {}
      for tr in crashed:
        saved = tr.get(step, {}).get("iterator") or {"shards": {}}
        for key, state in saved["shards"].items():
          if int(key) * new_count // run.data_shards == r["process"]:
            shards[key] = state
      expected = {"data_shards": run.data_shards, "batches": step, "shards": shards}
    processes.append(
      {
        "process": r["process"],
        "slice": r["slice"],
        "restored_step": step,
        "source": info.get("source"),
        "iterator_expected": expected,
        "iterator_in_checkpoint": info.get("saved_iterator"),
        "iterator_after_restore": info.get("iterator_after_restore"),
      }
    )
    if step is None:
      problems.append(f"process {r['process']} did not restore")
      continue
    if info.get("source") != "local":
      problems.append(f"process {r['process']} restored from {info.get('source')}, not local")
    if not info["iterator_after_restore"] == info["saved_iterator"] == expected:
      problems.append(
        f"process {r['process']}: data iterator after restore {info['iterator_after_restore']}"
        f" (restore returned {info['saved_iterator']}) != the saved shards' states {expected}"
      )
    losses = {int(k): v for k, v in r["losses"].items()}
    if sorted(losses) != list(range(step + 1, run.steps + 1)):
      problems.append(f"process {r['process']} trained steps {sorted(losses)}")
    if not all(math.isfinite(v) for v in losses.values()):
      problems.append(f"process {r['process']}: non-finite losses {losses}")
  steps = {p["restored_step"] for p in processes}
  if len(steps) != 1:
    problems.append(f"processes restored different steps: {sorted(steps, key=str)}")
  step = processes[0]["restored_step"] if processes else None

  resumed_ids = run.global_ids(name, new_count) if resumed else {}
  consumed = {s: ids for s, ids in crashed_ids.items() if step is not None and s <= step}
  consumed.update(resumed_ids)
  if step is not None and consumed != ref_ids:
    bad = sorted(s for s in set(consumed) | set(ref_ids) if consumed.get(s) != ref_ids.get(s))
    problems.append(
      f"the job's examples (crashed run to step {step}, then the resumed job) differ from the"
      f" reference's at steps {bad}"
    )

  resumed0 = {int(k): v for k, v in resumed[0]["losses"].items()} if resumed else {}
  rows, worst = [], 0.0
  for s in sorted(resumed0):
    rel = abs(resumed0[s] - ref[s]) / max(abs(ref[s]), 1e-30)
    worst = max(worst, rel)
    rows.append({"step": s, "resumed": resumed0[s], "reference": ref[s], "rel_diff": rel})
  if worst > rtol:
    problems.append(f"resumed losses differ from the reference by up to {worst:.3g} (> {rtol})")
  return {
    "ok": not problems,
    "problems": problems,
    "crash_at": run.crash_at,
    "restored_step": step,
    "saved_processes": run.nproc,
    "resumed_processes": new_count,
    "examples_at_restore": sum(len(consumed[s]) for s in consumed if s <= (step or 0)),
    "examples_consumed": {s: consumed[s] for s in sorted(consumed)},
    "reference_examples": ref_ids,
    "losses_max_rel_diff": worst,
    "losses_bit_equal": sum(r["resumed"] == r["reference"] for r in rows),
    "job_wall_s": dict(run.wall_s),
    "processes": processes,
    "losses": rows,
  }


def print_shrink_summary(summary: dict) -> None:
  print(
    f"crashed after step {summary['crash_at']} ({summary['saved_processes']} processes);"
    f" restored step {summary['restored_step']} on {summary['resumed_processes']}, at global"
    f" example {summary['examples_at_restore']}"
  )
  for p in summary["processes"]:
    it = p["iterator_after_restore"] or {}
    print(
      f"  process {p['process']} (slice {p['slice']}): from {p['source']}; shards"
      f" {it.get('shards')} ({it.get('batches')} batches drawn)"
    )
  print("  step  resumed loss      reference loss    relative diff")
  for row in summary["losses"]:
    print(
      f"  {row['step']:4d}  {row['resumed']:<16.10g}  {row['reference']:<16.10g}"
      f"  {row['rel_diff']:.2g}"
    )
  print("  job wall times (s): " + ", ".join(f"{k} {v}" for k, v in summary["job_wall_s"].items()))
  for problem in summary["problems"]:
    print(f"PROBLEM: {problem}")
  print(
    "FLAX+GRAIN SHRINK OK: one slice resumed from its ramdisk at the same global example count"
    if summary["ok"]
    else "FLAX+GRAIN SHRINK FAILED"
  )


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
    "--shrink",
    action="store_true",
    help="slice 1 is gone for good: restart as one slice (elastic data, remapped iterator states)",
  )
  p.add_argument(
    "--fault",
    choices=("fresh-iterator",),
    help="break the restart on purpose (fresh-iterator: do not restore the data iterator);"
    " the example must then fail",
  )
  p.add_argument("--keep", action="store_true", help="keep the work folders")
  p.add_argument("--json", help="also write the summary to this file")
  a = p.parse_args(argv)
  run = Run(steps=a.steps, crash_at=a.crash_at, procs_per_slice=a.procs_per_slice, elastic=a.shrink)
  try:
    print(f"== reference: {a.steps} steps, {run.nproc} processes, no checkpoints", flush=True)
    reference = run.reference()
    print(f"== checkpointed run: dies after step {a.crash_at}", flush=True)
    returncodes = run.crash(settle=a.shrink)
    run.wipe_lost_slice()
    if a.shrink:
      print(f"== slice 1 gone for good: hosts {run.lost_slice_hosts()} wiped", flush=True)
      print(
        f"== restart on one slice ({a.procs_per_slice} processes) to step {a.steps}", flush=True
      )
      resumed = run.resume_on_one_slice(fault=a.fault)
      summary = verify_shrink(run, reference, returncodes, resumed)
      print_shrink_summary(summary)
    else:
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
