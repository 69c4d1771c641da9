"""What each tier is doing for the trainer: durable steps, work in flight, failures, skips.

A checkpointer that must never stop training degrades instead: a hung bucket
makes the persistent tier skip steps, a full ramdisk makes local writes fail.
The trainer sees that here, not as an exception: `HealthTracker` is told when
a tier's work on a step starts, ends, fails or is skipped (by the save pipeline's
lanes, on any thread), and `snapshot()` answers the manager's `health()` with
one frozen `TierHealth` per tier. A skip or a failure is recorded once as an
event (`save_skipped`, `save_failed`) so `emergency-ckpt report` can show
outages from the event logs alone.

Called by: any thread of the process that owns the tracker; nothing blocks
beyond a short lock.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

logger = logging.getLogger("emergency_ckpt")

SKIPS_KEPT = 32
"""How many skipped steps a tier remembers by number (the total is always counted)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierHealth:
  """One tier's state, as of the snapshot's time.

  Attributes:
    tier: "local", "persistent", "state" or a redundancy scheme ("partner", "xor").
    newest_durable_step: the newest step this tier made durable on this process
      (None before the first).
    in_flight: the operations not yet finished, oldest first, each as
      "<operation> of step <N>".
    oldest_in_flight_s: how long the oldest of them has been running (None if none).
    consecutive_failures: failures since the tier's last success (0 when healthy).
    last_error: the newest failure's message (None if the tier never failed).
    skipped_steps: the newest skipped steps (at most SKIPS_KEPT), oldest first.
    skipped_total: every step skipped since the manager started.
  """

  tier: str
  newest_durable_step: int | None = None
  in_flight: tuple[str, ...] = ()
  oldest_in_flight_s: float | None = None
  consecutive_failures: int = 0
  last_error: str | None = None
  skipped_steps: tuple[int, ...] = ()
  skipped_total: int = 0

  @property
  def ok(self) -> bool:
    """True unless the tier's newest operation failed."""
    return self.consecutive_failures == 0

  def as_dict(self) -> dict:
    """A JSON-able copy (for event logs and metrics systems)."""
    return {**dataclasses.asdict(self), "ok": self.ok}


@dataclasses.dataclass(frozen=True)
class Health(Mapping):
  """Every tier's TierHealth, by tier name (a read-only mapping)."""

  tiers: Mapping[str, TierHealth]

  def __getitem__(self, tier: str) -> TierHealth:
    return self.tiers[tier]

  def __iter__(self):
    return iter(self.tiers)

  def __len__(self) -> int:
    return len(self.tiers)

  @property
  def ok(self) -> bool:
    """True when no tier's newest operation failed."""
    return all(t.ok for t in self.tiers.values())

  def problems(self) -> list[str]:
    """One line per tier that failed, skips steps, or has a long-running
    operation: what a trainer's check_for_errors reports."""
    out = []
    for t in self.tiers.values():
      if t.consecutive_failures:
        out.append(f"{t.tier}: {t.consecutive_failures} failure(s) in a row, last: {t.last_error}")
      if t.skipped_total:
        out.append(f"{t.tier}: {t.skipped_total} step(s) skipped, newest {list(t.skipped_steps)}")
    return out

  def as_dict(self) -> dict:
    """{tier: TierHealth.as_dict()}."""
    return {name: t.as_dict() for name, t in self.tiers.items()}


@dataclasses.dataclass
class _Tier:
  newest: int | None = None
  running: dict = dataclasses.field(default_factory=dict)  # (step, op) -> start time
  failures: int = 0
  last_error: str | None = None
  skipped: collections.deque = dataclasses.field(
    default_factory=lambda: collections.deque(maxlen=SKIPS_KEPT)
  )
  skipped_total: int = 0


class HealthTracker:
  """Thread-safe per-tier bookkeeping behind the manager's health()."""

  def __init__(self, tiers: Iterable[str], *, clock: Callable[[], float] = time.monotonic):
    """Args:
    tiers: the tiers this process runs (others are added when first told of).
    clock: a monotonic clock in seconds (tests pass a fake one).
    """
    self._clock = clock
    self._lock = threading.Lock()
    self._tiers: dict[str, _Tier] = {t: _Tier() for t in tiers}
    self._reported: tuple[str, ...] = ()

  def _tier(self, tier: str) -> _Tier:
    return self._tiers.setdefault(tier, _Tier())

  def begin(self, tier: str, step: int, op: str) -> None:
    """`op` (e.g. "upload", "write") of `step` started on `tier`."""
    with self._lock:
      self._tier(tier).running[(step, op)] = self._clock()

  def end(self, tier: str, step: int, *, error: str | None = None) -> None:
    """`tier`'s work on `step` ended (every operation of it): durable if
    `error` is None, else failed."""
    with self._lock:
      t = self._tier(tier)
      for key in [k for k in t.running if k[0] == step]:
        del t.running[key]
      if error is None:
        t.failures, t.newest = 0, step if t.newest is None else max(t.newest, step)
      else:
        t.failures += 1
        t.last_error = error

  def forget(self, tier: str, step: int) -> None:
    """`tier`'s work on `step` will never end (abandoned): no longer in flight."""
    with self._lock:
      t = self._tier(tier)
      for key in [k for k in t.running if k[0] == step]:
        del t.running[key]

  def skip(self, tier: str, step: int) -> None:
    """`tier` skipped `step` (it will never hold it)."""
    with self._lock:
      t = self._tier(tier)
      t.skipped.append(step)
      t.skipped_total += 1

  def in_flight(self, tier: str) -> tuple[tuple[int, str], float] | None:
    """The oldest running operation of `tier` as ((step, op), seconds running), or None."""
    with self._lock:
      running = self._tier(tier).running
      if not running:
        return None
      key, t0 = min(running.items(), key=lambda kv: kv[1])
      return key, self._clock() - t0

  def down(self, tier: str, error: str) -> None:
    """`tier` can no longer work on this process (e.g. its receiver stopped):
    a failure until it succeeds again; recorded once per error."""
    with self._lock:
      t = self._tier(tier)
      if t.last_error != error or not t.failures:
        t.failures += 1
        t.last_error = error

  def snapshot(self) -> Health:
    """Every tier's TierHealth now."""
    now = self._clock()
    with self._lock:
      out = {}
      for name, t in self._tiers.items():
        running = sorted(t.running.items(), key=lambda kv: kv[1])
        out[name] = TierHealth(
          tier=name,
          newest_durable_step=t.newest,
          in_flight=tuple(f"{op or 'operation'} of step {step}" for (step, op), _ in running),
          oldest_in_flight_s=round(now - running[0][1], 3) if running else None,
          consecutive_failures=t.failures,
          last_error=t.last_error,
          skipped_steps=tuple(t.skipped),
          skipped_total=t.skipped_total,
        )
      return Health(out)

  def report(self, log_prefix: str) -> Health:
    """snapshot(), logging its problems as one warning when they differ from
    the last reported (a trainer may call this every step).

    Args:
      log_prefix: names this process in the warning.

    Returns:
      The snapshot.
    """
    health = self.snapshot()
    problems = tuple(health.problems())
    with self._lock:
      new, self._reported = problems != self._reported, problems
    if problems and new:
      logger.warning(
        "%s checkpointing is degraded (training goes on): %s", log_prefix, "; ".join(problems)
      )
    return health
