"""Restoring ramdisk copies onto another mesh: which saved shard feeds which
new one (pure: no JAX arrays, no I/O).

A local copy holds raw shards with known global indices, so moving a step
onto another sharding inside a slice (2 processes x 2 devices saved, 4 x 1
restored; fewer or more slices with another slice shape) is array slicing.
What a receiver must know is where each saved shard lives, for every saved
process, without any process listing them all (at thousands of processes
that table would be O(shards) for everyone). So each local save records
how it was sharded, in O(leaves + devices per slice):
- per leaf, its NamedSharding's PartitionSpec (`shards.spec_of`; recorded
  only if `shards.block_index` reproduces the shard indices JAX gave this
  process);
- the slice grid (Topology.slice_grid): the slice position of the process
  owning each device of the writer's slice (the mesh without its replica
  axis).
From those, `SavedLayout` derives every saved process's shards, and
`plan_pieces` cuts each new shard into pieces (a saved shard, a box) from a
copy this process holds on its host, else from a holder in a source slice.
The state is replicated over the replica axis, so every saved slice holds
the whole state and any complete one can serve.

Called by: the restore planner and the reshard transfer (restore/), on
every process; no collective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from emergency_ckpt.core import shards as shards_lib

Index = shards_lib.Index


def intersect(a: Index, b: Index) -> Index | None:
  """The overlap of two boxes.

  Args:
    a, b: boxes of one array.

  Returns:
    Their intersection, or None if they do not overlap.
  """
  out = []
  for (a0, a1), (b0, b1) in zip(a, b):
    lo, hi = max(a0, b0), min(a1, b1)
    if lo >= hi:
      return None
    out.append((lo, hi))
  return tuple(out)


def relative(box: Index, to: Index) -> tuple[slice, ...]:
  """A global box as slices into one shard.

  Args:
    box: the box (global), inside `to`.
    to: the shard's global index.

  Returns:
    The slices into the shard's array.
  """
  return tuple(slice(a - t, b - t) for (a, b), (t, _) in zip(box, to))


@dataclasses.dataclass(frozen=True)
class SavedLayout:
  """How a saved step was sharded in one saved slice (the same in each):
  enough to tell which saved process holds which shard."""

  axis_names: tuple[str, ...]
  """The saved mesh's axes without the replica axis."""
  axis_sizes: tuple[int, ...]
  grid: tuple[int, ...]
  """Slice position of each device's process, row-major over axis_sizes."""
  leaves: tuple[tuple[str, tuple[int, ...], str, shards_lib.SpecJSON | None], ...]
  """Per saved leaf: (path, shape, dtype name, spec or None)."""

  @classmethod
  def from_manifest(cls, body: Mapping[str, Any]) -> SavedLayout | None:
    """The layout a local step's manifest records.

    Args:
      body: the manifest.

    Returns:
      The layout, or None if it records none (written before resharding
      existed, or malformed).
    """
    fp = body.get("topology") or {}
    try:
      names = list(fp["mesh_axis_names"])
      replica = names.index(fp["replica_axis"])
      sizes = [int(d) for d in fp["mesh_shape"]]
      grid = tuple(int(p) for p in fp["slice_grid"])
      leaves = tuple(
        (leaf["path"], tuple(leaf["shape"]), leaf["dtype"], leaf.get("spec"))
        for leaf in body["leaves"]
      )
    except (KeyError, TypeError, ValueError):
      return None
    if len(sizes) != len(names):  # a shape that does not name every axis: not a layout
      return None
    del names[replica], sizes[replica]
    if len(grid) != math.prod(sizes):
      return None
    return cls(tuple(names), tuple(sizes), grid, leaves)

  def to_json(self) -> dict:
    """This layout as JSON (from_json reads it back).

    Returns:
      A dict of lists.
    """
    return {
      "axis_names": list(self.axis_names),
      "axis_sizes": list(self.axis_sizes),
      "grid": list(self.grid),
      "leaves": [[p, list(s), d, spec] for p, s, d, spec in self.leaves],
    }

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> SavedLayout:
    """The layout to_json wrote.

    Args:
      d: to_json's dict.

    Returns:
      The layout.
    """
    return cls(
      tuple(d["axis_names"]),
      tuple(d["axis_sizes"]),
      tuple(d["grid"]),
      tuple((p, tuple(s), dt, spec) for p, s, dt, spec in d["leaves"]),
    )

  def problem(
    self, paths: Sequence[str], shapes: Sequence[tuple], dtypes: Sequence[str]
  ) -> str | None:
    """Why this layout cannot feed a state of these leaves.

    Args:
      paths, shapes, dtypes: the restored leaves' paths, shapes and dtype
        names.

    Returns:
      The reason for the first leaf that cannot be fed, or None.
    """
    saved = {p: (s, d, spec) for p, s, d, spec in self.leaves}
    for path, shape, dtype in zip(paths, shapes, dtypes):
      got = saved.get(path)
      if got is None:
        return f"leaf {path} was not saved"
      if tuple(got[0]) != tuple(shape) or got[1] != dtype:
        return f"leaf {path} was saved as {got[1]}{list(got[0])}, restored as {dtype}{list(shape)}"
      if got[2] is None or not self.holders(path):
        return (
          f"leaf {path} was saved without a NamedSharding spec that splits evenly"
          " inside a slice (it cannot be resharded)"
        )
    return None

  @functools.cached_property
  def _positions(self) -> dict[str, tuple[Index, list[int]]]:
    """{path: {saved index: slice positions holding it}}."""
    coords = list(np.ndindex(*self.axis_sizes)) if self.axis_sizes else [()]
    sizes = dict(zip(self.axis_names, self.axis_sizes))
    out: dict[str, dict[Index, list[int]]] = {}
    for path, shape, _, spec in self.leaves:
      if spec is None:
        continue
      by_index: dict[Index, list[int]] = {}
      for coord, pos in zip(coords, self.grid):
        try:
          index = shards_lib.block_index(shape, spec, sizes, dict(zip(self.axis_names, coord)))
        except KeyError:  # split over the replica axis: not the same in each slice
          index = None
        if index is None:
          by_index = {}
          break
        holders = by_index.setdefault(index, [])
        if pos not in holders:
          holders.append(pos)
      out[path] = by_index
    return out

  def holders(self, path: str) -> dict[Index, list[int]]:
    """Who holds each saved shard of one leaf.

    Args:
      path: the leaf's path.

    Returns:
      {saved shard index: slice positions holding it} ({} if unknown or
      not reshardable).
    """
    return self._positions.get(path, {})

  def shards_at(self, path: str, position: int) -> list[Index]:
    """The saved shards one slice position holds.

    Args:
      path: the leaf's path.
      position: a slice position.

    Returns:
      The shard indices of leaf `path` that `position` holds.
    """
    return [i for i, pos in self.holders(path).items() if position in pos]


