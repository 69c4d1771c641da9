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
began.

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


@contextlib.contextmanager
def paused() -> Iterator[None]:
  """Holds the cyclic collector off for the block (see the module's doc)."""
  global _depth, _was_enabled  # noqa: PLW0603 - one pause per process
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
      if _depth == 0 and _was_enabled:
        gc.enable()
