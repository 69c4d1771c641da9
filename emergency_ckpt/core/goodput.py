"""Goodput as one process sees it: the share of its time that trained the model.

A trainer calls save() every train step (the manager decides whether it
saves), so the time from one save() call's return to the next call, less
any restore() in between, is one step's training; time inside save() is
its stall, saving or not. `StepTimer` keeps running totals of these (O(1)
memory), and:

- records the start-up once, as a `startup` event, when the first save()
  call returns: from the manager's construction to the end of the first
  restore() that returns (none before the first save(): to the first
  save() call), plus that first save() call, which waits for the rest of
  the manager's set-up (Orbax, loaded in the background, then set up by
  every process together); `restore_s` is the time in restore() until
  then, `startup_s` the rest (set-up, compilation, ...), `age_s` the time
  since the manager's construction began. That save() call
  adds no stall, and a step only if a restore() ended the start-up (the
  time before it was training, else start-up);
- records `progress` events, each with the totals since the previous one
  (first_step, last_step, steps, train_s, stall_s): at a save() that
  saved, once PROGRESS_EVERY_S passed since the last one, and at close()
  (always, with closed=true: a log whose process ended without close() has
  none), so a log grows by one such event per PROGRESS_EVERY_S at most;
- answers CheckpointManager.goodput() with a frozen `Goodput`.

Work redone after a restart (steps an earlier process trained past the
step restored) is not known at run time; `emergency-ckpt report` counts it
from the event logs (cli/goodput.py).

Called by: CheckpointManager (manager/__init__.py), on the trainer's
thread (save(), restore(), close()); snapshot() on any thread. Blocks on a
short lock and, for an event, the event log's append.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from emergency_ckpt.core.telemetry import EventLog

PROGRESS_EVERY_S = 10.0
"""The least time between two `progress` events (but the one at close()):
the log stays small, and a crash loses at most this much of the record
(plus the steps to the next save)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Goodput:
  """Where this process's time went since its manager's construction began.

  Work redone after a restart is not in it (the manager cannot know which
  steps an earlier process trained past the restored step): it counts as
  productive here; `emergency-ckpt report` subtracts it.

  Attributes:
    wall_s: since the manager's construction began.
    productive_s: training: from each save() call's return to the next
      call, less restore() in between.
    stall_s: inside save(), every call (saving or not).
    startup_s: the start-up (construction to the end of the first
      restore() that returned, else to the first save() call; plus that
      first save() call), less restore_s of it.
    restore_s: inside restore(), every call.
    steps: the save() calls whose step's training is in productive_s.
  """

  wall_s: float
  productive_s: float
  stall_s: float
  startup_s: float
  restore_s: float
  steps: int

  @property
  def goodput_pct(self) -> float | None:
    """productive_s as a percentage of wall_s (None before any time passed)."""
    return 100.0 * self.productive_s / self.wall_s if self.wall_s > 0 else None

  @property
  def other_s(self) -> float:
    """The rest of wall_s: after the last save(), in close(), ..."""
    return self.wall_s - self.productive_s - self.stall_s - self.startup_s - self.restore_s

  def as_dict(self) -> dict:
    """A JSON-able copy, goodput_pct and other_s included (for metrics systems)."""
    return {**dataclasses.asdict(self), "goodput_pct": self.goodput_pct, "other_s": self.other_s}


@dataclasses.dataclass
class _Window:
  """The totals since the last progress event."""

  first_step: int | None = None
  last_step: int | None = None
  steps: int = 0
  train_s: float = 0.0
  stall_s: float = 0.0


