"""JobContext: what every orchestrator of a save or a restore needs about the job.

One frozen object instead of the same five parameters on every
constructor: the job's topology (slices, process identity), its collectives
(exchanges through the coordination service), the device mesh, the
manager's options, the event log and the per-tier health. The manager builds it once, before
anything that takes it; the save pipeline, the restorer, the inventory and
the reshard transfer read it and never change it.

Called by: the manager (builds it); save/, restore/ (read it). Pure: it
holds references, it does nothing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  import jax

  from emergency_ckpt.cluster.collectives import Collectives
  from emergency_ckpt.cluster.topology import Topology
  from emergency_ckpt.core.health import HealthTracker
  from emergency_ckpt.core.telemetry import EventLog
  from emergency_ckpt.options import CheckpointManagerOptions


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobContext:
  """The job a manager runs in, the same for the manager's whole life."""

  topology: Topology
  """This process's place in the job: slices, process index, the primary."""
  collectives: Collectives
  """Exchanges between processes (every process calls each one alike)."""
  mesh: jax.sharding.Mesh
  """The device mesh the state is sharded over (the manager's)."""
  options: CheckpointManagerOptions
  """The manager's options."""
  events: EventLog
  """This process's event log (save, restore and failure records)."""
  health: HealthTracker
  """Each tier's durable steps, work in flight, failures and skips (the
  manager's health())."""
