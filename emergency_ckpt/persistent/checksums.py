"""CRC32C per saved shard of a persistent step: recorded at save, checked on read.

Orbax's format checks no tensor data on read (its zarr3 index carries a
CRC32C, the chunks do not; zarr2 has none): flipped bytes in a data file come
back as wrong values. So a persistent step carries its own checksums, in
files Orbax never reads (the step stays in Orbax's standard format):

  state/<N>/process_<i>-of-<n>.json  key "shard_crc32c", on every process of
      the primary slice: the CRC32C of each unique shard it holds (from its
      local write's manifest, else summed from its staged snapshot),
      {leaf path: [[index, crc], ...]}
  state/<N>/SHARDS                   written by the primary process: for each
      leaf, the saved shard indices and which process recorded each (the
      lowest process of the primary slice holding it), shared by the leaves
      of the same shape and sharding

Both are written before the step's COMMIT, so a committed step has them; no
extra object per process (the JSON is written anyway) and one by the primary.

A reader (persistent_read) needs the SHARDS file and the JSON of the
processes that recorded the shards it reads: on an unchanged topology, one
process of the primary slice (itself, on the primary slice). Each region it
needs is read as the saved shards that overlap it, whole, so every byte read
is checked against its CRC32C whatever the new sharding is; a region equal to
a saved shard (the common case) is checked in place, with no extra copy.

Called by: saving.py (record), persistent_read.py (check), the CLI (verify).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import crc32c
import numpy as np

from emergency_ckpt.errors import CorruptCheckpointError

FORMAT = 1
Index = tuple[tuple[int, int], ...]
"""A box of a global array: ((start, stop), ...) per dimension (shards.Index)."""
# No JAX import here: the state store and the CLI's offline check use this
# module; only the save side (shard_table) needs JAX, and imports it there.


def _size(index: Index) -> int:
  return math.prod(hi - lo for lo, hi in index)


def _index_json(index: Index) -> list[list[int]]:
  return [[int(a), int(b)] for a, b in index]


def _index_of(raw: Any) -> Index:
  return tuple((int(a), int(b)) for a, b in raw)


def canonical(doc: Any) -> bytes:
  return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


# ---- recording (save side) --------------------------------------------------------


def snapshot_crcs(layout: Any, buffer: np.ndarray) -> dict[str, list]:
  """{leaf path: [[index, crc32c], ...]} of every unique shard in a staged
  snapshot (this process's). Releases the GIL while it sums."""
  out = {}
  for leaf in layout.leaves:
    out[leaf.path] = [
      [_index_json(slot.index), crc32c.crc32c(buffer[slot.offset : slot.offset + slot.nbytes])]
      for slot in leaf.slots
    ]
  return out


def manifest_crcs(body: dict) -> dict[str, list] | None:
  """snapshot_crcs' result from a local step's manifest (the local write
  summed the same bytes of the same snapshot), or None if a shard lacks a
  CRC32C."""
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
  """The SHARDS document of a persistent step: per leaf, its saved shard
  indices and the process that recorded each. Pure (no collective): every
  process can compute it from the global shardings."""
  from emergency_ckpt.core import shards as shards_lib  # noqa: PLC0415 - save side: JAX

  primary = frozenset(int(p) for p in primary_processes)
  layouts: list[list] = []
  seen: dict[tuple, int] = {}
  leaves, arrays = {}, {}
  for path, leaf in zip(paths, abstract):
    writers = _writers(tuple(leaf.shape), leaf.sharding, primary)
    if writers not in seen:
      seen[writers] = len(layouts)
      layouts.append([[_index_json(i), p] for i, p in writers])
    leaves[path] = seen[writers]
    arrays[path] = [[int(d) for d in leaf.shape], shards_lib.dtype_name(leaf.dtype)]
  body = {"format": FORMAT, "step": step, "leaves": leaves, "layouts": layouts, "arrays": arrays}
  return {**body, "crc32": zlib.crc32(canonical(body))}


# ---- checking (read side) ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SavedShard:
  index: Index
  process: int
  """The process whose JSON holds this shard's CRC32C."""


@dataclasses.dataclass(frozen=True)
class Table:
  """A parsed SHARDS document."""

  shards: dict[str, tuple[SavedShard, ...]]
  """leaf path -> its saved shards."""
  arrays: dict[str, tuple[tuple[int, ...], str]]
  """leaf path -> (global shape, dtype name) as saved."""


def parse_table(doc: Any, step: int, where: Any) -> Table:
  """A SHARDS document, parsed; CorruptCheckpointError if it is torn,
  edited or not this step's."""
  try:
    body = {k: doc[k] for k in ("format", "step", "leaves", "layouts", "arrays")}
    ok = zlib.crc32(canonical(body)) == doc["crc32"] and body["step"] == step
    layouts = [tuple(SavedShard(_index_of(i), int(p)) for i, p in lay) for lay in body["layouts"]]
    table = Table(
      {path: layouts[n] for path, n in body["leaves"].items()},
      {
        path: (tuple(int(d) for d in shape), str(dt))
        for path, (shape, dt) in body["arrays"].items()
      },
    )
  except (KeyError, TypeError, ValueError, IndexError) as e:
    raise CorruptCheckpointError(f"{where} is unreadable ({type(e).__name__}: {e})") from None
  if not ok:
    raise CorruptCheckpointError(f"{where} fails its checksum (torn or edited)")
  return table


def parse_crcs(raw: Any, where: Any) -> dict[str, dict[Index, int]]:
  """{leaf path: {index: crc32c}} from a process JSON's "shard_crc32c"."""
  try:
    return {path: {_index_of(i): int(c) for i, c in items} for path, items in raw.items()}
  except (AttributeError, TypeError, ValueError) as e:
    raise CorruptCheckpointError(f"{where}: shard checksums unreadable ({e})") from None


def overlap(a: Index, b: Index) -> Index | None:
  """The intersection of two index boxes, or None if empty."""
  box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
  return box if all(lo < hi for lo, hi in box) else None


class Expected:
  """The recorded CRC32C of a persistent step's shards, fetched as needed.

  `table`: parse_table's result. `fetch(processes)`: {process: parse_crcs
  result} of those processes' JSONs (read concurrently by the caller)."""

  def __init__(
    self,
    step: int,
    table: Table,
    fetch: Callable[[list[int]], Mapping[int, Mapping[str, Mapping[Index, int]]]],
    where: str,
  ):
    self.step = step
    self._table = table
    self._fetch = fetch
    self._where = where
    self._crcs: dict[int, Mapping[str, Mapping[Index, int]]] = {}

  @property
  def arrays(self) -> dict[str, tuple[tuple[int, ...], str]]:
    """leaf path -> (shape, dtype name) as saved (checksummed: authoritative)."""
    return self._table.arrays

  def shards(self, path: str) -> tuple[SavedShard, ...]:
    """Every saved shard of leaf `path` (what an offline check reads)."""
    return tuple(self._table.shards.get(path, ()))

  def saved(self, path: str, index: Index) -> list[SavedShard]:
    """The saved shards of leaf `path` that overlap `index`: they cover it."""
    shards = self._table.shards.get(path)
    if shards is None:
      raise CorruptCheckpointError(
        f"persistent step {self.step} records no shard checksums for leaf {path}"
        f" ({self._where}); it cannot be verified. Restore another step."
      )
    out = [s for s in shards if overlap(s.index, index) is not None]
    covered = sum(_size(overlap(s.index, index)) for s in out)
    if covered != _size(index):
      raise CorruptCheckpointError(
        f"the saved shards of leaf {path} in persistent step {self.step} do not cover"
        f" {index} ({self._where}); the step's records are damaged."
      )
    return out

  def prefetch(self, shards: Iterable[SavedShard]) -> None:
    """Reads, in one batch, the JSONs recording `shards` not read yet."""
    wanted = sorted({s.process for s in shards} - set(self._crcs))
    if wanted:
      self._crcs.update(self._fetch(wanted))

  def recorded(self, path: str, shard: SavedShard) -> int | None:
    """The CRC32C recorded for a saved shard (fetching its recorder's JSON
    if not read yet), or None if none was recorded."""
    self.prefetch([shard])
    return self._crcs.get(shard.process, {}).get(path, {}).get(shard.index)

  def check(self, path: str, shard: SavedShard, data: np.ndarray) -> None:
    """CorruptCheckpointError naming the leaf unless `data` (the whole saved
    shard, C-contiguous) has the recorded CRC32C."""
    recorded = self.recorded(path, shard)
    if recorded is None:
      raise CorruptCheckpointError(
        f"no CRC32C recorded for leaf {path} shard {list(shard.index)} of persistent step"
        f" {self.step} (process {shard.process}'s state file); it cannot be verified."
      )
    actual = crc32c.crc32c(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    if actual != recorded:
      raise CorruptCheckpointError(
        f"leaf {path} shard {list(shard.index)} of persistent step {self.step} fails its"
        f" CRC32C (recorded {recorded:08x}, read {actual:08x}): the stored data is"
        " damaged. Restore skips this step for an older one."
      )
