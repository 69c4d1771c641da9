"""Goodput of a run, from its event logs (for `emergency-ckpt report`).

Goodput is the share of the wall time that trained the model. An
incarnation is one process's life: from a `run_start` event to the next
`run_start` of the same process. Each incarnation's wall time (its first
event, or its manager's construction, to its last event) splits into:

- productive: training (the `progress` events' train_s; without them the
  trainer's `train_step` events' duration_s), less the lost work below;
- save stalls: time inside save() (`progress` stall_s; without them the
  `save` events' stall_s);
- restore: the `restore` events' duration_s;
- start-up: the `startup` event's startup_s (construction to the end of
  the first restore, less the restore, plus the first save() call); an
  incarnation that ended before it recorded one spent its whole life
  starting up;
- lost work: what the next incarnation redid: the steps it trained past the
  step the next incarnation restored (its newest step, from `progress`
  last_step, `save` and `train_step` events, minus the restored step),
  each at its `train_step` duration_s, else at the incarnation's mean step
  time (train_s / steps of its `progress` events);
- other: the rest (after the last save, close(), ...).

Per process, the run's wall time also holds the time outside its
incarnations (down: restarts, waiting for machines). The run's goodput is
that of the process with the lowest. An incarnation whose log ends without
a closed `progress` event ended without close(): a failure when the process
started again later, or when the logs carry goodput events at all (then
the last one failed too, or still runs).

Called by: report.py's summarize_events and _report_text. Pure.
"""

from __future__ import annotations

import math
from typing import Any

from emergency_ckpt.cli._output import Style, grid, secs

PARTS = ("productive_s", "stall_s", "restore_s", "startup_s", "lost_s", "other_s")
"""What an incarnation's wall time splits into."""


def _num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _total(events: list[dict[str, Any]], key: str) -> float:
  return float(sum(e[key] for e in events if _num(e.get(key))))


