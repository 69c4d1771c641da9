"""Host snapshots: save()'s copy of this process's shards into reused buffers.

A save copies this process's unique shards into a host buffer (the only
stall: a memcpy on CPU; from accelerators the DMA into page-locked host
memory, the copy into the buffer then running in the background, or with
local.device_snapshot a device-side copy only); the local tier
then writes the buffer to the ramdisk and, on CPU, the persistent upload
reads arrays that alias it. The buffers are reused and kept faulted in
between saves (buffers.py); `prepare()` allocates the next save's buffer in
the background, at the lowest CPU priority. With local.keep_staging_buffer
off, a buffer is let go once the step's last reader is done, and each
save copies into fresh memory. The copies themselves are
device_copy.py's.

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
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from emergency_ckpt.cluster.colocated import StagingWindow
from emergency_ckpt.core import placement
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.runtime import device_copy
from emergency_ckpt.runtime.buffers import BufferPool

if TYPE_CHECKING:
  from emergency_ckpt.runtime.background import Lane

logger = logging.getLogger("emergency_ckpt")


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
    """Blocks until `buffer` holds the step's bytes. Called by: every reader
    of the buffer, before reading it.

    Raises:
      OSError: the background device-to-host copy failed.
    """
    if self.filled is None:
      return
    try:
      self.filled.result()
    except Exception as e:  # noqa: BLE001 - one typed failure for the writers
      raise OSError(f"the device-to-host copy of step {self.step} failed: {e!r}") from e

  def hold(self) -> Callable[[], None]:
    """Keeps the buffer from reuse.

    Returns:
      The function that lets go (call it once).
    """
    self._area._pool.hold(self.buffer)
    return lambda: self._area._pool.unhold(self.buffer)

  def release(self) -> None:
    """The local write is done with the buffer (or no local write comes)."""
    self._area._pool.release(self.buffer)

  def arrays(self, abstract: Sequence[Any], memory_kind: str | None = None) -> list[Any]:
    """Global jax.Arrays built from the snapshot.

    Args:
      abstract: the state's abstract leaves (with shardings).
      memory_kind: the devices' memory to place them in (None: default;
        on CPU they then alias the buffer: hold() it while they live).

    Returns:
      One array per leaf.
    """
    by_index = [
      {slot.index: shards_lib.view(self.buffer, leaf, slot) for slot in leaf.slots}
      for leaf in self.layout.leaves
    ]
    # Dropped once the upload took them: not promoted by the collector's pause.
    return placement.assemble_many(abstract, by_index, memory_kind, long_lived=False)

  def wait_others_staged(self) -> float:
    """Blocks until no process of this job on this machine is copying a step
    (capped at 1 s + 4x this snapshot's own copy time). Called by:
    background threads, before memory-heavy work on the snapshot (see
    colocated.py).

    Returns:
      The seconds waited.
    """
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
    keep_buffers: bool = True,
  ):
    """Opens the area (its buffer pool and its side of the staging window).

    Args:
      buffers: how many local writes may hold a buffer at once.
      job: the job's key for the staging window (None: no coordination).
      preparer: a low-priority serial executor for prepare().
      filler: a serial executor for the copies into the staging buffer that
        may run after save() returns (None: save() makes every copy itself).
      device_snapshot: save() copies on the device (see
        LocalTierOptions.device_snapshot); needs a filler.
      keep_buffers: keep the staging buffers, faulted in, between saves
        (LocalTierOptions.keep_staging_buffer); False: each is let go
        once its last reader is done, and prepare() does nothing.
    """
    self._pool = BufferPool(buffers, keep=keep_buffers)
    self._window = StagingWindow(job)
    self._preparer = preparer
    self._filler = filler
    self._device_snapshot = device_snapshot
    self._closed = False

  def reserve(
    self, paths: Sequence[str], arrays: Sequence[Any], layout: shards_lib.Layout | None = None
  ) -> tuple:
    """A buffer for this layout, for stage(reserved=...). Blocks while every
    buffer is held by a running local write: call it before staging().

    Args:
      paths, arrays: the state's leaf paths and leaves.
      layout: shards.layout_for of them, if the caller has it (else computed).

    Returns:
      (its Layout, the buffer).
    """
    if layout is None:
      layout = shards_lib.layout_for(paths, arrays)
    return layout, self._pool.acquire(layout.nbytes)

  def stage(
    self, step: int, paths: Sequence[str], arrays: Sequence[Any], reserved: tuple | None = None
  ) -> HostSnapshot:
    """Copies this process's shards into a staging buffer. Blocks on that
    copy only, or less where the rest may run in the background
    (_start_fill; HostSnapshot.wait_filled).

    Args:
      step: the step being saved.
      paths, arrays: the state's leaf paths and leaves.
      reserved: reserve()'s answer (None: a buffer is taken here).

    Returns:
      The snapshot (release() it after the local write).

    Raises:
      Whatever the copy raises (the buffer is released first).
    """
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
    host_copy = self._filler is None or not self._device_snapshot
    if host_copy and layout.on_cpu and not device_copy.off_host(layout):
      device_copy.fill_from_cpu(arrays, layout, buffer)  # a memcpy: no per-shard objects
      return None
    shards = device_copy.slot_shards(arrays, layout)
    copies = self._device_copies(step, shards)
    if copies is not None:
      return self._filler.submit(device_copy.fill, copies, layout, buffer)
    if self._filler is None or not device_copy.off_host(shards):
      device_copy.fill(shards, layout, buffer)
      return None
    return self._filler.submit(device_copy.copy_into, device_copy.to_host(shards), layout, buffer)

  def _device_copies(self, step: int, shards: list) -> list | None:
    """The device-side copies for a device snapshot, or None to stage on the
    host (not asked for, or the device could not hold the copy)."""
    if self._filler is None or not self._device_snapshot:
      return None
    try:
      return device_copy.device_copies(shards)
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
    wait for this process's own background work.

    Returns:
      The context manager.
    """
    return self._window.staging()

  def prepare(self, paths: Sequence[str], abstract: Sequence[Any]) -> None:
    """Starts allocating and faulting in, in the background, the buffer a
    save of this layout copies into (nothing where buffers are not kept:
    it would hold the memory until the next save). Blocks on nothing.

    Args:
      paths, abstract: the state's leaf paths and (abstract) leaves.
    """
    if self._closed or not self._pool.keep:
      return
    # The layout too (thousands of leaves: milliseconds): off the caller's path.
    self._preparer.submit(self._preallocate_for, list(paths), list(abstract))

  def _preallocate_for(self, paths: list[str], abstract: list[Any]) -> None:
    """prepare()'s background part. A state the layout refuses is left to
    save(), which raises the same error where the trainer sees it."""
    nbytes = shards_lib.layout_for(paths, abstract).nbytes
    if nbytes:
      self._pool.preallocate(nbytes)

  def wait_prepared(self) -> None:
    """Blocks until prepare()'s queued work is done."""
    self._preparer.wait_queued()

  def close(self) -> None:
    """Drops the free buffers and leaves the staging window (after the
    preparer's owner shut it down)."""
    self._closed = True
    self._pool.clear()
    self._window.close()
