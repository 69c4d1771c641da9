"""Checking a copy of a local step while its bytes arrive, in file order.

A receiver that writes another process's step (redundancy/partner.py) sums
every shard's CRC32C over the bytes as they come, while they are still in
cache, then checks the sums against the manifest that follows the bytes:
no second pass over the file. The shards' spans are known before the
manifest (the sender's header), so the sums can start at once.

Called by: redundancy/partner.py (its Receiver). No JAX.
"""

from __future__ import annotations

import crc32c

from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local.format import SHARDS


class StreamChecksums:
  """Every shard's CRC32C of a step's shards.bin, summed over its bytes as
  they arrive in file order: a receiver checks a copy while the bytes are
  still in cache, instead of reading the file again. `spans`: the shards'
  [(offset, nbytes)] (spans_of a manifest, or of a staged layout when the
  manifest comes after the bytes). update() the bytes at [pos, pos +
  len(data)), in order; check(body) raises CorruptCheckpointError naming
  the first shard of the manifest `body` that does not match."""

  def __init__(self, spans, where: str):
    self._where = where
    self._spans = sorted((int(o), int(n)) for o, n in spans)
    self._crcs = [0] * len(self._spans)
    self._next = 0  # the first span not yet summed whole

  @staticmethod
  def spans_of(body: dict) -> list[tuple[int, int]]:
    """The (offset, nbytes) of every shard a manifest lists.

    Args:
      body: a manifest body.

    Returns:
      The spans, in manifest order.
    """
    return [(int(s["offset"]), int(s["nbytes"])) for leaf in body["leaves"] for s in leaf["shards"]]

  def update(self, pos: int, data) -> None:
    """Sums the bytes that arrived at [pos, pos + len(data)), in file order.

    Args:
      pos: their offset in shards.bin.
      data: the bytes (any buffer).
    """
    end, i = pos + len(data), self._next
    while i < len(self._spans):
      off, n = self._spans[i]
      if off >= end:
        break
      lo, hi = max(off, pos), min(off + n, end)
      if hi > lo:
        self._crcs[i] = crc32c.crc32c(data[lo - pos : hi - pos], self._crcs[i])
      if off + n > end:
        break
      i += 1
    self._next = i

  def check(self, body: dict) -> None:
    """Checks every shard of a manifest against what arrived.

    Args:
      body: the manifest body that came after the bytes.

    Raises:
      CorruptCheckpointError: naming the first shard that does not match,
        or the manifest's shards are not the spans summed.
    """
    shards = sorted(
      ((int(s["offset"]), int(s["nbytes"]), leaf["path"], s)
       for leaf in body["leaves"] for s in leaf["shards"]),
      key=lambda t: t[0],
    )  # fmt: skip
    if [(o, n) for o, n, _, _ in shards] != self._spans:
      raise CorruptCheckpointError(
        f"{self._where}/{SHARDS}: the manifest's shards are not the bytes that arrived"
      )
    for (_, _, path, s), crc in zip(shards, self._crcs):
      if "crc32c" not in s or s["crc32c"] != crc:
        raise CorruptCheckpointError(
          f"{self._where}/{SHARDS}: leaf {path} shard {s['index']} fails its checksum on arrival"
        )
