"""Measurement helpers: RSS sampling, page-cache eviction, raw I/O bounds.

The raw copies (memcpy, file write, file read) run with one thread or with
N threads (bound_threads(): min(os.cpu_count(), 8)), each of which copies
one contiguous range of the bytes; a bound is the faster of the two.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

_PAGE = os.sysconf("SC_PAGE_SIZE")
_CHUNK = 64 << 20
MAX_BOUND_THREADS = 8


def rss_bytes() -> int:
  """Resident set size of this process, now."""
  with open("/proc/self/statm", "rb") as f:
    return int(f.read().split()[1]) * _PAGE


def maxrss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


class PeakRss:
  """This process's peak RSS over a window: the kernel's high-water mark
  (VmHWM), reset at start() through /proc/self/clear_refs ("5"). Exact, and
  nothing runs during the window: a sampling thread polling every 5 ms was
  seen to lengthen the measured save() stall by 25-40% (GIL hand-offs while
  4 processes share 2 cores). Where the reset is not allowed, a sampling
  thread is the fallback."""

  def __init__(self, interval_s: float = 0.005):
    self._interval = interval_s
    self._stop = threading.Event()
    self._peak = 0
    self._thread: threading.Thread | None = None
    self.method = "VmHWM"

  def start(self) -> PeakRss:
    try:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
      _status_kib("VmHWM")
      return self
    except (OSError, KeyError):
      self.method = "sampled every 5 ms"
    self._peak = rss_bytes()
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
    self._thread.start()
    return self

  def _run(self) -> None:
    while not self._stop.wait(self._interval):
      self._peak = max(self._peak, rss_bytes())

  def stop(self) -> int:
    if self._thread is None:
      return _status_kib("VmHWM") * 1024
    self._stop.set()
    self._thread.join()
    self._peak = max(self._peak, rss_bytes())
    return self._peak


def evict_file(path: str) -> None:
  """Writes back and drops `path`'s pages from the page cache."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def evict_tree(root: str) -> int:
  """Evicts every regular file under `root`; returns how many."""
  n = 0
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      if os.path.isfile(path) and not os.path.islink(path):
        evict_file(path)
        n += 1
  return n


def bound_threads() -> int:
  """N of the N-thread raw bounds: min(os.cpu_count(), 8)."""
  return max(1, min(os.cpu_count() or 1, MAX_BOUND_THREADS))


