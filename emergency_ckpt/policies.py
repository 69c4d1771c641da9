"""Save decisions and retention: pure functions of steps, no collectives."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


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


def keep_local(steps: Iterable[int], max_to_keep: int, newest_committed: int | None) -> set[int]:
  """Local steps to keep. Never drops the newest step whose state is committed
  (the newest restorable candidate), nor any newer step (its commit may still
  be on its way); with no committed step known, drops nothing."""
  steps = set(steps)
  if newest_committed is None:
    return steps
  pending = {s for s in steps if s >= newest_committed}
  return keep_latest(steps, max_to_keep) | pending


def keep_state(
  listed: Iterable[int],
  committed: Iterable[int],
  persistent: Iterable[int],
  *,
  local_keep: int,
  persistent_interval: int,
) -> set[int]:
  """State-store steps to keep: those of every persistent step, of the newest
  `local_keep + 2` committed steps (local copies may still exist), every step
  newer than the newest committed one (commits in flight), and every
  persistent-interval step newer than the newest persistent one (uploads in
  flight)."""
  listed = set(listed)
  committed = sorted(set(committed) & listed)
  persistent = set(persistent)
  keep = (persistent & listed) | set(committed[-(local_keep + 2) :])
  if committed:
    keep |= {s for s in listed if s > committed[-1]}
  else:
    keep |= listed
  newest_persistent = max(persistent, default=-1)
  keep |= {s for s in listed if s > newest_persistent and s % persistent_interval == 0}
  return keep
