"""A one-thread executor on a daemon thread: work that never holds the process at exit.

The standard ThreadPoolExecutor joins its threads when the interpreter
exits, so a task stuck on a hung bucket (or a thread it started: threads
inherit the daemon flag of the thread that starts them, Orbax's upload
threads too) keeps a finished program alive for as long as the bucket
hangs. The manager bounds its own waits (finish_timeout_s) and then
abandons what is left; this executor makes abandoning real: its thread is
a daemon, so the interpreter may end while a task still runs. A manager
still open at exit is closed by an atexit hook first (manager/__init__.py),
so ordinary work is not lost at a normal exit.

Called by: the background lanes (runtime/background.py) and the
persistent tier's upload thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("emergency_ckpt")


class SerialExecutor(concurrent.futures.Executor):
  """Runs submitted tasks one at a time, in order, on one daemon thread
  (started by the first submit).

  Args:
    name: the thread's name prefix (the thread is "<name>_0").
    initializer: run by the thread as it starts; its error is logged and
      the tasks still run.
  """

  def __init__(self, name: str, initializer: Callable[[], Any] | None = None):
    self._name = name
    self._initializer = initializer
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._state_lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._closed = False

  def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
    """Queues fn(*args, **kwargs) behind the earlier tasks.

    Returns:
      Its future.

    Raises:
      RuntimeError: the executor was shut down.
    """
    with self._state_lock:
      if self._closed:
        raise RuntimeError("cannot schedule new futures after shutdown")
      fut: concurrent.futures.Future = concurrent.futures.Future()
      self._queue.put((fut, fn, args, kwargs))
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name=f"{self._name}_0", daemon=True)
        self._thread.start()
    return fut

  def _run(self) -> None:
    if self._initializer is not None:
      try:
        self._initializer()
      except Exception as e:  # noqa: BLE001 - the tasks matter more than the set-up
        logger.debug("%s: initializer failed: %s", self._name, e)
    while True:
      item = self._queue.get()
      if item is None:
        return
      fut, fn, args, kwargs = item
      if not fut.set_running_or_notify_cancel():
        continue
      try:
        result = fn(*args, **kwargs)
      except BaseException as e:  # noqa: BLE001 - the future carries it to its owner
        fut.set_exception(e)
      else:
        fut.set_result(result)
        del result
      # Not kept alive until the next task arrives: a task's closure may hold
      # a staging buffer (local.keep_staging_buffer=False lets it go here).
      del item, fut, fn, args, kwargs

  def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
    """Stops taking tasks; the queued ones still run unless `cancel_futures`.

    Args:
      wait: block until the running and queued tasks are done.
      cancel_futures: cancel the queued tasks (not the running one).
    """
    with self._state_lock:
      self._closed = True
      if cancel_futures:
        while True:
          try:
            item = self._queue.get_nowait()
          except queue.Empty:
            break
          if item is not None:
            item[0].cancel()
      self._queue.put(None)
      thread = self._thread
    if wait and thread is not None and thread is not threading.current_thread():
      thread.join()
