"""Reading a persistent step (Orbax's format) straight into one host buffer.

Orbax's restore has tensorstore allocate an array per shard (16-byte
aligned), then places it on its device, which copies it again (XLA's CPU
client aliases only 64-byte aligned host memory). Here tensorstore writes
every unique shard this process needs straight into one page-aligned buffer,
laid out like the local tier's file (shards.layout_for), and placement.assemble
places views of it: on CPU the arrays alias the buffer (one copy from storage
instead of two); on accelerators the buffer feeds the host-to-device copy.

The tensorstore specs and context are Orbax's own (its public type_handlers
helpers build them from the step's _METADATA), so this reads exactly what
Orbax would, including its OCDBT databases, zarr2/zarr3 and compression.
Nothing here writes: the persistent tier stays in Orbax's standard format.
Every region is read as the saved shards that cover it and checked against
their recorded CRC32C (checksums.py): in place when the region is a saved
shard (an unchanged sharding), else whole into a scratch array, then cut.
Each shard is checked as soon as tensorstore has read it, while the others
are still being read, and local files are read through a memory map
(checked_reads.py).

Called by: every process that restores from persistent (no collective);
blocks until its shards are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from etils import epath

from emergency_ckpt.core import compat, placement
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CorruptCheckpointError, StateMismatchError
from emergency_ckpt.local import schema
from emergency_ckpt.persistent import checked_reads
from emergency_ckpt.runtime.buffers import aligned_empty
from emergency_ckpt.state.shard_records import Expected, overlap

METADATA = "_METADATA"
COALESCE = "experimental_read_coalescing_threshold_bytes"


def _read_metadata(item_dir: epath.Path) -> dict:
  """The step's Orbax _METADATA, an object whose flags read are bools or
  null (anything else is damage: CorruptCheckpointError)."""
  path = item_dir / METADATA
  try:
    meta = json.loads(path.read_text())
  except (OSError, ValueError, RecursionError) as e:
    raise CorruptCheckpointError(
      f"{path} is unreadable ({type(e).__name__}: {e}); the step's"
      " Orbax metadata is damaged. Restore another step (all_steps() lists them)."
    ) from e
  for key in ("use_ocdbt", "use_zarr3", "store_array_data_equal_to_fill_value"):
    schema.field(meta, key, (bool, type(None)), f"{path} (damaged Orbax metadata)", None)
  return meta


def read(item_dir: epath.Path, abstract_tree: Any, ocp: Any, expected: Expected) -> Any:
  """A persistent step's arrays, every byte checked against its recorded CRC32C.

  Args:
    item_dir: the step's Orbax item (its tree, shapes and dtypes already
      checked against `abstract_tree`).
    abstract_tree: the arrays to read (shape, dtype, sharding per leaf).
    ocp: the orbax.checkpoint module.
    expected: the step's recorded shard CRC32Cs (checksums.py).

  Returns:
    abstract_tree's tree of arrays.

  Raises:
    CorruptCheckpointError: naming the leaf, if a shard fails its CRC32C or
      the step cannot be read.
    StateMismatchError: abstract_tree's leaves are not all sharded arrays.
  """
  _, abstract, treedef = shards_lib.leaf_paths(abstract_tree)
  layout, buffer = read_into(item_dir, abstract_tree, ocp, expected)
  arrays = placement.assemble_buffer(abstract, layout, buffer)
  return jax.tree_util.tree_unflatten(treedef, arrays)


def read_into(
  item_dir: epath.Path,
  abstract_tree: Any,
  ocp: Any,
  expected: Expected,
  select: Callable[[int, shards_lib.ShardSlot], bool] | None = None,
  *,
  buffer: np.ndarray | None = None,
  on_ready: Callable[[int, shards_lib.Index], None] | None = None,
  metadata: dict | None = None,
) -> tuple[shards_lib.Layout, np.ndarray]:
  """read()'s read and checks, into one host buffer instead of arrays.

  Args:
    item_dir: as for read().
    abstract_tree: as for read().
    ocp: the orbax.checkpoint module.
    expected: as for read().
    select: reads only the slots (leaf number, slot) it accepts (the rest
      are left unwritten); None: every slot.
    buffer: write there (layout.nbytes) instead of into a new buffer.
    on_ready: called with (leaf number, index) as each slot is read and
      checked, before the others.
    metadata: the step's _METADATA if already read (_read_metadata).

  Returns:
    (this process's layout, the page-aligned buffer laid out so).

  Raises:
    CorruptCheckpointError: as read().
    StateMismatchError: as read().
  """
  import tensorstore as ts  # noqa: PLC0415 - heavy import, only when used

  paths, abstract, _ = shards_lib.leaf_paths(abstract_tree)
  names = jax.tree_util.tree_leaves(
    ocp.tree.get_param_names(abstract_tree, include_empty_nodes=False)
  )
  if len(names) != len(abstract):
    raise StateMismatchError(
      f"abstract_state has {len(abstract)} leaves but {len(names)} Orbax names;"
      " every leaf must be a jax.ShapeDtypeStruct with a sharding."
    )
  meta = _read_metadata(item_dir) if metadata is None else metadata
  use_ocdbt = meta.get("use_ocdbt")
  if use_ocdbt is None:
    use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(item_dir)
  use_zarr3 = bool(meta.get("use_zarr3", False))
  missing_is_error = bool(meta.get("store_array_data_equal_to_fill_value", True))
  context = checked_reads.read_context(ocp, use_ocdbt)

  def spec(name: str) -> dict:
    info = ocp.type_handlers.ParamInfo(
      name=name,
      parent_dir=item_dir,
      is_ocdbt_checkpoint=use_ocdbt,
      use_zarr3=use_zarr3,
      ts_context=context,  # one context (and OCDBT cache) for every leaf
    )
    out = ocp.type_handlers.get_json_tspec_read(
      info, use_ocdbt=use_ocdbt, raise_array_data_missing_error=missing_is_error
    )
    kvstore = out.get("kvstore")
    if select is not None and isinstance(kvstore, dict) and COALESCE in kvstore:
      # Orbax merges reads of one remote data file less than 1 MB apart,
      # gaps included: a partial read would fetch the other slices' shards.
      kvstore[COALESCE] = 0
    return out

  layout = shards_lib.layout_for(paths, abstract)
  if buffer is None:
    buffer = aligned_empty(layout.nbytes)
  views = [
    {slot.index: shards_lib.view(buffer, leaf, slot) for slot in leaf.slots}
    for leaf in layout.leaves
  ]
  opened = [ts.open(spec(name), read=True, context=context) for name in names]
  copies = []  # (saved-shard array, its index, destination view, (leaf no, the view's index))
  with checked_reads.CheckedReads(expected, lambda name, e: _damaged(name, item_dir, e)) as reads:
    started = []  # the saved shards read, for expected.prefetch
    for leaf_no, (name, path, future, leaf, by_index) in enumerate(
      zip(names, paths, opened, layout.leaves, views)
    ):
      store = _wait(future.result, name, item_dir)
      compat.check_leaf(
        name, store.shape, store.dtype.numpy_dtype, leaf.shape, leaf.dtype, item_dir
      )
      pieces: dict[shards_lib.Index, np.ndarray] = {}
      for slot in leaf.slots:
        if not slot.nbytes or (select is not None and not select(leaf_no, slot)):
          continue
        saved = expected.saved(path, slot.index)
        if len(saved) == 1 and saved[0].index == slot.index:  # read in place, checked there
          target = by_index[slot.index]
          read_done = _read(ts, store, slot.index, target)
          reads.add(name, path, saved[0], target, read_done, (leaf_no, slot.index))
          started.append(saved[0])
          continue
        for shard in saved:  # another sharding: whole saved shards, checked, then cut
          if shard.index not in pieces:
            piece = np.empty(shards_lib.shard_shape(shard.index), leaf.dtype)
            pieces[shard.index] = piece
            reads.add(name, path, shard, piece, _read(ts, store, shard.index, piece), None)
            started.append(shard)
          copies.append(
            (pieces[shard.index], shard.index, by_index[slot.index], (leaf_no, slot.index))
          )
    expected.prefetch(started)  # while tensorstore reads
    reads.wait(None if on_ready is None else lambda key: on_ready(*key))
  for piece, piece_index, target, (_, target_index) in copies:
    box = overlap(piece_index, target_index)
    target[_within(box, target_index)] = piece[_within(box, piece_index)]
  if on_ready is not None:
    for key in dict.fromkeys(c[3] for c in copies):
      on_ready(*key)
  return layout, buffer


def _check_matches(metadata: Any, abstract_tree: Any, where: Any) -> None:
  """StateMismatchError unless abstract_tree has the saved tree, shapes and
  dtypes (Orbax would cast dtypes silently, and raise an untyped error on
  shapes)."""
  saved = getattr(metadata, "item_metadata", metadata)
  saved = getattr(saved, "tree", saved)
  flat = jax.tree_util.tree_flatten_with_path(saved)[0]
  recorded = {
    jax.tree_util.keystr(p): (tuple(getattr(m, "shape", ())), getattr(m, "dtype", None))
    for p, m in flat
  }
  paths, abstract, _ = shards_lib.leaf_paths(abstract_tree)
  compat.check_state(recorded, paths, abstract, where, ordered=False)


def _saved_paths(meta: dict) -> set[str] | None:
  """The keystr paths of the leaves the step's _METADATA lists (its
  tree_metadata), or None where a key is neither a dict key nor a sequence
  index (the caller then asks Orbax)."""
  out = set()
  tree = meta.get("tree_metadata")
  if not isinstance(tree, dict):
    return None
  for entry in tree.values():
    keys = entry.get("key_metadata") if isinstance(entry, dict) else None
    if not isinstance(keys, list) or not keys:
      return None
    parts = []
    for k in keys:
      kind, key = (k.get("key_type"), k.get("key")) if isinstance(k, dict) else (None, None)
      if kind == 2 and isinstance(key, str):
        parts.append(f"[{key!r}]")
      elif kind == 1 and isinstance(key, (str, int)) and str(key).isdigit():
        parts.append(f"[{key}]")
      else:
        return None
    out.add("".join(parts))
  return out


def read_step(
  item_dir: epath.Path,
  step: int,
  abstract_tree: Any,
  ocp: Any,
  expected: Expected,
  select: Callable[[int, shards_lib.ShardSlot], bool] | None = None,
  *,
  buffer: np.ndarray | None = None,
  on_ready: Callable[[int, shards_lib.Index], None] | None = None,
) -> tuple[shards_lib.Layout, np.ndarray]:
  """read_into() after checking abstract_tree against the step's record and metadata.

  What was saved comes from the step's own checksummed record: a mismatch
  there is the caller's; one with Orbax's metadata after it is damage. The
  saved tree is read from the step's _METADATA, and each leaf's shape and
  dtype from its array as read_into opens it (Orbax's own metadata read,
  which opens every array a second time, only where the trees differ, to
  name the difference).

  Args:
    item_dir: the step's Orbax item.
    step: the step (named in errors).
    abstract_tree: as for read_into().
    ocp: the orbax.checkpoint module.
    expected: as for read_into(); its record of shapes and dtypes is checked.
    select: as for read_into().
    buffer: as for read_into().
    on_ready: as for read_into().

  Returns:
    As read_into().

  Raises:
    StateMismatchError: abstract_tree does not match the step's record.
    CorruptCheckpointError: naming the leaf, if a shard fails its CRC32C,
      or if Orbax's metadata contradicts the step's record.
  """
  paths, abstract, _ = shards_lib.leaf_paths(abstract_tree)
  compat.check_state(
    {p: (shape, shards_lib.dtype_from_name(dt)) for p, (shape, dt) in expected.arrays.items()},
    paths,
    abstract,
    item_dir,
    ordered=False,
  )
  meta = _read_metadata(item_dir)
  try:
    if _saved_paths(meta) != set(paths):  # else read_into checks each leaf's shape, dtype
      with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        _check_matches(ckptr.metadata(item_dir), abstract_tree, item_dir)
    return read_into(
      item_dir,
      abstract_tree,
      ocp,
      expected,
      select,
      buffer=buffer,
      on_ready=on_ready,
      metadata=meta,
    )
  except StateMismatchError as e:
    what = str(e).split(" Pass the abstract_state")[0]
    raise CorruptCheckpointError(
      f"persistent step {step}'s stored array metadata is damaged: it contradicts the"
      f" step's checksummed record of its shapes and dtypes ({what})"
    ) from e


def _read(ts: Any, store: Any, index: shards_lib.Index, target: np.ndarray) -> Any:
  """Starts reading the box `index` of `store` into `target`."""
  source = store[tuple(slice(lo, hi) for lo, hi in index)]
  return ts.array(target, copy=False).write(source)


def _within(box: shards_lib.Index, origin: shards_lib.Index) -> tuple[slice, ...]:
  """`box` as slices of an array whose global index is `origin`."""
  return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _damaged(name: str, item_dir: epath.Path, e: ValueError) -> CorruptCheckpointError:
  """tensorstore's error (NOT_FOUND, DATA_LOSS, ...) reading leaf `name`, as
  the CorruptCheckpointError a reader raises."""
  return CorruptCheckpointError(
    f"cannot read leaf {name} of {item_dir}: {e}. The persistent step is damaged;"
    " restore another step (all_steps() lists them)."
  )


def _wait(result: Callable[[], Any], name: str, item_dir: epath.Path) -> Any:
  try:
    return result()
  except ValueError as e:  # tensorstore's errors (NOT_FOUND, DATA_LOSS, ...)
    raise _damaged(name, item_dir, e) from e
