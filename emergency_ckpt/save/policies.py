"""The save decision: which tiers save a step. Pure, the same on every process.

Retention (which steps to keep) is retention.py."""

from __future__ import annotations

import dataclasses


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
