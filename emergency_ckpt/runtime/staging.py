"""Host snapshots: save()'s copy of this process's shards into reused buffers.

A save copies this process's unique shards into a host buffer (the only
stall: a memcpy on CPU; from accelerators the DMA into page-locked host
memory, the copy into the buffer then running in the background, or with
local.device_snapshot a device-side copy only); the local tier
then writes the buffer to the ramdisk and, on CPU, the persistent upload
reads arrays that alias it. The buffers are reused and kept faulted in
between saves (like DCP's cached staging buffers): a copy into fresh memory
takes a page fault per page inside the stall. `prepare()` allocates the next
save's buffer in the background, at the lowest CPU priority.

Co-located processes of one job (several per machine) share its cores: each
holds the machine-wide staging window (colocated.py) while it copies, and
background work on a snapshot waits briefly until no process of the job on
the machine is still copying.

Called by: the process's own threads only; no collective.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from emergency_ckpt.cluster.colocated import StagingWindow
from emergency_ckpt.core import shards as shards_lib

if TYPE_CHECKING:
  from emergency_ckpt.runtime.background import Lane

logger = logging.getLogger("emergency_ckpt")

_PAGE = mmap.PAGESIZE
BACKGROUND_NICE = 19


def lower_thread_priority() -> None:
  """Runs the calling thread at the lowest CPU priority (Linux: nice is per
  thread). For background work that only prepares for later (the next
  save's staging buffer): on this 2-core machine, preparing at normal
  priority right after a peer restore made the restore's tail
  (block_until_ready) a median 0.24-0.34 s instead of 0.12-0.13 s, the whole
  restore 0.87-0.92 s instead of 0.64-0.66 s (measured when preparing meant
  allocating and mapping a ramdisk file). Elsewhere a no-op."""
  if not sys.platform.startswith("linux"):
    return
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
  except OSError as e:  # e.g. a sandbox forbids it: only slower
    logger.debug("cannot lower the priority of %s: %s", threading.current_thread().name, e)


def aligned_empty(nbytes: int) -> np.ndarray:
  """An uninitialised uint8 buffer whose start is page-aligned (so views at
  shards.ALIGN offsets can be aliased by jax CPU arrays without a copy)."""
  return _page_aligned(np.empty(nbytes + _PAGE, dtype=np.uint8), nbytes)


def aligned_zeros(nbytes: int) -> np.ndarray:
  """aligned_empty's zeroed twin (calloc's fresh pages: zeroed as faulted in)."""
  return _page_aligned(np.zeros(nbytes + _PAGE, dtype=np.uint8), nbytes)


def _page_aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
  start = (-raw.ctypes.data) % _PAGE
  return raw[start : start + nbytes]


def _fault_in(buf: np.ndarray) -> None:
  """Touches every page of `buf` (writing zeros), so a
  later copy into it takes no page fault. numpy's large allocations ask for
  transparent huge pages: 0.03 s per 256 MiB here."""
  if buf.nbytes:
    buf[::_PAGE] = 0
    buf[-1] = 0


class BufferPool:
  """Reused host staging buffers. At most `count` local writes hold one at a
  time (acquire blocks while all are writing); a buffer that something else
  still reads (a background persistent upload, see hold) goes back to the
  free list only when that reader lets go too."""

  def __init__(self, count: int):
    self._sem = threading.Semaphore(count)
    self._count = count
    self._lock = threading.Lock()
    self._ready = threading.Condition(self._lock)  # a preallocated buffer landed
    self._preparing: set[int] = set()  # sizes preallocate() is faulting in now
    self._free: list[np.ndarray] = []
    self._holders: dict[int, int] = {}  # id(buffer) -> readers besides the write
    self._writing: set[int] = set()  # id(buffer) of buffers a local write holds

  def _take_free(self, nbytes: int) -> np.ndarray | None:
    with self._lock:
      while nbytes in self._preparing:  # faulting it in here would cost the same, and double it
        self._ready.wait()
      i = next((i for i, b in enumerate(self._free) if b.nbytes == nbytes), None)
      if i is None:
        self._free.clear()  # the layout changed: drop old sizes
        return None
      return self._free.pop(i)

  def acquire(self, nbytes: int) -> np.ndarray:
    self._sem.acquire()
    buf = self._take_free(nbytes)
    if buf is None:  # the first save of a layout without preallocate(): faults in the copy
      buf = aligned_zeros(nbytes)  # zeros: the padding between shards (see preallocate)
    with self._lock:
      self._writing.add(id(buf))
    return buf

  def preallocate(self, nbytes: int) -> None:
    """Makes sure a free, faulted-in buffer of `nbytes` exists (so the next
    acquire's copy takes no page fault). Blocks on allocating and touching it."""
    with self._lock:
      if nbytes in self._preparing or any(b.nbytes == nbytes for b in self._free):
        return
      self._preparing.add(nbytes)
    buf = None
    try:
      # Zeroed (fresh pages cost the same): the padding between shards, never
      # staged into, is zeros in the written file and in the XOR parity
      # sent from the buffer (local_handler.write_shards writes it too).
      buf = aligned_zeros(nbytes)
      _fault_in(buf)
    finally:
      with self._lock:
        self._preparing.discard(nbytes)
        if buf is not None:
          self._free = [b for b in self._free if b.nbytes == nbytes]
          self._put_back(buf)
        self._ready.notify_all()

  def hold(self, buf: np.ndarray) -> None:
    """One more reader of `buf`; it must call unhold(buf) when done."""
    with self._lock:
      self._holders[id(buf)] = self._holders.get(id(buf), 0) + 1

  def unhold(self, buf: np.ndarray) -> None:
    with self._lock:
      left = self._holders[id(buf)] - 1
      if left:
        self._holders[id(buf)] = left
        return
      del self._holders[id(buf)]
      if id(buf) not in self._writing:
        self._put_back(buf)

  def _put_back(self, buf: np.ndarray) -> None:
    if len(self._free) <= self._count:
      self._free.append(buf)

  def release(self, buf: np.ndarray) -> None:
    """The local write of `buf` is done (frees a write slot at once)."""
    with self._lock:
      self._writing.discard(id(buf))
      if id(buf) not in self._holders:
        self._put_back(buf)
    self._sem.release()

  def clear(self) -> None:
    with self._lock:
      self._free.clear()


@dataclasses.dataclass(eq=False)
class HostSnapshot:
  """One step's shards of this process, copied to a host buffer.

  The local write reads it and then calls release(); another reader (the
  background persistent upload) takes hold() first and lets go when done:
  the buffer is reused only after both."""

  step: int
  layout: shards_lib.Layout
  buffer: np.ndarray
  stall_s: float
  """Seconds the copy took (the save's stall)."""
  _area: StagingArea = dataclasses.field(repr=False)
  filled: concurrent.futures.Future | None = dataclasses.field(default=None, repr=False)
  """The background copy into `buffer` (from accelerators: after the DMA
  to pinned host memory, or the whole device-to-host copy of a device
  snapshot); None: the buffer was filled inside save()."""

  def wait_filled(self) -> None:
    """Blocks until `buffer` holds the step's bytes. Raises OSError if the
    background device-to-host copy failed. Called by: every reader of the
    buffer, before reading it."""
    if self.filled is None:
      return
    try:
      self.filled.result()
    except Exception as e:  # noqa: BLE001 - one typed failure for the writers
      raise OSError(f"the device-to-host copy of step {self.step} failed: {e!r}") from e

  def hold(self) -> Callable[[], None]:
    """Keeps the buffer from reuse until the returned function is called, once."""
    self._area._pool.hold(self.buffer)
    return lambda: self._area._pool.unhold(self.buffer)

  def release(self) -> None:
    """The local write is done with the buffer (or no local write comes)."""
    self._area._pool.release(self.buffer)

  def arrays(self, abstract: Sequence[Any], memory_kind: str | None = None) -> list[Any]:
    """Global jax.Arrays for `abstract` built from the snapshot, in the
    devices' `memory_kind` (None: default; on CPU they then alias the
    buffer: hold() it while they live)."""
    return [
      shards_lib.assemble(
        a,
        {slot.index: shards_lib.view(self.buffer, leaf, slot) for slot in leaf.slots},
        memory_kind,
      )
      for a, leaf in zip(abstract, self.layout.leaves)
    ]

  def wait_others_staged(self) -> float:
    """Blocks until no process of this job on this machine is copying a step
    (capped at 1 s + 4x this snapshot's own copy time); returns the seconds
    waited. Called by: background threads, before memory-heavy work on the
    snapshot (see colocated.py)."""
    return self._area._window.wait_closed(1.0 + 4 * self.stall_s)


class StagingArea:
  """This process's staging buffers and its part in the machine-wide
  staging window. Per process: no collectives."""

  def __init__(
    self,
    *,
    buffers: int,
    job: str | None,
    preparer: Lane,
    filler: concurrent.futures.Executor | None = None,
    device_snapshot: bool = False,
  ):
    """`buffers`: how many local writes may hold a buffer at once.
    `job`: the job's key for the staging window (None: no coordination).
    `preparer`: a low-priority serial executor for prepare().
    `filler`: a serial executor for the copies into the staging buffer that
    may run after save() returns (None: save() makes every copy itself).
    `device_snapshot`: save() copies on the device (see
    LocalTierOptions.device_snapshot); needs a filler."""
    self._pool = BufferPool(buffers)
    self._window = StagingWindow(job)
    self._preparer = preparer
    self._filler = filler
    self._device_snapshot = device_snapshot
    self._closed = False

  def reserve(self, paths: Sequence[str], arrays: Sequence[Any]) -> tuple:
    """A buffer for this layout, for stage(reserved=...). Blocks while every
    buffer is held by a running local write: call it before staging()."""
    layout = shards_lib.layout_for(paths, arrays)
    return layout, self._pool.acquire(layout.nbytes)

  def stage(
    self, step: int, paths: Sequence[str], arrays: Sequence[Any], reserved: tuple | None = None
  ) -> HostSnapshot:
    """Copies this process's shards into `reserved` (from reserve(), or a
    buffer taken here). Blocks on that copy only, or less where the rest
    may run in the background (_start_fill; HostSnapshot.wait_filled)."""
    t0 = time.perf_counter()
    layout, buffer = reserved if reserved is not None else self.reserve(paths, arrays)
    try:
      filled = self._start_fill(step, arrays, layout, buffer)
    except BaseException:
      self._pool.release(buffer)
      raise
    return HostSnapshot(step, layout, buffer, time.perf_counter() - t0, self, filled)

  def _start_fill(self, step, arrays, layout, buffer) -> concurrent.futures.Future | None:
    """Device snapshots: dispatches the device copies and hands the rest to
    the filler. Else blocks on the device-to-host copy; from accelerators the
    copy into `buffer` then runs on the filler (the host copy is the
    process's own memory: the trainer may donate the arrays at once); CPU
    shards (views of the arrays) are copied here. None: `buffer` is filled."""
    shards = shards_lib.slot_shards(arrays, layout)
    copies = self._device_copies(step, shards)
    if copies is not None:
      return self._filler.submit(shards_lib.fill, copies, layout, buffer)
    if self._filler is None or not shards_lib.off_host(shards):
      shards_lib.fill(shards, layout, buffer)
      return None
    return self._filler.submit(shards_lib.copy_into, shards_lib.to_host(shards), layout, buffer)

  def _device_copies(self, step: int, shards: list) -> list | None:
    """The device-side copies for a device snapshot, or None to stage on the
    host (not asked for, or the device could not hold the copy)."""
    if self._filler is None or not self._device_snapshot:
      return None
    try:
      return shards_lib.device_copies(shards)
    except Exception as e:  # noqa: BLE001 - e.g. out of device memory: stage on the host
      logger.warning(
        "step %d: no device memory for a device snapshot (%s); copying to the host in save()",
        step,
        e,
      )
      return None

  def staging(self) -> contextlib.AbstractContextManager:
    """A context in which this process counts as staging: co-located
    processes of the job hold their background work until it ends. Called
    by: the thread that calls stage(). Never blocks; nothing inside it may
    wait for this process's own background work."""
    return self._window.staging()

  def prepare(self, paths: Sequence[str], abstract: Sequence[Any]) -> None:
    """Starts allocating and faulting in, in the background, the buffer a
    save of this layout copies into. Blocks on nothing."""
    nbytes = shards_lib.layout_for(paths, abstract).nbytes
    if self._closed or nbytes == 0:
      return
    self._preparer.submit(self._pool.preallocate, nbytes)

  def wait_prepared(self) -> None:
    """Blocks until prepare()'s queued work is done."""
    self._preparer.wait_queued()

  def close(self) -> None:
    """Drops the free buffers and leaves the staging window (after the
    preparer's owner shut it down)."""
    self._closed = True
    self._pool.clear()
    self._window.close()
