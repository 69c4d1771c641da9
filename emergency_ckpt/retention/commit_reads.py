"""What local retention knows of commits, without waiting on a sick state store.

Local retention asks, after every local write, which of this process's
steps are committed; the answer is a COMMIT in the state store, which sits
in the persistent directory (a bucket). A bucket that hangs must not stop
local retention: if it did, every step saved during the outage would stay
on the ramdisk (host memory), one checkpoint per save.

So a step is known committed without a read once this process learned it
(the primary's own commit, a `committed_<step>` signal, an earlier read);
any other step is read with a short bound, one read in flight at a time.
A read that does not answer in time, or fails, leaves the step unknown,
and the rest of that pass asks no more: unknown steps count as not
committed. That is safe: a step whose state this process wrote stays
claimed until a step it KNOWS committed passes it (claims.py), so
retention never deletes a step that may commit; it keeps the newest step
it knows committed and at most `max_to_keep` + 1 newer ones (plans.py).

Called by: the retainer (retainer.py), on every process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from emergency_ckpt.runtime.serial import SerialExecutor

logger = logging.getLogger("emergency_ckpt")

READ_WAIT_S = 2.0
"""The longest a retention pass waits for one COMMIT read (a healthy read
takes milliseconds)."""


class CommitReads:
  """One process's knowledge of committed steps, for local retention.

  Args:
    has_commit: reads whether a step has a valid COMMIT (the state store's).
    log_prefix: the process's log prefix.
    wait_s: the longest wait for one read.
  """

  def __init__(
    self, has_commit: Callable[[int], bool], *, log_prefix: str, wait_s: float = READ_WAIT_S
  ):
    self._has_commit = has_commit
    self._log_prefix = log_prefix
    self._wait_s = wait_s
    self._lock = threading.Lock()
    self._known: set[int] = set()
    self._reader = SerialExecutor("ec-commit-read")  # a daemon: a hung read never holds exit
    self._pending: concurrent.futures.Future | None = None
    self._sick_since: float | None = None  # time.monotonic() of the first unanswered read

  def learned(self, step: int) -> None:
    """Records that `step` committed (its COMMIT was seen or signalled).
    Called by: any thread. Blocks on nothing."""
    with self._lock:
      self._known.add(step)

  def forget_below(self, step: int) -> None:
    """Forgets the steps below `step` (none of them is held any more)."""
    with self._lock:
      self._known = {s for s in self._known if s >= step}

  def known(self) -> frozenset[int]:
    """The steps known committed now."""
    with self._lock:
      return frozenset(self._known)

  def asker(self) -> Callable[[int], bool]:
    """A retention pass's is_committed: known steps at once, the others
    read (one read per step per pass, each at most `wait_s`); after one
    read went unanswered, the pass's other unknown steps are not read and
    count as not committed. Called by: the retention lane; blocks on at
    most one read's bound."""
    asked: dict[int, bool] = {}
    sick = False

    def is_committed(step: int) -> bool:
      nonlocal sick
      with self._lock:
        if step in self._known:
          return True
      if step in asked:
        return asked[step]
      if sick:
        return False
      got = self._read(step)
      if got is None:
        sick = True
        return False
      asked[step] = got
      if got:  # now: the read's callback (_late) may run after result() returned
        self.learned(step)
      return got

    return is_committed

  def _read(self, step: int) -> bool | None:
    """has_commit(step), or None if it did not answer within the bound,
    failed, or an earlier read is still waiting for the store."""
    with self._lock:
      if self._pending is not None and not self._pending.done():
        return None  # the store has not answered the last read: do not pile up more
      try:
        future = self._reader.submit(self._has_commit, step)
      except RuntimeError:  # closed
        return None
      self._pending = future
    future.add_done_callback(lambda f: self._late(f, step))  # a late yes still counts
    try:
      got = bool(future.result(timeout=self._wait_s))
    except concurrent.futures.TimeoutError:
      self._sick(f"no answer within {self._wait_s:g}s")
      return None
    except Exception as e:  # noqa: BLE001 - an unreadable store is a sick one here
      self._sick(f"{type(e).__name__}: {e}")
      return None
    self._healthy()
    return got

  def _late(self, future: concurrent.futures.Future, step: int) -> None:
    if not future.cancelled() and future.exception() is None and future.result():
      self.learned(step)

  def _sick(self, why: str) -> None:
    with self._lock:
      first, self._sick_since = self._sick_since is None, self._sick_since or time.monotonic()
    if first:
      logger.warning(
        "%s local retention cannot read COMMITs from the state store (%s): until it"
        " answers, steps not known committed count as uncommitted, and the ramdisk keeps"
        " the newest known commit and at most local.max_to_keep + 1 newer steps",
        self._log_prefix,
        why,
      )

  def _healthy(self) -> None:
    with self._lock:
      since, self._sick_since = self._sick_since, None
    if since is not None:
      logger.warning(
        "%s local retention reads COMMITs again (after %.1fs)",
        self._log_prefix,
        time.monotonic() - since,
      )

  def close(self) -> None:
    """Stops the reader (a read still waiting on the store is abandoned)."""
    self._reader.shutdown(wait=False, cancel_futures=True)
