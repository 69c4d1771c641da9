"""The local manifest's schema: every field a reader uses, typed and within
what the reader computes itself (a shard's size from its shape and dtype,
its place inside shards.bin); also the field checks the other file formats
(state files, COMMIT, run.json, Orbax metadata) use.

A manifest that fails is a damaged copy (CorruptCheckpointError naming the
file), skipped like a flipped bit. Any process, or an offline tool, may
call these functions; no I/O, no JAX.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import ml_dtypes
import numpy as np

from emergency_ckpt.errors import CorruptCheckpointError

_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

_REQUIRED = object()


def field(doc: Any, key: str, kind: type | tuple[type, ...], where: str, default: Any = _REQUIRED):
  """`doc[key]`, checked to be a `kind` (is_a); `default` if absent, when
  given. Called by: every on-disk decoder (here, blocks.py, state/format.py,
  the persistent tier's readers); no I/O. Raises CorruptCheckpointError
  (naming `where`) if `doc` is no object, or the field is absent or mistyped."""
  if not isinstance(doc, dict):
    raise CorruptCheckpointError(f"{where}: expected an object, got {type(doc).__name__}")
  if key not in doc:
    if default is _REQUIRED:
      raise CorruptCheckpointError(f"{where}: {key!r} is missing")
    return default
  value = doc[key]
  if not is_a(value, kind):
    raise CorruptCheckpointError(f"{where}: {key!r} is a {type(value).__name__} ({value!r:.80})")
  return value


def is_a(value: Any, kind: type | tuple[type, ...]) -> bool:
  """isinstance(value, kind), where a bool is no int and an int is a float too."""
  kinds = kind if isinstance(kind, tuple) else (kind,)
  if isinstance(value, bool):
    return bool in kinds
  return isinstance(value, kinds) or (float in kinds and isinstance(value, int))


def ints(value: Any, where: str, what: str, *, low: int = 0) -> list[int]:
  """`value`, checked to be a list of ints >= `low` (else CorruptCheckpointError
  naming `where` and `what`)."""
  if not isinstance(value, list) or not all(is_a(v, int) and v >= low for v in value):
    raise CorruptCheckpointError(f"{where}: {what} is not a list of ints >= {low} ({value!r:.80})")
  return value


def check_manifest(body: dict, where: str) -> None:
  """Checks a manifest body's every field a reader uses (types, and each
  shard's size and place against what its shape and dtype make it).

  Args:
    body: a decoded manifest body.
    where: names it in errors.

  Raises:
    CorruptCheckpointError: a field is missing, mistyped or out of bounds.
  """
  check_manifest_head(body, where)
  paths = set()
  total = body["nbytes"]
  for leaf in field(body, "leaves", list, where):
    if _leaf_ok(leaf, total):  # the common case, without the per-field calls below
      paths.add(leaf["path"])
      continue
    paths.add(field(leaf, "path", str, where))
    shape = ints(field(leaf, "shape", list, where), where, "a leaf's shape")
    itemsize = _itemsize(field(leaf, "dtype", str, where), where)
    spec = field(leaf, "spec", list, where, None)
    if spec is not None and (
      len(spec) != len(shape)
      or not all(s is None or (isinstance(s, list) and all(is_a(a, str) for a in s)) for s in spec)
    ):
      raise CorruptCheckpointError(f"{where}: leaf {leaf['path']} has a malformed spec")
    for s in field(leaf, "shards", list, where):
      _check_shard(s, shape, itemsize, body["nbytes"], f"{where}: leaf {leaf['path']}")
  if len(paths) != len(body["leaves"]):
    raise CorruptCheckpointError(f"{where}: a leaf path appears twice")


def check_manifest_head(body: dict, where: str) -> None:
  """check_manifest without the per-leaf checks: every field outside
  `leaves` (step, sizes, run, process, topology), and `leaves` a list. What
  the local tier's discovery reads of every kept step; the step a restore
  reads gets check_manifest whole.

  Args:
    body: a decoded manifest body.
    where: names it in errors.

  Raises:
    CorruptCheckpointError: a field is missing, mistyped or out of bounds.
  """
  if field(body, "step", int, where) < 0 or field(body, "nbytes", int, where) < 0:
    raise CorruptCheckpointError(f"{where}: negative step or nbytes")
  for key, kind in (("run_id", str), ("process_index", int), ("slice_index", int)):
    field(body, key, kind, where, None)
  field(body, "saved_at", float, where, None)
  check_topology(field(body, "topology", dict, where, {}), where)
  field(body, "leaves", list, where)


def _leaf_ok(leaf: Any, total: int) -> bool:
  """True if a manifest leaf passes every check check_manifest makes of it
  (never looser: False sends the leaf through those checks, which name
  what is wrong); one pass of type() tests instead of a call per field.
  JSON has no int subclass but bool, so `type(v) is int` is is_a(v, int)."""
  if type(leaf) is not dict:
    return False
  shape, dtype, shards = leaf.get("shape"), leaf.get("dtype"), leaf.get("shards")
  if type(leaf.get("path")) is not str or type(shape) is not list or type(shards) is not list:
    return False
  if type(dtype) is not str:
    return False
  for d in shape:  # a loop, not all(): no generator per leaf
    if type(d) is not int or d < 0:
      return False
  itemsize = dtype_size(dtype)
  if itemsize is None:
    return False
  if "spec" in leaf and not spec_ok(leaf["spec"], len(shape)):
    return False
  for sh in shards:
    if not shard_ok(sh, shape, itemsize, total):
      return False
  return True


def spec_ok(spec: Any, rank: int) -> bool:
  """True if a leaf record's "spec" passes check_manifest's checks: per
  dimension None or a list of mesh axis names. Called by: check_manifest,
  and readers checking a record themselves (local/read.py)."""
  if type(spec) is not list or len(spec) != rank:
    return False
  for entry in spec:
    if entry is not None and (type(entry) is not list or not all(type(a) is str for a in entry)):
      return False
  return True


def shard_ok(sh: Any, shape: list[int], itemsize: int, total: int) -> bool:
  """True if a shard record passes every check check_manifest makes of it
  (a box of the leaf's rank inside `shape`, its size what the box and
  `itemsize` make, inside a file of `total` bytes, integer checksums);
  False: check_manifest names what is wrong. Called by: check_manifest,
  and readers checking a record themselves (local/read.py)."""
  if type(sh) is not dict:
    return False
  index, offset, nbytes = sh.get("index"), sh.get("offset"), sh.get("nbytes")
  if type(index) is not list or len(index) != len(shape):
    return False
  if type(offset) is not int or type(nbytes) is not int:
    return False
  count = 1
  for box, dim in zip(index, shape):
    if type(box) is not list or len(box) != 2:
      return False
    lo, hi = box
    if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= dim:
      return False
    count *= hi - lo
  if nbytes != count * itemsize or offset < 0 or offset + nbytes > total:
    return False
  # Absent: 0 (an int); present: an int, or the leaf takes the slow checks.
  return type(sh.get("crc32c", 0)) is int and type(sh.get("crc32", 0)) is int


def check_topology(fp: dict, where: str) -> None:
  """Checks the types of a recorded topology's fields (Topology.fingerprint);
  CorruptCheckpointError naming `where` if one is mistyped."""
  field(fp, "process_count", int, where, None)
  for key in ("mesh_shape", "slice_grid", "process_origin"):
    value = field(fp, key, list, where, None)
    if value is not None:
      ints(value, where, f"topology.{key}")
  for procs in field(fp, "slice_processes", list, where, ()):
    ints(procs, where, "topology.slice_processes")
  names = field(fp, "mesh_axis_names", list, where, ())
  if not all(is_a(n, str) for n in names):
    raise CorruptCheckpointError(f"{where}: topology.mesh_axis_names is not a list of names")
  field(fp, "replica_axis", (str, int), where, None)


def _check_shard(s: Any, shape: list[int], itemsize: int, total: int, where: str) -> None:
  index, offset, nbytes = field(s, "index", list, where), field(s, "offset", int, where), 0
  if len(index) != len(shape):
    raise CorruptCheckpointError(f"{where}: shard index {index!r:.80} is not of rank {len(shape)}")
  count = 1
  for box, dim in zip(index, shape):
    if len(ints(box, where, "a shard index's range")) != 2 or not box[0] <= box[1] <= dim:
      raise CorruptCheckpointError(f"{where}: shard index {index!r:.80} is outside {shape}")
    count *= box[1] - box[0]
  nbytes = field(s, "nbytes", int, where)
  if nbytes != count * itemsize:
    raise CorruptCheckpointError(
      f"{where}: shard {index} has {nbytes} bytes; its index and dtype make {count * itemsize}"
    )
  if offset < 0 or offset + nbytes > total:
    raise CorruptCheckpointError(f"{where}: shard {index} at {offset} is past the end ({total})")
  field(s, "crc32c", int, where, None)
  field(s, "crc32", int, where, None)


@functools.lru_cache(maxsize=64)
def dtype_size(name: str) -> int | None:
  """The itemsize of a dtype name a manifest may record; None: not one."""
  if not _DTYPE_NAME.fullmatch(name):
    return None
  try:
    dt = np.dtype(getattr(ml_dtypes, name, name))
  except (TypeError, ValueError):
    return None
  return (
    dt.itemsize if dt.kind in "biufcV" and (dt.kind != "V" or hasattr(ml_dtypes, name)) else None
  )


def _itemsize(name: str, where: str) -> int:
  size = dtype_size(name)
  if size is None:
    raise CorruptCheckpointError(f"{where}: unknown dtype {name!r:.80}")
  return size
