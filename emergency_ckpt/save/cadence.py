"""Which steps a tier saves when its save_interval_steps is "auto" or it has
a save_interval_s, the same on every process, with no collective per step.

The primary process measures (cadence_costs.py: step times, each tier's
save cost) and decides each tier's interval; the schedule is a list of
segments "from step S on, every k steps" (cadence_schedule.py). Every
process starts from the same schedule, derived from the first step it is
asked about (the same on every process): a save at that step, then every
LOCAL_WARMUP_STEPS (local "auto"), PERSISTENT_WARMUP_STEPS (persistent
"auto"), or none until the primary decided (save_interval_s).

Agreement, through the coordination service:
- the schedule is agreed up to a step, the horizon H, which only grows;
  the first is the first step + the lead (below), the same everywhere;
- the primary changes an interval only after H (change_start), publishes
  the new segment under its own key, then the head {H, its refresh point,
  each tier's newest segment} (one key, overwritten); it extends H to its
  step + lead whenever its step reaches the refresh point (H - lead / 2):
  one call every half lead, plus one per change;
- every other process decides each step up to its H from the schedule it
  knows, and reads the head (one non-blocking call, plus one per new
  segment) at each of its saves from the refresh point on; a process that
  reaches a step past its H without having read a newer head polls for it
  (blocking, up to collective_timeout_s, then CollectiveTimeoutError names
  the primary process).
Since nothing up to H ever changes, two processes never disagree on a step.
The lead is max(MIN_LEAD_STEPS, LEAD_SAVES x the shortest interval in
force, LEAD_SAVES x the primary's last step increment), so a process waits
only when it runs more than half a lead ahead of the primary process (by
then the primary extended H: processes in lockstep never wait).

In a single-process job nothing is published: a change starts at the next
step, and save_interval_s saves the first step at least that long after
the tier's previous save. Every change is logged and recorded as a
`cadence` event (tier, interval_steps, from_step, why) on every process.

Called by: the save pipeline, on the trainer's thread of every process
(decide() at each save() call); built by cadence_job.py. Blocks on
nothing but the rare poll above and, on the primary process, one call
every half lead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from emergency_ckpt.errors import CollectiveTimeoutError
from emergency_ckpt.options.checks import AUTO
from emergency_ckpt.save.cadence_costs import TIERS, CostModel
from emergency_ckpt.save.cadence_schedule import Segment, TierSchedule, change_start
from emergency_ckpt.save.cadence_targets import FailureHistory, Planner
from emergency_ckpt.save.policies import SaveDecision

logger = logging.getLogger("emergency_ckpt")

LEAD_SAVES = 4
"""The horizon runs at least this many of the shortest interval ahead."""
MIN_LEAD_STEPS = 16
"""... and at least this many steps."""
LOCAL_WARMUP_STEPS = 5
"""Local "auto" saves every this many steps until measured (steps without
a write in flight between saves give the step time the costs compare to)."""
PERSISTENT_WARMUP_STEPS = 100
"""Persistent "auto" saves every this many steps until one save's cost is
measured (persistent.save_interval_steps' default)."""
POLL_S = (0.005, 0.2)
"""The first and the longest sleep between two reads of a late head."""


class Channel(Protocol):
  """What the agreement uses of Collectives (signals.py)."""

  def publish(self, name: str, value: str, *, overwrite: bool = False) -> None: ...

  def try_value(self, name: str) -> str | None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierPlan:
  """How one tier's interval is chosen (from its options)."""

  fixed: int | None = None
  """A fixed step interval (neither "auto" nor seconds): step % fixed == 0."""
  auto: bool = False
  """save_interval_steps is "auto"."""
  seconds: float | None = None
  """save_interval_s, if set."""
  budget: float = 0.01
  """local.overhead_budget (local "auto")."""
  mtbf_s: float | None = None
  """persistent.mean_time_between_failures_s (persistent "auto"; None: estimated)."""

  @property
  def managed(self) -> bool:
    """Whether this module schedules the tier."""
    return self.auto or self.seconds is not None

  @classmethod
  def of(cls, options: Any) -> TierPlan:
    """A LocalTierOptions' or PersistentTierOptions' plan."""
    if options.save_interval_s is not None:
      return cls(seconds=float(options.save_interval_s))
    if options.save_interval_steps == AUTO:
      return cls(
        auto=True,
        budget=getattr(options, "overhead_budget", 0.01),
        mtbf_s=getattr(options, "mean_time_between_failures_s", None),
      )
    return cls(fixed=options.save_interval_steps)


def managed(options: Any) -> bool:
  """Whether a manager's options have a tier with "auto" or save_interval_s."""
  return any(TierPlan.of(getattr(options, t)).managed for t in TIERS)


class Cadence:
  """The save decisions of one process (see the module docstring).

  Args:
    plans: {"local": ..., "persistent": ...}.
    deciding: this is the primary process (it measures and decides).
    channel: the coordination service (None: a single-process job).
    prefix: the name of this manager's keys (Collectives.sequenced).
    events: the event log (`cadence` events).
    log_prefix: this process, for log lines.
    primary: the primary process's index (named when it is waited for).
    timeout_s: the longest wait for the primary's schedule.
    history: this run's starts (the MTBF estimate; the primary's).
    clock, wall, sleep: monotonic seconds, time.time, time.sleep (fakes in tests).
    busy: the tiers with save work in flight now (busy_probe).
  """

  def __init__(
    self,
    plans: Mapping[str, TierPlan],
    *,
    deciding: bool,
    channel: Channel | None,
    prefix: str = "cadence",
    events: Any,
    log_prefix: str = "",
    primary: int = 0,
    timeout_s: float = 300.0,
    history: FailureHistory | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    busy: Callable[[], frozenset[str]] = frozenset,
  ):
    self._plans = dict(plans)
    self._deciding = deciding
    self._channel = channel
    self._prefix = prefix
    self._events = events
    self._log_prefix = log_prefix
    self._primary = primary
    self._timeout_s = timeout_s
    self._clock, self._wall, self._sleep, self._busy = clock, wall, sleep, busy
    self.costs = CostModel()
    """The primary's measurements (fed on the deciding process only)."""
    self._planner = Planner(self.costs, history or FailureHistory())
    self._schedules: dict[str, TierSchedule] | None = None  # from the first call
    self._horizon = self._refresh_at = -1
    self._last_s: dict[str, float | None] = {}  # single process, seconds: last save's time
    self.waits = 0
    """How often this process polled for a late head (tests, logs)."""
    self._uploads: list[int] = []  # the primary: steps decided persistent (persistent_steps)
    self._uploads_lock = threading.Lock()

  # ---- every process ---------------------------------------------------------
  def decide(self, step: int, *, force: bool = False) -> SaveDecision:
    """Which tiers save `step`. Called by: every process, at every save()
    call, in step order. Blocks only past its horizon (a poll for the
    primary's head) and, on the primary, on one publish every half lead.

    Raises:
      CollectiveTimeoutError: past its horizon, the primary's head did not
        come within timeout_s.
    """
    now = self._clock()
    if self._schedules is None:
      self._begin(step)
    if self._deciding:
      if step > self._horizon or (self._channel is not None and step >= self._refresh_at):
        self._extend(step)
    elif step > self._horizon:
      self._wait_for(step)
    decision = self._decision(step, now, force)
    if not self._deciding and decision.any and step >= self._refresh_at:
      self._read()
    if self._deciding:
      if decision.persistent:
        with self._uploads_lock:
          self._uploads.append(step)
      busy = self._busy()
      self.costs.call(step, now, busy)
      if not decision.any:
        self.costs.returned(now, (), busy)
        self._plan(step)
    for sched in self._schedules.values():
      if len(sched.segments) > 4:
        sched.forget_before(step)
    return decision

  def saved(self, step: int, decision: SaveDecision) -> None:
    """The save() call of `step` that saved `decision` returns. Called by:
    every process (only the primary measures). Blocks on nothing but, on
    the primary after a change of interval, its publication."""
    if self._deciding:
      tiers = [t for t, on in zip(TIERS, (decision.local, decision.persistent)) if on]
      self.costs.returned(self._clock(), tiers, self._busy())
      self._plan(step)

  def would_save(self, step: int) -> SaveDecision:
    """decide(step) as far as this process knows now, without measuring,
    reading or waiting (exact up to its horizon). Called by: any process."""
    if self._schedules is None:
      return SaveDecision(*(p.managed or step % p.fixed == 0 for p in self._tiers()))
    return self._decision(step, self._clock(), False, peek=True)

  def persistent_steps(self, newer_than: int | None) -> list[int]:
    """The steps decide() sent to the persistent tier (forced ones too)
    newer than `newer_than`; older ones are forgotten. Only the primary
    process keeps them: the state retention of the steps whose upload may
    be in flight (retention/retainer.py). Called by: the primary's commit
    lane. Blocks on nothing."""
    with self._uploads_lock:
      if newer_than is not None:
        self._uploads = [s for s in self._uploads if s > newer_than]
      return list(self._uploads)

  def interval(self, tier: str) -> int | None:
    """The newest interval `tier` follows (None: fixed, or not yet decided)."""
    sched = (self._schedules or {}).get(tier)
    return None if sched is None else sched.latest.every

  # ---- the schedule ----------------------------------------------------------
  def _tiers(self) -> list[TierPlan]:
    return [self._plans[t] for t in TIERS]

  def _begin(self, step: int) -> None:
    """The first schedule, the same on every process."""
    self._schedules = {}
    for tier, plan in self._plans.items():
      if not plan.managed:
        continue
      if plan.seconds is not None and self._channel is None:
        self._last_s[tier] = None  # exact seconds: no schedule
        continue
      warmup = LOCAL_WARMUP_STEPS if tier == "local" else PERSISTENT_WARMUP_STEPS
      every = None if plan.seconds is not None else warmup
      why = {"warm_up": True, **({"save_interval_s": plan.seconds} if plan.seconds else {})}
      self._schedules[tier] = TierSchedule(Segment(step, every, 0, why))
      self._record(tier, self._schedules[tier].latest)
    lead = self._lead() if self._channel is not None else 0
    self._horizon, self._refresh_at = step + lead, step + lead - lead // 2

  def _decision(self, step: int, now: float, force: bool, *, peek: bool = False) -> SaveDecision:
    out = []
    for tier, plan in zip(TIERS, self._tiers()):
      if not plan.managed:
        out.append(step % plan.fixed == 0)
      elif tier in self._last_s:
        last = self._last_s[tier]
        out.append(last is None or now - last >= plan.seconds)
      else:
        out.append(self._schedules[tier].saves(step))
    decision = SaveDecision(force or out[0], force or out[1])
    if not peek:
      for tier, on in zip(TIERS, (decision.local, decision.persistent)):
        if on and tier in self._last_s:
          self._last_s[tier] = now
    return decision

  def _lead(self) -> int:
    intervals = [s.latest.every for s in self._schedules.values() if s.latest.every]
    shortest = min(intervals, default=1)
    return max(MIN_LEAD_STEPS, LEAD_SAVES * shortest, LEAD_SAVES * self.costs.last_increment)

  def _record(self, tier: str, seg: Segment) -> None:
    """Records a tier's new segment as a `cadence` event, which the event
    log also logs (INFO)."""
    self._events.record(
      "cadence", tier=tier, interval_steps=seg.every, from_step=seg.start, why=dict(seg.why)
    )

  # ---- the primary: measure, decide, publish ---------------------------------
  def _extend(self, step: int) -> None:
    """Agrees the schedule further: to `step` (single process), else to
    `step` + lead, published."""
    if self._channel is None:
      self._horizon = max(self._horizon, step)
      return
    lead = self._lead()
    self._horizon = max(self._horizon, step + lead)
    self._refresh_at = self._horizon - lead // 2
    self._publish_head()

  def _publish_head(self) -> None:
    head = {
      "h": self._horizon,
      "r": self._refresh_at,
      "n": {t: s.latest.seq for t, s in self._schedules.items()},
    }
    self._channel.publish(f"{self._prefix}/head", json.dumps(head), overwrite=True)

  def _plan(self, step: int) -> None:
    """Changes the intervals the measurements call for; publishes them."""
    starts = []
    for tier, sched in self._schedules.items():
      change = self._target(tier, step, sched.latest.every)
      if change is None:
        continue
      every, why = change
      start = change_start(sched, self._horizon, every)
      seg = Segment(start, every, sched.latest.seq + 1, why)
      sched.add(seg)
      self.costs.tiers[tier].settle(start)
      if self._channel is not None:
        self._channel.publish(f"{self._prefix}/{tier}/{seg.seq}", seg.to_json())
      self._record(tier, seg)
      starts.append(start)
    if starts and self._channel is not None:
      lead = self._lead()
      self._horizon = max(self._horizon, max(starts) + lead)
      self._refresh_at = self._horizon - lead // 2
      self._publish_head()

  def _target(self, tier: str, step: int, current: int | None) -> tuple[int, dict] | None:
    """The interval `tier` should change to now, with why; None: keep it."""
    plan = self._plans[tier]
    if plan.seconds is not None:
      return self._planner.seconds(plan.seconds, current)
    if tier == "persistent":
      return self._planner.persistent(plan.mtbf_s, self._wall(), current)
    return self._planner.local(plan.budget, step, current)

  # ---- the others: read the primary's schedule -------------------------------
  def _read(self) -> None:
    """Reads the head and any new segments (non-blocking); applies them
    only when every segment it names was read."""
    raw = self._channel.try_value(f"{self._prefix}/head")
    if raw is None:
      return
    try:
      head = json.loads(raw)
      horizon, refresh, newest = int(head["h"]), int(head["r"]), dict(head["n"])
      new = {}
      for tier, sched in self._schedules.items():
        segs = []
        for seq in range(sched.latest.seq + 1, int(newest.get(tier, 0)) + 1):
          text = self._channel.try_value(f"{self._prefix}/{tier}/{seq}")
          if text is None:
            return  # not there yet: the next read takes it
          segs.append(Segment.from_json(text, seq))
        new[tier] = segs
    except (ValueError, KeyError, TypeError) as e:
      logger.warning("%s unreadable save cadence %r: %s", self._log_prefix, raw, e)
      return
    for tier, segs in new.items():
      for seg in segs:
        self._schedules[tier].add(seg)
        self._record(tier, seg)
    if horizon > self._horizon:
      self._horizon, self._refresh_at = horizon, refresh

  def _wait_for(self, step: int) -> None:
    """Polls the head until its horizon reaches `step`."""
    deadline = self._clock() + self._timeout_s
    delay = POLL_S[0]
    self.waits += 1
    while True:
      self._read()
      if self._horizon >= step:
        return
      if self._clock() >= deadline:
        raise CollectiveTimeoutError(
          f"save(step={step}): the primary process (process {self._primary}) published no"
          f" save schedule past step {self._horizon} within {self._timeout_s:.0f}s"
          " (save_interval_steps 'auto' or save_interval_s): it is hung, dead or far"
          " behind this process. Every process must call save() with the same steps."
        )
      self._sleep(delay)
      delay = min(POLL_S[1], 2 * delay)
