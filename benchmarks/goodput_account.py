"""The goodput study's pure parts: the failure schedule and the accounting.

`failure_times(seed, mtbf_s, duration_s)`: when the study kills the job,
in seconds from a run's start: exponential inter-arrival times with mean
`mtbf_s` (a Poisson process), from `random.Random(seed)` alone, so every
configuration of a seed meets the same failures.

`account_process(records, windows, final_step)`: where one process's wall
time went, from its timeline (the records the trainer appends,
benchmarks/goodput_job.py) and the driver's incarnation windows. Incarnation
k runs in the window [begin_k, end_k]: begin_k is the previous window's end
(the kill, or the run's start), end_k its own kill or the run's deadline. Its
time splits into:

- restore+startup: begin_k to its first train step's start (the kill's
  clean-up, the relaunch, imports, jax.distributed, the manager, the
  restore, compilation); all of the window if it never trained;
- productive: the train steps it kept: those past the step it restored and
  at most the step the job restored next (the smallest step any later
  incarnation restored, or the run's final step);
- redone: the train steps past that bound (trained again later), and for a
  killed incarnation the part of a step it was computing when killed;
- stall: time inside save() (every call), and a save() a kill interrupted;
- other: the rest (the loop between save() and the next step, a step cut
  off by the deadline, steps of one process past the job's final step).

The parts add up to the window. `goodput_pct(final_step, step_s, wall_s)`
is the study's headline figure: the final step reached times the fixed step
time, over the wall time; the productive time is its cross-check (each kept
step timed as it ran, so a little above final_step x step_s).

`summarize(rows)` gives the median over seeds per configuration, and
`table`, `row_cells` and `summary_cells` the printed tables.

Called by: benchmarks/goodput.py (the driver) and tests. Pure: no I/O.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

PARTS = ("productive_s", "stall_s", "restore_startup_s", "redone_s", "other_s")
"""What a process's wall time splits into (they add up to it)."""
COLUMNS = ("goodput %", "stalls s", "restore+startup s", "redone s", "failures")
"""The printed tables' figures (then "check %" and "report %")."""


def failure_times(seed: int, mtbf_s: float, duration_s: float) -> list[float]:
  """The failures of a run, in seconds from its start, ascending, each in
  [0, duration_s): a Poisson process of mean inter-arrival `mtbf_s`.

  Args:
    seed: the schedule's seed (the same seed gives the same times).
    mtbf_s: the mean time between failures, > 0.
    duration_s: the run's length, >= 0.

  Returns:
    The failure times.

  Raises:
    ValueError: mtbf_s <= 0 or duration_s < 0.
  """
  if not mtbf_s > 0 or not duration_s >= 0:
    raise ValueError(f"need mtbf_s > 0 and duration_s >= 0, got {mtbf_s!r}, {duration_s!r}")
  rng = random.Random(f"goodput-failures-{seed}")
  out: list[float] = []
  t = rng.expovariate(1.0 / mtbf_s)
  while t < duration_s:
    out.append(t)
    t += rng.expovariate(1.0 / mtbf_s)
  return out


def goodput_pct(final_step: int, step_s: float, wall_s: float) -> float | None:
  """100 x final_step x step_s / wall_s (None for no wall time)."""
  return 100.0 * final_step * step_s / wall_s if wall_s > 0 else None


def _of(records: list[dict[str, Any]], inc: int, kind: str) -> list[dict[str, Any]]:
  return [r for r in records if r.get("inc") == inc and r.get("ev") == kind]


def restored_step(records: list[dict[str, Any]], inc: int) -> int | None:
  """The step incarnation `inc` resumed from (0: a fresh start), or None
  if it was killed before it knew."""
  done = _of(records, inc, "restored")
  return int(done[0]["step"]) if done else None


def reached_step(records: list[dict[str, Any]], inc: int, deadline: float) -> int | None:
  """The newest step incarnation `inc` holds at `deadline`: its last train
  step finished by then, else the step it restored (None: neither)."""
  steps = [r["step"] for r in _of(records, inc, "step") if r["t1"] <= deadline]
  if steps:
    return max(steps)
  return restored_step(records, inc)


