"""Which uncommitted local steps this process may still delete.

A step commits once every process wrote its state file and none vetoed it
(save/commit.py: the `unsaved_<step>` flag, raised before the state
counter, which the primary reads once the count is full). A veto is only
conclusive BEFORE a process counts; afterwards the primary may commit at
any moment. So local retention and the state lane settle each uncommitted
step between them, under one lock:

- the state lane CLAIMS a step before it writes the step's state file: a
  claimed step is never deleted by local retention until it or a newer
  step commits (plans.py keeps it first among the uncommitted steps);
- a step local retention already DROPPED (its budget of `max_to_keep` + 1
  uncommitted steps was full of newer or claimed ones) is vetoed instead
  of claimed.

So every step that commits is held where it was saved: a restart never
finds its newest committed step missing on a process and resumes from an
older one. Claims are not capped: a cap vetoes steps on one process that
another commits, so while one process lags, the processes would claim
different steps and nothing would commit. While commits lag (a slow or
hung process of the job), the claimed steps stay on the ramdisk; the
retainer warns when they outnumber the budget.

Called by: the commit pipeline (claim/release, on the state lane) and the
retainer (settle/drop, on the retention lane), on every process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

DROPPED = "local retention deleted its copy here while older commits lagged"


class CommitClaims:
  """The claims of one process's uncommitted local steps."""

  def __init__(self):
    self._lock = threading.Lock()
    self._claimed: set[int] = set()
    self._dropped: set[int] = set()

  def claim(self, step: int) -> str | None:
    """Claims `step` before its state file is written. Blocks on nothing.

    Args:
      step: a step whose local write succeeded.

    Returns:
      None if claimed (retention keeps the step until it or a newer step
      commits); else why it must be vetoed (retention dropped it).
    """
    with self._lock:
      if step in self._dropped:
        return DROPPED
      self._claimed.add(step)
      return None

  def release(self, step: int) -> None:
    """Ends the claim of `step` (its state file could not be written)."""
    with self._lock:
      self._claimed.discard(step)

  def settle(self, newest_committed: int | None) -> None:
    """Forgets claims and drops at or below the newest committed step
    (steps below it never commit later: the primary commits in order)."""
    if newest_committed is None:
      return
    with self._lock:
      self._claimed = {s for s in self._claimed if s > newest_committed}
      self._dropped = {s for s in self._dropped if s > newest_committed}

  def claimed(self) -> frozenset[int]:
    """The steps claimed now."""
    with self._lock:
      return frozenset(self._claimed)

  def drop(self, steps: Iterable[int], newest_committed: int | None) -> set[int]:
    """Retention's delete list, settled: claimed steps are taken out (kept),
    the uncommitted rest are marked dropped (their claim will be refused).

    Args:
      steps: the steps local retention would delete.
      newest_committed: the newest committed step held (None: none).

    Returns:
      The steps of `steps` that must be kept after all (claimed meanwhile).
    """
    with self._lock:
      keep = {s for s in steps if s in self._claimed}
      self._dropped.update(
        s for s in steps if s not in keep and (newest_committed is None or s > newest_committed)
      )
      return keep
