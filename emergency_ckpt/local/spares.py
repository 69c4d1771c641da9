"""The local tier's spare files: retired steps' shards.bin kept for later
saves to write into, and the files a restore mapped, which never are.

A save that writes into an existing tmpfs file reuses its pages: nothing is
allocated, zeroed or mapped into the process (tier.py). So a step that
local retention retires keeps its shards.bin in a `.tmp-spare-<hex>`
folder (at most one per write that may run at once) instead of being
unlinked. A file a read mapped is never one of them: restored arrays alias
its pages through a private mapping, which would see the overwrite.

Called by: tier.py (its writer thread takes spares; deleting and reading
threads keep them and note mapped files). Any thread: one lock.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading

from emergency_ckpt.core import layout
from emergency_ckpt.local import format as local_format


class Spares:
  """One process folder's spare files, and the files its reads mapped."""

  def __init__(self, directory: str, *, max_spares: int):
    """`directory`: the process folder the spares live in; `max_spares`:
    how many are kept (one per write that may run at once)."""
    self._directory = directory
    self._max = max_spares
    self._lock = threading.Lock()
    self._spares: list[str] = []  # .tmp-spare-* folders, each holding a retired shards.bin
    self._mapped: set[tuple[int, int]] = set()  # (st_dev, st_ino) of files a read mapped
    self._closed = False

  def take(self, nbytes: int) -> str | None:
    """A spare folder whose shards.bin has exactly `nbytes`, taken off the
    list; spares of another size are removed on the way.

    Args:
      nbytes: the size the next save writes.

    Returns:
      The folder (the caller removes it once done), or None.
    """
    while True:
      with self._lock:
        spare = self._spares.pop() if self._spares else None
      if spare is None:
        return None
      try:
        if os.stat(os.path.join(spare, local_format.SHARDS)).st_size == nbytes:
          return spare
      except OSError:  # gone (the ramdisk was wiped): try the next one
        pass
      shutil.rmtree(spare, ignore_errors=True)  # another layout's size

  def keep(self, doomed: str) -> bool:
    """Keeps a deleted step's shards.bin as a spare (its other files go),
    unless it is no regular file, a read mapped it, enough spares exist or
    the tier closed.

    Args:
      doomed: the step's folder, already renamed out of the step namespace.

    Returns:
      Whether it was kept (else the caller removes it).
    """
    if os.path.islink(doomed):
      return False
    try:
      st = os.stat(os.path.join(doomed, local_format.SHARDS), follow_symlinks=False)
    except OSError:
      return False
    with self._lock:
      if (
        self._closed
        or len(self._spares) >= self._max
        or not stat.S_ISREG(st.st_mode)
        or (st.st_dev, st.st_ino) in self._mapped
      ):
        return False
      spare = os.path.join(self._directory, layout.spare_dir_name())
      try:
        os.rename(doomed, spare)
        for name in os.listdir(spare):
          if name != local_format.SHARDS:
            os.unlink(os.path.join(spare, name))
      except OSError:
        return False
      self._spares.append(spare)
    return True

  def mapped(self, st: os.stat_result) -> bool:
    """Whether a read mapped the file of `st` (restored arrays may alias its
    pages: it must never be written over).

    Args:
      st: the file's stat.

    Returns:
      True if note_mapped saw it.
    """
    with self._lock:
      return (st.st_dev, st.st_ino) in self._mapped

  def note_mapped(self, st: os.stat_result) -> None:
    """Records that a read mapped the file of `st`.

    Args:
      st: the file's stat, taken before it is mapped.
    """
    with self._lock:
      self._mapped.add((st.st_dev, st.st_ino))

  def close(self) -> None:
    """Removes every spare; none is kept from now on."""
    with self._lock:
      self._closed = True
      spares, self._spares = self._spares, []
    for spare in spares:
      shutil.rmtree(spare, ignore_errors=True)
