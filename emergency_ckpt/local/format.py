"""The local tier's on-disk format: one step folder, checked without JAX.

A step folder holds `shards.bin` (this process's shards, raw, each at a
64-byte aligned offset) and `manifest.json`: the tree's leaves with shapes,
dtypes and, per shard, its global index, offset, size and CRC32C (computed
in hardware; zlib's CRC32, used before, was much slower and a large part of
a local save's time). The manifest starts with its head (every field but
the leaves) and carries a CRC32 over the canonical form of each part, so
discovery reads a step's head without parsing its leaves. Reads map
shards.bin privately (copy-on-write: nothing is copied, and writes through
the arrays never reach the file) and verify every shard they hand out. A
copy checked while it arrives: incoming.py.

Any process, or an offline tool, may call these functions.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import threading
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from emergency_ckpt.core import layout
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local.schema import check_manifest, check_manifest_head

if TYPE_CHECKING:  # shards imports JAX: offline tools (verify, gc) never need it
  from emergency_ckpt.core import shards as shards_lib

FORMAT = "emergency_ckpt.local/1"
SHARDS = layout.SHARDS_FILE
MANIFEST = layout.MANIFEST_FILE


def shard_checksum(data) -> dict:
  """The checksum record of one shard's bytes.

  Args:
    data: the bytes (any buffer).

  Returns:
    {"crc32c": its CRC32C}.
  """
  return {"crc32c": crc32c.crc32c(data)}


crc32c_of = crc32c.crc32c
"""The CRC32C of bytes (any buffer): what a shard record's "crc32c" holds."""


def checksum_ok(data, record: dict) -> bool:
  """Whether bytes match a shard record's checksum.

  Args:
    data: the bytes (any buffer).
    record: a manifest's shard record: its CRC32C, or the CRC32 of
      manifests written before 0.2.

  Returns:
    True if they match; False if they differ or the record has neither.
  """
  running = RunningChecksum(record)
  running.update(data)
  return running.ok()


class RunningChecksum:
  """A shard record's checksum (checksum_ok) summed over its bytes piece by
  piece, in order (a peer receiver sums each piece as it arrives)."""

  def __init__(self, record: dict):
    """Args:
    record: a manifest's shard record (checksum_ok).
    """
    if "crc32c" in record:
      self._fn, self._want = crc32c.crc32c, record["crc32c"]
    elif "crc32" in record:
      self._fn, self._want = zlib.crc32, record["crc32"]
    else:
      self._fn, self._want = None, None
    self._value = 0

  def update(self, piece) -> None:
    """Adds the next piece of the bytes (any buffer)."""
    if self._fn is not None:
      self._value = self._fn(piece, self._value)

  def ok(self) -> bool:
    """Whether the bytes so far match the record (False: no checksum in it)."""
    return self._fn is not None and self._value == self._want


def _canonical(body: dict) -> bytes:
  return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(body: dict) -> bytes:
  """The manifest file's bytes for a body: its head (every field but the
  leaves) first, then the body, each with the CRC32 of its canonical form.

  Both parts are written in canonical form, so a reader checks each CRC32
  over the file's own bytes instead of encoding a decoded part again, and
  discovery reads a step's head (decode_manifest(leaves=False)) without
  parsing thousands of leaf records. The document's "body" and "crc32" are
  what manifests held before heads were added (older readers read it).

  Args:
    body: the manifest body (manifest_body).

  Returns:
    The file's bytes.
  """
  head = _canonical(_head_of(body)) if isinstance(body, dict) else b"null"
  canonical = _canonical(body)
  return b'%s%s, "head_crc32": %d, "body": %s, "crc32": %d}' % (
    _WITH_HEAD,
    head,
    zlib.crc32(head),
    canonical,
    zlib.crc32(canonical),
  )


def _head_of(body: dict) -> dict:
  return {k: v for k, v in body.items() if k != "leaves"}


