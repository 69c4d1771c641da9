"""The scale benchmark's planner stage: the pure restore planner on
inventories of thousands of processes (time, and memory per process)."""

from __future__ import annotations

import gc
import json
import statistics
import time
import tracemalloc
from typing import Any

from emergency_ckpt.restore import plan as restore_plan
from emergency_ckpt.restore import summary as restore_summary

STEP_EVERY = 100


def planner_inputs(processes: int, slices: int, steps: int):
  """(every process's exchanged inventory JSON, slice_processes, expected).

  Every process holds every committed step in its local tier, except one
  process in each slice s with s % 16 == 5, which lost the newest 3 steps,
  and one in each slice s % 16 == 9, which lost a step in the middle. The
  primary lists all `steps` committed state steps and every 10th step in the
  persistent tier. Expected: the newest step, restored locally by every
  slice but those with s % 16 == 5, which get it from a peer."""
  slices = min(slices, processes)
  if processes % slices:
    raise ValueError(f"{processes} processes do not split into {slices} equal slices")
  per = processes // slices
  all_steps = tuple(range(STEP_EVERY, STEP_EVERY * steps + 1, STEP_EVERY))
  damaged = min(2, per - 1)  # which process of a slice lost steps
  encoded = []
  for p in range(processes):
    s, j = divmod(p, per)
    local = all_steps
    if j == damaged and s % 16 == 5:
      local = all_steps[:-3]
    elif j == damaged and s % 16 == 9:
      local = all_steps[: steps // 2] + all_steps[steps // 2 + 1 :]
    inv = restore_summary.Inventory(
      process=p,
      slice=s,
      local_steps=local,
      persistent_steps=all_steps[9::10] if p == 0 else None,
      state_steps=all_steps if p == 0 else None,
    )
    encoded.append(json.dumps(inv.to_json(), sort_keys=True))
  slice_processes = tuple(tuple(range(s * per, (s + 1) * per)) for s in range(slices))
  peer = tuple(s for s in range(slices) if s % 16 == 5)
  local_slices = tuple(s for s in range(slices) if s not in peer)
  expected = {
    "newest_step": all_steps[-1],
    "candidates": steps,
    "local_slices": len(local_slices),
    "peer_slices": len(peer),
    "peer_source": local_slices[0] if peer else None,
    "in_persistent": all_steps[-1] in all_steps[9::10],
  }
  return encoded, slice_processes, expected


def _plan(encoded: list[str], slice_processes, statuses):
  """The planner as a job runs it: each slice's last process to arrive
  summarises its slice (in parallel across slices: the slowest counts), the
  last of those combines the summaries, then every process plans from the job summary."""
  t0 = time.perf_counter()
  invs = [restore_summary.Inventory.from_json(json.loads(e)) for e in encoded]
  t1 = time.perf_counter()
  sums, slice_s = {}, []
  for s, procs in enumerate(slice_processes):
    ts = time.perf_counter()
    values = {p: json.loads(encoded[p]) for p in procs}
    sums[s] = json.loads(json.dumps(restore_summary.slice_summary(s, values, len(procs))))
    slice_s.append(time.perf_counter() - ts)
  t2 = time.perf_counter()
  job_json = json.dumps(restore_summary.job_summary(sums, len(slice_processes)))
  t3 = time.perf_counter()
  cands = restore_plan.candidates(restore_summary.JobInventory.from_json(json.loads(job_json)))
  t4 = time.perf_counter()
  plan = restore_plan.decide(cands[0], statuses, slice_processes) if cands else None
  t5 = time.perf_counter()
  del invs
  times = {
    "parse_s": t1 - t0,
    "slice_summary_max_s": max(slice_s),
    "slice_summaries_s": t2 - t1,
    "combine_s": t3 - t2,
    "candidates_s": t4 - t3,
    "decide_s": t5 - t4,
  }
  return times, cands, plan, len(job_json)


def measure_planner(processes: int, slices: int, steps: int, reps: int) -> dict[str, Any]:
  encoded, slice_processes, expected = planner_inputs(processes, slices, steps)
  statuses: dict = {}  # every process read its copy: nothing reported (gather_sparse)
  runs = []
  for _ in range(reps):
    gc.collect()
    times, cands, plan, job_bytes = _plan(encoded, slice_processes, statuses)
    runs.append(times)
  newest = cands[0] if cands else None
  got = {
    "newest_step": newest.step if newest else None,
    "candidates": len(cands),
    "local_slices": len(newest.local_slices) if newest else None,
    "peer_slices": plan.sources.count(restore_plan.PEER) if plan else None,
    "peer_source": plan.peer_source if plan else None,
    "in_persistent": newest.in_persistent if newest else None,
  }
  # Memory: inventories parsed from JSON, then candidates + decide, under
  # tracemalloc (the encoded JSON, the exchange's output, is the baseline).
  del cands, plan
  gc.collect()
  tracemalloc.start()
  try:
    base = tracemalloc.get_traced_memory()[0]
    invs = [restore_summary.Inventory.from_json(json.loads(e)) for e in encoded]
    held = tracemalloc.get_traced_memory()[0] - base
    cands = restore_plan.candidates(restore_summary.summarize(invs, slice_processes))
    restore_plan.decide(cands[0], statuses, slice_processes)
    peak = tracemalloc.get_traced_memory()[1] - base
  finally:
    tracemalloc.stop()
  del invs, cands

  def med(key: str) -> float:
    return statistics.median(r[key] for r in runs)

  return {
    "k": processes,
    "slices": len(slice_processes),
    "steps": steps,
    # the restore path: the slowest slice summary, the combine,
    # then one process's candidates + decide (on different hosts, in turn)
    "wall_s": med("slice_summary_max_s") + med("combine_s") + med("candidates_s") + med("decide_s"),
    "all_in_one_process_s": med("slice_summaries_s")
    + med("combine_s")
    + med("candidates_s")
    + med("decide_s"),
    "slice_summary_max_s": med("slice_summary_max_s"),
    "combine_s": med("combine_s"),
    "candidates_s": med("candidates_s"),
    "decide_s": med("decide_s"),
    "parse_s": med("parse_s"),
    "job_summary_bytes": job_bytes,
    "reps": runs,
    "inventory_json_bytes_mean": sum(len(e) for e in encoded) / processes,
    "inventories_bytes": held,
    "tracemalloc_peak_bytes": peak,
    "peak_bytes_per_process": peak / processes,
    "result": got,
    "expected": expected,
    "correct": got == expected,
  }


# ---- fits, report ---------------------------------------------------------------------------------
