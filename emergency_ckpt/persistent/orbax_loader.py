"""Loading Orbax off the restore path: its import, then its multihost set-up.

Orbax costs about 0.5 s of CPU to import (more when a host's processes load
it at once); its multihost set-up (topology.init_orbax_multihost) is
nothing with Orbax's defaults, and an all-gather of every process where
Orbax is flagged to translate process ids. Reading
a local copy or receiving one from a peer needs neither, so the manager
starts both on a background lane once the restore path is behind it (at
the end of restore(), or when all_steps() finds nothing to restore: every
process is up then, and the load no longer competes with the restore for
the host's cores: measured, a 4-process restart's restore() took 0.45 s
with the load started at construction, 0.13 s after), and only the tiers'
first Orbax use waits: the local tier's first write for the import, the
persistent tier's first save or restore (and the manager's first save())
for the set-up too; a trainer that saves without calling restore() or
latest_step() first waits for the load in its first save().
"""

from __future__ import annotations

import concurrent.futures
import threading

from emergency_ckpt.cluster.topology import init_orbax_multihost
from emergency_ckpt.errors import CollectiveTimeoutError
from emergency_ckpt.runtime.background import Background


class OrbaxLoader:
  """Imports Orbax and runs its multihost set-up once, in the background."""

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
    """Blocks until Orbax is imported and set up (starting them if needed);
    raises CollectiveTimeoutError if the set-up failed. Called by: the
    persistent tier before its first save or restore, the manager's first
    save() and wait_until_finished()."""
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
