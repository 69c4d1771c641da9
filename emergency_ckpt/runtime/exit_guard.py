"""A program never waits at exit for checkpoint work it gave up on.

When close() gives up on work that still runs (an upload to a bucket that
stopped answering), the threads doing it stay blocked, and the interpreter
joins such threads at exit: Orbax's and tensorstore's executors, whose
threads it cannot be told to leave. So a job whose bucket died would never
end. Two hooks run where the interpreter starts that joining, before it:

- `close_at_exit(manager)`: a manager still open is closed (bounded by its
  finish_timeout_s), so a program that never called close() still gets its
  last saves finished;
- once any close() abandoned work (`abandoned()`), the process then ends at
  once with os._exit, status 1: its last checkpoint work did not finish,
  and the status the program meant to exit with cannot be seen there, so a
  failure is never turned into success. Buffered output and logging are
  flushed first.

Uses the hook the standard library's own executors use
(threading._register_atexit, Python >= 3.9): atexit's handlers run only
after the joining.

Called by: CheckpointManager (every process), at construction and close().
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import Any

logger = logging.getLogger("emergency_ckpt")

_lock = threading.Lock()
_abandoned: list[str] = []
_exiting = False


def _exit_now() -> None:
  with _lock:
    what = list(_abandoned)
  if not what:
    return
  logger.warning(
    "exiting (status 1) without waiting for checkpoint work that was abandoned: %s",
    "; ".join(what),
  )
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError, AttributeError):
      pass
  logging.shutdown()
  os._exit(1)


def _register(fn: Any) -> bool:
  try:
    threading._register_atexit(fn)  # noqa: SLF001 - see the module docstring
  except RuntimeError:  # the interpreter is already exiting
    return False
  return True


def abandoned(what: str) -> None:
  """Records that close() left `what` running: the process will not wait for it at exit.

  Args:
    what: the work, for the exit's warning (e.g. "the upload of step 12 to gs://b/run").
  """
  with _lock:
    first = not _abandoned
    _abandoned.append(what)
  if first and not _exiting and not _register(_exit_now):
    _exit_now()


def close_at_exit(manager: Any) -> None:
  """Closes `manager` at interpreter exit if it is still open, then ends the
  process at once if work was abandoned.

  Args:
    manager: has close() and a `closed` property; held by a weak reference.
  """
  ref = weakref.ref(manager)

  def hook() -> None:
    global _exiting
    _exiting = True
    m = ref()
    if m is not None and not m.closed:
      try:
        m.close()
      except Exception as e:  # noqa: BLE001 - at exit: say it, never raise
        logger.error("closing the checkpoint manager at exit: %s", e)
    _exit_now()

  _register(hook)