_WITH_HEAD = b'{"head": '
_HEAD = b'{"body": '  # a manifest without a head (written by earlier versions)
_MID = re.compile(rb', "head_crc32": (\d{1,10}), "body": ')
_TAIL = re.compile(rb', "crc32": (\d{1,10})\}\Z')


def _parts(raw: bytes) -> tuple[bytes | None, bytes] | None:
  """(the head's bytes or None, the body's bytes) of encode_manifest's
  layouts, each matching its recorded CRC32 (then each is the canonical
  form its CRC32 was taken of); None: not those layouts, or a CRC32 that
  does not match (the caller decodes and checks the whole document).
  In canonical JSON no ', "' occurs (strings escape their quotes), so the
  first separator after the head ends it."""
  tail = _TAIL.search(raw, max(0, len(raw) - 24))
  if tail is None:
    return None
  if raw.startswith(_WITH_HEAD):
    mid = _MID.search(raw, len(_WITH_HEAD), tail.start())
    if mid is None:
      return None
    head, body = raw[len(_WITH_HEAD) : mid.start()], raw[mid.end() : tail.start()]
    if zlib.crc32(head) != int(mid[1]):
      return None
  elif raw.startswith(_HEAD):
    head, body = None, raw[len(_HEAD) : tail.start()]
  else:
    return None
  return (head, body) if zlib.crc32(body) == int(tail[1]) else None


def decode_manifest(
  raw: bytes, where: str, *, leaves: bool = True, check_leaves: bool = True
) -> dict:
  """The body of a manifest file's bytes, checked.

  Args:
    raw: the file's bytes.
    where: names it in errors.
    leaves: False: the head only (every field but "leaves", which it
      lacks), its checks made and both parts' checksums too, the leaves
      not parsed: what discovery needs of each kept step. A reader of the
      step's tensors decodes it again whole (that decode checks the head
      against the body). A manifest written without a head is parsed
      whole, and its body handed on to the next whole decode of the same
      bytes (the step's read), which then parses nothing.
    check_leaves: False (with leaves): every check but the per-leaf ones
      (schema.check_manifest's): the caller checks each leaf record it
      reads as strictly (read.read_step's, which checks every leaf while
      it reads the step, and calls check_manifest where one is not the
      common case).

  Returns:
    The body (leaves=False: its head).

  Raises:
    CorruptCheckpointError: it is torn, altered or of an unknown format.
  """
  raw = bytes(raw)
  if not leaves:
    head = _light_head(raw, where)
    if head is not None:
      return head
  with _CHECKED_LOCK:
    known = raw in _CHECKED
    body = _PARKED.pop(raw, None) if leaves else None
    if leaves:
      _PARKED.clear()  # a read came: discovery's other bodies are not wanted
  if known:  # these very bytes passed every check below: decode only
    body = body if body is not None else json.loads(raw)["body"]
    return body if leaves else _head_of(body)
  if body is None:
    body = _decode(raw, where)
  if not leaves or not check_leaves:  # not remembered: only these bytes' full check is
    check_manifest_head(body, where)
    if leaves:
      return body
    if len(raw) <= _PARKED_MAX_BYTES:
      _remember(_PARKED, raw, body, _PARKED_KEEP)
    return _head_of(body)
  check_manifest(body, where)
  if len(raw) <= _CHECKED_MAX_BYTES:
    _remember(_CHECKED, raw, None, _CHECKED_KEEP)
  return body


def _light_head(raw: bytes, where: str) -> dict | None:
  """The head of a manifest with one, checked (both parts' CRC32s, the
  head's fields); None: written without a head, or not encode_manifest's
  layout (the caller decodes the whole document)."""
  parts = _parts(raw)
  if parts is None or parts[0] is None:
    return None
  try:
    head = json.loads(parts[0])
  except (ValueError, RecursionError) as e:
    raise CorruptCheckpointError(f"{where}: unreadable manifest head ({e})") from None
  if not isinstance(head, dict) or head.get("format") != FORMAT or "leaves" in head:
    what = head.get("format") if isinstance(head, dict) else type(head).__name__
    raise CorruptCheckpointError(f"{where}: unknown format {what!r} in the manifest's head")
  check_manifest_head({**head, "leaves": []}, where)
  return head


