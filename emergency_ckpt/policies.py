"""The save decision: which tiers save a step. Pure, the same on every process.

Retention (which steps to keep) is retention.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from emergency_ckpt import retention


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


# ---- TODO(lead): wire manager.py, options.py (retention() builds retention.Rules) and
# tests/test_retention_local.py to retention.py, then drop everything below. ----------
Retention = retention.Rules
keep_latest = retention.keep_latest
best_steps = retention.best_steps
retain = retention.retain


def keep_local(
  steps: Iterable[int],
  rules: retention.Rules | int,
  newest_committed: int | None,
  metrics: Mapping[int, Mapping[str, float]] | None = None,
) -> set[int]:
  """Old spelling of retention.local_plan(...).keep, given the newest
  committed step instead of a predicate. TODO(lead): drop."""
  if isinstance(rules, int):
    rules = retention.Rules(max_to_keep=rules)
  plan = retention.local_plan(
    steps,
    rules,
    is_committed=lambda s: newest_committed is not None and s <= newest_committed,
    metrics=metrics,
  )
  return set(plan.keep)


def keep_state(
  listed: Iterable[int],
  committed: Iterable[int],
  persistent: Iterable[int],
  *,
  local_keep: int | retention.Rules,
  persistent_interval: int,
  metrics: Mapping[int, Mapping[str, float]] | None = None,
) -> set[int]:
  """Old spelling of retention.state_plan(..., extra_newest=LOCAL_LAG_STEPS).keep.
  TODO(lead): drop."""
  if isinstance(local_keep, retention.Rules):
    rules = local_keep
  else:
    rules = retention.Rules(max_to_keep=local_keep)
  plan = retention.state_plan(
    listed,
    committed,
    rules,
    persistent=persistent,
    persistent_interval=persistent_interval,
    metrics=metrics,
    extra_newest=retention.LOCAL_LAG_STEPS,
  )
  return set(plan.keep)
