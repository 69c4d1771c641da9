"""CRC32C per saved shard of a persistent step: summed at save, checked on read.

Orbax's format checks no tensor data on read (its zarr3 index carries a
CRC32C, the chunks do not; zarr2 has none): flipped bytes in a data file come
back as wrong values. So a persistent step carries its own checksums, in the
state store's files (their format: state/shard_records.py): each process of
the primary slice records the CRC32C of each unique shard it holds (from its
local write's manifest, else summed from its staged snapshot), and the
primary process writes the SHARDS table saying which process recorded which
shard. Both are written before the step's COMMIT, so a committed step has
them; no extra object per process (the JSON is written anyway) and one by
the primary.

A reader (persistent/read.py) needs the SHARDS file and the JSON of the
processes that recorded the shards it reads: on an unchanged topology, one
process of the primary slice (itself, on the primary slice). Each region it
needs is read as the saved shards that overlap it, whole, so every byte read
is checked against its CRC32C whatever the new sharding is; a region equal to
a saved shard (the common case) is checked in place, with no extra copy.

Called by: save/pipeline.py (record), persistent/read.py (check), the CLI
(verify).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import crc32c
import numpy as np

from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.state import shard_records
from emergency_ckpt.state.shard_records import Expected, Index, SavedShard

# No JAX import here: the CLI's offline check uses this module; only the save
# side (shard_table) needs JAX, and imports it there.


# ---- recording (save side) --------------------------------------------------------


def snapshot_crcs(layout: Any, buffer: np.ndarray) -> dict[str, list]:
  """The CRC32C of every unique shard in this process's staged snapshot.

  Releases the GIL while it sums.

  Args:
    layout: the snapshot's layout (shards.Layout).
    buffer: the staged snapshot's bytes.

  Returns:
    {leaf path: [[index, crc32c], ...]}, as a process JSON's "shard_crc32c".
  """
  out = {}
  for leaf in layout.leaves:
    out[leaf.path] = [
      [
        shard_records.index_json(slot.index),
        crc32c.crc32c(buffer[slot.offset : slot.offset + slot.nbytes]),
      ]
      for slot in leaf.slots
    ]
  return out


def manifest_crcs(body: dict) -> dict[str, list] | None:
  """snapshot_crcs' result from a local step's manifest.

  The local write summed the same bytes of the same snapshot.

  Args:
    body: the local step's manifest body.

  Returns:
    {leaf path: [[index, crc32c], ...]}, or None if a shard lacks a CRC32C.
  """
  out = {}
  for leaf in body["leaves"]:
    if any("crc32c" not in s for s in leaf["shards"]):
      return None
    out[leaf["path"]] = [[s["index"], s["crc32c"]] for s in leaf["shards"]]
  return out


@functools.lru_cache(maxsize=256)
def _writers(shape: tuple[int, ...], sharding: Any, primary: frozenset[int]) -> tuple:
  """((index, process), ...) of one leaf: each shard index of the global
  sharding and the lowest primary-slice process holding it (its recorder)."""
  from emergency_ckpt.core import shards as shards_lib  # noqa: PLC0415 - save side: JAX

  best: dict[Index, int] = {}
  for device, idx in sharding.devices_indices_map(shape).items():
    proc = device.process_index
    if proc not in primary:
      continue
    index = shards_lib.normalize_index(idx, shape)
    if index not in best or proc < best[index]:
      best[index] = proc
  return tuple(sorted(best.items()))


def shard_table(
  step: int, paths: Sequence[str], abstract: Sequence[Any], primary_processes: Iterable[int]
) -> dict:
  """The SHARDS document of a persistent step, from the global shardings.

  Pure (no collective): every process can compute it.

  Args:
    step: the persistent step.
    paths: the leaves' paths.
    abstract: the leaves (shape, dtype and global sharding), as `paths`.
    primary_processes: the processes of the primary slice (the recorders).

  Returns:
    Per leaf, its saved shard indices and the process that recorded each
    (shard_records.encode_table's document).
  """
  from emergency_ckpt.core import shards as shards_lib  # noqa: PLC0415 - save side: JAX

  primary = frozenset(int(p) for p in primary_processes)
  layouts: list[list] = []
  seen: dict[tuple, int] = {}
  leaves, arrays = {}, {}
  for path, leaf in zip(paths, abstract):
    writers = _writers(tuple(leaf.shape), leaf.sharding, primary)
    if writers not in seen:
      seen[writers] = len(layouts)
      layouts.append([[shard_records.index_json(i), p] for i, p in writers])
    leaves[path] = seen[writers]
    arrays[path] = [[int(d) for d in leaf.shape], shards_lib.dtype_name(leaf.dtype)]
  return shard_records.encode_table(step, leaves, layouts, arrays)


# ---- checking (read side) ---------------------------------------------------------


def check_shard(expected: Expected, path: str, shard: SavedShard, data: np.ndarray) -> None:
  """Checks a whole saved shard's bytes against its recorded CRC32C.

  Args:
    expected: the step's recorded checksums.
    path: the leaf's path.
    shard: the saved shard `data` holds.
    data: the shard's values (C-contiguous or not).

  Raises:
    CorruptCheckpointError: naming the leaf, if no CRC32C was recorded for
      the shard or `data` does not have it.
  """
  recorded = expected.recorded(path, shard)
  if recorded is None:
    raise CorruptCheckpointError(
      f"no CRC32C recorded for leaf {path} shard {list(shard.index)} of persistent step"
      f" {expected.step} (process {shard.process}'s state file); it cannot be verified."
    )
  actual = crc32c.crc32c(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
  if actual != recorded:
    raise CorruptCheckpointError(
      f"leaf {path} shard {list(shard.index)} of persistent step {expected.step} fails its"
      f" CRC32C (recorded {recorded:08x}, read {actual:08x}): the stored data is"
      " damaged. Restore skips this step for an older one."
    )
