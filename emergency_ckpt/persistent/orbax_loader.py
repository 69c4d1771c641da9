"""Loading Orbax off the restore path: its import, then its multihost set-up.

Orbax is costly to import (more so when a host's processes load it at
once); its multihost set-up (jax_runtime.init_orbax_multihost) is nothing
with Orbax's defaults, and an all-gather of every process where Orbax is
flagged to translate process ids. Reading a local copy or receiving one
from a peer needs neither, so the manager starts both on a background lane
once the restore path is behind it (at the end of restore(), or when
all_steps() finds nothing to restore: every process is up then, and the
load no longer competes with the restore for the host's cores, which
shortens a restart's restore()), and only the tiers' first Orbax use
waits: the local tier's first write for the import, the persistent tier's
first save or restore (and the manager's first save()) for the set-up too;
a trainer that saves without calling restore() or latest_step() first waits
for the load in its first save().
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from emergency_ckpt.cluster.jax_runtime import init_orbax_multihost
from emergency_ckpt.errors import CollectiveTimeoutError
from emergency_ckpt.runtime.background import Background


def orbax() -> Any:
  """The orbax.checkpoint module, imported on first use (a heavy import).

  Its absl flags are marked parsed, so that Orbax reads their defaults in a
  trainer that never parses absl flags itself.

  Returns:
    The orbax.checkpoint module.
  """
  import orbax.checkpoint as ocp  # noqa: PLC0415 - heavy import, only when used

  try:
    from absl import flags  # noqa: PLC0415

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
  except ImportError:  # pragma: no cover - absl ships with orbax
    pass
  return ocp


class OrbaxLoader:
  """Imports Orbax and runs its multihost set-up once, in the background.

  Args:
    background: the manager's background lanes (the load runs on "orbax").
    log_prefix: prefixes the error's message (this process's log prefix).
  """

  def __init__(self, background: Background, log_prefix: str = ""):
    self._background = background
    self._log_prefix = log_prefix
    self._lock = threading.Lock()
    self._futures: tuple[concurrent.futures.Future, concurrent.futures.Future] | None = None

  def start(self) -> None:
    """Starts, once, on the lane "orbax": the import, then the set-up (where
    Orbax is flagged to translate process ids, a global barrier inside
    Orbax: every process must start it). Called by:
    every process, once its restore path is behind it; blocks on nothing. Not
    tracked as background work: a failure is raised where Orbax is needed
    (a process that died during start-up fails the set-up; the local tier,
    which needs only the import, keeps saving)."""
    with self._lock:
      if self._futures is None:
        lane = self._background.lane("orbax")
        self._futures = (lane.submit(_import_orbax), lane.submit(init_orbax_multihost))

  def imported(self) -> None:
    """Blocks until Orbax is imported (starting the load if needed). Called
    by: the local tier, before its first write."""
    self.start()
    self._futures[0].result()

  def ready(self) -> None:
    """Blocks until Orbax is imported and set up (starting them if needed).

    Called by: the persistent tier before its first save or restore, the
    manager's first save() and wait_until_finished().

    Raises:
      CollectiveTimeoutError: the set-up failed (a process died or hung
        during start-up).
    """
    self.start()
    try:
      self._futures[0].result()
      self._futures[1].result()
    except Exception as e:
      raise CollectiveTimeoutError(
        f"{self._log_prefix} Orbax's multihost set-up (a barrier of every process,"
        f" started once the restore path was behind) failed: {e}. A process died or hung"
        " during start-up: check every process's log, then restart the job."
      ) from e


def _import_orbax() -> None:
  """Imports Orbax through the local tier's handler module."""
  from emergency_ckpt.local import handler as local_handler  # noqa: F401, PLC0415
