"""Outages of a tier, found in a run's event logs (for `emergency-ckpt report`).

A tier is out while the steps saved to it stop becoming durable: an outage
is a run of consecutive steps of the tier (in step order, every process's
events together) of which none became durable and at least one was skipped
(`save_skipped`: the persistent tier's upload was still in flight) or
failed (`save_failed`, or `save_durable` with an error). It began when the
first of those steps was saved, and the tier caught up when the next step
saved to it became durable; an outage with no such step is still going at
the end of the logs.
"""

from __future__ import annotations

import math
from typing import Any


def _num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def find_outages(events: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
  """Every outage of every tier in `events`, oldest first.

  Args:
    events: the run's events (telemetry's schema), every process's.
    t0: the run's start (event time); each outage's times are relative to it.

  Returns:
    One dict per outage: tier, began_s, ended_s (None while still out),
    duration_s (None while still out), steps (the steps that never became
    durable), skipped and failed (step counts), caught_up_step (the first
    durable step after it) and catch_up_s (from that step's save to its
    durable record: how long the tier took to hold a step again).
  """
  saved: dict[str, dict[int, float]] = {}  # tier -> step -> first save time
  durable: dict[str, dict[int, float]] = {}  # tier -> step -> first durable time
  skipped: dict[str, set[int]] = {}
  failed: dict[str, set[int]] = {}
  for e in sorted(events, key=lambda e: e["time"]):
    step, kind = e.get("step"), e["event"]
    if not _num(step):
      continue
    if kind == "save":
      for tier in e.get("tiers") or []:
        saved.setdefault(tier, {}).setdefault(step, e["time"])
      continue
    tier = e.get("tier")
    if not isinstance(tier, str):
      continue
    if kind == "save_skipped":
      skipped.setdefault(tier, set()).add(step)
    elif kind == "save_failed" or (kind == "save_durable" and e.get("error") is not None):
      failed.setdefault(tier, set()).add(step)
    elif kind == "save_durable":
      durable.setdefault(tier, {}).setdefault(step, e["time"])
    else:
      continue
    saved.setdefault(tier, {}).setdefault(step, e["time"])
  out = []
  for tier in sorted(set(skipped) | set(failed)):
    times, ok = saved.get(tier, {}), durable.get(tier, {})
    bad = skipped.get(tier, set()) | failed.get(tier, set())
    run: list[int] = []
    for step in sorted(times) + [None]:
      if step is not None and step not in ok:
        run.append(step)
        continue
      if run and bad.intersection(run):
        began = times[run[0]]
        ended = None if step is None else ok[step]
        out.append(
          {
            "tier": tier,
            "began_s": began - t0,
            "ended_s": None if ended is None else ended - t0,
            "duration_s": None if ended is None else ended - began,
            "steps": run,
            "skipped": len(skipped.get(tier, set()).intersection(run)),
            "failed": len(failed.get(tier, set()).intersection(run)),
            "caught_up_step": step,
            "catch_up_s": None if ended is None else ended - times[step],
          }
        )
      run = []
  return sorted(out, key=lambda o: o["began_s"])
