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
ramdisk; the retainer warns when they outnumber its budget. A step that
retention deleted before its state file was written may still commit: a
partner copy or parity may hold it, else the restore takes the newest
step every process holds.

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

  def claim(self, step: int) -> None:
    """Claims `step` before its state file is written. Blocks on nothing.

    Args:
      step: a step whose local write succeeded.
    """
    with self._lock:
      self._claimed.add(step)

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

  def claimed(self) -> frozenset[int]:
    """The steps claimed now."""
    with self._lock:
      return frozenset(self._claimed)

  def kept(self, steps: Iterable[int]) -> set[int]:
    """The steps of retention's delete list that were claimed since its
    plan was made: they must be kept after all.

    Args:
      steps: the steps local retention would delete.
    """
    with self._lock:
      return {s for s in steps if s in self._claimed}
