"""What a manager remembers per saved step, bounded.

save() records each step's metrics, save info (topology, bytes, time, tiers)
and start time; the persistent tier's finalize marks steps final. All of it
is needed only for a while (until the step commits, its durable events are
logged, retention has ranked it), and anything dropped is read back from the
step's COMMIT record. So each map keeps the newest `cap` steps: a run of a
million steps holds the same few kilobytes as a run of ten.

Called by: the owning process's threads (thread-safe).
"""

from __future__ import annotations

import math
import threading
from typing import Any

from emergency_ckpt.errors import MetricsError

DEFAULT_CAP = 64


class _Bounded:
  """A step -> value map holding the newest `cap` steps."""

  def __init__(self, cap: int, lock: threading.Lock):
    self._cap = cap
    self._lock = lock
    self._items: dict[int, Any] = {}

  def put(self, step: int, value: Any) -> None:
    """Remembers `value` for `step`, dropping the oldest steps over the cap.

    Args:
      step: the step.
      value: what to remember.
    """
    with self._lock:
      self._items[step] = value
      while len(self._items) > self._cap:
        del self._items[min(self._items)]

  def get(self, step: int, default: Any = None) -> Any:
    """What is remembered for `step`.

    Args:
      step: the step.
      default: returned if nothing is.

    Returns:
      The value, or `default`.
    """
    with self._lock:
      return self._items.get(step, default)

  def pop(self, step: int) -> None:
    """Forgets `step` (nothing if unknown).

    Args:
      step: the step.
    """
    with self._lock:
      self._items.pop(step, None)

  def __contains__(self, step: int) -> bool:
    with self._lock:
      return step in self._items

  def __len__(self) -> int:
    with self._lock:
      return len(self._items)


class StepRecords:
  """Per-step memory of one manager: metrics, save info, save start times
  and which steps the persistent tier finalized; the newest `cap` steps of
  each."""

  def __init__(self, cap: int = DEFAULT_CAP):
    lock = threading.Lock()
    self.metrics = _Bounded(cap, lock)
    """step -> save(metrics=...) (or what its COMMIT record said)."""
    self.info = _Bounded(cap, lock)
    """step -> topology, bytes, saved_at, tiers (stored in its COMMIT record)."""
    self.started = _Bounded(cap, lock)
    """step -> time.monotonic() when save() began (for durable_s)."""
    self.persistent_final = _Bounded(cap, lock)
    """step -> True once the persistent tier finalized it."""

  def sizes(self) -> dict[str, int]:
    """How many steps each map holds (for tests and debugging).

    Returns:
      {map name: its step count}.
    """
    return {
      "metrics": len(self.metrics),
      "info": len(self.info),
      "started": len(self.started),
      "persistent_final": len(self.persistent_final),
    }

  def forget(self, step: int) -> None:
    """Drops everything about `step` (after delete()).

    Args:
      step: the step.
    """
    for m in (self.metrics, self.info, self.started, self.persistent_final):
      m.pop(step)


def check_metrics(metrics: Any) -> dict:
  """Checks and converts save(metrics=...).

  Args:
    metrics: None, or a dict of name -> number (numpy / jax scalars too).

  Returns:
    {name: float} ({} for None).

  Raises:
    MetricsError: not a dict, a key that is not a str, or a value that is
      not a finite number.
  """
  if metrics is None:
    return {}
  if not isinstance(metrics, dict):
    raise MetricsError(f"metrics must be a dict of name -> number, got a {type(metrics).__name__}.")
  out = {}
  for k, v in metrics.items():
    if not isinstance(k, str):
      raise MetricsError(f"metrics key {k!r} must be a str.")
    if hasattr(v, "item") and callable(v.item):  # numpy / jax scalars
      v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      raise MetricsError(f"metrics[{k!r}]={v!r} must be a finite number.")
    out[k] = float(v)
  return out
