"""Who owns a local process folder: the user, and the live process.

The user: every folder the local tier writes through is this user's, 0700
and no symlink (secure_makedirs), so no other user can read or plant
shards. The process: the one whose manager uses `<root>/<run_id>/process_<i>`
holds an exclusive lock on the folder's owner file until close (the kernel
drops it if the process dies), so another process on the host that looks
for copies left by earlier processes (discovery.py) never takes, or
deletes, a live folder's steps.

Called by: tier.py (creating and taking its folder), discovery.py (skipping
live folders, removing dead ones left empty). Per process; no collective, no JAX.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat

from emergency_ckpt.core import layout
from emergency_ckpt.errors import UnsafeDirectoryError

logger = logging.getLogger("emergency_ckpt")


def secure_makedirs(path: str, *, shared_ok: bool = False) -> None:
  """Creates `path` (and parents) 0700, refusing symlinks and foreign owners.

  Args:
    path: the folder.
    shared_ok: an existing sticky directory (mode +t, like /dev/shm or
      /tmp) owned by root or by us is accepted whatever its mode: other
      users may create entries there but cannot rename or remove ours (its
      owner could, so another user's sticky folder is refused), and every
      folder the local tier creates below it gets the full check.

  Raises:
    UnsafeDirectoryError: a symlink, not a folder, another user's, or open
      to other users.
  """
  parts = os.path.abspath(path)
  os.makedirs(parts, mode=0o700, exist_ok=True)
  st = os.lstat(parts)
  if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
    raise UnsafeDirectoryError(
      f"{parts} is a symlink or not a directory; the local tier refuses to"
      " write through it. Remove it, or point local.directory elsewhere."
    )
  if shared_ok and st.st_mode & stat.S_ISVTX and st.st_uid in (0, os.geteuid()):
    return
  if st.st_uid != os.geteuid():
    raise UnsafeDirectoryError(
      f"{parts} is owned by uid {st.st_uid}, not by this process (uid"
      f" {os.geteuid()}); another user could read or plant checkpoints there."
      " Remove it or choose another local.directory."
    )
  if st.st_mode & 0o077:
    raise UnsafeDirectoryError(
      f"{parts} has mode {oct(st.st_mode & 0o777)}; the local tier needs 0700"
      f" so no other user can read or plant shards. Run: chmod 700 {parts}"
    )


def take(folder: str, log_prefix: str) -> int | None:
  """Takes this process's folder: an exclusive flock() on its owner file,
  held until close (the kernel drops it if the process dies).

  Args:
    folder: the process folder.
    log_prefix: this process's log prefix.

  Returns:
    The lock's file descriptor (for release), or None (with a warning) if
    another live manager holds it.
  """
  fd = os.open(
    os.path.join(folder, layout.OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600
  )
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    os.close(fd)
    logger.warning(
      "%s %s is in use by another live manager on this host (same run_id and process index?)",
      log_prefix,
      folder,
    )
    return None
  return fd


def held(folder: str) -> bool:
  """Whether a live process holds a folder.

  Args:
    folder: a process folder.

  Returns:
    True if its owner file is flock()ed.
  """
  try:
    fd = os.open(os.path.join(folder, layout.OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
  except OSError:
    return False  # none: no manager of this version has used it since boot
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except OSError:
    return True
  finally:
    os.close(fd)  # closing drops the probe's own lock
  return False


def remove_unused(folder: str) -> bool:
  """Removes a process folder that holds nothing but its owner file, under
  the folder's lock (never one a live process holds). Failures are ignored.

  Args:
    folder: a process folder no live process of this job uses.

  Returns:
    True if it is gone.
  """
  if os.path.islink(folder):
    return False
  try:
    fd = os.open(os.path.join(folder, layout.OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
  except OSError:
    return False  # none (a folder being made has none yet), or not ours to judge
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if os.listdir(folder) != [layout.OWNER_FILE]:
      return False
    os.unlink(os.path.join(folder, layout.OWNER_FILE))
    os.rmdir(folder)
  except OSError:
    return False
  finally:
    os.close(fd)
  return True


def release(fd: int | None) -> None:
  """Lets go of a folder taken with take().

  Args:
    fd: what take() returned (None: nothing to do).
  """
  if fd is not None:
    os.close(fd)
