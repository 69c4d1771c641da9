"""Save decisions and retention: pure functions of steps, no collectives."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class SaveDecision:
  local: bool
  persistent: bool

  @property
  def any(self) -> bool:
    return self.local or self.persistent


def decide_save(
  step: int, *, local_interval: int, persistent_interval: int, force: bool = False
) -> SaveDecision:
  """Which tiers save `step`. The same on every process, so no agreement is needed.
  `force` saves to both tiers."""
  if force:
    return SaveDecision(True, True)
  return SaveDecision(step % local_interval == 0, step % persistent_interval == 0)


def keep_latest(
  steps: Iterable[int], max_to_keep: int | None, protected: Iterable[int] = ()
) -> set[int]:
  """The newest `max_to_keep` steps (all if None) plus `protected`."""
  ordered = sorted(set(steps), reverse=True)
  keep = set(ordered if max_to_keep is None else ordered[:max_to_keep])
  return keep | (set(protected) & set(ordered))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Retention:
  """One tier's retention rules; a step is kept if ANY rule keeps it."""

  max_to_keep: int | None
  """The newest N steps; None: every step."""
  keep_period: int | None = None
  """Every step divisible by N."""
  keep_best: int | None = None
  """The N best steps by `best_metric` (steps without it never count as best)."""
  best_metric: str | None = None
  best_mode: str = "min"


def best_steps(
  metrics: Mapping[int, Mapping[str, float]], metric: str, mode: str, n: int | None = None
) -> list[int]:
  """Steps ranked best first by `metrics[step][metric]` (ties: newer first);
  steps lacking a finite value are left out. The first `n` if given."""
  scored = []
  for step, values in metrics.items():
    value = (values or {}).get(metric)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
      scored.append((value if mode == "min" else -value, -step))
  ranked = [-neg_step for _, neg_step in sorted(scored)]
  return ranked if n is None else ranked[:n]


def retain(
  steps: Iterable[int],
  rules: Retention,
  *,
  metrics: Mapping[int, Mapping[str, float]] | None = None,
  protected: Iterable[int] = (),
) -> set[int]:
  """Steps to keep: the union of the newest `max_to_keep`, every
  `keep_period`-th, the `keep_best` best by metric, and `protected` (those
  present). Pure: the same inputs give the same set on every process."""
  steps = set(steps)
  keep = keep_latest(steps, rules.max_to_keep, protected)
  if rules.keep_period is not None:
    keep |= {s for s in steps if s % rules.keep_period == 0}
  if rules.keep_best is not None and rules.best_metric is not None:
    present = {s: m for s, m in (metrics or {}).items() if s in steps}
    keep |= set(best_steps(present, rules.best_metric, rules.best_mode, rules.keep_best))
  return keep


def keep_local(
  steps: Iterable[int],
  rules: Retention | int,
  newest_committed: int | None,
  metrics: Mapping[int, Mapping[str, float]] | None = None,
) -> set[int]:
  """Local steps to keep by `rules` (or a plain max_to_keep). Never drops the
  newest step whose state is committed (the newest restorable candidate), nor
  any newer step (its commit may still be on its way); with no committed step
  known, drops nothing."""
  steps = set(steps)
  if newest_committed is None:
    return steps
  if isinstance(rules, int):
    rules = Retention(max_to_keep=rules)
  pending = {s for s in steps if s >= newest_committed}
  return retain(steps, rules, metrics=metrics, protected=pending)


def keep_state(
  listed: Iterable[int],
  committed: Iterable[int],
  persistent: Iterable[int],
  *,
  local_keep: int | Retention,
  persistent_interval: int,
  metrics: Mapping[int, Mapping[str, float]] | None = None,
) -> set[int]:
  """State-store steps to keep: those of every persistent step, of the
  committed steps the local tier's rules keep (with 2 extra newest: local
  copies may lag), every step newer than the newest committed one (commits in
  flight), and every persistent-interval step newer than the newest
  persistent one (uploads in flight)."""
  listed = set(listed)
  committed = sorted(set(committed) & listed)
  persistent = set(persistent)
  rules = local_keep if isinstance(local_keep, Retention) else Retention(max_to_keep=local_keep)
  rules = dataclasses.replace(rules, max_to_keep=rules.max_to_keep + 2)
  keep = (persistent & listed) | retain(committed, rules, metrics=metrics)
  if committed:
    keep |= {s for s in listed if s > committed[-1]}
  else:
    keep |= listed
  newest_persistent = max(persistent, default=-1)
  keep |= {s for s in listed if s > newest_persistent and s % persistent_interval == 0}
  return keep
