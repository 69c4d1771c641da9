"""The state store's file formats: a process's JSON and the COMMIT record.

A process's file holds its data state and, at a persistent step on the
primary slice, the CRC32C of its shards (shard_records.py); each payload
carries the CRC32 of its canonical JSON, so a torn or edited file is found
where it is read instead of loaded. The COMMIT record lists the files and
carries the step's metrics and info; it is valid iff its format, its step,
a process count >= 1 and the types of the fields readers use check out
(anything else reads as uncommitted). Nothing read is trusted: a field of
the wrong type is damage (CorruptCheckpointError), never an AttributeError.

Pure encoding and decoding, no I/O. Called by: store.py.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from emergency_ckpt.core import layout
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local import schema
from emergency_ckpt.state.shard_records import canonical

FORMAT = "emergency_ckpt.state/1"


def encode_process_file(
  step: int,
  process_index: int,
  process_count: int,
  data_state: Any,
  shard_crc32c: dict | None,
) -> bytes:
  """A process's file for a step.

  Args:
    step: the step saved.
    process_index: the process writing it.
    process_count: the job's process count.
    data_state: the encoded data state.
    shard_crc32c: the CRC32C of the process's shards, or None.

  Returns:
    The file's bytes.
  """
  doc = {
    "format": FORMAT,
    "step": step,
    "process_index": process_index,
    "process_count": process_count,
    "data_state": data_state,
    "crc32": zlib.crc32(canonical(data_state)),
  }
  if shard_crc32c is not None:
    doc["shard_crc32c"] = shard_crc32c
    doc["shard_crc32c_crc32"] = zlib.crc32(canonical(shard_crc32c))
  return json.dumps(doc).encode()


def decode_verified(raw: bytes, step: int, key: str, crc_key: str, where: Any) -> Any:
  """One payload of a process's file, checked against its CRC32.

  Args:
    raw: the file's bytes.
    step: the step the file must belong to.
    key: the payload's key ("data_state" or "shard_crc32c").
    crc_key: the key of its CRC32.
    where: names the file in errors.

  Returns:
    The payload.

  Raises:
    CorruptCheckpointError: the file is unreadable, torn, edited, of
      another format or another step's.
  """
  try:
    doc = json.loads(raw)
    value = doc[key]
    ok = (
      doc.get("format") == FORMAT
      and doc.get("step") == step
      and zlib.crc32(canonical(value)) == doc.get(crc_key)
    )
  except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
    raise CorruptCheckpointError(f"{where} is unreadable ({type(e).__name__}: {e})") from None
  if not ok:
    raise CorruptCheckpointError(f"{where} fails its checksum (torn or edited)")
  for name in ("process_index", "process_count"):
    if schema.field(doc, name, int, str(where), 0) < 0:
      raise CorruptCheckpointError(f"{where}: {name} is negative")
  if key == "shard_crc32c":
    schema.field(doc, key, dict, str(where))
  return value


def encode_commit(
  step: int, process_count: int, *, committed_at: float, metrics: dict, info: dict
) -> bytes:
  """The COMMIT record of a step whose every process's file exists.

  Args:
    step: the step committed.
    process_count: how many processes saved it (names the files).
    committed_at: the wall time of the commit.
    metrics: the step's metrics.
    info: the step's topology, bytes and save time.

  Returns:
    The record's bytes.
  """
  marker = {
    "format": FORMAT,
    "step": step,
    "process_count": process_count,
    "files": [layout.state_file_name(p, process_count) for p in range(process_count)],
    "committed_at": committed_at,
    "metrics": metrics,
    "info": info,
  }
  return json.dumps(marker).encode()


def decode_commit(raw: bytes, step: int) -> dict | None:
  """A COMMIT record, if valid.

  Args:
    raw: the record's bytes.
    step: the step it must belong to.

  Returns:
    The record, or None if it is unreadable or invalid.
  """
  try:
    doc = json.loads(raw)
  except (ValueError, RecursionError):
    return None
  if not isinstance(doc, dict):
    return None
  count = doc.get("process_count")
  valid = (
    doc.get("format") == FORMAT
    and doc.get("step") == step
    and schema.is_a(count, int)
    and count >= 1
  )
  return doc if valid and _commit_shape_ok(doc) else None


def _commit_shape_ok(doc: dict) -> bool:
  """Whether a COMMIT's fields a reader uses have their types: files (names),
  committed_at, metrics and info (objects), info's topology (an object) and
  saved_at (a number). A record that fails reads as uncommitted."""
  try:
    files = schema.field(doc, "files", list, "COMMIT", [])
    schema.field(doc, "committed_at", float, "COMMIT", None)
    schema.field(doc, "metrics", dict, "COMMIT", None)
    info = schema.field(doc, "info", dict, "COMMIT", None) or {}
    topology = schema.field(info, "topology", dict, "COMMIT", None) or {}
    schema.field(info, "saved_at", float, "COMMIT", None)
    schema.check_topology(topology, "COMMIT")
  except CorruptCheckpointError:
    return False
  return all(isinstance(f, str) for f in files)
