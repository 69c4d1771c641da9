"""Which shards a process holds, and where each lives in a flat host buffer.

A `Layout` is computed once per (tree paths, shapes, dtypes, shardings) and
cached: saves of the same train state reuse it and its host buffers. A
leaf's NamedSharding is recorded as JSON (`spec_of`) where `block_index`
reproduces the shard each device holds, so that another mesh can reshard a
local copy (core/reshard.py). `assemble` builds global arrays back from
host shards (the copies the other way are runtime/device_copy.py's).

Called by: every tier and transfer, the staging area and the restore
paths; no collective, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from emergency_ckpt.errors import StateMismatchError, TopologyError

ALIGN = 64
Index = tuple[tuple[int, int], ...]
SpecJSON = list  # per dimension: None, or the mesh axis names it is split over


def normalize_index(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
  """A shard's index as JAX gives it, as a box.

  Args:
    index: a tuple of slices (possibly with None bounds; may be shorter
      than the rank).
    shape: the global shape.

  Returns:
    ((start, stop), ...) per dimension.

  Raises:
    TopologyError: a strided index.
  """
  out = []
  for dim, sl in zip(shape, index):
    start, stop, step = sl.indices(dim)
    if step != 1:
      raise TopologyError(f"strided shard index {index} is not supported")
    out.append((start, stop))
  out.extend((0, d) for d in shape[len(out) :])
  return tuple(out)


def shard_shape(index: Index) -> tuple[int, ...]:
  """The shape of the shard at `index`.

  Args:
    index: a box.

  Returns:
    Its extent per dimension.
  """
  return tuple(stop - start for start, stop in index)


def spec_of(sharding: Any, shape: Sequence[int]) -> SpecJSON | None:
  """A sharding's PartitionSpec as JSON.

  Args:
    sharding: a leaf's sharding.
    shape: the leaf's global shape.

  Returns:
    Per dimension None or the mesh axis names it is split over (padded to
    the rank); None if it is not a NamedSharding (such a leaf cannot be
    resharded from ramdisks).
  """
  spec = getattr(sharding, "spec", None)
  mesh = getattr(sharding, "mesh", None)
  if spec is None or mesh is None or not hasattr(mesh, "axis_names"):
    return None
  out: SpecJSON = []
  for d in range(len(shape)):
    entry = spec[d] if d < len(spec) else None
    if entry is None:
      out.append(None)
    elif isinstance(entry, str):
      out.append([entry])
    else:
      out.append([str(a) for a in entry] or None)
  return out


def block_index(
  shape: Sequence[int], spec: SpecJSON, sizes: Mapping[str, int], coord: Mapping[str, int]
) -> Index | None:
  """The shard a device holds under a PartitionSpec (blocks of equal size,
  the first named axis the slowest).

  Args:
    shape: the leaf's global shape.
    spec: spec_of's JSON.
    sizes: {mesh axis: its size}.
    coord: {mesh axis: the device's coordinate}.

  Returns:
    The shard's global index, or None if a split dimension does not divide
    evenly.

  Raises:
    KeyError: the spec names an axis missing from `sizes` or `coord`.
  """
  out = []
  for dim, entry in zip(shape, spec):
    if not entry:
      out.append((0, dim))
      continue
    n, b = 1, 0
    for axis in entry:
      b = b * sizes[axis] + coord[axis]
      n *= sizes[axis]
    if dim % n:
      return None
    size = dim // n
    out.append((b * size, (b + 1) * size))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class ShardSlot:
  """One shard of a leaf held by this process, and its place in the buffer."""

  index: Index
  offset: int
  nbytes: int
  devices: tuple[Any, ...]  # local devices holding this index (save side)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """One leaf: its path, shape, dtype, and the slots of this process's shards."""

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  slots: tuple[ShardSlot, ...]
  spec: list | None = None
  """The NamedSharding's PartitionSpec as JSON (spec_of), if it
  reproduces this process's shard indices: recorded in local copies so
  another mesh can reshard them."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """Every leaf's slots in one flat host buffer of `nbytes` (ALIGN-aligned)."""

  leaves: tuple[LeafLayout, ...]
  nbytes: int


def dtype_name(dtype) -> str:
  """A dtype's name as recorded in manifests (bfloat16 & co. included).

  Args:
    dtype: anything jnp.dtype accepts.

  Returns:
    Its name.
  """
  return str(jnp.dtype(dtype))


def dtype_from_name(name: str) -> np.dtype:
  """The dtype a recorded name stands for.

  Args:
    name: dtype_name's answer.

  Returns:
    The dtype.
  """
  return jnp.dtype(name)


def leaf_paths(tree) -> tuple[list[str], list[Any], Any]:
  """A pytree's leaves with their paths.

  Args:
    tree: the pytree.

  Returns:
    (keystr paths, leaves, treedef).
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat], treedef


@functools.lru_cache(maxsize=16)
def _layout_cached(key) -> Layout:
  leaves = []
  offset = 0
  for path, shape, dtype, sharding in key:
    by_index: dict[Index, list[Any]] = {}
    for device, idx in sharding.addressable_devices_indices_map(shape).items():
      by_index.setdefault(normalize_index(idx, shape), []).append(device)
    slots = []
    for index in sorted(by_index):
      nbytes = int(np.prod(shard_shape(index), dtype=np.int64)) * dtype.itemsize
      slots.append(ShardSlot(index, offset, nbytes, tuple(by_index[index])))
      offset += -(-nbytes // ALIGN) * ALIGN
    spec = _checked_spec(sharding, shape, by_index)
    leaves.append(LeafLayout(path, tuple(shape), dtype, tuple(slots), spec))
  return Layout(tuple(leaves), offset)


def _checked_spec(sharding, shape, by_index: dict[Index, list[Any]]) -> list | None:
  """spec_of(sharding), if block_index gives every device of this process
  the index JAX gives it; else None (not reshardable)."""
  spec = spec_of(sharding, shape)
  if spec is None:
    return None
  mesh = sharding.mesh
  sizes = {str(k): int(v) for k, v in mesh.shape.items()}
  names = [str(n) for n in mesh.axis_names]
  coords = {d.id: dict(zip(names, c)) for c, d in np.ndenumerate(np.asarray(mesh.devices))}
  for index, devices in by_index.items():
    for d in devices:
      c = coords.get(d.id)
      try:
        if c is None or block_index(shape, spec, sizes, c) != index:
          return None
      except KeyError:
        return None
  return spec


def layout_for(paths: Sequence[str], leaves: Sequence[Any]) -> Layout:
  """The Layout of this process's unique addressable shards (cached).

  Args:
    paths: the leaves' paths.
    leaves: jax.Arrays or abstract leaves with shardings.

  Returns:
    The Layout.

  Raises:
    StateMismatchError: a leaf without a sharding or a shape.
  """
  key = []
  for path, leaf in zip(paths, leaves):
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or not hasattr(leaf, "shape"):
      raise StateMismatchError(
        f"leaf {path} is a {type(leaf).__name__}; every leaf of the train state"
        " must be a jax.Array (and of abstract_state a jax.ShapeDtypeStruct"
        " with a sharding). Wrap scalars with jnp.asarray and device_put them."
      )
    key.append(
      (path, tuple(leaf.shape), np.dtype(jnp.dtype(leaf.dtype)), sharding)
    )  # hashable, compared by value
  return _layout_cached(tuple(key))


def view(buffer: np.ndarray, leaf: LeafLayout, slot: ShardSlot) -> np.ndarray:
  """The slot's bytes in a buffer laid out by a Layout.

  Args:
    buffer: the flat uint8 buffer.
    leaf: the slot's leaf.
    slot: the slot.

  Returns:
    A view of its bytes, as an array of the shard's dtype and shape.
  """
  raw = buffer[slot.offset : slot.offset + slot.nbytes]
  return raw.view(leaf.dtype).reshape(shard_shape(slot.index))


def assemble(
  abstract, arrays_by_index: dict[Index, np.ndarray], memory_kind: str | None = None
) -> jax.Array:
  """A global jax.Array from this process's host shards.

  Args:
    abstract: the leaf's abstract value (shape, sharding).
    arrays_by_index: {shard index: host array} for this process's shards.
    memory_kind: the devices' memory to place them in (None: default).

  Returns:
    The array (on CPU, aligned host pieces are aliased, not copied).
  """
  sharding = abstract.sharding
  shape = tuple(abstract.shape)
  devices, pieces = [], []
  for device, idx in sharding.addressable_devices_indices_map(shape).items():
    devices.append(device)
    pieces.append(arrays_by_index[normalize_index(idx, shape)])
  targets: list[Any] = devices
  if memory_kind is not None:
    sharding = sharding.with_memory_kind(memory_kind)
    targets = [jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind) for d in devices]
  # On CPU, aligned host pieces are aliased, not copied (a restore from a
  # mapped local file then costs no copy at all); elsewhere this is the H2D
  # (into pinned host memory: a host copy).
  placed = jax.device_put(pieces, targets, may_alias=True)
  return jax.make_array_from_single_device_arrays(shape, sharding, placed)


def assemble_buffer(abstract: Sequence[Any], layout: Layout, buffer: np.ndarray) -> list[jax.Array]:
  """Global jax.Arrays from a host buffer.

  Args:
    abstract: the abstract leaves.
    layout: layout_for of the same leaves.
    buffer: the flat buffer laid out by `layout`.

  Returns:
    One array per leaf.
  """
  return [
    assemble(a, {slot.index: view(buffer, leaf, slot) for slot in leaf.slots})
    for a, leaf in zip(abstract, layout.leaves)
  ]
