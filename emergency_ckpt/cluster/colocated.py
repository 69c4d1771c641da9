"""A staging window shared by this job's processes on one machine.

Processes on one machine (8 per GPU host, or simulated hosts on one CPU box)
share its cores and memory bandwidth. When they save at the same step, the
first to finish its staging copy would start its background work (the
ramdisk write with its checksums, the persistent upload) while the others
still copy, and slow their copies down: the job's save() stall is its
slowest process's, so holding background work back until every copy is
done shortens the stall.

So a process holds a shared flock on a per-job lock file while it is inside
save(), and background work first waits (briefly, capped) until no process
holds it. No network, no collective: a flock on a file of the machine's
/dev/shm (or its temp directory), in a per-user 0700 folder
(emergency_ckpt-<uid>/<job>.staging, <job> a digest of the JAX coordinator's
address: other jobs on the machine, even of the same run, never wait on
this one; removed at close when no process holds it, and by a later job's
open once a day old and unlocked, if its job died). save() never blocks
here: it takes the shared lock without waiting and goes on without it if it
cannot. A folder or file that is not this user's own is never used
(coordination is off, with a debug log): another user cannot make a save
wait.

Called by: the staging area (runtime/staging.py) of each process; no
collective.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import time

logger = logging.getLogger("emergency_ckpt")

_POLL_S = 0.001
_SHARED_TRIES = 5  # LOCK_SH fails only while a waiter holds LOCK_EX for an instant


def lock_dir() -> str:
  """Where the machine's lock files live.

  Returns:
    /dev/shm if present, else the temp directory.
  """
  return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _own_private_dir(folder: str) -> bool:
  """Creates `folder` 0700 if missing; True if it is this user's private directory."""
  try:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
  except OSError as e:
    logger.debug("staging window off: cannot create %s: %s", folder, e)
    return False
  ok = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077
  if not ok:
    logger.debug("staging window off: %s is not this user's private directory", folder)
  return ok


def _open_own(path: str) -> int | None:
  """`path` opened read-write (created 0600 if missing), or None if it is a
  link, not a regular file, or owned by another user."""
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
  except OSError as e:
    logger.debug("staging window off: cannot open %s: %s", path, e)
    return None
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
    os.close(fd)
    logger.debug("staging window off: %s is not this user's regular file", path)
    return None
  return fd


STALE_S = 24 * 3600.0  # a lock file untouched this long, and unlocked, is a dead job's


def _sweep(folder: str, keep: str) -> None:
  """Removes other jobs' lock files that no process has locked and that
  were last modified STALE_S ago or more: a job whose processes were killed
  (or never closed their manager) leaves its file behind. A job still
  running keeps its coordination through the files its processes hold
  open; only a process that opens its lock later would start another."""
  now = time.time()
  for name in os.listdir(folder):
    path = os.path.join(folder, name)
    if not name.endswith(".staging") or path == keep:
      continue
    try:
      st = os.lstat(path)
      if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or now - st.st_mtime < STALE_S:
        continue
      fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      os.unlink(path)
    except OSError:  # locked now (staging), or gone
      pass
    finally:
      os.close(fd)


class StagingWindow:
  """This process's view of the machine-wide staging window of one run.

  `staging()` is called by the thread that copies (save()); `wait_closed()`
  by background threads before memory-heavy work. Per process, no collective.
  """

  def __init__(self, job: str | None, *, directory: str | None = None):
    """Opens this process's side of the window (off where the folder or
    file is not this user's own). Sweeps dead jobs' lock files.

    Args:
      job: an id shared by exactly the processes of one job (None: a
        single-process job, which has no co-located processes: the window
        is off).
      directory: where the lock folder lives (default: lock_dir()).
    """
    folder = os.path.join(directory or lock_dir(), f"emergency_ckpt-{os.geteuid()}")
    self.path = os.path.join(folder, f"{job}.staging")
    self._holder = self._waiter = None
    self._ran_out = False  # the last wait_closed gave up: a co-located process is stuck
    if job is not None and _own_private_dir(folder):
      _sweep(folder, self.path)
      self._holder = _open_own(self.path)  # shared while staging
      self._waiter = _open_own(self.path) if self._holder is not None else None

  @property
  def enabled(self) -> bool:
    """The window coordinates this process (its lock file is open)."""
    return self._holder is not None and self._waiter is not None

  @contextlib.contextmanager
  def staging(self):
    """Holds the window open (shared) while the caller copies. Never waits
    more than a few milliseconds: if the lock is not had, the copy runs anyway.

    Returns:
      A context manager; the window is held inside it.
    """
    held = False
    if self.enabled:
      for _ in range(_SHARED_TRIES):
        try:
          fcntl.flock(self._holder, fcntl.LOCK_SH | fcntl.LOCK_NB)
          held = True
          break
        except BlockingIOError:
          time.sleep(_POLL_S)
    try:
      yield
    finally:
      if held:
        fcntl.flock(self._holder, fcntl.LOCK_UN)

  def wait_closed(self, timeout_s: float) -> float:
    """Blocks until no process of this job on this machine is staging, at
    most `timeout_s`; not at all while the last wait ran out and the window
    has not been seen closed since.

    Args:
      timeout_s: the longest wait.

    Returns:
      The seconds waited (0.0 where the window is off).
    """
    if not self.enabled:
      return 0.0
    t0 = time.monotonic()
    # After a wait that ran out (a co-located process stuck inside save():
    # stopped, or wedged), only look until the window is seen closed again:
    # one stuck process must not cost every later save its whole cap.
    deadline = t0 + (0.0 if self._ran_out else timeout_s)
    while True:
      try:
        fcntl.flock(self._waiter, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(self._waiter, fcntl.LOCK_UN)
        self._ran_out = False
        break
      except BlockingIOError:
        if time.monotonic() >= deadline:
          self._ran_out = True
          break
        time.sleep(_POLL_S)
    return time.monotonic() - t0

  def close(self) -> None:
    """Releases the lock file, removing it if no other process has it locked
    now (one that opened it but has not locked it yet keeps an unlinked
    file: only the coordination is lost, for that job's remaining saves)."""
    if self._waiter is not None:
      try:
        fcntl.flock(self._waiter, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(self.path)
      except OSError:  # held by a co-located process (or gone): it stays
        pass
    for fd in (self._holder, self._waiter):
      if fd is not None:
        os.close(fd)
    self._holder = self._waiter = None
