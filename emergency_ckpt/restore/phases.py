"""Where one restore's time went, by phase: the restore event's `phases`
and the restore's log line (inventory, read, agree, transfer / place /
persistent), so an operator sees which part of a slow restore to look at.

Called by: the manager and the restorer, on every process; blocks on nothing.
"""

from __future__ import annotations

import contextlib
import time


class PhaseClock:
  """Seconds spent per phase of one restore (summed over the candidates
  tried): `with clock("read"): ...`."""

  def __init__(self, before: dict[str, float] | None = None):
    self._s: dict[str, float] = dict(before or {})

  @contextlib.contextmanager
  def __call__(self, name: str):
    t0 = time.monotonic()
    try:
      yield
    finally:
      self._s[name] = self._s.get(name, 0.0) + time.monotonic() - t0

  def rounded(self) -> dict[str, float]:
    """{phase: seconds}, to the microsecond."""
    return {k: round(v, 6) for k, v in self._s.items()}

  def text(self) -> str:
    """'inventory 0.012 s, read 0.101 s, ...'."""
    return ", ".join(f"{k} {v:.3f} s" for k, v in self._s.items())
