"""Persistent tier: Orbax's standard format on gs:// or any path.

Saved by the primary slice only, through an Orbax CheckpointManager whose
barriers span the primary slice's processes only: it gets the global arrays
and writes the shards of replica 0, which live on the primary slice (the
state is replicated over the replica axis), so no copy is made. Restored by every process
through Orbax, each reading the shards it needs straight from storage (no
broadcast, so values come back bit-exact), onto any topology.

Compression: Orbax's default (zstd in zarr3/OCDBT) on purpose: the network to
GCS is the bottleneck of this tier, unlike the ramdisk tier.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
from etils import epath
from jax.sharding import Mesh, NamedSharding

from emergency_ckpt.errors import TopologyError
from emergency_ckpt.options import PersistentTierOptions
from emergency_ckpt.storage import check_bucket, forget_listings
from emergency_ckpt.topology import Topology

logger = logging.getLogger("emergency_ckpt")

ITEM = "default"


def _ocp():
  import orbax.checkpoint as ocp  # noqa: PLC0415 - heavy import, only when used

  try:
    from absl import flags  # noqa: PLC0415

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
  except ImportError:  # pragma: no cover - absl ships with orbax
    pass
  return ocp


def check_replicated(tree: Any, replica_axis: str) -> None:
  """Raises TopologyError unless every leaf is replicated over the replica axis
  (then the primary slice alone holds a full copy: the shards of replica 0)."""
  for path, arr in jax.tree_util.tree_flatten_with_path(tree)[0]:
    sharding = getattr(arr, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      raise TopologyError(
        f"leaf {jax.tree_util.keystr(path)} has a {type(sharding).__name__}; the"
        " train state must use NamedSharding on the manager's mesh."
      )
    for entry in sharding.spec:
      names = entry if isinstance(entry, tuple) else (entry,)
      if replica_axis in names:
        raise TopologyError(
          f"leaf {jax.tree_util.keystr(path)} is sharded over the replica axis"
          f" {replica_axis!r}; no single slice holds it, so neither the persistent"
          " tier nor a peer slice can serve it. Replicate the train state over"
          " the replica axis."
        )


class PersistentTier:
  """Orbax on the persistent directory's tensors/ folder."""

  def __init__(
    self, options: PersistentTierOptions, *, topology: Topology, mesh: Mesh, barrier_prefix: str
  ):
    self._options = options
    self._topology = topology
    self._mesh = mesh
    self.directory = epath.Path(options.directory) / "tensors"
    self._manager = None
    # Every process, before anything waits on another: a missing bucket fails
    # each of them at once, naming it (on GCS; no-op elsewhere).
    check_bucket(options.directory, "opening the persistent directory")
    if topology.is_primary_slice:
      ocp = _ocp()
      procs = set(topology.slice_processes[0])
      mp = ocp.options.MultiprocessingOptions(
        primary_host=topology.primary_process,
        active_processes=procs if topology.process_count > 1 else None,
        barrier_sync_key_prefix=barrier_prefix,
      )
      self.directory.mkdir(parents=True, exist_ok=True)  # idempotent on every process
      # Writes the shards of replica 0 only: the primary slice's.
      registry = ocp.type_handlers.create_type_handler_registry(
        (
          jax.Array,
          ocp.type_handlers.ArrayHandler(
            primary_host=topology.primary_process, replica_id=0, use_replica_parallel=False
          ),
        )
      )
      self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers=ocp.PyTreeCheckpointHandler(
          multiprocessing_options=mp, type_handler_registry=registry
        ),
        options=ocp.CheckpointManagerOptions(
          max_to_keep=options.max_to_keep,
          enable_async_checkpointing=True,
          multiprocessing_options=mp,
          create=False,
        ),
      )

  def steps(self) -> list[int]:
    """Committed (finalized) steps. Any process may call it."""
    ocp = _ocp()
    forget_listings(self.directory)  # other processes save and delete steps here
    if not self.directory.exists():
      return []
    return sorted(ocp.path.step.checkpoint_steps(self.directory))

  def save(self, step: int, tree: Any) -> None:
    """Starts an async save. Called by: every process of the primary slice.
    Blocks on the host copy (and on a previous persistent save still running)."""
    ocp = _ocp()
    assert self._manager is not None, "only the primary slice saves persistently"
    check_replicated(tree, self._topology.replica_axis_name)
    self._manager.save(step, args=ocp.args.PyTreeSave(tree))

  def restore(self, step: int, abstract_tree: Any) -> Any:
    """Reads `step` onto abstract_tree's shardings. Called by: every process."""
    ocp = _ocp()
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
      return ckptr.restore(
        self.directory / str(step) / ITEM, args=ocp.args.StandardRestore(abstract_tree)
      )

  def wait_until_finished(self) -> None:
    if self._manager is not None:
      self._manager.wait_until_finished()

  def close(self) -> None:
    if self._manager is not None:
      self._manager.close()
      self._manager = None
