"""Global jax.Arrays built back from this process's host shards: one leaf
(`assemble`), many in two batched calls (`assemble_many`: direct_put.py
for replicated leaves this process addresses whole, one jax.device_put for
the rest), or a whole flat buffer laid out by a shards.Layout
(`assemble_buffer`). On CPU, aligned host pieces are aliased, not copied.

Called by: every restore path (local, peer, persistent), the staging area
(the upload's arrays); no collective, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from emergency_ckpt.core import direct_put, gc_pause
from emergency_ckpt.core.shards import Index, Layout, normalize_index, shard_shape, view


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


def assemble_many(
  abstract: Sequence[Any],
  arrays_by_index: Sequence[dict[Index, np.ndarray]],
  memory_kind: str | None = None,
  *,
  copy_small: bool = True,
  long_lived: bool = True,
) -> list[jax.Array]:
  """`assemble` of many leaves, batched: each sharding's placement is
  computed once, and the pieces of the leaves not placed whole go in one
  jax.device_put (a state of thousands of small leaves otherwise pays the
  device_put overhead per leaf). Replicated leaves of a sharding this process addresses whole
  (every device holds the whole array; never across processes:
  device_put would then compare the value between processes) are placed
  as global arrays directly (_put_whole: a copy up to SMALL_LEAF bytes);
  the rest as assemble does (on CPU, aligned pieces aliased).

  Args:
    abstract: the leaves' abstract values (shape, sharding).
    arrays_by_index: per leaf, {shard index: host array} for this process's shards.
    memory_kind: the devices' memory to place them in (None: default).
    copy_small: False: small replicated leaves alias their host bytes on
      CPU too (the caller keeps them unchanged for the arrays' lifetime:
      the local tier's private mapping of a step, which it never recycles
      while mapped).
    long_lived: the arrays outlive the call (a restored state): the
      collector's pause promotes them as it ends (gc_pause.paused). False
      for arrays dropped soon (a snapshot handed to one upload).

  Returns:
    One array per leaf.
  """
  with gc_pause.paused(promote=long_lived):  # thousands of arrays: no collector passes
    return _assemble_many(abstract, arrays_by_index, memory_kind, copy_small)


def _assemble_many(abstract, arrays_by_index, memory_kind, copy_small) -> list[jax.Array]:
  placements: dict[Any, tuple] = {}
  whole_leaves: list[tuple[int, np.ndarray, Any, tuple]] = []
  split: list[tuple[int, Any, tuple, int, int]] = []
  pieces: list[np.ndarray] = []
  targets: list[Any] = []
  for i, (a, by_index) in enumerate(zip(abstract, arrays_by_index)):
    shape = tuple(a.shape)
    key = (a.sharding, shape)
    p = placements.get(key)
    if p is None:
      p = placements[key] = _placement(a.sharding, shape, memory_kind)
    sharding, devices, indices, targets_of, whole = p
    if whole:
      whole_leaves.append((i, by_index[indices[0]], sharding, shape))
      continue
    split.append((i, sharding, shape, len(pieces), len(devices)))
    pieces.extend(by_index[idx] for idx in indices)
    targets.extend(targets_of)
  out: list[Any] = [None] * len(arrays_by_index)
  for i, x in zip(
    [w[0] for w in whole_leaves],
    direct_put.put_whole(whole_leaves, SMALL_LEAF if copy_small else -1),
  ):
    out[i] = x
  if split:
    placed = jax.device_put(pieces, targets, may_alias=True)
    for i, sharding, shape, start, n in split:
      out[i] = jax.make_array_from_single_device_arrays(shape, sharding, placed[start : start + n])
  return out


SMALL_LEAF = 1 << 20
"""Replicated leaves up to this size are restored as a copy (made here or
by force_copy: with some jax versions a device_put aliases even when told
not to); bigger ones alias their host bytes on CPU (no copy at all)."""


def _placement(sharding, shape: tuple[int, ...], memory_kind: str | None) -> tuple:
  """(sharding in `memory_kind`, addressable devices, their shard indices,
  the single-device targets, whether a device_put of the one host value
  to the sharding places it: default memory, fully addressable, every
  device holding the whole array) of a leaf."""
  devices, indices = [], []
  for device, idx in sharding.addressable_devices_indices_map(shape).items():
    devices.append(device)
    indices.append(normalize_index(idx, shape))
  targets: list[Any] = devices
  if memory_kind is not None:
    sharding = sharding.with_memory_kind(memory_kind)
    targets = [jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind) for d in devices]
  whole = (
    memory_kind is None
    and bool(indices)
    and sharding.is_fully_addressable
    and all(shard_shape(idx) == shape for idx in indices)
  )
  return sharding, devices, indices, targets, whole


def assemble_buffer(abstract: Sequence[Any], layout: Layout, buffer: np.ndarray) -> list[jax.Array]:
  """Global jax.Arrays from a host buffer.

  Args:
    abstract: the abstract leaves.
    layout: layout_for of the same leaves.
    buffer: the flat buffer laid out by `layout`.

  Returns:
    One array per leaf.
  """
  return assemble_many(
    abstract,
    [{slot.index: view(buffer, leaf, slot) for slot in leaf.slots} for leaf in layout.leaves],
  )