def _remember(cache: dict, raw: bytes, value, keep: int) -> None:
  """cache[raw] = value, the oldest entries dropped beyond `keep`."""
  with _CHECKED_LOCK:
    cache[raw] = value
    while len(cache) > keep:
      del cache[next(iter(cache))]


def _decode(raw: bytes, where: str) -> dict:
  """A manifest's body, its checksum, head and format checked (not its
  fields)."""
  parts = _parts(raw)
  try:
    doc = json.loads(raw)
    body = doc["body"]
    crc = doc["crc32"]
    ok = parts is not None or zlib.crc32(_canonical(body)) == crc
  except (ValueError, KeyError, TypeError, RecursionError) as e:
    raise CorruptCheckpointError(f"{where}: unreadable manifest ({e})") from None
  if not ok:
    raise CorruptCheckpointError(f"{where}: manifest checksum mismatch")
  if not isinstance(body, dict) or body.get("format") != FORMAT:
    what = body.get("format") if isinstance(body, dict) else type(body).__name__
    raise CorruptCheckpointError(f"{where}: unknown format {what!r}")
  if "head" in doc or raw.startswith(_WITH_HEAD):
    # What a light decode of these bytes returns must be this body's head.
    head = _head_of(body)
    try:
      light = json.loads(parts[0]) if parts is not None and parts[0] is not None else None
    except (ValueError, RecursionError):
      light = None
    if doc.get("head") != head or light != head:
      raise CorruptCheckpointError(f"{where}: the manifest's head differs from its body")
  return body


# The bodies of the last light decodes (discovery's), by their bytes, for
# the next whole decode of the same bytes: a restore reads the newest step's
# manifest in discovery, then again in the read, and a manifest of
# thousands of leaves takes milliseconds per parse. A whole decode takes
# its body and drops the rest, so at most _PARKED_KEEP bodies outlive a
# restore, and only where discovery ran without a read.
_PARKED: dict[bytes, dict] = {}
_PARKED_KEEP = 2
_PARKED_MAX_BYTES = 2 << 20

# The last manifests that passed decode_manifest's checks, as bytes: the
# restore reads a step's manifest more than once (discovery, then the read),
# and a manifest of thousands of leaves costs tens of ms to check. Keyed by
# the whole file, so a changed byte is checked afresh; each caller gets a
# body of its own (freshly decoded, or parked for it by a light decode).
_CHECKED: dict[bytes, None] = {}
_CHECKED_KEEP = 8
_CHECKED_MAX_BYTES = 16 << 20
_CHECKED_LOCK = threading.Lock()


def read_manifest(step_dir: str, *, leaves: bool = True, check_leaves: bool = True) -> dict:
  """decode_manifest of a step folder's manifest.

  Args:
    step_dir: the step's folder.
    leaves, check_leaves: as decode_manifest's.

  Returns:
    The body.

  Raises:
    OSError: it is absent.
    CorruptCheckpointError: it is torn, altered or of an unknown format.
  """
  path = os.path.join(step_dir, MANIFEST)
  with open(path, "rb") as f:
    return decode_manifest(f.read(), path, leaves=leaves, check_leaves=check_leaves)


def raw_manifest(step_dir: str) -> bytes:
  """The manifest file of a step folder, as written (not decoded).

  Called by: the save pipeline, sending a step's manifest to its partner or
  XOR group (who store the bytes as they are).

  Args:
    step_dir: the step's folder.

  Returns:
    The manifest's bytes.

  Raises:
    OSError: it is absent or unreadable.
  """
  with open(os.path.join(step_dir, MANIFEST), "rb") as f:
    return f.read()