def _split(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
  """One process's events (by time) cut at each run_start; events before
  the first run_start join the first incarnation."""
  groups: list[list[dict[str, Any]]] = []
  for e in events:
    if not groups or (
      e["event"] == "run_start" and any(x["event"] == "run_start" for x in groups[-1])
    ):
      groups.append([])
    groups[-1].append(e)
  return groups


def _incarnation(events: list[dict[str, Any]], t0: float, aware: bool) -> dict[str, Any]:
  """An incarnation's own numbers (lost work is charged later, by the next one)."""

  def of(kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]

  progress, saves, trained = of("progress"), of("save"), of("train_step")
  trained = [e for e in trained if _num(e.get("step"))]
  begin, end = events[0]["time"], max(e["time"] for e in events)
  startup = next(iter(of("startup")), None)
  if startup is not None:  # the manager's construction began before its run_start
    age = startup.get("age_s")
    if not _num(age):  # older logs: recorded as the start-up ended
      age = _total([startup], "startup_s") + _total([startup], "restore_s")
    begin = min(begin, startup["time"] - age)
  wall = end - begin
  restores = of("restore")
  restore_s = _total(restores, "duration_s")
  restored = [r for r in restores if r.get("error") is None and _num(r.get("step"))]
  if progress:
    train_s, stall_s = _total(progress, "train_s"), _total(progress, "stall_s")
    steps = int(_total(progress, "steps"))
  elif any(_num(e.get("duration_s")) for e in trained):
    train_s, stall_s, steps = _total(trained, "duration_s"), _total(saves, "stall_s"), len(trained)
  else:
    train_s, stall_s, steps = None, _total(saves, "stall_s"), 0
  if startup is not None:
    startup_s = _total([startup], "startup_s")
  else:  # it never finished starting (when the logs record start-ups at all)
    startup_s = max(0.0, wall - restore_s - stall_s) if aware else None
  known = [train_s, stall_s, restore_s, startup_s]
  newest = [e["last_step"] for e in progress if _num(e.get("last_step"))]
  return {
    "process": events[0].get("process"),
    "slice": events[0].get("slice"),
    "began_s": begin - t0,
    "ended_s": end - t0,
    "wall_s": wall,
    "closed": any(e.get("closed") is True for e in progress),
    "failed": False,  # set by goodput_summary
    "steps": steps,
    "train_s": train_s,
    "productive_s": train_s,
    "stall_s": stall_s,
    "restore_s": restore_s,
    "startup_s": startup_s,
    "restored_step": restored[0]["step"] if restored else None,
    "restored_at_s": restored[0]["time"] - t0 if restored else None,
    "newest_step": max(
      [*newest, *(e["step"] for e in saves if _num(e.get("step"))), *(e["step"] for e in trained)],
      default=None,
    ),
    "lost_steps": 0,
    "lost_s": 0.0 if train_s is not None else None,
    "other_s": max(0.0, wall - sum(x for x in known if x is not None)),
    "goodput_pct": None,
    "_progress_step": max(newest, default=None),
    "_trained": [(e["step"], e.get("duration_s")) for e in trained],
    # it started (startup recorded) and restored nothing: training began again
    "_started_fresh": startup is not None and not restored,
  }


def _charge_lost(inc: dict[str, Any], restored_step: int) -> None:
  """The work `inc` did past `restored_step` (the next incarnation's restore), redone."""
  newest = inc["newest_step"]
  if newest is None or newest <= restored_step:
    return
  inc["lost_steps"] = redone = newest - restored_step
  shown = inc["_progress_step"]  # steps up to it are in train_s; later ones never were
  durations = [(s, d) for s, d in inc["_trained"] if s > restored_step and _num(d)]
  if durations:
    lost = sum(d for _, d in durations)
    in_train = lost if shown is None else sum(d for s, d in durations if s <= shown)
  elif inc["steps"] and inc["train_s"] is not None:
    per_step = inc["train_s"] / inc["steps"]
    lost = redone * per_step
    in_train = max(0, min(shown if shown is not None else restored_step, newest) - restored_step)
    in_train *= per_step
  else:
    inc["lost_s"] = None
    return
  inc["lost_s"] = lost
  if inc["productive_s"] is not None:
    inc["productive_s"] = max(0.0, inc["productive_s"] - in_train)
  inc["other_s"] = max(0.0, inc["other_s"] - (lost - in_train))


def _sum(rows: list[dict[str, Any]], key: str) -> float | None:
  values = [r[key] for r in rows if r[key] is not None]
  return float(sum(values)) if values else None


def _pct(part: float | None, whole: float) -> float | None:
  return None if part is None or whole <= 0 else 100.0 * part / whole


def goodput_summary(events: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
  """The run's goodput, per process and per incarnation.

  Args:
    events: the run's events with a time, every process's (telemetry's schema).
    t0: the run's start (event time; wall_start if earlier); times are relative to it.
    t1: the run's end (the last event).

  Returns:
    The run's figures (those of `process`, the process with the lowest
    goodput): wall_s, productive_s, stall_s, restore_s, startup_s, lost_s,
    lost_steps, down_s, other_s, goodput_pct (None without any training
    time in the logs); `per_process`: the same per process; `incarnations`:
    per incarnation (process, slice, began_s, ended_s, wall_s, closed,
    failed, steps, train_s, restored_step, newest_step and the parts).
  """
  wall = t1 - t0
  aware = any(e["event"] in ("startup", "progress") for e in events)
  by_process: dict[int, list[dict[str, Any]]] = {}
  for e in sorted(events, key=lambda e: e["time"]):
    if isinstance(e.get("process"), int):
      by_process.setdefault(e["process"], []).append(e)
  incarnations, per_process = [], []
  for p, mine in sorted(by_process.items()):
    rows = [_incarnation(g, t0, aware) for g in _split(mine)]
    for i, row in enumerate(rows):
      row["index"] = i
      later = rows[i + 1] if i + 1 < len(rows) else None
      if later is not None and later["restored_step"] is not None:
        _charge_lost(row, later["restored_step"])
      elif later is not None and later["_started_fresh"]:  # nothing restored: all of it redone
        _charge_lost(row, row["restored_step"] or 0)
      row["failed"] = not row["closed"] and (later is not None or aware)
    for row in rows:
      row["goodput_pct"] = _pct(row["productive_s"], row["wall_s"])
      del row["_progress_step"], row["_trained"], row["_started_fresh"]
    incarnations += rows
    total = {k: _sum(rows, k) for k in PARTS}
    total["lost_steps"] = sum(r["lost_steps"] for r in rows)
    total["down_s"] = max(0.0, wall - sum(r["wall_s"] for r in rows))
    per_process.append(
      {
        "process": p,
        "slice": rows[0]["slice"],
        "incarnations": len(rows),
        "failures": sum(r["failed"] for r in rows),
        "wall_s": wall,
        **total,
        "goodput_pct": _pct(total["productive_s"], wall),
      }
    )
  known = [r for r in per_process if r["goodput_pct"] is not None]
  worst = min(known, key=lambda r: r["goodput_pct"], default=None)
  run = {k: None for k in ("process", *PARTS, "lost_steps", "down_s", "goodput_pct")}
  if worst is not None:
    run.update({k: worst[k] for k in run})
  return {**run, "wall_s": wall, "per_process": per_process, "incarnations": incarnations}


def fill_redone(restores: list[dict[str, Any]], g: dict[str, Any]) -> None:
  """Gives the report's restores that have no redone steps (no train_step
  events) those of the incarnation before the restoring one, if known.

  Args:
    restores: summarize_events' restore rows (process, at_s, redone_steps, ...).
    g: goodput_summary's result.
  """
  incs = g["incarnations"]
  for prev, inc in zip(incs, incs[1:]):
    if prev["process"] != inc["process"] or inc["restored_at_s"] is None:
      continue
    for r in restores:
      if (r["process"], r["at_s"]) == (inc["process"], inc["restored_at_s"]):
        if r["redone_steps"] is None:
          r["newest_trained"] = prev["newest_step"]
          r["redone_steps"], r["redone_s"] = prev["lost_steps"], prev["lost_s"]


def goodput_lines(g: dict[str, Any], style: Style) -> list[str]:
  """The report's goodput lines: the run's figure, where the rest went, and
  a table of incarnations (when the logs have training times).

  Args:
    g: goodput_summary's result.
    style: the output's styles.

  Returns:
    The lines.
  """
  if g["goodput_pct"] is None:
    return [
      "goodput              - (no progress or train_step events: call save() every"
      " step, with event_log set)"
    ]

  def s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"

  def sp(key: str, *more: str) -> str:  # seconds, (share of the wall time, more)
    share = _pct(g[key], g["wall_s"])
    notes = [*([f"{share:.1f} %"] if share is not None else []), *more]
    return s(g[key]) + (f" ({', '.join(notes)})" if notes else "")

  redone = f"{g['lost_steps']} steps"

  out = [
    f"goodput              {g['goodput_pct']:.2f} % (process {g['process']}:"
    f" {s(g['productive_s'])} productive of {s(g['wall_s'])} wall time)",
    f"time lost            save stalls {sp('stall_s')}, restores {sp('restore_s')},"
    f" start-up {sp('startup_s')}, redone work {sp('lost_s', redone)},"
    f" down {sp('down_s')}, other {sp('other_s')}",
    "",
    style("goodput per incarnation", "bold"),
  ]
  ended = {(True, False): "close", (False, True): "no close: FAILED", (False, False): "no close"}
  out.append(
    grid(
      [
        "process",
        "slice",
        "began at s",
        "wall s",
        "productive s",
        "stall s",
        "restore s",
        "start-up s",
        "redone steps",
        "redone s",
        "other s",
        "goodput %",
        "ended",
      ],
      [
        [
          r["process"],
          r["slice"],
          f"{r['began_s']:.1f}",
          secs(r["wall_s"], 1),
          secs(r["productive_s"], 1),
          secs(r["stall_s"], 2),
          secs(r["restore_s"], 2),
          secs(r["startup_s"], 2),
          r["lost_steps"],
          secs(r["lost_s"], 2),
          secs(r["other_s"], 1),
          secs(r["goodput_pct"], 1),
          ended[(r["closed"], r["failed"])],
        ]
        for r in g["incarnations"]
      ],
      style,
      lambda h, v: ("red",) if h == "ended" and "FAILED" in v else (),
    )
  )
  return out
