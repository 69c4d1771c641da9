"""The Orbax CheckpointManager the persistent tier saves through, and why it is set up so.

Orbax's defaults assume every process saves and waits at every barrier, and
keep their own retention. Here only the primary slice uploads: its barriers
span the primary slice's processes only, and its array handler writes the
shards of replica 0 (which live on the primary slice, the state being
replicated over the replica axis), so no copy is made and no other slice
waits on an upload. Retention stays the manager's (retention/), which knows
which steps are restorable; saves are asynchronous, with a timeout that
fails Orbax's barriers after collective_timeout_s rather than Orbax's
default of minutes; the folder is created by the tier, not by Orbax.
Orbax's manager asks JAX's preemption sync service at every save and
finalize (`reached_preemption(step)`), from the upload threads, with the
upload's step: each call moves this process's counter in that service, so
the trainer's own `reached_preemption(step)` could miss the agreed step on
the primary slice. The tier's manager never asks: preemption is the
trainer's call (`CheckpointManager.reached_preemption`).

Called by: PersistentTier.open(), on each primary-slice process, at its
first persistent save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from etils import epath

from emergency_ckpt.cluster.topology import Topology


def _without_preemption_checks(ocp: Any) -> type:
  """ocp.CheckpointManager whose reached_preemption() is always False (the
  manager decides what to save; JAX's sync service is the trainer's)."""

  class _Manager(ocp.CheckpointManager):
    def reached_preemption(self, step: int) -> bool:  # noqa: ARG002
      return False

  return _Manager


def create(
  ocp: Any,
  directory: epath.Path,
  *,
  topology: Topology,
  compression: bool,
  timeout_s: float,
  barrier_prefix: str,
  on_finalized: Callable[[], None],
) -> Any:
  """An Orbax CheckpointManager that uploads the primary slice's shards.

  Args:
    ocp: the orbax.checkpoint module.
    directory: the persistent directory's tensors/ folder (created here if
      missing; idempotent on every process).
    topology: this job's slices and processes (the primary slice's
      processes are Orbax's active processes).
    compression: Orbax's zstd on the chunks (persistent.compression).
    timeout_s: Orbax's barrier timeout, in seconds (at least 1).
    barrier_prefix: prefixes Orbax's barrier keys (unique per manager).
    on_finalized: Orbax's post-finalization callback.

  Returns:
    The ocp.CheckpointManager.
  """
  procs = set(topology.slice_processes[0])
  mp = ocp.options.MultiprocessingOptions(
    primary_host=topology.primary_process,
    active_processes=procs if topology.process_count > 1 else None,
    barrier_sync_key_prefix=barrier_prefix,
  )
  directory.mkdir(parents=True, exist_ok=True)  # idempotent on every process
  # Writes the shards of replica 0 only: the primary slice's.
  registry = ocp.type_handlers.create_type_handler_registry(
    (
      jax.Array,
      ocp.type_handlers.ArrayHandler(
        primary_host=topology.primary_process, replica_id=0, use_replica_parallel=False
      ),
    )
  )
  return _without_preemption_checks(ocp)(
    directory,
    item_handlers=ocp.PyTreeCheckpointHandler(
      multiprocessing_options=mp,
      type_handler_registry=registry,
      use_compression=compression,
    ),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=None,  # retention is the manager's (retention/)
      # Orbax lists the steps at creation; without this it also reads each
      # one's metadata (falling back to a stat of its folder), and a step
      # that retention deletes meanwhile (the pass a restart's restore
      # queues) fails the save on this process alone, while the others
      # wait for it in Orbax's barriers. Nothing here uses those timestamps.
      lightweight_initialize=True,
      # No root metadata file: nothing reads it, and writing it ends
      # Orbax's constructor in a barrier (at Orbax's own 5-minute timeout)
      # that a process which failed before opening the manager never joins.
      save_root_metadata=False,
      enable_async_checkpointing=True,
      # timeout: a hung primary-slice process fails Orbax's barriers
      # after collective_timeout_s, not Orbax's default 20 minutes.
      async_options=ocp.AsyncOptions(
        timeout_secs=max(1, int(timeout_s)), post_finalization_callback=on_finalized
      ),
      multiprocessing_options=mp,
      create=False,
    ),
  )