def manifest_body(
  layout: shards_lib.Layout, crcs: Sequence[Sequence[int]], *, step: int, **identity: Any
) -> dict:
  """The manifest body of a step written from a layout.

  Args:
    layout: the step's shard layout.
    crcs: per leaf, each slot's CRC32C.
    step: the step.
    **identity: run_id, process_index, slice_index, topology.

  Returns:
    The body (encode_manifest writes it).
  """
  from emergency_ckpt.core import shards as shards_lib  # noqa: PLC0415

  leaves = []
  for leaf, leaf_crcs in zip(layout.leaves, crcs):  # keys in canonical (sorted) order
    leaves.append(
      {
        "dtype": shards_lib.dtype_name(leaf.dtype),
        "path": leaf.path,
        "shape": list(leaf.shape),
        "shards": [
          {
            "crc32c": crc,
            "index": [list(r) for r in slot.index],
            "nbytes": slot.nbytes,
            "offset": slot.offset,
          }
          for slot, crc in zip(leaf.slots, leaf_crcs)
        ],
        **({} if leaf.spec is None else {"spec": leaf.spec}),
      }
    )
  body = {
    "format": FORMAT,
    "step": step,
    **identity,
    "nbytes": layout.nbytes,
    "saved_at": time.time(),
    "leaves": leaves,
  }
  return {k: body[k] for k in sorted(body)}


@dataclasses.dataclass(frozen=True)
class LocalStep:
  """A verified local step: views into one host buffer, per leaf and index."""

  step: int
  manifest: dict
  arrays: list[dict[tuple, np.ndarray]]
  """Per leaf, {global shard index: the shard as an array}."""


def map_file(path: str, nbytes: int, where: str) -> np.ndarray:
  """A file's bytes as a uint8 array backed by a private (copy-on-write)
  mapping: nothing is copied, and writes through the array never reach the
  file.

  Args:
    path: the file.
    nbytes: its expected size.
    where: names it in errors.

  Returns:
    The array.

  Raises:
    OSError: it is absent.
    CorruptCheckpointError: its size is not `nbytes`.
  """
  with open(path, "rb") as f:
    return map_open(f, nbytes, where)


def map_open(f, nbytes: int, where: str) -> np.ndarray:
  """map_file for an open file.

  Args:
    f: the open file.
    nbytes: its expected size.
    where: names it in errors.

  Returns:
    The array.

  Raises:
    CorruptCheckpointError: its size is not `nbytes`.
  """
  size = os.fstat(f.fileno()).st_size
  if size != nbytes:
    raise CorruptCheckpointError(
      f"{where}/{SHARDS} has the wrong size ({size} bytes, manifest says {nbytes})"
    )
  if nbytes == 0:
    return np.empty(0, dtype=np.uint8)
  # No MAP_POPULATE: on a writable private mapping it would copy every page.
  mapped = mmap.mmap(
    f.fileno(), nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
  )
  return np.frombuffer(mapped, dtype=np.uint8)


def verify_step_dir(path: str) -> tuple[dict | None, list[str]]:
  """Checks one local step folder's manifest and every shard's checksum,
  without JAX (offline tools).

  Args:
    path: the step's folder.

  Returns:
    (manifest body, or None if unreadable; the problems found).
  """
  try:
    body = read_manifest(path)
  except (OSError, CorruptCheckpointError) as e:
    return None, [str(e)]
  try:
    buf = map_file(os.path.join(path, SHARDS), body["nbytes"], path)
  except OSError as e:
    return body, [f"{path}/{SHARDS}: {e}"]
  except CorruptCheckpointError as e:
    return body, [str(e)]
  problems = []
  for leaf in body["leaves"]:
    for s in leaf["shards"]:
      if not checksum_ok(buf[s["offset"] : s["offset"] + s["nbytes"]], s):
        problems.append(f"{path}: leaf {leaf['path']} shard {s['index']} fails its checksum")
  return body, problems
