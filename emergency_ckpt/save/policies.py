"""The save decision of fixed step intervals: which tiers save a step. Pure,
the same on every process. Intervals that are "auto" or in seconds are
decided by cadence.py, which uses this SaveDecision.

Retention (which steps to keep) is retention/. Called by: the save
pipeline (its save() and would_save())."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SaveDecision:
  """Which tiers save a step."""

  local: bool
  persistent: bool

  @property
  def any(self) -> bool:
    """Whether any tier saves it."""
    return self.local or self.persistent


def decide_save(
  step: int, *, local_interval: int, persistent_interval: int, force: bool = False
) -> SaveDecision:
  """Which tiers save `step`. The same on every process, so no agreement is needed.

  Args:
    step: the step.
    local_interval: local.save_interval_steps.
    persistent_interval: persistent.save_interval_steps.
    force: save to both tiers.

  Returns:
    The decision: a tier saves a step that is a multiple of its interval.
  """
  if force:
    return SaveDecision(True, True)
  return SaveDecision(step % local_interval == 0, step % persistent_interval == 0)
