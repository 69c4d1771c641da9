"""The save intervals measured costs call for, and how much they must move
before an interval changes. Pure.

- local "auto" (`Planner.local`): the smallest interval whose cost per
  step, one save's cost / k, stays under overhead_budget x the step time
  (`budget_interval`: k >= need) with HEADROOM to spare: k = ceil(need x
  (1 + HEADROOM)). A dead band keeps noise from moving it: it changes to
  that target as soon as the budget is exceeded (k < need), but to a
  shorter one only once k > need x (1 + HEADROOM) / (1 - MARGIN), after
  LOCAL_DECREASE_SAMPLES saves at it. It never shrinks below the steps
  one save's background work runs (shorter, saves would queue behind each
  other, and no step would run without one to compare with), nor back to
  the interval it last grew from within FLOOR_SAVES saves. At most
  LOCAL_MAX_STEPS steps or LOCAL_MAX_S seconds of steps.
- persistent "auto" (`Planner.persistent`): Young and Daly's interval
  sqrt(2 x C x MTBF) seconds (`young_daly_s`), in steps of the measured
  step time (outside save()), at least UPLOAD_HEADROOM x the steps one upload runs; changed
  when it moves by more than PERSISTENT_CHANGE. The MTBF is the option, or
  `mtbf_estimate` from this run's starts (`FailureHistory`).
- save_interval_s (`Planner.seconds`): the smallest interval at least that
  many seconds of the measured step time (outside save(): the save stalls
  only lengthen it) (`seconds_interval`), changed
  when it moves by more than SECONDS_CHANGE.

Called by: save/cadence.py, on the primary process. Blocks on nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from emergency_ckpt.save.cadence_costs import CostModel, TierCosts

DEFAULT_MTBF_S = 24 * 3600.0
"""The mean time between failures assumed for a run that never restarted
(or the run's age, if longer)."""
MIN_MTBF_S = 600.0
"""The least mean time between failures estimated from restarts (a burst of
restarts at start-up is not the failure rate of a running job)."""
LOCAL_MAX_STEPS, LOCAL_MAX_S = 1000, 1800.0
"""Local "auto" never saves less often than every 1000 steps or 30 minutes
of steps: an older local copy protects little."""
MAX_STEPS = 1_000_000
"""The longest persistent or save_interval_s interval, in steps."""
LOCAL_SAMPLES, LOCAL_DECREASE_SAMPLES, PERSISTENT_SAMPLES = 2, 4, 1
"""Saves measured at an interval before it may grow / shrink (local), change (persistent)."""
BLIND_SAMPLES = 3
"""Local saves whose slowdown could not be measured (never a step without a
write in flight) after which the interval doubles."""
HEADROOM, MARGIN = 0.2, 0.25
"""A local interval is HEADROOM longer than the budget needs; it shrinks
only once it is longer than that target by a factor 1 / (1 - MARGIN)."""
FLOOR_SAVES = 50
"""After a local interval grew, it does not shrink back to the one it left
for this many saves."""
PERSISTENT_CHANGE, SECONDS_CHANGE = 0.2, 0.1
"""Least relative change of a persistent "auto" / save_interval_s interval."""
STEP_SAMPLES = 3
"""Step times measured before save_interval_s is first turned into steps."""
UPLOAD_HEADROOM = 1.25
"""A persistent "auto" interval spans at least this many times the steps one
upload runs (a step that comes while the last upload runs is skipped)."""


def budget_interval(cost_s: float, step_s: float, budget: float) -> float:
  """The interval (in steps, not rounded) at which saves cost `budget` of the
  step time: cost_s / (budget x step_s). At a longer interval they cost less.

  Args:
    cost_s: one save's cost (stall plus slowdown), seconds.
    step_s: a step's time without save work in flight, seconds.
    budget: the share of the step time saves may cost (0 < budget < 1).
  """
  return cost_s / (budget * max(step_s, 1e-9))


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
  """Young and Daly's checkpoint interval, sqrt(2 x cost_s x mtbf_s) seconds:
  the interval that minimizes the expected time lost to saves plus the work
  redone after failures, for a save cost small beside the MTBF.

  Args:
    cost_s: one save's cost to the trainer, seconds.
    mtbf_s: the mean time between failures, seconds.
  """
  return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def seconds_interval(seconds: float, step_s: float, cap: int) -> int:
  """The smallest step interval at least `seconds` long at `step_s` per
  step, within [1, cap]."""
  return max(1, min(cap, math.ceil(seconds / max(step_s, 1e-9) - 1e-9)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailureHistory:
  """What the manager knows of this run's failures at its start (the
  primary process keeps it in the persistent root's run.json)."""

  first_start: float | None = None
  """Wall time (time.time()) of this run's first manager start, or None."""
  starts: int = 1
  """Manager starts of this run, this one included: starts - 1 restarts."""

  @classmethod
  def after(cls, previous: Mapping[str, Any] | None, run_id: str, now: float) -> FailureHistory:
    """The history once this start is counted.

    Args:
      previous: run.json's record before this start (None: none), whose
        "first_start" and "starts" count only if its run_id is `run_id`.
      run_id: this run's id.
      now: this start's wall time.
    """
    prev = previous if previous and previous.get("run_id") == run_id else {}
    first, starts = prev.get("first_start"), prev.get("starts")
    ok = isinstance(first, (int, float)) and not isinstance(first, bool) and first <= now
    n = starts if isinstance(starts, int) and not isinstance(starts, bool) and starts >= 1 else 0
    if not ok:
      return cls(first_start=now, starts=1)
    return cls(first_start=float(first), starts=n + 1)

  def as_record(self) -> dict:
    """The fields run.json keeps ("first_start", "starts")."""
    return {"first_start": self.first_start, "starts": self.starts}


def mtbf_estimate(option_s: float | None, history: FailureHistory, now: float) -> tuple[float, str]:
  """The mean time between failures to plan with, and where it came from.

  Args:
    option_s: persistent.mean_time_between_failures_s (None: estimate).
    history: this run's starts.
    now: the wall time.

  Returns:
    (seconds, source): the option ("option"); else the run's age over its
    restarts, at least MIN_MTBF_S ("restarts"); else, never restarted,
    DEFAULT_MTBF_S or the run's age if longer ("default").
  """
  if option_s is not None:
    return float(option_s), "option"
  age = max(0.0, now - history.first_start) if history.first_start is not None else 0.0
  if history.starts >= 2:
    return max(MIN_MTBF_S, age / (history.starts - 1)), "restarts"
  return max(DEFAULT_MTBF_S, age), "default"


def _r(x: float | None) -> float | None:
  return None if x is None else round(x, 6)


class Planner:
  """The primary process's interval decisions (see the module docstring).

  Args:
    costs: its measurements.
    history: this run's starts (for the MTBF estimate).
  """

  def __init__(self, costs: CostModel, history: FailureHistory):
    self._costs = costs
    self._history = history
    self._floor: tuple[int, int] | None = None  # (local interval left, until step)

  def seconds(self, seconds: float, current: int | None) -> tuple[int, dict] | None:
    """save_interval_s's interval in steps, if it should change from `current`."""
    m = self._costs
    if m.step_s.count < STEP_SAMPLES:
      return None
    k = seconds_interval(seconds, m.step_s.value, MAX_STEPS)
    if current is not None and abs(k - current) <= SECONDS_CHANGE * current:
      return None
    return k, {"save_interval_s": seconds, "step_s": _r(m.step_s.value)}

  def local(self, budget: float, step: int, current: int) -> tuple[int, dict] | None:
    """Local "auto"'s interval, if it should change from `current` at `step`."""
    c: TierCosts = self._costs.tiers["local"]
    idle, step_s = self._costs.idle_step_s.value, self._costs.step_s.value
    cap = LOCAL_MAX_STEPS
    if step_s is not None:
      cap = max(1, min(LOCAL_MAX_STEPS, int(LOCAL_MAX_S // step_s)))
    if idle is None:
      if c.blind < BLIND_SAMPLES or current >= cap:
        return None
      why = "no step ran without a local write in flight: the writes outlast the interval"
      return min(cap, 2 * current), {"reason": why, "stall_s": _r(c.stall.value)}
    if c.samples < LOCAL_SAMPLES:
      return None
    cost = c.estimate
    need = budget_interval(cost, idle, budget)
    target = max(1, math.ceil(need * (1 + HEADROOM) - 1e-9))
    if self._floor is not None and step >= self._floor[1]:
      self._floor = None
    if current < need - 1e-9 and current < cap:  # over the budget
      k = min(cap, target)
      self._floor = (current, step + FLOOR_SAVES * k)
    elif current > need * (1 + HEADROOM) / (1 - MARGIN) and c.samples >= LOCAL_DECREASE_SAMPLES:
      background = round(c.busy_steps.value or 1.0)  # steps one save's work runs
      k = max(target, background, self._floor[0] + 1 if self._floor else 1)
      if k >= current:
        return None
    else:
      return None
    why = {
      "cost_s": _r(cost),
      "stall_s": _r(c.stall.value),
      "slowdown_s": _r(c.slowdown.value),
      "step_s": _r(idle),
      "overhead_budget": budget,
      "background_steps": _r(c.busy_steps.value),
      "overhead": _r(cost / (k * idle)) if idle > 0 else None,
      **({"capped": True} if need > cap else {}),
    }
    return k, why

  def persistent(
    self, mtbf_option_s: float | None, now_wall: float, current: int
  ) -> tuple[int, dict] | None:
    """Persistent "auto"'s interval, if it should change from `current`."""
    c: TierCosts = self._costs.tiers["persistent"]
    step_s = self._costs.step_s.value
    if c.samples < PERSISTENT_SAMPLES or not step_s:
      return None
    cost = c.estimate
    mtbf, source = mtbf_estimate(mtbf_option_s, self._history, now_wall)
    tau = young_daly_s(cost, mtbf)
    busy = c.busy_steps.value or 0.0
    cap = max(1, min(MAX_STEPS, int(mtbf // step_s)))
    k = min(cap, max(1, round(tau / step_s), math.ceil(UPLOAD_HEADROOM * busy - 1e-9)))
    if abs(k - current) <= PERSISTENT_CHANGE * current:
      return None
    why = {
      "cost_s": _r(cost),
      "stall_s": _r(c.stall.value),
      "slowdown_s": _r(c.slowdown.value),
      "mtbf_s": _r(mtbf),
      "mtbf_from": source,
      "young_daly_s": _r(tau),
      "step_s": _r(step_s),
      "upload_steps": _r(busy),
    }
    return k, why
