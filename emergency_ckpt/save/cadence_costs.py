"""What saves cost the trainer, measured from its save() calls, and the
save intervals those costs call for. Pure: a clock and a probe of the work
in flight come in from outside (fakes in tests).

A trainer calls save() every step, so the manager sees each step as the
time between two save() calls: the time outside save() is the step's
training, the time inside it the save's stall. A save costs the trainer
its stall plus its slowdown: how much longer the steps that run while its
background work is in flight (a local write or redundancy send, an upload)
take than the steps with nothing in flight (`CostModel`). Each estimate is
an exponentially weighted mean (`Ewma`), so one odd step (an evaluation
pause, a restore) moves it little.

The intervals these costs call for are cadence_targets.py's.

Called by: save/cadence.py, on the process that decides the cadence (the
primary process). Blocks on nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

ALPHA = 0.2
"""Weight of a new observation in each mean: about the last ten count."""

STEP_CLIP = 4.0
"""A step time above this multiple of its mean counts as this multiple (an
evaluation pause or a restore between two save() calls is not the step)."""

TIERS = ("local", "persistent")


class Ewma:
  """An exponentially weighted mean.

  Args:
    clip: a new value above `clip` times the mean counts as that (None: as
      is); the first value is taken as is.
  """

  def __init__(self, clip: float | None = None):
    self.value: float | None = None
    self.count = 0
    self._clip = clip

  def update(self, x: float) -> None:
    """Adds the observation `x`."""
    if self._clip is not None and self.value is not None and self.value > 0:
      x = min(x, self._clip * self.value)
    self.value = x if self.value is None else self.value + ALPHA * (x - self.value)
    self.count += 1


@dataclasses.dataclass
class TierCosts:
  """One tier's measured costs. A save's observation closes at the tier's
  next save: its stall, and the slowdown of the steps in between."""

  stall: Ewma = dataclasses.field(default_factory=Ewma)
  """save() stall per save of the tier (seconds)."""
  cost: Ewma = dataclasses.field(default_factory=Ewma)
  """Stall plus slowdown per save (seconds)."""
  slowdown: Ewma = dataclasses.field(default_factory=Ewma)
  """Slowdown per save (seconds): the extra time of the steps with its work
  in flight over as many steps without (noise may make one negative)."""
  busy_steps: Ewma = dataclasses.field(default_factory=Ewma)
  """Steps with the tier's work in flight, per save."""
  excess_per_busy_step: Ewma = dataclasses.field(default_factory=Ewma)
  """Extra seconds of a step with only this tier's work in flight."""
  samples: int = 0
  """Observations closed since `settle_from` (an interval change)."""
  blind: int = 0
  """Observations since `settle_from` that could not measure the slowdown
  (their steps were all busy before any idle step was seen)."""
  settle_from: int = 0
  """Observations of saves from this step on count in samples and blind."""
  open_step: int | None = None
  """The save whose observation is open (None before the first)."""
  open_stall: float = 0.0
  open_excess: float = 0.0
  open_busy: int = 0
  open_blind: bool = False

  @property
  def estimate(self) -> float | None:
    """One save's cost to plan with: the mean cost, at least the mean stall
    (noise in the step times may make a slowdown look negative)."""
    if self.cost.value is None:
      return None
    return max(self.cost.value, self.stall.value or 0.0)

  def busy_for(self, steps: int, excess: float | None) -> None:
    """`steps` steps ran with this tier's work in flight, `excess` seconds
    longer than as many idle steps (None: unknown, no idle step seen yet)."""
    self.open_busy += steps
    if excess is None:
      self.open_blind = True
    else:
      self.open_excess += excess

  def saved(self, step: int, stall_s: float) -> None:
    """A save of the tier at `step` whose stall was `stall_s`: closes the
    previous save's observation, opens this one's."""
    if self.open_step is not None:
      counts = self.open_step >= self.settle_from
      if self.open_blind:
        self.blind += counts
      else:
        self.cost.update(self.open_stall + self.open_excess)
        self.slowdown.update(self.open_excess)
        self.samples += counts
      self.busy_steps.update(self.open_busy)
    self.stall.update(stall_s)
    self.open_step, self.open_stall = step, stall_s
    self.open_excess, self.open_busy, self.open_blind = 0.0, 0, False

  def settle(self, step: int) -> None:
    """The interval changes at `step`: only saves from there on count as
    samples of it."""
    self.settle_from, self.samples, self.blind = step, 0, 0


class CostModel:
  """One process's step times and per-tier save costs, fed by every save()
  call. Not thread-safe: the trainer's thread calls it."""

  def __init__(self):
    self.tiers: dict[str, TierCosts] = {t: TierCosts() for t in TIERS}
    self.step_s = Ewma(clip=STEP_CLIP)
    """Seconds per step outside save(): from a save() call's return to the
    next call (a save's stall is its tier's cost, not the step's: a rare
    long stall would make this swing)."""
    self.idle_step_s = Ewma(clip=STEP_CLIP)
    """Training seconds of a step with no save work in flight."""
    self.last_increment = 1
    """Steps between the last two save() calls."""
    self._step: int | None = None
    self._began: float | None = None  # the last call's start
    self._returned: float | None = None  # the last call's return
    self._busy_after: frozenset[str] = frozenset()  # in flight at the last return

  def call(self, step: int, now: float, busy: frozenset[str]) -> None:
    """A save(step) call begins at `now`; `busy`: the tiers with work in
    flight now. Accounts the step(s) since the last call's return: idle
    (nothing in flight at that return nor now) or slowed by the busy tiers."""
    if self._step is not None and self._returned is not None and step > self._step:
      gap = step - self._step
      self.last_increment = gap
      train = max(0.0, now - self._returned)
      self.step_s.update(train / gap)
      in_flight = (self._busy_after | busy) & set(TIERS)
      if not in_flight:
        self.idle_step_s.update(train / gap)
      else:
        self._slowed(train, gap, in_flight)
    self._step, self._began, self._returned = step, now, None

  def _slowed(self, train: float, gap: int, in_flight: frozenset[str]) -> None:
    """Shares a busy stretch's extra time between the tiers in flight: with
    both, the local tier gets what its work alone costs a step."""
    idle = self.idle_step_s.value
    excess = None if idle is None else train - gap * idle
    if len(in_flight) == 1 or excess is None:
      for t in in_flight:
        self.tiers[t].busy_for(gap, excess)
        if excess is not None:
          self.tiers[t].excess_per_busy_step.update(excess / gap)
      return
    local = self.tiers["local"]
    per_step = local.excess_per_busy_step.value
    share = excess / 2 if per_step is None else min(excess, per_step * gap)
    local.busy_for(gap, share)
    self.tiers["persistent"].busy_for(gap, excess - share)

  def returned(self, now: float, saved: Iterable[str], busy: frozenset[str]) -> None:
    """The save() call that began last returns at `now`, having saved the
    tiers `saved`; `busy`: the tiers with work in flight now. A stall of a
    save to both tiers is the local tier's usual stall, the rest the
    persistent tier's."""
    if self._began is None:
      return
    stall = max(0.0, now - self._began)
    saved = [t for t in TIERS if t in set(saved)]
    if len(saved) == 2:
      usual = self.tiers["local"].stall.value
      local = stall if usual is None else min(stall, usual)
      self.tiers["local"].saved(self._step, local)
      self.tiers["persistent"].saved(self._step, stall - local)
    elif saved:
      self.tiers[saved[0]].saved(self._step, stall)
    self._returned, self._busy_after = now, busy
