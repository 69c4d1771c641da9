"""Which uncommitted local steps this process may still delete.

A step commits once every process wrote its state file (save/commit.py);
from then on the primary may write its COMMIT at any moment. So the state
lane CLAIMS a step before it writes the step's state file, and local
retention never deletes a claimed step until it (or a newer step)
commits (plans.py keeps claimed steps first among the uncommitted ones):
a step whose COMMIT lands is on the ramdisk of every process that wrote
its state, and a restart does not resume from an older step because
retention deleted the newest committed one meanwhile.

Claims are not capped: a cap would have to veto steps on one process that
another commits, and while one process lags the processes would then veto
different steps and nothing would commit. While commits lag (a slow or
hung process of the job, a slow state store) the claimed steps stay on the
ramdisk; the retainer warns when they outnumber its budget. Retention
marks each unclaimed step it deletes as dropped, under the same lock as the
claims: the state lane's claim of a dropped step fails, and the process
vetoes that step (no state file; the primary gives it up) rather than let
it commit without this process's copy. A lane that lags so far behind its
saves catches up at once (a veto writes nothing) and claims the steps it
still holds, the newest ones, which every process keeps.

Called by: the commit pipeline (claim/release, on the state lane) and the
retainer (settle/kept, on the retention lane), on every process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class CommitClaims:
  """The claims of one process's uncommitted local steps."""

  def __init__(self):
    self._lock = threading.Lock()
    self._claimed: set[int] = set()
    self._dropped: set[int] = set()

  def claim(self, step: int) -> bool:
    """Claims `step` before its state file is written. Blocks on nothing.

    Args:
      step: a step whose local write succeeded.

    Returns:
      False if retention deleted the step already (it must not commit).
    """
    with self._lock:
      if step in self._dropped:
        return False
      self._claimed.add(step)
      return True

  def release(self, step: int) -> None:
    """Ends the claim of `step` (its state file could not be written)."""
    with self._lock:
      self._claimed.discard(step)

  def settle(self, newest_committed: int | None) -> None:
    """Forgets the claims at or below the newest committed step (steps
    below it never commit later: the primary commits in order)."""
    if newest_committed is None:
      return
    with self._lock:
      self._claimed = {s for s in self._claimed if s > newest_committed}
      self._dropped = {s for s in self._dropped if s > newest_committed}

  def claimed(self) -> frozenset[int]:
    """The steps claimed now."""
    with self._lock:
      return frozenset(self._claimed)

  def drop(self, steps: Iterable[int]) -> set[int]:
    """Retention is about to delete `steps`: the ones claimed since its
    plan was made must be kept after all (returned); the others are marked
    dropped, so that their claim fails from now on.

    Args:
      steps: the steps local retention would delete.

    Returns:
      The claimed steps among them (keep these).
    """
    with self._lock:
      kept = {s for s in steps if s in self._claimed}
      self._dropped.update(s for s in steps if s not in kept)
      return kept
