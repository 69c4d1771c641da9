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

import errno
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
      to other users; or an ancestor is (check_ancestors).
  """
  parts = os.path.abspath(path)
  check_ancestors(parts)
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


def check_ancestors(path: str) -> None:
  """Checks every existing folder above `path` (and each link on the way):
  owned by root or this user, and not writable by group or others unless
  sticky (/dev/shm, /tmp), so no other user can swap a folder on the way
  for one of theirs. Called by: secure_makedirs; blocks on one lstat per
  ancestor.

  Args:
    path: an absolute path.

  Raises:
    UnsafeDirectoryError: naming the ancestor and what is wrong with it.
  """
  me, parent = os.geteuid(), os.path.dirname(path)
  while True:
    try:
      st, link = os.stat(parent), os.lstat(parent)
    except FileNotFoundError:
      st = link = None  # made below, 0700
    for s in (st, link):
      if s is not None and s.st_uid not in (0, me):
        raise UnsafeDirectoryError(
          f"{parent} (above local.directory {path}) is owned by uid {s.st_uid}, not by root"
          f" or this user (uid {me}): its owner could swap the folders below it. Choose a"
          " local.directory whose every folder is root's or yours."
        )
    if st is not None and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
      raise UnsafeDirectoryError(
        f"{parent} (above local.directory {path}) has mode {oct(st.st_mode & 0o7777)}:"
        " other users may rename what is inside it. Run: chmod go-w "
        f"{parent} (or chmod +t, as /dev/shm and /tmp have), or choose another local.directory."
      )
    if parent == os.path.dirname(parent):
      return
    parent = os.path.dirname(parent)


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


def parent_fd(path: str) -> tuple[int, str]:
  """A descriptor of a step folder's parent, opened from the local root down
  with no link followed below the root (O_NOFOLLOW per folder: run,
  process, and partner/process_<j> or xor), and the folder's name. Called
  by: every rename and deletion here; blocks on a few open() calls.

  Args:
    path: a step folder (or its renamed name) under a local root.

  Returns:
    (the parent's descriptor, to be closed by the caller; the name).

  Raises:
    UnsafeDirectoryError: a folder below the root is a symlink (with a
      warning: something swapped it in).
    OSError: a folder is absent.
  """
  parent, name = os.path.split(os.path.abspath(path))
  parts = parent.split(os.sep)
  below = 3 if parts[-1] == layout.XOR_DIR else 4 if parts[-2:-1] == [layout.PARTNER_DIR] else 2
  below = min(below, len(parts) - 1)
  fd = os.open(os.sep.join(parts[:-below]) or os.sep, os.O_RDONLY | os.O_DIRECTORY)
  try:
    for part in parts[-below:]:
      try:
        nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
      except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
          raise
        logger.warning("refused to follow %s: a symlink below the local root", path)
        raise UnsafeDirectoryError(
          f"{path}: {part} is a symlink or not a folder; the local tier never renames or"
          " deletes through one (something swapped it in). Remove it, and check who can"
          " write to the local root."
        ) from None
      os.close(fd)
      fd = nxt
  except BaseException:
    os.close(fd)
    raise
  return fd, name