@dataclasses.dataclass(frozen=True)
class Piece:
  """One box of a new shard: its bytes are `box` of saved shard `index`."""

  leaf: int
  slot: shards_lib.ShardSlot
  index: Index
  box: Index
  saved_process: int
  local: bool
  """Read from a copy on this host (else pulled from its holder)."""


def plan_pieces(
  layout: shards_lib.Layout,
  saved: SavedLayout,
  sources: Sequence[Sequence[int]],
  held: set[int],
  rank: int,
) -> list[Piece]:
  """Each new shard of this process cut into pieces of saved shards.

  Args:
    layout: this process's new Layout.
    saved: the saved step's layout.
    sources: the saved process lists of the complete saved slices that
      may serve.
    held: saved processes whose copies are on this host (their pieces are
      read locally, whatever slice).
    rank: this process's place among the receivers, which spreads remote
      reads over the source slices and over the positions holding a
      replicated shard.

  Returns:
    The pieces, in leaf and slot order.
  """
  pos_of_held = {}
  for procs in sources:
    for pos, p in enumerate(procs):
      if p in held:
        pos_of_held.setdefault(pos, p)
  out = []
  k = rank
  for leaf_no, leaf in enumerate(layout.leaves):
    holders = saved.holders(leaf.path)
    for slot in leaf.slots:
      for index, positions in holders.items():
        box = intersect(index, slot.index)
        if box is None:
          continue
        mine = next((pos_of_held[p] for p in positions if p in pos_of_held), None)
        if mine is not None:
          out.append(Piece(leaf_no, slot, index, box, mine, True))
          continue
        procs = sources[k % len(sources)]
        pos = positions[(k // len(sources)) % len(positions)]
        k += 1
        out.append(Piece(leaf_no, slot, index, box, procs[pos], False))
  return out


def covered(layout: shards_lib.Layout, pieces: Sequence[Piece]) -> str | None:
  """Checks that pieces tile every new shard exactly.

  Args:
    layout: this process's new Layout.
    pieces: plan_pieces's answer.

  Returns:
    Why they do not (the first shard short of elements), or None.
  """
  got: dict[tuple[int, Index], int] = {}
  for p in pieces:
    key = (p.leaf, p.slot.index)
    got[key] = got.get(key, 0) + math.prod(b - a for a, b in p.box)
  for leaf_no, leaf in enumerate(layout.leaves):
    for slot in leaf.slots:
      want = math.prod(shards_lib.shard_shape(slot.index))
      if got.get((leaf_no, slot.index), 0) != want:
        return f"leaf {leaf.path} shard {slot.index}: saved shards cover {got.get((leaf_no, slot.index), 0)} of {want} elements"
  return None
