"""Persistent tier: Orbax's standard format on gs:// or any path.

Saved by the primary slice only, from a slice-local view of the train state
(the primary slice's shards, no copy), through an Orbax CheckpointManager whose
barriers span the primary slice's processes only. Restored by every process
through Orbax, each reading the shards it needs straight from storage (no
broadcast, so values come back bit-exact), onto any topology.

Compression: Orbax's default (zstd in zarr3/OCDBT) on purpose: the network to
GCS is the bottleneck of this tier, unlike the ramdisk tier.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.sharding import Mesh, NamedSharding

from emergency_ckpt.errors import TopologyError
from emergency_ckpt.options import PersistentTierOptions
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


def slice_mesh(mesh: Mesh, topology: Topology, slice_index: int) -> Mesh:
  """The sub-mesh of one slice, without the replica axis."""
  axis = topology.replica_axis_index
  devices = np.take(np.asarray(mesh.devices), slice_index, axis=axis)
  names = tuple(n for i, n in enumerate(mesh.axis_names) if i != axis)
  return Mesh(devices, names)


def slice_local_view(arr: jax.Array, sub_mesh: Mesh, replica_axis: str) -> jax.Array:
  """`arr` seen from one slice only: the same buffers, a slice-local sharding."""
  sharding = arr.sharding
  if not isinstance(sharding, NamedSharding):
    raise TopologyError(
      f"persistent saves need NamedSharding leaves, got {type(sharding).__name__}"
    )
  for entry in sharding.spec:
    names = entry if isinstance(entry, tuple) else (entry,)
    if replica_axis in names:
      raise TopologyError(
        f"a leaf is sharded over the replica axis {replica_axis!r}; the primary"
        " slice alone does not hold it, so the persistent tier cannot save it."
        " Replicate the train state over the replica axis."
      )
  devices = set(sub_mesh.devices.flat)
  shards = [s.data for s in arr.addressable_shards if s.device in devices]
  return jax.make_array_from_single_device_arrays(
    arr.shape, NamedSharding(sub_mesh, sharding.spec), shards
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
    self._sub_mesh = None
    if topology.is_primary_slice:
      ocp = _ocp()
      procs = set(topology.slice_processes[0])
      mp = ocp.options.MultiprocessingOptions(
        primary_host=topology.primary_process,
        active_processes=procs if topology.process_count > 1 else None,
        barrier_sync_key_prefix=barrier_prefix,
      )
      self.directory.mkdir(parents=True, exist_ok=True)  # idempotent on every process
      self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers=ocp.StandardCheckpointHandler(multiprocessing_options=mp),
        options=ocp.CheckpointManagerOptions(
          max_to_keep=options.max_to_keep,
          enable_async_checkpointing=True,
          multiprocessing_options=mp,
          create=False,
        ),
      )
      self._sub_mesh = slice_mesh(mesh, topology, 0)

  def steps(self) -> list[int]:
    """Committed (finalized) steps. Any process may call it."""
    ocp = _ocp()
    if not self.directory.exists():
      return []
    return sorted(ocp.path.step.checkpoint_steps(self.directory))

  def save(self, step: int, tree: Any) -> None:
    """Starts an async save. Called by: every process of the primary slice.
    Blocks on the host copy (and on a previous persistent save still running)."""
    ocp = _ocp()
    assert self._manager is not None, "only the primary slice saves persistently"
    local_tree = jax.tree.map(
      lambda a: slice_local_view(a, self._sub_mesh, self._topology.replica_axis_name), tree
    )
    self._manager.save(step, args=ocp.args.StandardSave(local_tree))

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
