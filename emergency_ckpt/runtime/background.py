"""The one owner of a manager's background threads, their errors and waits.

Every background task runs on a named serial lane (one thread each: a local
write, the JSON state write, the commit, retention, the commit watch, the
next save's buffer). A lane keeps its tasks in order; tasks of different
lanes run side by side. A tracked task's error is kept and raised by the
next call that checks (`raise_errors`, `wait`), once, and marks the runtime
failed (sticky: close() then waits only for this process's own work).

Called by: the owning process's threads; no collective.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from emergency_ckpt.runtime.serial import SerialExecutor

logger = logging.getLogger("emergency_ckpt")

BACKGROUND_NICE = 19


def lower_thread_priority() -> None:
  """Runs the calling thread at the lowest CPU priority (Linux: nice is per
  thread). For background work that only prepares for later (the next
  save's staging buffer): at normal priority, preparing right after a peer
  restore competed with the restore's tail (block_until_ready) for the
  cores and made the whole restore slower. Elsewhere a no-op.

  Called by: a low-priority lane's thread, as it starts (Background.lane).
  """
  if not sys.platform.startswith("linux"):
    return
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
  except OSError as e:  # e.g. a sandbox forbids it: only slower
    logger.debug("cannot lower the priority of %s: %s", threading.current_thread().name, e)


class Lane(SerialExecutor):
  """One lane: a serial executor (one thread) that remembers its last task,
  so that waiting for what is queued costs nothing on an idle lane. A no-op
  task to wait for would start the lane's thread if it has none, or hand off
  to it and back: a scheduling round each, on a loaded machine, twice per
  lane before every restore()."""

  def __init__(self, name: str, initializer: Callable[[], Any] | None = None):
    """A lane with no thread yet.

    Args:
      name: its thread's name prefix.
      initializer: run by its thread as it starts (e.g. lower_thread_priority).
    """
    super().__init__(name, initializer)
    self._last_lock = threading.Lock()
    self._last: concurrent.futures.Future | None = None

  def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
    """Queues fn(*args, **kwargs) behind the lane's earlier tasks.

    Args:
      fn, args, kwargs: the task.

    Returns:
      Its future.

    Raises:
      RuntimeError: the lane was shut down.
    """
    with self._last_lock:  # the lane runs tasks in this order
      fut = super().submit(fn, *args, **kwargs)
      self._last = fut
    return fut

  @property
  def busy(self) -> bool:
    """Whether a task of the lane is queued or running. Blocks on a short lock."""
    with self._last_lock:
      last = self._last
    return last is not None and not last.done()

  def wait_queued(self) -> None:
    """Blocks until every task submitted so far is done; never raises their
    errors (their owners do). Not from the lane's own thread."""
    with self._last_lock:
      last = self._last
    if last is not None:
      concurrent.futures.wait([last])


class Background:
  """Named serial lanes and the futures of tracked tasks."""

  def __init__(self, log_prefix: str = ""):
    """No lanes yet.

    Args:
      log_prefix: the prefix of its log lines (Topology.log_prefix()).
    """
    self._log_prefix = log_prefix
    self._lock = threading.Lock()
    self._lanes: dict[str, Lane] = {}
    self._pending: list[concurrent.futures.Future] = []
    self._errors: list[BaseException] = []  # not raised yet
    self._raised: list[BaseException] = []  # raised before their callback ran
    self._failed = False
    self._closed = False

  def lane(self, name: str, *, low_priority: bool = False) -> Lane:
    """The serial executor named `name` (created on first use).

    Args:
      name: the lane's name.
      low_priority: its thread runs at the lowest CPU priority (work that
        only prepares for later); counts only when the lane is created.

    Returns:
      The lane.

    Raises:
      RuntimeError: a new lane after close().
    """
    with self._lock:
      lane = self._lanes.get(name)
      if lane is None:
        if self._closed:
          raise RuntimeError(f"background lane {name!r} requested after close()")
        lane = Lane(f"ec-{name}", lower_thread_priority if low_priority else None)
        self._lanes[name] = lane
      return lane

  def busy(self, lane: str) -> bool:
    """Whether lane `lane` has a task queued or running (False for a lane
    never used). Called by: any thread. Blocks on short locks.

    Args:
      lane: the lane's name.
    """
    with self._lock:
      found = self._lanes.get(lane)
    return found is not None and found.busy

  def submit(self, lane: str, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Runs fn(*args) on `lane`, tracked (its error is raised later).

    Args:
      lane: the lane's name.
      fn, args: the task.

    Returns:
      Its future.

    Raises:
      RuntimeError: the lane takes no more work (closed).
    """
    fut = self.lane(lane).submit(fn, *args)
    self.track(fut)
    return fut

  def try_submit(self, lane: str, fn: Callable[..., Any], *args: Any) -> None:
    """submit(), or nothing once the runtime is closing.

    Args:
      lane, fn, args: as for submit().
    """
    try:
      self.submit(lane, fn, *args)
    except RuntimeError:  # the lane takes no more work
      pass

  @property
  def failed(self) -> bool:
    """Some tracked task failed (its error may have been raised already)."""
    return self._failed

  def track(self, fut: concurrent.futures.Future) -> None:
    """Keeps `fut`'s error for raise_errors() / wait().

    Args:
      fut: a future of work this runtime owns.
    """

    def done(f: concurrent.futures.Future) -> None:
      e = f.exception()
      if e is not None:
        logger.error("%s background checkpoint work failed: %s", self._log_prefix, e)
        with self._lock:
          if not any(x is e for x in self._raised):
            self._errors.append(e)
          self._failed = True

    with self._lock:
      self._pending = [f for f in self._pending if not f.done()]
      self._pending.append(fut)
    fut.add_done_callback(done)

  def raise_errors(self, only: tuple[type[BaseException], ...] | None = None) -> None:
    """Raises the first error of a tracked task not raised yet.

    Args:
      only: raise only an error of these types (the others stay, for a
        later call without `only`); None: any.

    Raises:
      That error, once.
    """
    with self._lock:
      pick = [e for e in self._errors if only is None or isinstance(e, only)]
      if pick:
        self._errors = [e for e in self._errors if e is not pick[0]]
    if pick:
      raise pick[0]

  def _pending_now(self) -> list[concurrent.futures.Future]:
    with self._lock:
      return [f for f in self._pending if not f.done()]

  def wait(self, extra: Callable[[], concurrent.futures.Future | None] = lambda: None) -> None:
    """Blocks until every tracked task (and the future `extra()` returns, if
    any: e.g. an upload another module owns) is done, raising the first error
    as soon as any tracked task fails: a process whose step failed must not
    sit behind work that waits for a process that already failed the same
    way. A failed `extra` future ends the wait (its owner raises it).

    Args:
      extra: returns another future to wait for, or None.

    Raises:
      The first error of a tracked task not raised yet.
    """
    while True:
      self.raise_errors()
      upload = extra()
      if upload is not None and upload.done():
        if upload.exception() is not None:
          return  # its owner raises it, translated
        upload = None
      waiting = self._pending_now() + ([upload] if upload is not None else [])
      if not waiting:
        return
      done, _ = concurrent.futures.wait(waiting, return_when=concurrent.futures.FIRST_COMPLETED)
      for f in done:
        if f is upload:
          continue
        e = f.exception()
        if e is not None:  # its done-callback may not have recorded it yet
          with self._lock:
            self._failed = True
            self._errors = [x for x in self._errors if x is not e]
            self._raised.append(e)
          raise e

  def drain(self) -> None:
    """Blocks until every tracked task is done.

    Raises:
      The first error of a tracked task not raised yet.
    """
    while pending := self._pending_now():
      concurrent.futures.wait(pending)
    self.raise_errors()

  def flush(self, lane: str) -> None:
    """Blocks until the tasks queued on `lane` so far are done.

    Args:
      lane: the lane's name.
    """
    self.lane(lane).wait_queued()

  def close(self, lanes: tuple[str, ...] = (), *, abandon: bool = False) -> None:
    """Shuts down `lanes` first, in order, then every other lane; waits for
    queued tasks, unless `abandon`: then queued tasks are cancelled and a
    running one is left to its thread (nothing here blocks).

    Args:
      lanes: the lanes to shut down first.
      abandon: do not wait (after wait_until_finished() gave up).
    """
    with self._lock:
      self._closed = True
      order = [n for n in lanes if n in self._lanes]
      order += [n for n in self._lanes if n not in order]
      executors = [self._lanes[n] for n in order]
    for ex in executors:
      ex.shutdown(wait=not abandon, cancel_futures=abandon)


def run_within(fn: Callable[[], Any], timeout_s: float | None) -> bool:
  """Runs fn() on a daemon thread and waits at most `timeout_s` (None: as
  long as it takes). Called by: the thread that would otherwise block in fn.

  Args:
    fn: the wait to bound.
    timeout_s: the longest wait, or None.

  Returns:
    True once fn() returned; False if it still runs after `timeout_s` (it
    goes on in the background).

  Raises:
    Whatever fn() raised, when it ended in time.
  """
  if timeout_s is None:
    fn()
    return True
  box: list[BaseException] = []

  def run() -> None:
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
      box.append(e)

  thread = threading.Thread(target=run, name="ec-bounded-wait", daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    return False
  if box:
    raise box[0]
  return True
