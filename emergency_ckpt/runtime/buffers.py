"""Reused, page-aligned host buffers: what a save stages its shards into and
what the restore paths receive into.

Page alignment lets jax CPU arrays alias views at shards.ALIGN offsets
without a copy. The staging buffers are reused and kept faulted in between
saves (like DCP's cached staging buffers): a copy into fresh memory takes a
page fault per page inside the save's stall. `BufferPool` keeps them: at
most `count` local writes hold one at a time, and a buffer another reader
still uses (a background persistent upload) is reused only once that
reader lets go too. `preallocate` faults the next save's buffer in ahead
of time (on staging.py's low-priority lane). A pool made with keep=False
(local.keep_staging_buffer) keeps nothing: once a buffer's last user lets
go, its pages go back to the system at once (madvise, even where a stale
reference, such as Orbax's record of its last save, keeps the allocation
itself alive), and each save faults a fresh one in.

Called by: the staging area (staging.py), and for aligned_empty /
aligned_zeros the restore paths and the XOR redundancy, on any thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading

import numpy as np

_PAGE = mmap.PAGESIZE


def aligned_empty(nbytes: int) -> np.ndarray:
  """An uninitialised uint8 buffer whose start is page-aligned (so views at
  shards.ALIGN offsets can be aliased by jax CPU arrays without a copy).

  Args:
    nbytes: its size.

  Returns:
    The buffer (a view into a slightly larger allocation).
  """
  return _page_aligned(np.empty(nbytes + _PAGE, dtype=np.uint8), nbytes)


def aligned_zeros(nbytes: int) -> np.ndarray:
  """aligned_empty's zeroed twin (calloc's fresh pages: zeroed as faulted in).

  Args:
    nbytes: its size.

  Returns:
    The zeroed, page-aligned buffer.
  """
  return _page_aligned(np.zeros(nbytes + _PAGE, dtype=np.uint8), nbytes)


def _page_aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
  start = (-raw.ctypes.data) % _PAGE
  return raw[start : start + nbytes]


def _fault_in(buf: np.ndarray) -> None:
  """Touches every page of `buf` (writing zeros), so a later copy into it
  takes no page fault (numpy's large allocations ask for transparent huge
  pages, so touching is cheap)."""
  if buf.nbytes:
    buf[::_PAGE] = 0
    buf[-1] = 0


def _libc_madvise() -> ctypes._CFuncPtr | None:
  if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
    return None
  try:
    fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
  except (OSError, AttributeError):
    return None
  fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
  fn.restype = ctypes.c_int
  return fn


_MADVISE = _libc_madvise()


def drop_pages(buf: np.ndarray) -> bool:
  """Gives `buf`'s whole pages back to the system now (MADV_DONTNEED), so
  they leave the resident set even while something still references the
  array; a later read sees zeros, a write faults in fresh pages. Only for a
  buffer that nobody reads any more. Called by: BufferPool, as a buffer of a
  pool that keeps none is let go (any thread).

  Args:
    buf: a page-aligned buffer (aligned_empty / aligned_zeros).

  Returns:
    Whether the pages were dropped (False: not Linux, or madvise refused).
  """
  length = buf.nbytes // _PAGE * _PAGE
  if _MADVISE is None or length == 0 or buf.ctypes.data % _PAGE:
    return False
  return _MADVISE(buf.ctypes.data, length, mmap.MADV_DONTNEED) == 0


class BufferPool:
  """Reused host staging buffers. At most `count` local writes hold one at a
  time (acquire blocks while all are writing); a buffer that something else
  still reads (a background persistent upload, see hold) goes back to the
  free list only when that reader lets go too."""

  def __init__(self, count: int, *, keep: bool = True):
    """An empty pool.

    Args:
      count: how many local writes may hold a buffer at once.
      keep: keep buffers for reuse once their users let go (False: drop
        them, and preallocate() does nothing).
    """
    self._sem = threading.Semaphore(count)
    self._count = count
    self.keep = keep
    self._lock = threading.Lock()
    self._ready = threading.Condition(self._lock)  # a preallocated buffer landed
    self._preparing: set[int] = set()  # sizes preallocate() is faulting in now
    self._free: list[np.ndarray] = []
    self._holders: dict[int, int] = {}  # id(buffer) -> readers besides the write
    self._writing: set[int] = set()  # id(buffer) of buffers a local write holds
    self.allocated = 0  # buffers made so far (host memory: each is a whole layout)

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
    """A buffer of `nbytes` for one local write (a free one if any, else a
    new zeroed one); blocks while `count` writes hold one.

    Args:
      nbytes: the layout's size.

    Returns:
      The buffer; release() it when the write is done.
    """
    self._sem.acquire()
    buf = self._take_free(nbytes)
    if buf is None:  # the first save of a layout without preallocate(): faults in the copy
      buf = aligned_zeros(nbytes)  # zeros: the padding between shards (see preallocate)
      with self._lock:
        self.allocated += 1
    with self._lock:
      self._writing.add(id(buf))
    return buf

  def preallocate(self, nbytes: int) -> None:
    """Makes sure a free, faulted-in buffer of `nbytes` exists (so the next
    acquire's copy takes no page fault). Blocks on allocating and touching it.

    Nothing where the pool keeps no buffers.

    Args:
      nbytes: the layout's size.
    """
    if not self.keep:
      return
    with self._lock:
      if nbytes in self._preparing or any(b.nbytes == nbytes for b in self._free):
        return
      self._preparing.add(nbytes)
    buf = None
    try:
      # Zeroed (fresh pages cost the same): the padding between shards, never
      # staged into, is zeros in the written file and in the XOR parity
      # sent from the buffer (local/handler.py's write_shards writes it too).
      buf = aligned_zeros(nbytes)
      _fault_in(buf)
    finally:
      with self._lock:
        self._preparing.discard(nbytes)
        if buf is not None:
          self.allocated += 1
          self._free = [b for b in self._free if b.nbytes == nbytes]
          self._put_back(buf)
        self._ready.notify_all()

  def hold(self, buf: np.ndarray) -> None:
    """One more reader of `buf`; it must call unhold(buf) when done.

    Args:
      buf: a buffer from acquire().
    """
    with self._lock:
      self._holders[id(buf)] = self._holders.get(id(buf), 0) + 1

  def unhold(self, buf: np.ndarray) -> None:
    """One reader of `buf` (see hold) is done with it.

    Args:
      buf: the buffer.
    """
    with self._lock:
      left = self._holders[id(buf)] - 1
      if left:
        self._holders[id(buf)] = left
        return
      del self._holders[id(buf)]
      if id(buf) in self._writing:
        return
      self._put_back(buf)
    self._let_go(buf)

  def _put_back(self, buf: np.ndarray) -> None:
    if self.keep and len(self._free) <= self._count:
      self._free.append(buf)

  def _let_go(self, buf: np.ndarray) -> None:
    """The last user let go of `buf`: in a pool that keeps no buffers, its
    pages go back now (outside the lock: it takes a while)."""
    if not self.keep:
      drop_pages(buf)

  def release(self, buf: np.ndarray) -> None:
    """The local write of `buf` is done (frees a write slot at once).

    Args:
      buf: the buffer acquire() gave it.
    """
    with self._lock:
      self._writing.discard(id(buf))
      last = id(buf) not in self._holders
      if last:
        self._put_back(buf)
    if last:
      self._let_go(buf)
    self._sem.release()

  def clear(self) -> None:
    """Drops the free buffers."""
    with self._lock:
      self._free.clear()

  def free_count(self) -> int:
    """How many buffers the pool keeps for reuse now (none held by a user)."""
    with self._lock:
      return len(self._free)
