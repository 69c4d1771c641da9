"""Which shards a process holds, and where each lives in a flat host buffer.

A `Layout` is computed once per (tree paths, shapes, dtypes, shardings) and
cached: saves of the same train state reuse it and its host buffers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from emergency_ckpt.errors import StateMismatchError, TopologyError

ALIGN = 64
Index = tuple[tuple[int, int], ...]


def normalize_index(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
  """A tuple of slices (possibly with None bounds) as ((start, stop), ...)."""
  out = []
  for dim, sl in zip(shape, index):
    start, stop, step = sl.indices(dim)
    if step != 1:
      raise TopologyError(f"strided shard index {index} is not supported")
    out.append((start, stop))
  out.extend((0, d) for d in shape[len(out) :])
  return tuple(out)


def shard_shape(index: Index) -> tuple[int, ...]:
  return tuple(stop - start for start, stop in index)


@dataclasses.dataclass(frozen=True)
class ShardSlot:
  index: Index
  offset: int
  nbytes: int
  devices: tuple[Any, ...]  # local devices holding this index (save side)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  slots: tuple[ShardSlot, ...]
  spec: list | None = None
  """The NamedSharding's PartitionSpec as JSON (reshard.spec_of), if it
  reproduces this process's shard indices: recorded in local copies so
  another mesh can reshard them."""


@dataclasses.dataclass(frozen=True)
class Layout:
  leaves: tuple[LeafLayout, ...]
  nbytes: int


def dtype_name(dtype) -> str:
  return str(jnp.dtype(dtype))


def dtype_from_name(name: str) -> np.dtype:
  return jnp.dtype(name)


def leaf_paths(tree) -> tuple[list[str], list[Any], Any]:
  """(keystr paths, leaves, treedef) of a pytree."""
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
  """reshard.spec_of(sharding), if reshard.block_index gives every device
  of this process the index JAX gives it; else None (not reshardable)."""
  from emergency_ckpt.core import reshard  # noqa: PLC0415 - reshard imports this module

  spec = reshard.spec_of(sharding, shape)
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
        if c is None or reshard.block_index(shape, spec, sizes, c) != index:
          return None
      except KeyError:
        return None
  return spec


def layout_for(paths: Sequence[str], leaves: Sequence[Any]) -> Layout:
  """Layout of this process's unique addressable shards (arrays or abstract)."""
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
  """The slot's bytes in `buffer`, as an array of the shard's dtype and shape."""
  raw = buffer[slot.offset : slot.offset + slot.nbytes]
  return raw.view(leaf.dtype).reshape(shard_shape(slot.index))


def slot_shards(arrays: Sequence[jax.Array], layout: Layout) -> list[list[jax.Array]]:
  """Per leaf, the single-device array of each slot (this process's unique shards)."""
  out = []
  for arr, leaf in zip(arrays, layout.leaves):
    by_device = {s.device: s for s in arr.addressable_shards}
    out.append([by_device[slot.devices[0]].data for slot in leaf.slots])
  return out


@functools.lru_cache(maxsize=64)
def _copier(n: int):
  """One jitted program copying n arrays of one device (a copy, not a
  forwarded input: copy_p's result is a new buffer)."""
  return jax.jit(lambda xs: [jnp.array(x, copy=True) for x in xs])


def device_copies(shards: list[list[jax.Array]]) -> list[list[jax.Array]]:
  """A device-side copy of `shards` (laid out as slot_shards), one
  dispatched program per device. Blocks on the dispatch only; raises what
  the dispatch raises (e.g. out of device memory)."""
  by_device: dict[Any, list[tuple[int, int]]] = {}
  for i, per_leaf in enumerate(shards):
    for j, x in enumerate(per_leaf):
      by_device.setdefault(x.device, []).append((i, j))
  out = [list(per_leaf) for per_leaf in shards]
  for places in by_device.values():
    copies = _copier(len(places))([shards[i][j] for i, j in places])
    for (i, j), c in zip(places, copies):
      out[i][j] = c
  return out


@functools.cache
def _pinned_host(device) -> Any:
  """A sharding on `device`'s page-locked host memory, or None where the
  device has none (CPU devices, older backends)."""
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001 - a backend without memory spaces
    return None
  if "pinned_host" not in kinds:
    return None
  return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def off_host(shards: list[list[jax.Array]]) -> bool:
  """True if every shard lives in accelerator memory (its host copy is then
  a new buffer, not a view of the array)."""
  return all(x.device.platform != "cpu" for per_leaf in shards for x in per_leaf)


def to_host(shards: list[list[jax.Array]]) -> list[list[np.ndarray]]:
  """Host copies of `shards` (laid out as slot_shards): from accelerators
  by DMA into page-locked host memory where the device has it (on an H200,
  4 GiB in 79 ms against 2.15 s through jax's pageable copy: see
  benchmarks/results/2026-11-26-device-stall-h200), else jax's own copy;
  CPU shards as views. Every transfer starts before the first is awaited.
  Blocks on the transfers."""
  started = []
  for per_leaf in shards:
    row = []
    for x in per_leaf:
      pinned = None if x.device.platform == "cpu" else _pinned_host(x.device)
      if pinned is not None:
        x = jax.device_put(x, pinned)
      elif x.device.platform != "cpu":
        x.copy_to_host_async()
      row.append(x)
    started.append(row)
  return [[np.asarray(x) for x in row] for row in started]


def copy_into(hosts: list[list[np.ndarray]], layout: Layout, buffer: np.ndarray) -> None:
  """Copies host shards (laid out as slot_shards) into `buffer`."""
  for per_leaf, leaf in zip(hosts, layout.leaves):
    for x, slot in zip(per_leaf, leaf.slots):
      np.copyto(view(buffer, leaf, slot), x, casting="no")


def fill(shards: list[list[jax.Array]], layout: Layout, buffer: np.ndarray) -> None:
  """Copies `shards` (laid out as slot_shards, e.g. this process's unique
  shards) into `buffer` (to_host, then copy_into). Blocks on the copies."""
  copy_into(to_host(shards), layout, buffer)


def assemble(
  abstract, arrays_by_index: dict[Index, np.ndarray], memory_kind: str | None = None
) -> jax.Array:
  """A global jax.Array for `abstract` from this process's host shards, in
  the devices' `memory_kind` (None: their default memory)."""
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
  """A global jax.Array per leaf of `abstract` from a host buffer laid out
  as `layout` (layout_for of the same leaves)."""
  return [
    assemble(a, {slot.index: view(buffer, leaf, slot) for slot in leaf.slots})
    for a, leaf in zip(abstract, layout.leaves)
  ]
