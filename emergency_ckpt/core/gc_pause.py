"""Python's cyclic garbage collector held off while a many-leaf state is
read, laid out or copied.

Decoding a manifest of thousands of leaves, or building thousands of
arrays, allocates enough containers to trigger several of the collector's
passes, and each full pass walks every object of the process (a trainer's
heap is large): on a state of thousands of leaves those passes cost more
than the work itself. `paused()` defers them to its end (nothing is freed
later than one collection after it; reference counting still frees
everything without cycles at once). Nested and concurrent uses share one
pause; the collector is re-enabled only if it was enabled when the first
began. A pause whose survivors are long-lived (a restore's arrays, a kept
layout) promotes them to the oldest generation as it ends, so the young
generation's next pass does not walk them all once more.

Called by: the local tier's discovery and read, the restore's placement
and layouts, save()'s host copy on CPU; no I/O, no JAX.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_depth = 0
_was_enabled = False


_promote = False
_STARTUP_FROZEN = gc.get_freeze_count()
"""Objects the interpreter froze itself before this module was imported
(none on Python 3.11, a few hundred on 3.12); more means the process froze
its own (e.g. before forking workers), and then no pause promotes."""


@contextlib.contextmanager
def paused(*, promote: bool = False) -> Iterator[None]:
  """Holds the cyclic collector off for the block (see the module's doc).

  Args:
    promote: the objects the pause leaves alive are long-lived (a restored
      state and what it is read from): at the end of the pause every
      tracked object goes straight to the oldest generation, unscanned
      (gc.freeze then gc.unfreeze), instead of the young generation's
      next pass walking them all (tens of ms for thousands of leaves).
      Cyclic garbage made meanwhile waits for the next full pass. Never
      where the process froze objects itself (more than the interpreter
      froze at start, _STARTUP_FROZEN: some Pythons freeze their own).
  """
  global _depth, _was_enabled, _promote  # noqa: PLW0603 - one pause per process
  with _LOCK:
    if _depth == 0:
      _was_enabled = gc.isenabled()
      gc.disable()
    _depth += 1
  try:
    yield
  finally:
    with _LOCK:
      _depth -= 1
      _promote = _promote or promote
      if _depth == 0:
        if _promote and gc.get_freeze_count() <= _STARTUP_FROZEN:
          gc.freeze()  # every generation into the permanent one, the young count reset
          gc.unfreeze()  # ... and all of it back into the oldest generation
        _promote = False
        if _was_enabled:
          gc.enable()
