"""Finding the copies of this run on this host that are not in this
process's own folder: other processes' folders, partner copies, parity blocks.

A host that ran other processes before a restart (shuffled hosts, fewer or
more slices) still holds their folders; a copy is found by what it holds,
not by who wrote it. Three kinds:
- a step another process of this run left here, written with this
  process's slice shape at its slice position: it holds the shards this
  process needs (the state is replicated over the replica axis), so the
  tier reads it as its own (`sources`, adopted);
- any copy of this run, whatever topology wrote it (`copies`): a restore
  onto another mesh reshards from those (restore/, core/reshard.py), and
  partner copies other processes sent here (blocks.partner_folders);
- XOR parity blocks in this host's process folders (`parity`), from which
  a lost group member is rebuilt (redundancy/xor.py).
Live folders (held by a manager: owner.py, or of a process of this job on
this machine: set_colocated) are never taken. What the dead ones left
beyond the steps (spares, saves in progress, torn step folders) goes at
start (clean_up, with this process's own leftovers), and their steps and
parity blocks once retention no longer needs them (sweep), then the
emptied folders.

Called by: tier.py (LocalTier.usable_steps and the accessors beside it,
its start-up and apply_retention), which hands Copy and Parity to the
restore side. Per process; no collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterable, Sequence

from emergency_ckpt.cluster import topology as topology_lib
from emergency_ckpt.cluster.topology import Topology
from emergency_ckpt.core import layout
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local import blocks, folders
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import owner as local_owner

logger = logging.getLogger("emergency_ckpt")


@dataclasses.dataclass(frozen=True)
class Copy:
  """Who wrote a local copy, in the topology that wrote it."""

  topology: str
  """A digest of that topology (copies of one save share it)."""
  process: int
  slice: int
  position: int
  slice_size: int
  partner: bool = False
  """Sent by its writer to this host's process (redundancy/partner.py)."""

  @classmethod
  def of(cls, body: dict, *, partner: bool = False) -> Copy | None:
    """The copy a manifest describes.

    Args:
      body: a local step's manifest body.
      partner: whether it is a partner copy.

    Returns:
      The Copy, or None if the manifest names no process of its topology.
    """
    fp = body.get("topology") or {}
    process = body.get("process_index")
    try:
      for s, procs in enumerate(fp["slice_processes"]):
        if process in procs:
          key = {k: fp.get(k) for k in ("slice_processes", "mesh_shape", "mesh_axis_names")}
          digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
          return cls(digest, int(process), s, list(procs).index(process), len(procs), partner)
    except (KeyError, TypeError, ValueError):
      pass
    return None

  def to_json(self) -> list:
    """The copy as JSON (the restore inventory's report).

    Returns:
      [topology, process, slice, position, slice_size, partner as 0 or 1].
    """
    return [
      self.topology,
      self.process,
      self.slice,
      self.position,
      self.slice_size,
      int(self.partner),
    ]


@dataclasses.dataclass(frozen=True)
class Parity:
  """An XOR parity block on this host (redundancy/xor.py), of `copy.process`."""

  where: str
  copy: Copy
  group: list[int]
  """Its group's slice positions, in group order."""
  body: dict
  """Its group.json: group (processes), member, sizes, manifests."""

  def to_json(self) -> list:
    """The block as JSON (the restore inventory's report).

    Returns:
      Its copy's to_json() without the partner flag, then its group.
    """
    return [*self.copy.to_json()[:5], self.group]


