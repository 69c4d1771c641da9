"""Retention rules: which steps of one listing the rules keep, and why.

A step is kept if ANY rule keeps it (`Rules`: the newest N, every P-th, the
K best by a metric) or a protection holds it; the protections of each tier
(the newest restorable step and every newer one) are plans.py's. Every
`Plan` carries a reason per step (gc prints them). No I/O, no JAX.

Called by: plans.py (the three tiers' plans), the manager (best_steps for
best_step()), `emergency-ckpt gc` (Rules from its flags).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from emergency_ckpt.errors import InvalidOptionsError

if TYPE_CHECKING:
  from emergency_ckpt.options import CheckpointManagerOptions

Metrics = Mapping[int, Mapping[str, float]]
"""{step: {metric name: value}}; a step without a finite value is never "best"."""

BEST_MODES = ("min", "max")


def _optional_int(value, name: str, minimum: int) -> None:
  ok = value is None or (
    isinstance(value, int) and not isinstance(value, bool) and value >= minimum
  )
  if not ok:
    raise InvalidOptionsError(f"{name} must be an integer >= {minimum} or None, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rules:
  """One tier's retention rules; a step is kept if ANY rule keeps it."""

  max_to_keep: int | None
  """The newest N steps; None: every step (0: none by this rule, as `gc --keep 0`)."""
  keep_period: int | None = None
  """Every step divisible by N (milestones kept forever)."""
  keep_best: int | None = None
  """The N best steps by `best_metric` (steps without it never count as best)."""
  best_metric: str | None = None
  """The metric that ranks steps for `keep_best`; None: keep_best is off."""
  best_mode: str = "min"
  """"min" if smaller is better (a loss), "max" if larger is (an accuracy)."""

  def __post_init__(self):
    _optional_int(self.max_to_keep, "max_to_keep", 0)
    _optional_int(self.keep_period, "keep_period", 1)
    _optional_int(self.keep_best, "keep_best", 0)
    if self.best_mode not in BEST_MODES:
      raise InvalidOptionsError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}.")

  @classmethod
  def for_tier(cls, options: CheckpointManagerOptions, tier: str) -> Rules:
    """The retention rules a manager's options give one of its tiers.

    Called by: the retainer (every process for "local", the primary process
    for the state store and "persistent").

    Args:
      options: the manager's options: the tier's max_to_keep, keep_period
        and keep_best, and the manager's best_metric and best_mode.
      tier: "local" or "persistent".

    Returns:
      The tier's rules.
    """
    t = getattr(options, tier)
    return cls(
      max_to_keep=t.max_to_keep,
      keep_period=t.keep_period,
      keep_best=t.keep_best,
      best_metric=options.best_metric,
      best_mode=options.best_mode,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """What one retention pass over one listing keeps and deletes."""

  keep: frozenset[int]
  delete: tuple[int, ...]
  """Oldest first."""
  reasons: Mapping[int, str]
  """Every step of the listing: why it is kept, or why no rule keeps it."""


def keep_latest(
  steps: Iterable[int], max_to_keep: int | None, protected: Iterable[int] = ()
) -> set[int]:
  """The newest steps, plus the protected ones present.

  Args:
    steps: the steps listed.
    max_to_keep: how many of the newest to keep; None keeps every step.
    protected: steps kept whatever `max_to_keep` says (only those in `steps`).

  Returns:
    The steps to keep.
  """
  ordered = sorted(set(steps), reverse=True)
  keep = set(ordered if max_to_keep is None else ordered[:max_to_keep])
  return keep | (set(protected) & set(ordered))


def _finite(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def best_steps(metrics: Metrics, metric: str, mode: str, n: int | None = None) -> list[int]:
  """Steps ranked best first by one metric (ties: newer first).

  Args:
    metrics: {step: {metric name: value}}; steps lacking a finite value of
      `metric` are left out.
    metric: the metric that ranks the steps.
    mode: "min" (smaller is better) or "max" (larger is better).
    n: keep only the first `n`; None: every ranked step.

  Returns:
    The steps, best first.
  """
  scored = []
  for step, values in metrics.items():
    value = (values or {}).get(metric)
    if _finite(value):
      scored.append((value if mode == "min" else -value, -step))
  ranked = [-neg_step for _, neg_step in sorted(scored)]
  return ranked if n is None else ranked[:n]


def _best(steps: Iterable[int], rules: Rules, metrics: Metrics | None) -> list[int]:
  if rules.keep_best is None or rules.best_metric is None:
    return []
  steps = set(steps)
  present = {s: m for s, m in (metrics or {}).items() if s in steps}
  return best_steps(present, rules.best_metric, rules.best_mode, rules.keep_best)


def retain(
  steps: Iterable[int],
  rules: Rules,
  *,
  metrics: Metrics | None = None,
  protected: Iterable[int] = (),
) -> set[int]:
  """Steps to keep: the union of what each rule keeps and the protected steps.

  The same inputs give the same set on every process.

  Args:
    steps: the steps listed.
    rules: the newest `max_to_keep`, every `keep_period`-th, the `keep_best`
      best by metric.
    metrics: {step: {metric name: value}} for keep_best; None: no step ranks.
    protected: steps kept whatever the rules say (only those in `steps`).

  Returns:
    The steps to keep.
  """
  steps = set(steps)
  keep = keep_latest(steps, rules.max_to_keep, protected)
  if rules.keep_period is not None:
    keep |= {s for s in steps if s % rules.keep_period == 0}
  return keep | set(_best(steps, rules, metrics))


def _shown(metrics: Metrics, step: int, metric: str) -> str:
  value = (metrics.get(step) or {}).get(metric)
  return f"{metric}={value:g}" if _finite(value) else f"no {metric}"


def explain(
  steps: Iterable[int],
  rules: Rules,
  *,
  metrics: Metrics | None = None,
  protected: Mapping[int, str] | None = None,
) -> Plan:
  """`retain` with a reason per step.

  Args:
    steps: the steps listed.
    rules: as for `retain`.
    metrics: as for `retain`.
    protected: {step: why it is protected}; kept whatever the rules say.

  Returns:
    The plan: each kept step's reasons are every rule (or protection) that
    keeps it, each deleted step's every rule it misses.
  """
  steps = sorted(set(steps))
  protected = dict(protected or {})
  metrics = metrics or {}
  keep = retain(steps, rules, metrics=metrics, protected=protected)
  newest = keep_latest(steps, rules.max_to_keep)
  best = _best(steps, rules, metrics)
  reasons = {}
  for s in steps:
    why, why_not = [], []
    if s in protected:
      why.append(protected[s])
    if rules.max_to_keep is None:
      why.append("every step (no max_to_keep)")
    elif s in newest:
      why.append(f"newest {rules.max_to_keep}")
    else:
      why_not.append(f"not among the newest {rules.max_to_keep}")
    if rules.keep_period is not None:
      if s % rules.keep_period == 0:
        why.append(f"multiple of {rules.keep_period}")
      else:
        why_not.append(f"not a multiple of {rules.keep_period}")
    if rules.best_metric is not None and rules.keep_best is not None:
      shown = _shown(metrics, s, rules.best_metric)
      if s in best:
        why.append(f"best {rules.keep_best} by {shown} (#{best.index(s) + 1})")
      else:
        why_not.append(f"not among the best {rules.keep_best} ({shown})")
    if s in keep:
      reasons[s] = "; ".join(why) or "retained"
    else:
      reasons[s] = ", ".join(why_not) or "not retained"
  return make_plan(steps, keep, reasons)


def make_plan(steps: Iterable[int], keep: Iterable[int], reasons: Mapping[int, str]) -> Plan:
  """A Plan of a listing.

  Args:
    steps: the steps listed.
    keep: the steps to keep (those not in `steps` are ignored).
    reasons: {step: why it is kept or deleted}.

  Returns:
    The plan; every listed step not kept is deleted, oldest first.
  """
  steps = sorted(set(steps))
  keep = frozenset(keep) & frozenset(steps)
  return Plan(keep=keep, delete=tuple(s for s in steps if s not in keep), reasons=dict(reasons))
