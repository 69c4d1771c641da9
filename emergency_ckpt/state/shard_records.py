"""The shard-checksum records of a persistent step: their format, parsed and looked up.

Orbax's format checks no tensor data on read, so a persistent step carries
its own CRC32C per saved shard, in files of the state store that Orbax never
reads (the step stays in Orbax's standard format):

  state/<N>/process_<i>-of-<n>.json  key "shard_crc32c", on every process of
      the primary slice: the CRC32C of each unique shard it holds,
      {leaf path: [[index, crc], ...]}
  state/<N>/SHARDS                   written by the primary process: for each
      leaf, the saved shard indices and which process recorded each (the
      lowest process of the primary slice holding it), shared by the leaves
      of the same shape and sharding; with a CRC32 of itself

This module owns the encoding of both (no JAX, no CRC32C of tensor data),
so that the state store, which writes and reads them, sits below the
persistent tier. What is summed and checked is persistent/checksums.py's.

Called by: the state store (encode, parse, Expected), persistent/checksums.py
(the SHARDS document from the global shardings; checking data),
persistent/read.py and persistent/share.py (Expected's look-ups, overlap).
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from emergency_ckpt.errors import CorruptCheckpointError

FORMAT = 1
Index = tuple[tuple[int, int], ...]
"""A box of a global array: ((start, stop), ...) per dimension (shards.Index)."""


def _size(index: Index) -> int:
  return math.prod(hi - lo for lo, hi in index)


def index_json(index: Index) -> list[list[int]]:
  """An index box as JSON stores it.

  Args:
    index: ((start, stop), ...) per dimension.

  Returns:
    [[start, stop], ...] of Python ints.
  """
  return [[int(a), int(b)] for a, b in index]


def _index_of(raw: Any) -> Index:
  return tuple((int(a), int(b)) for a, b in raw)


def canonical(doc: Any) -> bytes:
  """The bytes a state file's CRC32 covers: `doc` as canonical JSON.

  Args:
    doc: a JSON value.

  Returns:
    Its JSON with sorted keys and no spaces, UTF-8 encoded.
  """
  return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def encode_table(
  step: int, leaves: Mapping[str, int], layouts: Sequence[list], arrays: Mapping[str, list]
) -> dict:
  """The SHARDS document of a persistent step, with the CRC32 of its body.

  Args:
    step: the persistent step.
    leaves: {leaf path: its layout's number in `layouts`}.
    layouts: per layout, [[index_json(index), recording process], ...].
    arrays: {leaf path: [global shape, dtype name]}.

  Returns:
    The document the state store writes as SHARDS.
  """
  body = {"format": FORMAT, "step": step, "leaves": leaves, "layouts": layouts, "arrays": arrays}
  return {**body, "crc32": zlib.crc32(canonical(body))}


@dataclasses.dataclass(frozen=True)
class SavedShard:
  """One saved shard of a leaf, as the SHARDS table records it."""

  index: Index
  """Its box of the global array."""
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
  """A SHARDS document, parsed and checked.

  Args:
    doc: the document as JSON decoded it.
    step: the step it must belong to.
    where: names the file in errors.

  Returns:
    The parsed table.

  Raises:
    CorruptCheckpointError: the document is torn, edited or not this step's.
  """
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
  """A process JSON's "shard_crc32c", parsed.

  Args:
    raw: the value of "shard_crc32c" ({leaf path: [[index, crc32c], ...]}).
    where: names the file in errors.

  Returns:
    {leaf path: {index: crc32c}}.

  Raises:
    CorruptCheckpointError: the value is not of that shape.
  """
  try:
    return {path: {_index_of(i): int(c) for i, c in items} for path, items in raw.items()}
  except (AttributeError, TypeError, ValueError) as e:
    raise CorruptCheckpointError(f"{where}: shard checksums unreadable ({e})") from None


def overlap(a: Index, b: Index) -> Index | None:
  """The intersection of two index boxes.

  Args:
    a: one box.
    b: the other, of as many dimensions.

  Returns:
    The common box, or None if it is empty.
  """
  box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
  return box if all(lo < hi for lo, hi in box) else None


class Expected:
  """The recorded CRC32C of a persistent step's shards, fetched as needed.

  Built by the state store (expected_crcs); checked against data by
  persistent/checksums.py (check_shard).

  Args:
    step: the persistent step.
    table: parse_table's result.
    fetch: {process: parse_crcs result} of the given processes' JSONs (read
      concurrently by the caller).
    where: names the step's state folder in errors.
  """

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
    """Every saved shard of a leaf (what an offline check reads).

    Args:
      path: the leaf's path.

    Returns:
      Its saved shards; empty if the table records none.
    """
    return tuple(self._table.shards.get(path, ()))

  def saved(self, path: str, index: Index) -> list[SavedShard]:
    """The saved shards of a leaf that overlap a box: together they cover it.

    Args:
      path: the leaf's path.
      index: the box to read.

    Returns:
      The saved shards overlapping `index`.

    Raises:
      CorruptCheckpointError: the table records no shards for the leaf, or
        its saved shards do not cover `index`.
    """
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
    """Reads, in one batch, the JSONs recording the given shards not read yet.

    Args:
      shards: saved shards whose recorded CRC32C will be asked for.
    """
    wanted = sorted({s.process for s in shards} - set(self._crcs))
    if wanted:
      self._crcs.update(self._fetch(wanted))

  def recorded(self, path: str, shard: SavedShard) -> int | None:
    """The CRC32C recorded for a saved shard (its recorder's JSON read if not yet).

    Args:
      path: the leaf's path.
      shard: one of its saved shards.

    Returns:
      The recorded CRC32C, or None if none was recorded.
    """
    self.prefetch([shard])
    return self._crcs.get(shard.process, {}).get(path, {}).get(shard.index)
