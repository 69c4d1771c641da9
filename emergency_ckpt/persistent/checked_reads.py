"""Tensorstore reads of saved shards, each checked against its CRC32C as
soon as it lands, while the others are still being read.

read.py starts one tensorstore read per saved shard it needs; this module
checks each one's bytes (checksums.check_shard) on a small pool of helper
threads in the order tensorstore finishes them, not the order they were
started, so the CRC32C pass overlaps the reads still under way (crc32c
releases the GIL) instead of following them. Every byte read is still
checked before the caller sees it: wait() returns only once every read
has landed and passed.

read_context() is the tensorstore context the reads use: Orbax's own
(its concurrency limits and OCDBT cache), with local files read through
a memory map (tensorstore's file_io_mode "memmap"), so that tensorstore
copies a shard's bytes from the page cache straight into its place in the
restore buffer, instead of pread()ing them first into a freshly
allocated buffer of its own (page faults, zeroed pages, a second copy).
Only local files (file://) are affected; gs:// and other kvstores ignore
it. A committed step's files are never rewritten in place (Orbax writes
new files; retention unlinks whole steps, which a mapping outlives).

Called by: persistent/read.py (read_into), on the restoring thread; wait()
blocks until every read is in and checked (or one failed and every read
has stopped writing into the caller's buffer).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from emergency_ckpt.persistent import checksums
from emergency_ckpt.state.shard_records import Expected, SavedShard

MAX_THREADS = 4
FILE_IO_MODE = {"file_io_mode": {"mode": "memmap"}}


def read_context(ocp: Any, use_ocdbt: bool) -> Any:
  """Orbax's tensorstore context for reading a step, local files memory-mapped.

  Args:
    ocp: the orbax.checkpoint module.
    use_ocdbt: whether the step is an OCDBT database.

  Returns:
    A ts.Context: Orbax's (get_ts_context), with file_io_mode "memmap"
    added; Orbax's unchanged where this tensorstore lacks file_io_mode.
  """
  import tensorstore as ts  # noqa: PLC0415 - heavy import, only when used

  base = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
  try:
    return ts.Context(ts.Context.Spec(FILE_IO_MODE), base)
  except ValueError:  # an older tensorstore: no file_io_mode resource
    return base


class CheckedReads:
  """Started tensorstore reads, each checked against its CRC32C as it lands.

  Use as a context manager around add() and wait(): leaving it (normally
  or by an error) waits for every read started, so none writes into the
  caller's buffer afterwards, and stops the helper threads.

  Args:
    expected: the step's recorded shard CRC32Cs.
    fail: turns tensorstore's error for a leaf into the caller's
      (name, error) -> exception.
  """

  def __init__(self, expected: Expected, fail: Callable[[str, ValueError], Exception]):
    self._expected = expected
    self._fail = fail
    self._reads: list[Any] = []
    self._checked: list[tuple[concurrent.futures.Future, Any]] = []
    self._lock = threading.Lock()
    self._closed = False
    self._go = threading.Event()
    self._pool = concurrent.futures.ThreadPoolExecutor(
      max(1, min(MAX_THREADS, os.cpu_count() or 1)), thread_name_prefix="ec-crc32c"
    )

  def __enter__(self) -> CheckedReads:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def add(self, name: str, path: str, shard: SavedShard, target: np.ndarray, read: Any, key: Any):
    """Checks `target` against `shard`'s CRC32C once the tensorstore read
    `read` into it is done. Called by: read.py, on the restoring thread.

    Args:
      name: the leaf's Orbax name (for errors).
      path: the leaf's path.
      shard: the saved shard `target` receives, whole.
      target: the array the read writes.
      read: the tensorstore future of that read.
      key: handed back by wait() once checked (None: not reported).
    """
    checked: concurrent.futures.Future = concurrent.futures.Future()

    def check() -> None:
      self._go.wait()  # the recorded CRC32Cs are fetched (wait() began)
      if self._closed or not checked.set_running_or_notify_cancel():
        checked.cancel()
        return
      try:
        try:
          read.result()
        except ValueError as e:  # tensorstore's errors (NOT_FOUND, DATA_LOSS, ...)
          raise self._fail(name, e) from e
        checksums.check_shard(self._expected, path, shard, target)
        checked.set_result(None)
      except BaseException as e:  # noqa: BLE001 - handed to wait()'s caller
        checked.set_exception(e)

    def landed(_: Any) -> None:  # on a tensorstore thread
      with self._lock:
        if not self._closed:
          self._pool.submit(check)
          return
      checked.cancel()

    self._reads.append(read)
    self._checked.append((checked, key))
    read.add_done_callback(landed)

  def wait(self, on_ready: Callable[[Any], None] | None = None) -> None:
    """Blocks until every read is in and checked, calling on_ready(key) for
    each (key not None) as it passes, in the order they pass. Checks begin
    here: call it once the expected CRC32Cs are fetched (Expected.prefetch),
    so that the helper threads only look them up.

    Raises:
      The first failure: fail()'s exception for a read tensorstore
      could not do, or CorruptCheckpointError for a CRC32C mismatch.
    """
    self._go.set()
    keys = {id(f): key for f, key in self._checked}
    for done in concurrent.futures.as_completed([f for f, _ in self._checked]):
      done.result()
      key = keys[id(done)]
      if key is not None and on_ready is not None:
        on_ready(key)

  def close(self) -> None:
    """Waits for every read started (errors ignored: wait() reports them),
    then stops the helper threads, cancelling checks not yet begun."""
    for read in self._reads:
      try:
        read.result()
      except Exception:  # noqa: BLE001, S110 - reported by wait(), or moot after a failure
        pass
    with self._lock:
      self._closed = True
    self._go.set()  # checks not begun are cancelled
    self._pool.shutdown(wait=True, cancel_futures=True)