class HostCopies:
  """What scan() last found on this host beyond this process's own steps.

  Its attributes are read by the tier; scan() replaces them, drop() deletes
  a step's copies. Called by: the tier, on the thread that lists or
  deletes (no lock)."""

  def __init__(self, directory: str, *, run_id: str, topology: Topology):
    """`directory`: this process's folder (`<root>/<run_id>/process_<i>`)."""
    self._directory = directory
    self._run_id = run_id
    self._topology = topology
    self.sources: dict[int, str] = {}
    """step -> the folder scan() found a copy this process can read in."""
    self.copies: dict[int, dict[int, tuple[str, Copy]]] = {}
    """{step: {saved process: (folder, Copy)}} of every copy of this run."""
    self.parity: dict[int, dict[int, Parity]] = {}
    """{step: {saved process: Parity}} of the parity blocks in this host's folders."""
    self._colocated: set[int] | None = None  # None: not known yet

  def set_colocated(self, processes: Iterable[int]) -> None:
    """The processes of this job on this machine: their folders are live,
    never taken as copies, even before their managers hold them.

    Args:
      processes: their process indices (the placement check's group).
    """
    self._colocated = {int(p) for p in processes}

  def clean_up(self) -> None:
    """At start, once this process holds its folder: removes what crashed
    incarnations left in it and in the folders of this run no live process
    holds (_clear: `.tmp-*`, Orbax's temporary folders, step folders
    without their marker), in their partner and XOR folders too. Steps stay
    (a restore may need them)."""
    for folder in [self._directory, *self._other_folders()]:
      _clear(folder)

  def sweep(self, keep: Collection[int], doomed: Sequence[int]) -> None:
    """After a retention pass that kept `keep` and deleted `doomed`: in this
    process's folder and its partner and XOR folders, the step folders
    without their marker (damaged since the start); in the folders no live
    process holds, what clean_up removes, then, if the pass deleted a step,
    every step folder (data, partner copy, parity block) `keep` lacks that
    is older than it (the local plan deletes nothing while no step held is
    committed, else it protects the newest committed one and every newer
    step: older ones are none the newest restorable step may need); a
    folder left empty goes, the process folder itself (with its owner file)
    once this machine's processes are known (set_colocated: each of them
    holds its folder by then). Failures are ignored.

    Args:
      keep: the steps retention keeps.
      doomed: the steps it deleted.
    """
    own = [(self._directory, local_format.MANIFEST), *blocks.redundancy_folders(self._directory)]
    gone = [p for folder, marker in own for p in folders.drop_unmarked(folder, marker)]
    below = max(doomed) + 1 if doomed else None
    for folder in self._other_folders():
      gone += _clear(folder)
      subs = blocks.redundancy_folders(folder)
      if below is not None:
        for sub in [folder, *(f for f, _ in subs)]:
          gone += folders.drop_older(sub, below, keep)
      for sub in [*(f for f, _ in subs), os.path.join(folder, blocks.PARTNER_DIR)]:
        with contextlib.suppress(OSError):
          os.rmdir(sub)  # if empty
      if self._colocated is not None:
        local_owner.remove_unused(folder)
    if gone:
      self._forget(set(gone))

  def drop_newer(self, restored: int, keep: Collection[int]) -> None:
    """After a restore of `restored`: in the folders no live process holds,
    every step folder (data, partner copy, parity block) newer than it that
    `keep` lacks, damaged or not: a crashed incarnation's steps, which the
    steps trained from here will replace. Failures are ignored.

    Args:
      restored: the restored step.
      keep: the restorable steps (they stay).
    """
    gone = []
    for folder in self._other_folders():
      subs = [folder, *(f for f, _ in blocks.redundancy_folders(folder))]
      for sub in subs:
        gone += folders.drop_newer(sub, restored, keep)
    if gone:
      self._forget(set(gone))

  def _forget(self, gone: set[str]) -> None:
    """Drops the copies and parity blocks in the removed step folders `gone`."""
    self.sources = {s: w for s, w in self.sources.items() if w not in gone}
    copies = {s: {p: c for p, c in f.items() if c[0] not in gone} for s, f in self.copies.items()}
    self.copies = {s: found for s, found in copies.items() if found}
    parity = {
      s: {p: b for p, b in f.items() if b.where not in gone} for s, f in self.parity.items()
    }
    self.parity = {s: found for s, found in parity.items() if found}

  def adopted(self) -> dict[int, str]:
    """The copies this process can read that lie in other processes' folders.

    Returns:
      {step: folder}.
    """
    return {s: w for s, w in self.sources.items() if not w.startswith(self._directory + os.sep)}

  def scan(self) -> tuple[list[int], dict[int, str]]:
    """Lists this process's own folder first, then the folders other
    processes of this run left on this host; remembers every copy found.
    A copy serves this process if it was written with the same slice shape
    (mesh without the replica axis, processes per slice) at the same slice
    position (checked again, shard by shard, when read).

    Returns:
      (steps this process can read from this host's ramdisk, {step: why
      not} for its own folder's steps that it cannot).
    """
    good, bad, sources = [], {}, {}
    copies: dict[int, dict[int, tuple[str, Copy]]] = {}
    mine = (topology_lib.slice_shape(self._topology.fingerprint()), self._topology.slice_position)
    dirs = [self._directory] + self._other_folders()
    for folder in dirs:
      for step in folders.list_local_steps(folder):
        where = layout.local_step_dir(folder, step)
        try:
          body = local_format.read_manifest(where, leaves=False)
        except (OSError, CorruptCheckpointError) as e:
          if folder == self._directory:
            bad[step] = str(e)
          continue
        fp = body.get("topology") or {}
        copy = Copy.of(body) if body.get("run_id") == self._run_id else None
        if copy is not None:
          copies.setdefault(step, {}).setdefault(copy.process, (where, copy))
        if step in sources:
          continue
        theirs = (
          topology_lib.slice_shape(fp),
          topology_lib.slice_position_of(fp, body.get("process_index")),
        )
        grid, my_grid = fp.get("slice_grid"), self._topology.slice_grid
        if grid is not None and my_grid is not None and tuple(grid) != tuple(my_grid):
          theirs = None  # the slice's processes sit elsewhere in the mesh: reshard it
        if theirs != mine or body.get("run_id") != self._run_id:
          if folder == self._directory:
            bad[step] = (
              f"saved with topology {fp} as process {body.get('process_index')} of run"
              f" {body.get('run_id')!r}; this job has {self._topology.fingerprint()}"
              f" (run {self._run_id!r}): another run, slice shape or slice position"
              " holds other shards than this process needs: restore this step from a"
              " peer or the persistent tier"
            )
          continue
        sources[step] = where
        bad.pop(step, None)
        good.append(step)
    for folder in blocks.partner_folders(dirs):
      for step in folders.list_local_steps(folder):
        where = layout.local_step_dir(folder, step)
        try:
          body = local_format.read_manifest(where, leaves=False)
        except (OSError, CorruptCheckpointError):
          continue  # checked again when read; a torn copy is not listed
        copy = Copy.of(body, partner=True) if body.get("run_id") == self._run_id else None
        if copy is not None:
          copies.setdefault(step, {}).setdefault(copy.process, (where, copy))
    self.sources = sources
    self.copies = copies
    self.parity = self._find_parity(dirs)
    adopted = self.adopted()
    if adopted:
      logger.info(
        "%s local steps %s found in other processes' folders on this host (a restart"
        " onto other hosts or another slice count)",
        self._topology.log_prefix(),
        sorted(adopted),
      )
    return sorted(good), bad

  def _find_parity(self, dirs: Sequence[str]) -> dict[int, dict[int, Parity]]:
    out: dict[int, dict[int, Parity]] = {}
    for folder in dirs:
      root = blocks.xor_dir(folder)
      for step in blocks.parity_steps(root):
        where = layout.local_step_dir(root, step)
        try:
          body = blocks.read_group(where)
          group = [int(p) for p in body["group"]]
          process = group[int(body["member"])]
          some = local_format.decode_manifest(
            bytes.fromhex(next(iter(body["manifests"].values()))), where, leaves=False
          )
        except (
          OSError,
          CorruptCheckpointError,
          KeyError,
          TypeError,
          ValueError,
          IndexError,
          StopIteration,
        ) as e:
          logger.warning("parity block %s unusable, skipped: %s", where, e)
          continue
        if some.get("run_id") != self._run_id:
          continue
        holder = layout.process_of_dir_name(os.path.basename(os.path.normpath(folder)))
        if holder is not None and process != holder:
          logger.warning(
            "parity block %s unusable, skipped: its group file names process %d as its"
            " holder, but it lies in process %d's folder",
            where,
            process,
            holder,
          )
          continue
        copy = Copy.of({**some, "process_index": process})
        fp = some.get("topology") or {}
        positions = [topology_lib.slice_position_of(fp, p) for p in group]
        if copy is None or None in positions:
          continue
        out.setdefault(step, {}).setdefault(process, Parity(where, copy, positions, body))
    return out

  def _other_folders(self) -> list[str]:
    """The other `process_<i>` folders of this run on this host (real
    folders only, never links), live ones left out."""
    run = os.path.dirname(self._directory)
    try:
      names = os.listdir(run)
    except OSError:
      return []
    out = []
    for name in sorted(names):
      path = os.path.join(run, name)
      if (
        layout.process_of_dir_name(name) is not None
        and path != self._directory
        and not os.path.islink(path)
        and os.path.isdir(path)
        and layout.process_of_dir_name(name) not in (self._colocated or ())
        and not local_owner.held(path)
      ):
        out.append(path)
    return out

  def drop(self, step: int) -> None:
    """Forgets `step`'s copies and deletes those in other processes'
    folders (renamed away first), never a live folder's.

    Args:
      step: the step.
    """
    found = [w for w, _ in self.copies.pop(step, {}).values()]
    found.append(self.sources.pop(step, None))
    for where in dict.fromkeys(found):
      if where is None or where.startswith(self._directory + os.sep):
        continue
      if not local_owner.held(os.path.dirname(where)):
        gone = folders.rename_out_of_namespace(where)
        if gone is not None:
          folders.remove_renamed(gone)


def _clear(process_dir: str) -> list[str]:
  """Removes what a crashed incarnation left in a process folder and in its
  partner and XOR folders: `.tmp-*` (saves and receipts in progress,
  spares, deletions), Orbax's temporary folders, step folders without
  their marker (torn: never restorable). Returns the removed step folders."""
  folders.remove_tmp(process_dir, also=lambda name: layout.ORBAX_TMP_MARK in name)
  gone = folders.drop_unmarked(process_dir, local_format.MANIFEST)
  for sub, marker in blocks.redundancy_folders(process_dir):
    folders.remove_tmp(sub)
    gone += folders.drop_unmarked(sub, marker)
  return gone
