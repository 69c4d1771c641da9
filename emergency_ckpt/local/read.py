"""Reading one process's local step folder: map, verify, hand out arrays.

Shared by the local tier's restore path (which must not wait for Orbax to
load: a restart's time to restored state is on the job's critical path) and
the Orbax handler (handler.LocalShardsHandler.restore, for plain Orbax
users), and the XOR rebuild (verify_buffer). No Orbax here.

A read for a caller's tree checks the manifest's leaf records in the pass
that reads them (_read_common: a state of thousands of leaves pays one loop
of a few lookups per leaf); a record that is not the common case sends the
read the long way (schema.check_manifest, the tree, the layout, then each
shard), which names what is wrong. Both ways refuse the same records
(tests/test_one_pass_read.py).

Called by: any thread; blocks on one checksum pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from emergency_ckpt.core import compat
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CorruptCheckpointError, TopologyMismatchError
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import schema as local_schema
from emergency_ckpt.local.format import LocalStep


def read_step(
  where: str,
  *,
  abstract: Any = None,
  paths: Sequence[str] | None = None,
  on_map: Callable[[os.stat_result], None] | None = None,
  verify: bool = True,
) -> LocalStep:
  """A step's shards as arrays over a private mapping of `shards.bin`
  (nothing copied), each checked against its CRC32C.

  Args:
    where: the step's folder.
    abstract: the shards wanted: abstract arrays with shardings, a pytree
      (or with `paths` the flat list); None: every saved shard.
    paths: the keystr paths of a flat `abstract`.
    on_map: gets the file's stat before it is mapped.
    verify: False (every saved shard only): nothing checked yet, the
      caller checks each shard it uses against its manifest record (the
      restore's reshard transfer: a partner's copy, checked once, by
      whoever receives it).

  Returns:
    The step: per leaf, {index: shard array}.

  Raises:
    OSError: files absent.
    CorruptCheckpointError: bad bytes.
    TopologyMismatchError: a needed shard absent.
    StateMismatchError: tree, shape or dtype differ.
  """
  body = local_format.read_manifest(where, check_leaves=abstract is None)
  if abstract is None:
    buf = _map(where, body, on_map)
    return LocalStep(body["step"], body, verify_buffer(body, buf, where, check=verify))
  if paths is None:
    paths, abstract, _ = shards_lib.leaf_paths(abstract)
  buf = _map(where, body, on_map)
  arrays = _read_common(body, buf, paths, abstract, where)
  if arrays is None:  # not the common case: each check apart, naming what is wrong
    local_schema.check_manifest(body, where)
    compat.check_tree([leaf["path"] for leaf in body["leaves"]], paths, where)
    arrays = _verified_shards(body, buf, shards_lib.layout_for(paths, abstract), where)
  return LocalStep(body["step"], body, arrays)


def _map(where: str, body: dict, on_map) -> Any:
  with open(os.path.join(where, local_format.SHARDS), "rb") as f:
    if on_map is not None:
      on_map(os.fstat(f.fileno()))
    return local_format.map_open(f, body["nbytes"], where)


def verify_buffer(
  body: dict, buf: Any, where: str, *, check: bool = True
) -> list[dict[tuple, Any]]:
  """Every shard of a step's bytes as arrays, each verified.

  Args:
    body: the step's manifest body.
    buf: its shards.bin bytes.
    where: names the step in errors.
    check: False: sizes only.

  Returns:
    Per saved leaf of `body`, {index: shard array}.

  Raises:
    CorruptCheckpointError: a shard is short or fails its checksum.
  """
  out = []
  for leaf in body["leaves"]:
    dtype = shards_lib.dtype_from_name(leaf["dtype"])
    arrays = {}
    for s in leaf["shards"]:
      index = tuple(tuple(r) for r in s["index"])
      data = buf[s["offset"] : s["offset"] + s["nbytes"]]
      if len(data) != s["nbytes"] or (check and not local_format.checksum_ok(data, s)):
        raise _checksum_failed(where, leaf["path"], index)
      arrays[index] = data.view(dtype).reshape(shards_lib.shard_shape(index))
    out.append(arrays)
  return out


def _read_common(
  body: dict, buf: np.ndarray, paths: Sequence[str], abstract: Sequence[Any], where: str
) -> list[dict[shards_lib.Index, np.ndarray]] | None:
  """_verified_shards of a manifest whose leaves are not checked yet, in one
  pass: each leaf record checked as strictly as schema.check_manifest
  checks it, and found to be the caller's leaf (path, shape, dtype: equal
  to what the caller's leaf makes them), its shards verified and handed
  out. A state of thousands of leaves then pays one loop of a few dict
  lookups per leaf, instead of one per check.

  Returns:
    As _verified_shards; None where a record is not that common case (a
    malformed field, a mismatched leaf, a shard the caller's sharding does
    not hold, a checksum of manifests before 0.2): the caller then checks
    and reads the step the long way, which names what is wrong.

  Raises:
    CorruptCheckpointError: a shard of a well-formed record fails its
      checksum.
  """
  records = body["leaves"]  # a list: the head check saw to it
  if len(records) != len(paths) or len(set(paths)) != len(paths):
    return None
  total = body["nbytes"]
  crc = local_format.crc32c_of
  raw = memoryview(buf)  # its slices cost less than an array's
  shard_ok = local_schema.shard_ok
  out = []
  key = plan = itemsize = None
  for rec, path, leaf in zip(records, paths, abstract):
    try:
      k = (leaf.sharding, leaf.shape, leaf.dtype)
      if k != key:  # a state's leaves come in runs of one kind: few lookups
        key, plan = k, shards_lib.read_plan(*k)
        itemsize = local_schema.dtype_size(plan.dtype_name)
    except (AttributeError, TypeError):  # not an abstract array with a sharding
      return None
    if itemsize is None:
      return None
    if (
      type(rec) is not dict
      or rec.get("path") != path
      or rec.get("dtype") != plan.dtype_name
      or rec.get("shape") != plan.shape_json
    ):
      return None
    shape = rec["shape"]
    for d in shape:  # equal to the plan's ints; a JSON true would compare equal to 1
      if type(d) is not int:
        return None
    if "spec" in rec and not local_schema.spec_ok(rec["spec"], len(shape)):
      return None
    records_of = rec.get("shards")
    if type(records_of) is not list:
      return None
    for s in records_of:
      if not shard_ok(s, shape, itemsize, total):
        return None
    arrays = {}
    for index, index_json, nbytes, shard_shape in plan.slots:
      if len(records_of) == 1 and records_of[0]["index"] == index_json:
        s = records_of[0]
      else:
        s = next((r for r in records_of if r["index"] == index_json), None)
        if s is None:
          return None
      offset = s["offset"]
      if s["nbytes"] != nbytes or "crc32c" not in s:
        return None
      if crc(raw[offset : offset + nbytes]) != s["crc32c"]:
        raise _checksum_failed(where, path, index)
      arrays[index] = np.ndarray(shard_shape, plan.dtype, buf, offset)
    out.append(arrays)
  return out


def _verified_shards(
  body: dict, buf: np.ndarray, layout: shards_lib.Layout, where: str
) -> list[dict[shards_lib.Index, np.ndarray]]:
  """The shards a layout needs, from a step's bytes, each checked against
  its CRC32C.

  Args:
    body: the step's manifest body.
    buf: its shards.bin bytes.
    layout: the shards wanted.
    where: names the step in errors.

  Returns:
    Per leaf of `layout`, {index: the shard's bytes in `buf` as an array}.

  Raises:
    StateMismatchError: tree, shape or dtype differ.
    TopologyMismatchError: a needed shard was not saved.
    CorruptCheckpointError: bad bytes.
  """
  saved = {leaf["path"]: leaf for leaf in body["leaves"]}
  compat.check_state(
    {p: (rec["shape"], rec["dtype"]) for p, rec in saved.items()},
    [leaf.path for leaf in layout.leaves],
    layout.leaves,
    where,
  )
  out = []
  crc = local_format.crc32c_of
  raw = memoryview(buf)  # its slices cost less than an array's
  # check_state passed: the saved leaves are the layout's, in its order.
  whole = layout.whole or (False,) * len(layout.leaves)
  for rec, leaf, is_whole in zip(saved.values(), layout.leaves, whole):
    records = rec["shards"]
    if len(records) == 1:  # most leaves: one shard (no index table to build)
      s = records[0]
      by_index = {tuple(map(tuple, s["index"])): s}
    else:
      by_index = {tuple(map(tuple, s["index"])): s for s in records}
    arrays = {}
    for slot in leaf.slots:
      s = by_index.get(slot.index)
      if s is None:
        raise TopologyMismatchError(
          f"{where}: leaf {leaf.path} has no shard {slot.index}; it was"
          " saved with another sharding. Restore it from the persistent tier."
        )
      offset, nbytes = s["offset"], s["nbytes"]
      data = raw[offset : offset + nbytes]
      want = s.get("crc32c")
      if (crc(data) != want) if want is not None else not local_format.checksum_ok(data, s):
        raise _checksum_failed(where, leaf.path, slot.index)
      # One array over the bytes (not a slice, a view and a reshape).
      shape = leaf.shape if is_whole else shards_lib.shard_shape(slot.index)
      arrays[slot.index] = np.ndarray(shape, leaf.dtype, buf, offset)
    out.append(arrays)
  return out


def _checksum_failed(where: str, path: str, index) -> CorruptCheckpointError:
  """The error of a shard whose bytes fail its recorded checksum."""
  return CorruptCheckpointError(
    f"{where}/{local_format.SHARDS}: leaf {path} shard {index} fails its checksum"
  )