class StepTimer:
  """Running totals of one manager's time; see the module docstring.

  Args:
    events: where `startup` and `progress` events go.
    began: when the manager's construction began, on `clock`.
    clock: seconds, monotonic (time.monotonic; tests pass a fake).
    every_s: the least time between two progress events (but close()'s).
  """

  def __init__(
    self,
    events: EventLog,
    *,
    began: float,
    clock: Callable[[], float] = time.monotonic,
    every_s: float = PROGRESS_EVERY_S,
  ):
    self._events, self._clock, self._every_s = events, clock, every_s
    self._lock = threading.Lock()
    self._began = began
    self._ready: float | None = None  # when a restore() or the first save() call ended it
    self._startup_s: float | None = None  # the start-up, once the first save() returned
    self._first_began: float | None = None  # the first save() call's start, while under way
    self._no_step = False  # the save() call under way ends a start-up without restore
    self._startup_restore_s = 0.0
    self._resumed = began  # the last save() call's return, or the start-up's end
    self._paused_s = 0.0  # restore() time since then: not training
    self._train_s = self._stall_s = self._restore_s = 0.0
    self._steps = 0
    self._window = _Window()
    self._last_progress = began
    self._closed = False

  def save_began(self) -> float:
    """A save() call begins; the first ends the start-up when it returns.

    Returns:
      Its time on the clock, for save_returned().
    """
    now = self._clock()
    with self._lock:
      if self._startup_s is None:
        self._first_began = now
        if self._ready is None:  # no restore() returned: the time before it was start-up
          self._ready = self._resumed = now
          self._no_step = True
    return now

  def restored(self, began: float, *, ok: bool) -> None:
    """A restore() call that began at `began` (on the clock) just ended;
    `ok`: it returned (the first such call ends the start-up but for the
    first save() call)."""
    now = self._clock()
    with self._lock:
      spent = now - began
      self._restore_s += spent
      if self._ready is None:
        self._startup_restore_s += spent
        if ok:
          self._ready = self._resumed = now
      else:
        self._paused_s += spent

  def save_returned(self, step: int, began: float, *, saved: bool) -> None:
    """A save(step) call that began at `began` (save_began()'s answer) is
    returning (or raising); `saved`: a tier saved the step."""
    now = self._clock()
    with self._lock:
      w = self._window
      if not self._no_step:  # its training: since the last return (or restore)
        train = max(0.0, began - self._resumed - self._paused_s)
        self._train_s += train
        self._steps += 1
        w.train_s += train
        w.steps += 1
        w.first_step = step if w.first_step is None else w.first_step
        w.last_step = step
      self._no_step = False
      if self._startup_s is None:  # the manager's set-up ends in it: start-up, not a stall
        self._first_began = None
        self._start_up_ended(now - began)
      else:
        self._stall_s += now - began
        w.stall_s += now - began
      self._resumed, self._paused_s = now, 0.0
      if saved and now - self._last_progress >= self._every_s:
        self._progress(now)

  def close(self) -> None:
    """Records the last progress event (closed=true). Called by: the
    manager's close(), once; later calls do nothing."""
    with self._lock:
      if not self._closed:
        self._closed = True
        self._progress(self._clock(), closed=True)

  def snapshot(self) -> Goodput:
    """The totals as of now (CheckpointManager.goodput())."""
    now = self._clock()
    with self._lock:
      startup_s = self._startup_s
      if startup_s is None:  # under way: to now, or to the restore plus the first save() so far
        ready = now if self._ready is None else self._ready
        first = 0.0 if self._first_began is None else now - self._first_began
        startup_s = max(0.0, ready - self._began - self._startup_restore_s) + first
      return Goodput(
        wall_s=now - self._began,
        productive_s=self._train_s,
        stall_s=self._stall_s,
        startup_s=startup_s,
        restore_s=self._restore_s,
        steps=self._steps,
      )

  def _start_up_ended(self, first_call_s: float) -> None:
    """The first save() call (`first_call_s` long) returns: the start-up is known."""
    before = max(0.0, self._ready - self._began - self._startup_restore_s)
    self._startup_s = before + first_call_s
    self._events.record(
      "startup",
      startup_s=round(self._startup_s, 6),
      restore_s=round(self._startup_restore_s, 6),
      age_s=round(self._clock() - self._began, 6),
    )

  def _progress(self, now: float, *, closed: bool = False) -> None:
    w, self._window = self._window, _Window()
    self._last_progress = now
    self._events.record(
      "progress",
      first_step=w.first_step,
      last_step=w.last_step,
      steps=w.steps,
      train_s=round(w.train_s, 6),
      stall_s=round(w.stall_s, 6),
      **({"closed": True} if closed else {}),
    )