def split(nbytes: int, n: int) -> list[tuple[int, int]]:
  """`nbytes` cut into at most `n` contiguous (start, stop) ranges, in order,
  each but the last a multiple of the page size (none empty)."""
  if nbytes <= 0:
    return []
  step = -(-nbytes // max(1, n))
  step = -(-step // _PAGE) * _PAGE
  return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
  """This process's pool of `threads` threads (a forked child gets its own:
  the parent's threads do not survive a fork)."""
  return _pool_of(os.getpid(), threads)


@functools.cache
def _pool_of(pid: int, threads: int) -> concurrent.futures.ThreadPoolExecutor:
  """A pool of `threads` threads, all started now (outside any timed window):
  each start-up task waits until every one of them runs."""
  pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="bench-bound")
  gate = threading.Barrier(threads)
  list(pool.map(lambda _: gate.wait(timeout=60), range(threads)))
  return pool


def start_threads(threads: int) -> None:
  """Starts the pool the N-thread bounds run on (call before timing them)."""
  if threads > 1:
    _pool(threads)


def _each(fn: Callable[[int, int], int], ranges: list[tuple[int, int]], threads: int) -> int:
  """fn(start, stop) for every range: inline with one thread, else on the
  pool's `threads` threads (numpy copies and file I/O release the GIL).
  Returns the sum of fn's results."""
  if threads <= 1 or len(ranges) <= 1:
    return sum(fn(a, b) for a, b in ranges)
  return sum(_pool(threads).map(lambda r: fn(*r), ranges))


def parallel(calls: Sequence[Callable[[], int]]) -> int:
  """Runs every call at once, each on its own pool thread (inline if there
  is one); returns the sum of their results."""
  if len(calls) <= 1:
    return sum(c() for c in calls)
  return sum(_pool(len(calls)).map(lambda c: c(), calls))


def _flat(parts: Sequence[np.ndarray]) -> list[tuple[int, np.ndarray]]:
  """(offset, bytes) of each part, laid back to back."""
  out, pos = [], 0
  for p in parts:
    flat = p.reshape(-1).view(np.uint8)
    out.append((pos, flat))
    pos += flat.nbytes
  return out


def _pieces(flat: list[tuple[int, np.ndarray]], start: int, stop: int):
  """(offset, bytes) of the parts' bytes that fall in [start, stop)."""
  for pos, b in flat:
    lo, hi = max(start, pos), min(stop, pos + b.nbytes)
    if lo < hi:
      yield lo, b[lo - pos : hi - pos]


def memcpy(dst: np.ndarray, parts: Sequence[np.ndarray], threads: int = 1) -> None:
  """Copies `parts` back to back into the preallocated byte buffer `dst`;
  with `threads` > 1, each thread copies one contiguous range of the bytes."""
  flat = _flat(parts)
  total = sum(b.nbytes for _, b in flat)

  def copy(start: int, stop: int) -> int:
    for pos, piece in _pieces(flat, start, stop):
      np.copyto(dst[pos : pos + piece.nbytes], piece, casting="no")
    return stop - start

  _each(copy, split(total, threads), threads)


def write_file(path: str, parts: Sequence[np.ndarray], threads: int = 1) -> None:
  """Writes `parts` to a new file and fsyncs it; with `threads` > 1, each
  thread pwrite()s one contiguous range of the bytes at its offset."""
  if os.path.exists(path):
    os.remove(path)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  try:
    if threads <= 1:
      for p in parts:
        view = memoryview(p.reshape(-1).view(np.uint8))
        pos = 0
        while pos < len(view):
          pos += os.write(fd, view[pos : pos + _CHUNK])
    else:
      flat = _flat(parts)

      def write(start: int, stop: int) -> int:
        for pos, piece in _pieces(flat, start, stop):
          view, done = memoryview(piece), 0
          while done < len(view):
            done += os.pwrite(fd, view[done : done + _CHUNK], pos + done)
        return stop - start

      _each(write, split(sum(b.nbytes for _, b in flat), threads), threads)
    os.fsync(fd)
  finally:
    os.close(fd)


def read_file(
  path: str, dst: np.ndarray, threads: int = 1, start: int = 0, stop: int | None = None
) -> int:
  """Reads bytes [start, stop) of `path` (default: all of `dst`'s length)
  into the same range of the preallocated byte buffer `dst`; with `threads`
  > 1, each thread preadv()s one contiguous range. Returns bytes read."""
  stop = len(dst) if stop is None else stop
  view = memoryview(dst)
  if threads <= 1:
    got = 0
    with open(path, "rb", buffering=0) as f:
      f.seek(start)
      while start + got < stop:
        n = f.readinto(view[start + got : stop])
        if not n:
          break
        got += n
    return got
  fd = os.open(path, os.O_RDONLY)
  try:

    def read(a: int, b: int) -> int:
      got = 0
      while a + got < b:
        n = os.preadv(fd, [view[a + got : b]], a + got)
        if not n:
          break
        got += n
      return got

    return _each(read, [(start + a, start + b) for a, b in split(stop - start, threads)], threads)
  finally:
    os.close(fd)


def reset_dir(path: str) -> None:
  """Empties `path` (a simulated host's ramdisk), leaving it mode 0700."""
  shutil.rmtree(path, ignore_errors=True)
  os.makedirs(path, mode=0o700, exist_ok=True)
  os.chmod(path, 0o700)


def now() -> float:
  return time.perf_counter()


def precompile() -> bool:
  """Writes emergency_ckpt's bytecode (__pycache__), as pip does when it
  installs a package, so every job imports it from bytecode like Orbax and
  JAX (site-packages, compiled at install). Where PYTHONDONTWRITEBYTECODE is
  set (it is on the machine these figures come from) and the package runs
  from a source checkout, each job process would otherwise compile ~44
  modules at import: 0.17-0.46 s of CPU per process in a profile of a
  4-process restart, charged to ours only. True if every module compiled."""
  import compileall  # noqa: PLC0415

  import emergency_ckpt  # noqa: PLC0415

  return bool(compileall.compile_dir(os.path.dirname(emergency_ckpt.__file__), quiet=1))


def spread(xs: list[float]) -> dict:
  """Median, min, max and the samples of a benchmark figure (None if empty)."""
  return {
    "median": statistics.median(xs) if xs else None,
    "min": min(xs) if xs else None,
    "max": max(xs) if xs else None,
    "samples": xs,
  }
