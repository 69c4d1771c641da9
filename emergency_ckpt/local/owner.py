"""Who uses a local process folder: an flock() on its `.owner` file.

The process whose manager uses `<root>/<run_id>/process_<i>` holds an
exclusive lock on the folder's owner file until close (the kernel drops it
if the process dies), so another process on the host that looks for copies
left by earlier processes (local_tier.usable_steps) never takes, or deletes,
a live folder's steps. Per process; no collective, no JAX.
"""

from __future__ import annotations

import fcntl
import logging
import os

from emergency_ckpt.core import layout

logger = logging.getLogger("emergency_ckpt")


def take(folder: str, log_prefix: str) -> int | None:
  """Takes this process's folder: an exclusive flock() on its owner file,
  held until close (the kernel drops it if the process dies). None (with a
  warning) if another live manager holds it."""
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
  """True if a live process holds `folder` (its owner file is flock()ed)."""
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


def release(fd: int | None) -> None:
  """Lets go of a folder taken with take() (None: nothing to do)."""
  if fd is not None:
    os.close(fd)
