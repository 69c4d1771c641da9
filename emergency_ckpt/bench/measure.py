"""Measurement helpers: RSS sampling, page-cache eviction, raw I/O bounds."""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Sequence

import numpy as np

_PAGE = os.sysconf("SC_PAGE_SIZE")
_CHUNK = 64 << 20


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


def memcpy(dst: np.ndarray, parts: Sequence[np.ndarray]) -> None:
  """Copies `parts` back to back into the preallocated byte buffer `dst`."""
  pos = 0
  for p in parts:
    flat = p.reshape(-1).view(np.uint8)
    np.copyto(dst[pos : pos + flat.nbytes], flat, casting="no")
    pos += flat.nbytes


def write_file(path: str, parts: Sequence[np.ndarray]) -> None:
  """Writes `parts` to a new file and fsyncs it."""
  if os.path.exists(path):
    os.remove(path)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  try:
    for p in parts:
      view = memoryview(p.reshape(-1).view(np.uint8))
      pos = 0
      while pos < len(view):
        pos += os.write(fd, view[pos : pos + _CHUNK])
    os.fsync(fd)
  finally:
    os.close(fd)


def read_file(path: str, dst: np.ndarray) -> int:
  """Reads `path` into the preallocated byte buffer `dst`; returns bytes read."""
  view = memoryview(dst)
  got = 0
  with open(path, "rb", buffering=0) as f:
    while got < len(view):
      n = f.readinto(view[got:])
      if not n:
        break
      got += n
  return got


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
