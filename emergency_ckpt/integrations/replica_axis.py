"""Which mesh axis holds the slices, for a mesh built for Orbax (pure).

Orbax's emergency manager takes the slices from the axis at
`replica_axis_index` (default 0). MaxText's mesh puts a `diloco` axis of size
1 first, so Orbax sees one slice and keeps no local copy. `find_replica_axis`
instead picks the first axis that can hold slices: size > 1, every entry made
of whole processes, and no leaf of the train state sharded over it (each
entry holds a full copy). Called by: the orbax_emergency facade's
constructor (every process, same answer: it depends on the mesh and the
abstract state only). Blocks on nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from emergency_ckpt.errors import TopologyError


def _sharded_axes(leaves: Sequence[Any]) -> set[str]:
  """Mesh axis names any leaf's PartitionSpec uses."""
  used: set[str] = set()
  for leaf in leaves:
    spec = getattr(getattr(leaf, "sharding", None), "spec", None)
    for entry in spec or ():
      if entry is None:
        continue
      used.update(str(n) for n in (entry if isinstance(entry, (tuple, list)) else (entry,)))
  return used


def _whole_processes(devices: np.ndarray, axis: int) -> bool:
  """True iff every process's devices lie in one entry of `axis`."""
  owner: dict[int, int] = {}
  for s in range(devices.shape[axis]):
    for d in devices.take(s, axis=axis).flat:
      if owner.setdefault(d.process_index, s) != s:
        return False
  return True


def axis_problem(mesh: jax.sharding.Mesh, axis: int, abstract_state: Any) -> str | None:
  """Why a mesh axis cannot hold the slices.

  Args:
    mesh: the device mesh.
    axis: the axis's index.
    abstract_state: the train state (its leaves' shardings).

  Returns:
    The reason, or None if it can.
  """
  name = str(mesh.axis_names[axis])
  devices = np.asarray(mesh.devices)
  if not _whole_processes(devices, axis):
    return f"axis {name!r} splits a process's devices between its entries"
  if name in _sharded_axes(jax.tree_util.tree_leaves(abstract_state)):
    return f"the train state is sharded over axis {name!r} (its entries hold no full copy)"
  return None


def find_replica_axis(
  mesh: jax.sharding.Mesh, abstract_state: Any, preferred: int | str | None = None
) -> str:
  """The name of the mesh axis whose entries are slices.

  Args:
    mesh: the device mesh.
    abstract_state: the train state (its leaves' shardings).
    preferred: a name or index (e.g. Orbax's `replica_axis_index`): it wins
      if its size is > 1 and it can hold slices.

  Returns:
    The preferred axis if it can; otherwise the first axis (in mesh order)
    of size > 1 that can; if none, the preferred axis (or axis 0): one
    slice, local + persistent tiers, no peer.

  Raises:
    TopologyError: `preferred` is not an axis of the mesh, or has size > 1
      and cannot hold slices.
  """
  names = [str(n) for n in mesh.axis_names]
  sizes = dict(zip(names, np.asarray(mesh.devices).shape))
  if preferred is not None:
    if isinstance(preferred, int):
      if not 0 <= preferred < len(names):
        raise TopologyError(
          f"replica axis index {preferred} is out of range for a mesh with axes {names}."
        )
      preferred = names[preferred]
    if preferred not in names:
      raise TopologyError(f"replica axis {preferred!r} is not an axis of the mesh {names}.")
    if sizes[preferred] > 1:
      problem = axis_problem(mesh, names.index(preferred), abstract_state)
      if problem:
        raise TopologyError(
          f"replica axis {preferred!r} cannot hold slices: {problem}. Name the mesh"
          " axis whose entries are data-parallel replicas (whole hosts, each with a"
          " full copy of the state)."
        )
      return preferred
  for i, name in enumerate(names):
    if sizes[name] > 1 and axis_problem(mesh, i, abstract_state) is None:
      return name
  return preferred if preferred is not None else names[0]
