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

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def off_host(shards: list[list[jax.Array]]) -> bool:
  """Whether every shard lives in accelerator memory (its host copy is then
  a new buffer, not a view of the array).

  Args:
    shards: laid out as slot_shards returns them.

  Returns:
    True if none is on a CPU device.
  """
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
  """Copies host shards into `buffer`, each at its slot's offset.

  Args:
    hosts: host arrays, laid out as slot_shards.
    layout: the buffer's Layout.
    buffer: the staging buffer (layout.nbytes).
  """
  for per_leaf, leaf in zip(hosts, layout.leaves):
    for x, slot in zip(per_leaf, leaf.slots):
      np.copyto(shards_lib.view(buffer, leaf, slot), x, casting="no")


def fill(shards: list[list[jax.Array]], layout: shards_lib.Layout, buffer: np.ndarray) -> None:
  """Copies `shards` into `buffer` (to_host, then copy_into). Blocks on
  the copies.

  Args:
    shards: laid out as slot_shards (e.g. this process's unique shards).
    layout: the buffer's Layout.
    buffer: the staging buffer (layout.nbytes).
  """
  copy_into(to_host(shards), layout, buffer)
