"""One job at a time on a helper thread, in order, beside the caller: a
peer session MACs (and checksums) each piece of a payload there while the
next piece crosses the socket (session.py).

Called by: session.py, on each end of a peer connection; no I/O.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable


class Overlap:
  """Runs one job at a time on a helper thread, in order, while the caller
  goes on (the next piece's system call): `then(fn, ...)` first waits for the
  job before it. Leaving the block waits for the last one; its error (or the
  block's own) is raised."""

  def __init__(self):
    self._pending: concurrent.futures.Future | None = None

  def __enter__(self) -> Overlap:
    return self

  def then(self, fn: Callable[..., None], *args) -> None:
    self._wait()
    self._pending = _helpers().submit(fn, *args)

  def _wait(self) -> None:
    pending, self._pending = self._pending, None
    if pending is not None:
      pending.result()

  def __exit__(self, kind, *_) -> None:
    if kind is None:
      self._wait()
    elif self._pending is not None:  # the caller failed: the job's outcome is moot
      concurrent.futures.wait([self._pending])


_HELPERS: concurrent.futures.ThreadPoolExecutor | None = None
_HELPERS_LOCK = threading.Lock()


def _helpers() -> concurrent.futures.ThreadPoolExecutor:
  """The process's pool of MAC/checksum helper threads (made on first use)."""
  global _HELPERS
  with _HELPERS_LOCK:
    if _HELPERS is None:
      _HELPERS = concurrent.futures.ThreadPoolExecutor(16, "ec-peer-digest")
    return _HELPERS