def account_process(
  records: list[dict[str, Any]], windows: list[dict[str, Any]], final_step: int
) -> dict[str, Any]:
  """Where one process's wall time went (module docstring).

  Args:
    records: the process's timeline: dicts with `inc` (incarnation) and
      `ev`: "restored" (step, t0, t1: the restore() call, or a fresh start
      with step 0), "step" (step, t0, t1: one train step), "save" (step, t0,
      t1: one save() call).
    windows: per incarnation, in order: {"inc", "begin", "end", "killed"}
      (unix seconds; `killed`: a failure ended it, not the deadline).
    final_step: the job's final step (every process holds it at the end).

  Returns:
    The parts (PARTS), wall_s (the windows' span), restore_s (time in
    restore(), part of restore_startup_s), kept_steps (steps counted as
    productive; final_step when every kept step was trained once), redone
    steps, and per incarnation its restored step, bound and parts.
  """
  restores = [restored_step(records, w["inc"]) for w in windows]
  totals = dict.fromkeys(PARTS, 0.0)
  totals["restore_s"] = 0.0
  kept_steps = redone_steps = 0
  rows = []
  for k, w in enumerate(windows):
    begin, end, inc = w["begin"], w["end"], w["inc"]
    later = [r for r in restores[k + 1 :] if r is not None]
    bound = min([*later, final_step])
    start = restores[k]
    steps = sorted((r for r in _of(records, inc, "step") if r["t1"] <= end), key=lambda r: r["t0"])
    saves = sorted((r for r in _of(records, inc, "save") if r["t1"] <= end), key=lambda r: r["t0"])
    part = dict.fromkeys(PARTS, 0.0)
    part["restore_startup_s"] = (steps[0]["t0"] if steps else end) - begin
    part["restore_s"] = sum(
      r["t1"] - r["t0"] for r in _of(records, inc, "restored") if r["t1"] <= end
    )
    kept = redone = 0
    for r in steps:
      d = r["t1"] - r["t0"]
      if (start is None or r["step"] > start) and r["step"] <= bound:
        part["productive_s"] += d
        kept += 1
      elif r["step"] > bound and w["killed"]:
        part["redone_s"] += d
        redone += 1
      # else: a step past the job's final step at the deadline (other)
    part["stall_s"] = sum(r["t1"] - r["t0"] for r in saves)
    if steps:
      last_step_end = steps[-1]["t1"]
      last_save_end = saves[-1]["t1"] if saves else -float("inf")
      tail = end - max(last_step_end, last_save_end)
      if last_save_end < last_step_end:  # cut off inside save()
        part["stall_s"] += tail
      elif w["killed"]:  # cut off while computing a step: lost
        part["redone_s"] += tail
    part["other_s"] = (end - begin) - sum(part[p] for p in PARTS if p != "other_s")
    for p in (*PARTS, "restore_s"):
      totals[p] += part[p]
    kept_steps += kept
    redone_steps += redone
    rows.append(
      {
        "inc": inc,
        "killed": w["killed"],
        "restored_step": start,
        "kept_up_to": bound,
        "trained_steps": len(steps),
        "kept_steps": kept,
        "redone_steps": redone,
        **part,
      }
    )
  wall = windows[-1]["end"] - windows[0]["begin"] if windows else 0.0
  return {
    "wall_s": wall,
    **totals,
    "kept_steps": kept_steps,
    "redone_steps": redone_steps,
    "incarnations": rows,
  }


def final_step(per_process: list[list[dict[str, Any]]], last_inc: int, deadline: float) -> int:
  """The job's final step: the newest step every process holds at the
  deadline (the last incarnation's last train step, else its restored
  step; 0 if a process holds neither)."""
  reached = [reached_step(records, last_inc, deadline) for records in per_process]
  return min((r if r is not None else 0) for r in reached) if reached else 0


# ---- the driver's rows: summary and tables -----------------------------------
def row_cells(row: dict[str, Any]) -> list[str]:
  """A run's figures (COLUMNS, check %, report %), as table cells."""
  if not row.get("available", True):
    return ["not available"] + [""] * (len(COLUMNS) + 1)
  if row.get("error"):
    return ["error"] + [""] * (len(COLUMNS) + 1)
  b = row["breakdown"]
  report = row.get("report") or {}
  return [
    f"{row['goodput_pct']:.1f}",
    f"{b['stall_s']:.1f}",
    f"{b['restore_startup_s']:.1f}",
    f"{b['redone_s']:.1f}",
    f"{row['failures']}",
    f"{row['check_goodput_pct']:.1f}",
    "-"
    if report.get("productive_pct_of_run_wall") is None
    else f"{report['productive_pct_of_run_wall']:.1f}",
  ]


def table(rows: list[list[str]]) -> str:
  """A plain-text table of rows of cells (the configuration first)."""
  head = ["configuration", *COLUMNS, "check %", "report %"]
  widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
  lines = [
    "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    for r in [head, *rows]
  ]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per configuration, the median over seeds of each figure (runs that
  ended in an error left out and counted)."""
  out = []
  for name in dict.fromkeys(r["config"] for r in rows):
    mine = [r for r in rows if r["config"] == name]
    good = [r for r in mine if r.get("available", True) and not r.get("error")]
    entry: dict[str, Any] = {
      "config": name,
      "runs": len(good),
      "errors": sum(bool(r.get("error")) for r in mine),
      "available": all(r.get("available", True) for r in mine),
    }
    if good:

      def med(values: list[float | None]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

      entry.update(
        {
          "goodput_pct": med([r["goodput_pct"] for r in good]),
          "stall_s": med([r["breakdown"]["stall_s"] for r in good]),
          "restore_startup_s": med([r["breakdown"]["restore_startup_s"] for r in good]),
          "redone_s": med([r["breakdown"]["redone_s"] for r in good]),
          "failures": med([r["failures"] for r in good]),
          "check_goodput_pct": med([r["check_goodput_pct"] for r in good]),
          "report_pct": med(
            [(r.get("report") or {}).get("productive_pct_of_run_wall") for r in good]
          ),
        }
      )
    out.append(entry)
  return out


def summary_cells(s: dict[str, Any]) -> list[str]:
  """A summarize() entry as table cells, its configuration first."""
  if not s["available"]:
    return [s["config"], "not available"] + [""] * (len(COLUMNS) + 1)
  if not s["runs"]:
    return [s["config"], "error"] + [""] * (len(COLUMNS) + 1)

  def f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)

  return [
    s["config"],
    f(s["goodput_pct"]),
    f(s["stall_s"]),
    f(s["restore_startup_s"]),
    f(s["redone_s"]),
    f(s["failures"], "g"),
    f(s["check_goodput_pct"]),
    f(s["report_pct"]),
  ]
