"""How a save's shards leave the devices: the copies between this process's
device arrays and a host staging buffer.

A save takes this process's unique shards (one single-device array per
slot of its Layout: `slot_shards`), then either copies them on the device
first (a device snapshot: `device_copies`, one dispatched program per
device, so the trainer may go on at once) or copies them to the host:
from accelerators by DMA into page-locked host memory where the device has
it (far faster than jax's pageable copy), every transfer started before the
first is awaited (`to_host`), and then into the staging buffer at the
slots' offsets (`copy_into`). `fill` is both host steps in one.

Called by: the staging area (staging.py), on the thread that stages a save
or on its filler; no collective.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from emergency_ckpt.core import gc_pause
from emergency_ckpt.core import shards as shards_lib


def slot_shards(arrays: Sequence[jax.Array], layout: shards_lib.Layout) -> list[list[jax.Array]]:
  """This process's unique shards, one per slot of `layout`.

  Args:
    arrays: the state's leaves (global jax.Arrays).
    layout: shards.layout_for of the same leaves.

  Returns:
    Per leaf, the single-device array of each slot.
  """
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
  """A device-side copy of `shards`, one dispatched program per device.
  Blocks on the dispatch only.

  Args:
    shards: laid out as slot_shards returns them.

  Returns:
    The copies (new device buffers), laid out the same.

  Raises:
    Whatever the dispatch raises (e.g. out of device memory).
  """
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


def off_host(shards: list[list[jax.Array]] | shards_lib.Layout) -> bool:
  """Whether every shard lives in accelerator memory (its host copy is then
  a new buffer, not a view of the array).

  Args:
    shards: laid out as slot_shards returns them, or a Layout (its slots'
      devices: no shard needed).

  Returns:
    True if none is on a CPU device.
  """
  if isinstance(shards, shards_lib.Layout):
    if shards.on_cpu:
      return False
    return all(
      d.platform != "cpu" for leaf in shards.leaves for slot in leaf.slots for d in slot.devices
    )
  return all(x.device.platform != "cpu" for per_leaf in shards for x in per_leaf)


def to_host(shards: list[list[jax.Array]]) -> list[list[np.ndarray]]:
  """Host copies of `shards`: from accelerators by DMA into page-locked host
  memory where the device has it (see benchmarks/device_stall.py for how
  much faster than jax's pageable copy), else jax's own copy; CPU shards as
  views. Every transfer starts before the first is awaited. Blocks on the
  transfers.

  Args:
    shards: laid out as slot_shards returns them.

  Returns:
    The host arrays, laid out the same.
  """
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


def copy_into(hosts: list[list[np.ndarray]], layout: shards_lib.Layout, buffer: np.ndarray) -> None:
  """Copies host shards into `buffer`, each at its slot's offset: as bytes
  (one memcpy, no view objects), or with np.copyto where the bytes cannot
  be taken as they are (a strided array, a dtype without a buffer format).

  Args:
    hosts: host arrays, laid out as slot_shards.
    layout: the buffer's Layout.
    buffer: the staging buffer (layout.nbytes, flat uint8).
  """
  out = memoryview(buffer)
  for per_leaf, leaf in zip(hosts, layout.leaves):
    for x, slot in zip(per_leaf, leaf.slots):
      if x.dtype == leaf.dtype and x.flags.c_contiguous and slot.nbytes:
        try:
          out[slot.offset : slot.offset + slot.nbytes] = memoryview(x).cast("B")
          continue
        except (TypeError, ValueError, BufferError):
          pass
      np.copyto(shards_lib.view(buffer, leaf, slot), x, casting="no")


def cpu_hosts(arrays: Sequence[jax.Array], layout: shards_lib.Layout) -> list[list[np.ndarray]]:
  """The host values of this process's unique shards of CPU arrays (a
  layout with on_cpu; views, not copies), laid out as slot_shards, without
  slot_shards' per-shard objects where a leaf is replicated (the array's
  own host value is then its one slot's bytes).

  Args:
    arrays: the state's leaves (global jax.Arrays on CPU devices).
    layout: shards.layout_for of the same leaves.

  Returns:
    Per leaf, the host array of each slot.
  """
  out = []
  for arr, leaf, whole in zip(arrays, layout.leaves, layout.whole):
    if whole:
      out.append([np.asarray(arr)])
    else:
      by_device = {s.device: s for s in arr.addressable_shards}
      out.append([np.asarray(by_device[slot.devices[0]].data) for slot in leaf.slots])
  return out


def fill_from_cpu(
  arrays: Sequence[jax.Array], layout: shards_lib.Layout, buffer: np.ndarray
) -> None:
  """Copies this process's unique shards of CPU arrays into `buffer`: a
  replicated leaf's bytes straight from the array (its buffer, as the
  buffer protocol gives it once the array is ready: no host array object),
  the rest as cpu_hosts then copy_into (a memcpy per slot). Blocks on the
  copies.

  Args:
    arrays: the state's leaves (global jax.Arrays on CPU devices).
    layout: shards.layout_for of the same leaves (on_cpu).
    buffer: the staging buffer (layout.nbytes, flat uint8).
  """
  out = memoryview(buffer)
  rest: list[int] = []
  with gc_pause.paused():  # an object or two per leaf: no collector passes in the stall
    for i, (arr, leaf, whole) in enumerate(zip(arrays, layout.leaves, layout.whole)):
      if whole:
        slot = leaf.slots[0]
        try:  # one device's buffer (else BufferError), as bytes (else TypeError)
          src = memoryview(arr)
          if src.c_contiguous and src.nbytes == slot.nbytes:
            if slot.nbytes:
              out[slot.offset : slot.offset + slot.nbytes] = src.cast("B")
            continue
        except (BufferError, TypeError, ValueError):
          pass
      rest.append(i)
    if rest:
      sub = dataclasses.replace(
        layout,
        leaves=tuple(layout.leaves[i] for i in rest),
        whole=tuple(layout.whole[i] for i in rest),
      )
      copy_into(cpu_hosts([arrays[i] for i in rest], sub), sub, buffer)


def fill(shards: list[list[jax.Array]], layout: shards_lib.Layout, buffer: np.ndarray) -> None:
  """Copies `shards` into `buffer` (to_host, then copy_into). Blocks on
  the copies.

  Args:
    shards: laid out as slot_shards (e.g. this process's unique shards).
    layout: the buffer's Layout.
    buffer: the staging buffer (layout.nbytes).
  """
  copy_into(to_host(shards), layout, buffer)
