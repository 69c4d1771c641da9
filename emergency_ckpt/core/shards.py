"""Which shards a process holds, and where each lives in a flat host buffer.

A `Layout` is computed once per (tree paths, shapes, dtypes, shardings) and
cached: saves of the same train state reuse it and its host buffers; a
tree's keystr paths are cached per tree structure (`leaf_paths`), so a
save of thousands of leaves flattens and looks up, and a restore places
thousands of leaves in two batched calls (placement.py). A
leaf's NamedSharding is recorded as JSON (`spec_of`) where `block_index`
reproduces the shard each device holds, so that another mesh can reshard a
local copy (core/reshard.py). placement.py builds global arrays back from
host shards (the copies the other way are runtime/device_copy.py's).

Called by: every tier and transfer, the staging area and the restore
paths; no collective, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from emergency_ckpt.core import gc_pause
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
  state_nbytes: int = 0
  """The leaves' global bytes (every shard of every process): the step's
  size as the records report it."""
  on_cpu: bool = False
  """Every slot's devices are CPU devices (save()'s host copy is a memcpy)."""
  whole: tuple[bool, ...] = ()
  """Per leaf: its one slot is the whole array (a replicated leaf: the
  array's own host value is the slot's bytes)."""


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


_PATHS: dict[Any, tuple[str, ...]] = {}
_PATHS_KEEP = 16
_PATHS_LOCK = threading.Lock()


def leaf_paths(tree) -> tuple[list[str], list[Any], Any]:
  """A pytree's leaves with their paths. The paths are computed once per
  tree structure (a treedef fixes every key) and kept for the last
  _PATHS_KEEP structures: a save of thousands of leaves then only flattens.

  Args:
    tree: the pytree.

  Returns:
    (keystr paths, leaves, treedef).
  """
  with gc_pause.paused():  # thousands of leaves: no collector passes between them
    return _leaf_paths(tree)


def _leaf_paths(tree) -> tuple[list[str], list[Any], Any]:
  paths = leaves = None
  if _PATHS:  # else (a restarted process) nothing to look up: one flatten, with paths
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    try:
      with _PATHS_LOCK:
        paths = _PATHS.get(treedef)
    except (TypeError, ValueError):  # a node's aux data that cannot be hashed or compared
      paths = None
  if paths is None or len(paths) != len(leaves):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = tuple("".join(map(str, p)) for p, _ in flat)  # jax.tree_util.keystr(p)
    leaves = [x for _, x in flat]
    try:
      with _PATHS_LOCK:
        _PATHS[treedef] = paths
        while len(_PATHS) > _PATHS_KEEP:
          del _PATHS[next(iter(_PATHS))]
    except (TypeError, ValueError):
      pass
  return list(paths), leaves, treedef


@functools.lru_cache(maxsize=16)
def _layout_cached(key) -> Layout:
  leaves, whole = [], []
  offset = state_nbytes = 0
  on_cpu = True
  # Once per distinct (sharding, shape, dtype), not per leaf: the slots'
  # indices, sizes and devices, the spec check, the leaf's global bytes.
  plans: dict[tuple, tuple] = {}
  placed: dict[tuple, tuple] = {}  # (sharding, shape): (by_index, spec)
  new = object.__new__
  last = plan = None
  for path, shape, dtype, sharding in key:
    if last is None or sharding is not last[0] or shape != last[1] or dtype is not last[2]:
      last = (sharding, shape, dtype)
      plan = plans.get(last)
    if plan is None:
      known = placed.get((sharding, shape))
      if known is None:
        by_index = _devices_by_index(sharding, shape)
        known = placed[(sharding, shape)] = (by_index, _checked_spec(sharding, shape, by_index))
      by_index, spec = known
      slots = []
      for index in sorted(by_index):
        nbytes = math.prod(shard_shape(index)) * dtype.itemsize
        slots.append((index, nbytes, tuple(by_index[index]), -(-nbytes // ALIGN) * ALIGN))
      plan = plans[last] = (
        slots,
        spec,
        math.prod(shape) * dtype.itemsize,
        all(d.platform == "cpu" for _, _, devices, _ in slots for d in devices),
        len(slots) == 1 and shard_shape(slots[0][0]) == tuple(shape),
      )
    slots, spec, leaf_nbytes, leaf_on_cpu, leaf_whole = plan
    placed_slots = []
    # Frozen dataclasses built without their generated __init__ (one
    # object.__setattr__ per field): a third of the cost, for the
    # thousands of slots and leaves of a cold layout.
    for index, nbytes, devices, aligned in slots:
      slot = new(ShardSlot)
      slot.__dict__.update(index=index, offset=offset, nbytes=nbytes, devices=devices)
      placed_slots.append(slot)
      offset += aligned
    state_nbytes += leaf_nbytes
    on_cpu = on_cpu and leaf_on_cpu
    leaf = new(LeafLayout)
    leaf.__dict__.update(path=path, shape=shape, dtype=dtype, slots=tuple(placed_slots), spec=spec)
    leaves.append(leaf)
    whole.append(leaf_whole)
  return Layout(tuple(leaves), offset, state_nbytes, on_cpu, tuple(whole))


class ReadPlan(NamedTuple):
  """What a reader of one leaf needs of its (sharding, shape, dtype):
  read_plan's, once per distinct triple (a state of thousands of leaves
  has a few). Its lists are the JSON a manifest records, compared with a
  record as they are; never changed."""

  dtype: np.dtype
  dtype_name: str
  """As manifests record it (dtype_name)."""
  shape_json: list[int]
  slots: tuple[tuple[Index, list[list[int]], int, tuple[int, ...]], ...]
  """Per unique addressable shard, in index order: (index, the index as
  JSON, its bytes, the shape of its array: the leaf's own where whole)."""


@functools.lru_cache(maxsize=256)
def read_plan(sharding, shape: tuple[int, ...], dtype) -> ReadPlan:
  """The ReadPlan of a leaf (cached).

  Args:
    sharding: its sharding.
    shape: its global shape.
    dtype: its dtype.

  Returns:
    The plan: the same slots, in the same order, as layout_for's.
  """
  np_dtype = _np_dtype(dtype)
  indices = sorted(_devices_by_index(sharding, shape))
  slots = tuple(
    (
      index,
      [list(box) for box in index],
      math.prod(shard_shape(index)) * np_dtype.itemsize,
      shard_shape(index),
    )
    for index in indices
  )
  return ReadPlan(np_dtype, dtype_name(dtype), list(shape), slots)


def _devices_by_index(sharding, shape: tuple[int, ...]) -> dict[Index, list[Any]]:
  """This process's devices of a leaf, by the shard index each holds."""
  by_index: dict[Index, list[Any]] = {}
  for device, idx in sharding.addressable_devices_indices_map(shape).items():
    by_index.setdefault(normalize_index(idx, shape), []).append(device)
  return by_index


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

  The last layout of each tree (its paths) is kept with its leaves'
  shapes, dtypes and shardings: a save of the same state compares three
  lists (shardings by identity first) instead of building and hashing a
  key of every leaf.

  Args:
    paths: the leaves' paths.
    leaves: jax.Arrays or abstract leaves with shardings.

  Returns:
    The Layout.

  Raises:
    StateMismatchError: a leaf without a sharding or a shape.
  """
  try:
    seen = (
      [x.sharding for x in leaves],
      [x.shape for x in leaves],
      [x.dtype for x in leaves],
    )
    tree = tuple(paths)
  except AttributeError:
    seen = tree = None
  if tree is not None:
    with _LAST_LOCK:
      last = _LAST.get(tree)
    if last is not None and last[0] == seen:  # lists: equal objects by identity first
      return last[1]
  if seen is None or any(sh is None for sh in seen[0]):
    for path, leaf in zip(paths, leaves):
      if getattr(leaf, "sharding", None) is None or not (
        hasattr(leaf, "shape") and hasattr(leaf, "dtype")
      ):
        raise StateMismatchError(
          f"leaf {path} is a {type(leaf).__name__}; every leaf of the train state"
          " must be a jax.Array (and of abstract_state a jax.ShapeDtypeStruct"
          " with a sharding). Wrap scalars with jnp.asarray and device_put them."
        )
  shardings, shapes, dtypes = seen
  # compared by value (the lru_cache's key)
  key = tuple(zip(paths, map(tuple, shapes), map(_np_dtype, dtypes), shardings))
  with gc_pause.paused(promote=True):  # a layout is kept: long-lived
    out = _layout_cached(key)
  if tree is not None:
    with _LAST_LOCK:
      _LAST[tree] = (seen, out)
      while len(_LAST) > _LAST_KEEP:
        del _LAST[next(iter(_LAST))]
  return out


# layout_for's last layout per tree: {paths: ((shardings, shapes, dtypes), Layout)}.
_LAST: dict[tuple[str, ...], tuple[tuple, Layout]] = {}
_LAST_KEEP = 16
_LAST_LOCK = threading.Lock()


def state_nbytes(leaves: Sequence[Any]) -> int:
  """The global bytes of leaves (anything with .shape and .dtype): what a
  step of them holds across every process.

  Args:
    leaves: the leaves.

  Returns:
    Their bytes.
  """
  total = 0
  for x in leaves:
    total += math.prod(x.shape) * _np_dtype(x.dtype).itemsize
  return total


@functools.lru_cache(maxsize=64)
def _np_dtype(dtype) -> np.dtype:
  return np.dtype(jnp.dtype(dtype))


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
