"""Offline check of a persistent step's tensor bytes against its shard
CRC32Cs (checksums.py), for `emergency-ckpt verify`. Tensorstore only: no
JAX or Orbax import (the step's _METADATA gives Orbax's storage options and
the array names). Reads every saved shard once; run it where reading the
whole step is affordable.

Called by: the CLI (any machine with access to the persistent root).
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath

from emergency_ckpt.core import layout
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.persistent import checked_reads, checksums
from emergency_ckpt.persistent import layout as persistent_layout

METADATA = "_METADATA"


def _names(meta: dict) -> dict[str, str]:
  """keystr path (as the SHARDS file names leaves) -> Orbax's array name."""
  out = {}
  for entry in meta.get("tree_metadata", {}).values():
    keys = entry.get("key_metadata", [])
    path = "".join(f"[{k['key']!r}]" if k.get("key_type") == 2 else f"[{k['key']}]" for k in keys)
    out[path] = ".".join(str(k["key"]) for k in keys)
  return out


def _spec(item: epath.Path, name: str, meta: dict) -> dict[str, Any]:
  base = str(item).rstrip("/") + "/"
  if "://" not in base:
    base = "file://" + base
  driver = "zarr3" if meta.get("use_zarr3") else "zarr"
  if meta.get("use_ocdbt", True):
    kvstore: Any = {"driver": "ocdbt", "base": base, "path": name + "/"}
  else:
    kvstore = base + name + "/"
  return {"driver": driver, "kvstore": kvstore, "recheck_cached_data": False}


def verify_step(root: epath.PathLike, step: int) -> list[str]:
  """Reads every saved shard of a committed persistent step and checks its CRC32C.

  Args:
    root: the persistent root (path or gs://).
    step: the step to check.

  Returns:
    The step's problems, one line each; empty if every saved shard matches
    its recorded CRC32C.
  """
  import tensorstore as ts  # noqa: PLC0415 - only the check needs it

  root = epath.Path(root)
  store = persistent_layout.reader_store(root)
  record = store.record(step)
  if record is None:
    return [f"step {step} has no valid COMMIT"]
  try:
    expected = store.expected_crcs(step, record["process_count"])
  except CorruptCheckpointError as e:
    return [str(e)]
  item = layout.tensor_step_dir(layout.tensors_dir(root), step) / layout.ORBAX_ITEM
  try:
    meta = json.loads((item / METADATA).read_text())
  except (OSError, ValueError) as e:
    return [f"{item / METADATA} is unreadable ({e})"]
  names = _names(meta)
  try:  # local files read through a memory map, as a restore reads them
    context = ts.Context(ts.Context.Spec(checked_reads.FILE_IO_MODE))
  except ValueError:  # an older tensorstore: no file_io_mode resource
    context = ts.Context()
  problems = []
  for path in expected.arrays:
    name = names.get(path)
    if name is None:
      problems.append(f"leaf {path} is recorded but absent from {item / METADATA}")
      continue
    try:
      array = ts.open(_spec(item, name, meta), read=True, context=context).result()
      for shard in expected.shards(path):
        box = tuple(slice(lo, hi) for lo, hi in shard.index)
        checksums.check_shard(expected, path, shard, array[box].read().result())
    except CorruptCheckpointError as e:
      problems.append(str(e))
    except ValueError as e:  # tensorstore: DATA_LOSS, NOT_FOUND, ...
      problems.append(f"leaf {path} ({item / name}) is unreadable: {e}")
  return problems
