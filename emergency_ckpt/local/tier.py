"""Local tier: each process writes the shards it holds to its own ramdisk folder.

Layout (per process; nobody else reads it):
  <directory>/<run_id>/process_<i>/step_<N>/shards.bin     raw shard bytes
  <directory>/<run_id>/process_<i>/step_<N>/manifest.json  tree, shards, CRC32Cs
  <directory>/<run_id>/process_<i>/.tmp-step_<N>-<uuid>/   a save in progress
  <directory>/<run_id>/process_<i>/.tmp-spare-<uuid>/      a retired step's file, reused
(the format of one step folder: local_format.py)

A step exists only once its folder is renamed from .tmp-*, after both files are
written, so a crash never leaves a listed partial step.

A save's host snapshot (staging.py) is written by the tier's writer thread
through Orbax's checkpointer API: a synchronous `LocalCheckpointer` driving
`LocalShardsHandler` (local_handler.py), which pwrite()s the buffer into the
ramdisk, computing each shard's CRC32C on the chunk it writes, then the
manifest; Orbax's temporary folder is a `.tmp-step_<N>-<hex>` name, renamed
into place. That checkpointer is configured so that no process sync, barrier
or shared Orbax state is touched (../shared/notes/orbax-local-handler.md):
measured here, a 256 MiB save is durable 1.00-1.04x as late as with the plain
writer thread it replaced (+0.4-0.7 ms fixed per save, write_async() still
blocks ~0.07 ms), and uneven local saves across processes never disturb the
persistent tier's barriers.

The file a save writes into is, in steady state, the shards.bin of a step
that local retention retired (kept as a spare instead of unlinked; the
handler moves it into the new step folder): the kernel copies into tmpfs
pages that already exist, so no page is allocated, zeroed or mapped into
this process. Per 256 MiB process here: 0.05 cpu-s for that write, 0.13 into
a fresh file; mapping a preallocated file instead (the design before) cost
0.19 cpu-s of fallocate and page-table work per save.

A file this process has mapped to restore from is never reused: restored
arrays alias its pages through a private mapping, which would see the
overwrite. Such a step is unlinked when retired (its pages live on for the
mapping).

Reads go through the same checkpointer's restore and map shards.bin (no
copy into a private buffer): on CPU the restored arrays alias those pages
(copy-on-write), so a restore costs one checksum pass.

Why not Orbax's own handlers: zarr3 + zstd through tensorstore, with
barriers across processes, measured 6.2x a raw ramdisk write on this
hardware; a ramdisk copy is only useful if it is nearly free. Orbax's
CheckpointManager (its own retention, a `default/` subfolder, 7-11 ms per
save, settings shared with the persistent tier's manager) is not used either.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import crc32c

from emergency_ckpt.cluster import topology as topology_lib
from emergency_ckpt.cluster.topology import Topology
from emergency_ckpt.core import failpoints, layout
from emergency_ckpt.errors import (
  CorruptCheckpointError,
  UnsafeDirectoryError,
)
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import owner as local_owner
from emergency_ckpt.local import read as local_read
from emergency_ckpt.local.format import LocalStep
from emergency_ckpt.options import LocalTierOptions
from emergency_ckpt.redundancy import xor as xor_lib
from emergency_ckpt.runtime.background import Background
from emergency_ckpt.runtime.staging import HostSnapshot

if TYPE_CHECKING:
  from emergency_ckpt.local.handler import LocalCheckpointer

logger = logging.getLogger("emergency_ckpt")


def secure_makedirs(path: str, *, shared_ok: bool = False) -> None:
  """Creates `path` (and parents) 0700, refusing symlinks and foreign owners.

  `shared_ok`: an existing sticky directory (mode +t, like /dev/shm or /tmp)
  owned by root or by us is accepted whatever its mode: other users may
  create entries there but cannot rename or remove ours (its owner could, so
  another user's sticky folder is refused), and every folder the local tier
  creates below it gets the full check."""
  parts = os.path.abspath(path)
  os.makedirs(parts, mode=0o700, exist_ok=True)
  st = os.lstat(parts)
  if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
    raise UnsafeDirectoryError(
      f"{parts} is a symlink or not a directory; the local tier refuses to"
      " write through it. Remove it, or point local.directory elsewhere."
    )
  if shared_ok and st.st_mode & stat.S_ISVTX and st.st_uid in (0, os.geteuid()):
    return
  if st.st_uid != os.geteuid():
    raise UnsafeDirectoryError(
      f"{parts} is owned by uid {st.st_uid}, not by this process (uid"
      f" {os.geteuid()}); another user could read or plant checkpoints there."
      " Remove it or choose another local.directory."
    )
  if st.st_mode & 0o077:
    raise UnsafeDirectoryError(
      f"{parts} has mode {oct(st.st_mode & 0o777)}; the local tier needs 0700"
      f" so no other user can read or plant shards. Run: chmod 700 {parts}"
    )


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
  """Sent by its writer to this host's process (peer/partner.py)."""

  @classmethod
  def of(cls, body: dict, *, partner: bool = False) -> Copy | None:
    """The copy a manifest describes, or None if it names no such process."""
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
  """An XOR parity block on this host (peer/xor.py), of `copy.process`."""

  where: str
  copy: Copy
  group: list[int]
  """Its group's slice positions, in group order."""
  body: dict
  """Its group.json: group (processes), member, sizes, manifests."""

  def to_json(self) -> list:
    return [*self.copy.to_json()[:5], self.group]


@dataclasses.dataclass(frozen=True)
class WriteResult:
  step: int
  ok: bool
  nbytes: int
  durable_s: float
  error: str | None = None


class LocalTier:
  """One process's ramdisk folder. All methods are per process: no collectives."""

  def __init__(
    self,
    options: LocalTierOptions,
    *,
    run_id: str,
    topology: Topology,
    background: Background | None = None,
    orbax_ready: Callable[[], None] | None = None,
  ):
    """`background`: whose lane "local-write" runs the writes (a private
    one if None). `orbax_ready`: blocks until Orbax may be used (the
    manager's multihost set-up); the first write calls it, then opens the
    checkpointer. Reading never needs Orbax."""
    self._options = options
    self._topology = topology
    self._run_id = run_id
    self.directory = layout.process_dir(
      os.path.abspath(options.directory), run_id, topology.process_index
    )
    secure_makedirs(options.directory, shared_ok=True)  # may be /dev/shm itself
    for p in (os.path.dirname(self.directory), self.directory):
      secure_makedirs(p)
    self._own_background = background is None
    self._background = Background(topology.log_prefix()) if background is None else background
    self._writer = self._background.lane("local-write")
    self._spare_lock = threading.Lock()
    self._spares: list[str] = []  # .tmp-spare-* folders, each holding a retired shards.bin
    self._max_spares = options.staging_buffers  # one per write that may run at once
    self._mapped: set[tuple[int, int]] = set()  # (st_dev, st_ino) of files read() mapped
    self._sources: dict[int, str] = {}  # step -> the folder usable_steps() found it in
    self._copies: dict[int, dict[int, tuple[str, Copy]]] = {}  # see copies()
    self._parity: dict[int, dict[int, Parity]] = {}  # see parity()
    self._colocated: set[int] = set()  # this job's processes on this machine (set_colocated)
    self._closed = False
    # Orbax's checkpointer API over this folder alone (local_handler.py),
    # opened on first use: loading Orbax is off the restore path.
    self._orbax_ready = orbax_ready
    self._checkpointer: LocalCheckpointer | None = None
    self._open_lock = threading.Lock()
    self._cleanup_tmp()
    self._owner = local_owner.take(self.directory, topology.log_prefix())

  def open(self) -> LocalCheckpointer:
    """The tier's Orbax checkpointer, created on first use (after
    `orbax_ready`). Called by: the writer thread; blocks on loading Orbax
    the first time."""
    if self._checkpointer is None and self._orbax_ready is not None:
      self._orbax_ready()  # never under the lock: the warm-up may take a while
    with self._open_lock:
      if self._checkpointer is None:
        self._checkpointer = _handler().LocalCheckpointer(
          process_index=self._topology.process_index, barrier_prefix=f"ec_local_{self._run_id}"
        )
      return self._checkpointer

  # ---- listing -------------------------------------------------------------
  def step_dir(self, step: int) -> str:
    return layout.local_step_dir(self.directory, step)

  def steps(self) -> list[int]:
    """Committed steps (folders renamed into place with a manifest)."""
    return layout.list_local_steps(self.directory)

  def manifest(self, step: int) -> dict:
    """The step's manifest body (OSError if absent, CorruptCheckpointError if bad)."""
    return local_format.read_manifest(self.step_dir(step))

  def step_bytes(self, step: int) -> int | None:
    """Bytes of `step`'s files, or None if this process holds no such step
    (its own, or the copy usable_steps() last found in another folder)."""
    if step in self.steps():
      d = self.step_dir(step)
    elif step in self.adopted_steps():
      d = self._sources[step]
    else:
      return None
    try:
      return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    except OSError:  # deleted meanwhile
      return None

  def usable_steps(self) -> tuple[list[int], dict[int, str]]:
    """(steps this process can read from this host's ramdisk, {step: why
    not}). A copy is found by what it holds, not by who wrote it: this
    process's own folder first, then the folders other processes of this
    run left on this host (a host that ran another process before a
    restart: shuffled hosts, fewer or more slices). A copy serves this
    process if it was written with the same slice shape (mesh without the
    replica axis, processes per slice) at the same slice position: the
    state is replicated over the replica axis, so it holds the same shards
    (checked again, shard by shard, when read). Remembers where each
    step's copy is for read()."""
    good, bad, sources = [], {}, {}
    copies: dict[int, dict[int, tuple[str, Copy]]] = {}
    mine = (topology_lib.slice_shape(self._topology.fingerprint()), self._topology.slice_position)
    folders = [self.directory] + self._other_folders()
    for folder in folders:
      for step in layout.list_local_steps(folder):
        where = layout.local_step_dir(folder, step)
        try:
          body = local_format.read_manifest(where)
        except (OSError, CorruptCheckpointError) as e:
          if folder == self.directory:
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
          if folder == self.directory:
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
    for folder in self._partner_folders(folders):
      for step in layout.list_local_steps(folder):
        where = layout.local_step_dir(folder, step)
        try:
          body = local_format.read_manifest(where)
        except (OSError, CorruptCheckpointError):
          continue  # checked again when read; a torn copy is not listed
        copy = Copy.of(body, partner=True) if body.get("run_id") == self._run_id else None
        if copy is not None:
          copies.setdefault(step, {}).setdefault(copy.process, (where, copy))
    self._sources = sources
    self._copies = copies
    self._parity = self._find_parity(folders)
    adopted = self.adopted_steps()
    if adopted:
      logger.info(
        "%s local steps %s found in other processes' folders on this host (a restart"
        " onto other hosts or another slice count)",
        self._topology.log_prefix(),
        sorted(adopted),
      )
    return sorted(good), bad

  def parity(self) -> dict[int, dict[int, Parity]]:
    """{step: {saved process: Parity}} of the XOR parity blocks usable_steps()
    found in this host's process folders (peer/xor.py)."""
    return self._parity

  def _find_parity(self, folders: Sequence[str]) -> dict[int, dict[int, Parity]]:
    out: dict[int, dict[int, Parity]] = {}
    for folder in folders:
      root = os.path.join(folder, layout.XOR_DIR)
      for step in xor_lib.parity_steps(root):
        where = layout.local_step_dir(root, step)
        try:
          body = xor_lib.read_group(where)
          group = [int(p) for p in body["group"]]
          process = group[int(body["member"])]
          some = local_format.decode_manifest(
            bytes.fromhex(next(iter(body["manifests"].values()))), where
          )
        except (OSError, CorruptCheckpointError, KeyError, TypeError, ValueError, StopIteration):
          continue  # checked again if a rebuild needs it
        if some.get("run_id") != self._run_id:
          continue
        copy = Copy.of({**some, "process_index": process})
        fp = some.get("topology") or {}
        positions = [topology_lib.slice_position_of(fp, p) for p in group]
        if copy is None or None in positions:
          continue
        out.setdefault(step, {}).setdefault(process, Parity(where, copy, positions, body))
    return out

  def copies(self) -> dict[int, dict[int, tuple[str, Copy]]]:
    """{step: {saved process: (folder, Copy)}} of every copy of this run
    that usable_steps() found on this host, whatever topology wrote it
    (what a restore onto another mesh reshards: reshard.py)."""
    return self._copies

  @staticmethod
  def _partner_folders(folders: Sequence[str]) -> list[str]:
    """The `partner/process_<i>` folders inside `folders` (peer/partner.py)."""
    out = []
    for folder in folders:
      root = os.path.join(folder, layout.PARTNER_DIR)
      try:
        names = sorted(os.listdir(root))
      except OSError:
        continue
      for name in names:
        path = os.path.join(root, name)
        if layout.process_of_dir_name(name) is not None and not os.path.islink(path):
          out.append(path)
    return out

  def _other_folders(self) -> list[str]:
    """The other `process_<i>` folders of this run on this host (real
    folders only, never links)."""
    run = os.path.dirname(self.directory)
    try:
      names = os.listdir(run)
    except OSError:
      return []
    out = []
    for name in sorted(names):
      path = os.path.join(run, name)
      if (
        layout.process_of_dir_name(name) is not None
        and path != self.directory
        and not os.path.islink(path)
        and os.path.isdir(path)
        and layout.process_of_dir_name(name) not in self._colocated
        and not local_owner.held(path)
      ):
        out.append(path)
    return out

  def set_colocated(self, processes) -> None:
    """The processes of this job on this machine (the placement check's
    group): their folders are live, never taken as copies, even before
    their managers hold them."""
    self._colocated = {int(p) for p in processes}

  def held_steps(self) -> list[int]:
    """This process's own steps, and those usable_steps() found in other
    processes' folders on this host or written on another mesh (copies()):
    what retention manages."""
    return sorted(set(self.steps()) | set(self.adopted_steps()) | set(self._copies))

  def adopted_steps(self) -> dict[int, str]:
    """{step: folder} of the copies usable_steps() found in other processes'
    folders (deleted by apply_retention like this process's own)."""
    return {s: w for s, w in self._sources.items() if not w.startswith(self.directory + os.sep)}

  def _cleanup_tmp(self) -> None:
    """Removes what a crashed incarnation left: saves in progress, spares and
    deletions (`.tmp-*`), and Orbax's own temporary folders
    (`*.orbax-checkpoint-tmp*`, e.g. of a plain Orbax save into this folder)."""
    layout.remove_tmp(self.directory, also=lambda name: layout.ORBAX_TMP_MARK in name)

  # ---- save ----------------------------------------------------------------
  def write_async(
    self, staged: HostSnapshot, on_done: Callable[[WriteResult], None] | None = None
  ) -> concurrent.futures.Future:
    """Writes a host snapshot in the background, then releases it (its
    buffer may be reused); the future gives a WriteResult. Blocks on nothing."""

    def run() -> WriteResult:
      t0 = time.perf_counter()
      try:
        self._write(staged)
        result = WriteResult(staged.step, True, staged.layout.nbytes, time.perf_counter() - t0)
      except OSError as e:
        logger.warning(
          "%s local save of step %d failed and was discarded: %s",
          self._topology.log_prefix(),
          staged.step,
          e,
        )
        result = WriteResult(staged.step, False, 0, time.perf_counter() - t0, str(e))
      finally:
        staged.release()
      if on_done is not None:
        on_done(result)
      return result

    return self._writer.submit(run)

  def _write(self, staged: HostSnapshot) -> None:
    """One save, on the writer thread: Orbax's checkpointer writes the step
    into a fresh `.tmp-step_<N>-<hex>` folder (into a spare file if one
    fits) and renames it into place. Raises OSError (the folder is gone)."""
    final = self.step_dir(staged.step)
    failpoints.hit("local.before_write", staged.step)
    staged.wait_filled()
    staged.wait_others_staged()
    if os.path.lexists(final):  # a leftover of an earlier incarnation: Orbax
      self.delete(staged.step, recycle=True)  # never overwrites; its file may serve
    spare = self._take_spare(staged.layout.nbytes)
    args = _handler().LocalShardsSave(
      staged,
      run_id=self._run_id,
      process_index=self._topology.process_index,
      slice_index=self._topology.slice_index,
      topology=self._recorded_topology(),
      spare=None if spare is None else os.path.join(spare, local_format.SHARDS),
    )
    try:
      self.open().save(final, args=args)
    finally:
      if spare is not None:  # empty unless the save failed before taking its file
        shutil.rmtree(spare, ignore_errors=True)
    failpoints.hit("local.after_rename", staged.step)

  def _recorded_topology(self) -> dict:
    """The fingerprint, with the slice grid (reshard.py) when known."""
    fp = self._topology.fingerprint()
    if self._topology.slice_grid is not None:
      fp["slice_grid"] = list(self._topology.slice_grid)
    return fp

  def _take_spare(self, nbytes: int) -> str | None:
    """A spare folder whose shards.bin has exactly `nbytes` (taken off the
    list), or None; spares of another size are removed."""
    while True:
      with self._spare_lock:
        spare = self._spares.pop() if self._spares else None
      if spare is None:
        return None
      try:
        if os.stat(os.path.join(spare, local_format.SHARDS)).st_size == nbytes:
          return spare
      except OSError:  # gone (the ramdisk was wiped): try the next one
        pass
      shutil.rmtree(spare, ignore_errors=True)  # another layout's size

  def wait(self) -> None:
    """Blocks until every queued write finished."""
    self._writer.wait_queued()

  # ---- read ----------------------------------------------------------------
  def read(self, step: int, paths: Sequence[str], abstract: Sequence[Any]) -> LocalStep:
    """Reads and verifies this process's shards of `step` for `abstract`,
    through the checkpointer's restore. Its shards.bin is never recycled
    afterwards (the arrays alias it). Blocks on one checksum pass.

    Raises CorruptCheckpointError (bad bytes, or not a plain step folder),
    OSError (files absent), TopologyMismatchError (needed shards absent) or
    StateMismatchError (tree/shape/dtype differ).
    """
    where = self._sources.get(step, self.step_dir(step))
    if os.path.islink(where) or not os.path.isdir(where):
      raise CorruptCheckpointError(
        f"{where} is not a step folder the local tier wrote (a symlink, or not a folder)"
      )
    return local_read.read_step(
      where, abstract=list(abstract), paths=list(paths), on_map=self._note_mapped
    )

  def read_copy(self, where: str, *, verify: bool = True) -> LocalStep:
    """Every shard of the copy in `where` (a folder copies() lists),
    verified (verify=False: not yet, see local_read.read_step); its file is
    never recycled afterwards. Blocks on one checksum pass. Raises OSError
    or CorruptCheckpointError."""
    if os.path.islink(where) or not os.path.isdir(where):
      raise CorruptCheckpointError(f"{where} is not a step folder the local tier wrote")
    return local_read.read_step(where, on_map=self._note_mapped, verify=verify)

  def xor_files(self, where: str, parity: Parity) -> dict[tuple[int, str], Any]:
    """{(process, "data"): the copy's shards.bin in `where`, (process,
    "parity"): its parity block}, mapped (never recycled afterwards); the
    block checked against its CRC32C. Raises OSError or
    CorruptCheckpointError."""
    out = {}
    for kind, path in (
      ("data", os.path.join(where, local_format.SHARDS)),
      ("parity", os.path.join(parity.where, xor_lib.PARITY_FILE)),
    ):
      with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        self._note_mapped(st)
        out[(parity.copy.process, kind)] = local_format.map_open(f, st.st_size, where)
    block = out[(parity.copy.process, "parity")]
    if len(block) != parity.body.get("parity_nbytes") or crc32c.crc32c(block) != parity.body.get(
      "parity_crc32c"
    ):
      raise CorruptCheckpointError(f"{parity.where}/{xor_lib.PARITY_FILE} fails its checksum")
    return out

  def mapped(self, st: os.stat_result) -> bool:
    """Whether a read mapped the file of `st` (restored arrays may alias its
    pages: it must never be written over). Any thread."""
    with self._spare_lock:
      return (st.st_dev, st.st_ino) in self._mapped

  def _note_mapped(self, st: os.stat_result) -> None:
    with self._spare_lock:
      self._mapped.add((st.st_dev, st.st_ino))

  # ---- delete --------------------------------------------------------------
  def delete(self, step: int, *, recycle: bool = False) -> None:
    """Deletes one of this process's steps (renamed away first), or else the
    copy of it usable_steps() found in another process's folder. With
    `recycle`, its shards.bin is kept as a spare for a later save to write
    into, unless this process mapped it (read()) or enough spares exist."""
    doomed = layout.rename_out_of_namespace(self.step_dir(step))
    self._drop_adopted(step)
    if doomed is None:
      return
    if recycle and self._keep_as_spare(doomed):
      return
    layout.remove_renamed(doomed)

  def _keep_as_spare(self, doomed: str) -> bool:
    if os.path.islink(doomed):
      return False
    try:
      st = os.stat(os.path.join(doomed, local_format.SHARDS), follow_symlinks=False)
    except OSError:
      return False
    with self._spare_lock:
      if (
        self._closed
        or len(self._spares) >= self._max_spares
        or not stat.S_ISREG(st.st_mode)
        or (st.st_dev, st.st_ino) in self._mapped
      ):
        return False
      spare = os.path.join(self.directory, layout.spare_dir_name())
      try:
        os.rename(doomed, spare)
        for name in os.listdir(spare):
          if name != local_format.SHARDS:
            os.unlink(os.path.join(spare, name))
      except OSError:
        return False
      self._spares.append(spare)
    return True

  def apply_retention(self, keep: set[int], among: Sequence[int] | None = None) -> list[int]:
    """Deletes held steps (held_steps()) not in `keep`, considering only
    `among` (the listing `keep` was computed from: a step written since is
    never touched) or, if None, a fresh listing; this process's own files
    become spares for later saves. Returns the deleted steps."""
    doomed = [s for s in (self.held_steps() if among is None else among) if s not in keep]
    for s in doomed:
      self.delete(s, recycle=True)  # own, else a copy another process left here
    return doomed

  def _drop_adopted(self, step: int) -> None:
    """Deletes the copies of `step` usable_steps() found in other processes'
    folders (renamed away first), never a live folder's."""
    found = [w for w, _ in self._copies.pop(step, {}).values()]
    found.append(self._sources.pop(step, None))
    for where in dict.fromkeys(found):
      if where is None or where.startswith(self.directory + os.sep):
        continue
      if not local_owner.held(os.path.dirname(where)):
        gone = layout.rename_out_of_namespace(where)
        if gone is not None:
          layout.remove_renamed(gone)

  def close(self) -> None:
    """Waits for writes, then removes the spares and lets go of the folder."""
    self.wait()
    with self._open_lock:
      if self._checkpointer is not None:
        self._checkpointer.close()
    with self._spare_lock:
      self._closed = True
      spares, self._spares = self._spares, []
    for spare in spares:
      shutil.rmtree(spare, ignore_errors=True)
    local_owner.release(self._owner)
    self._owner = None
    if self._own_background:
      self._background.close()


def _handler() -> Any:
  """The local_handler module. It loads Orbax, so it is imported when a tier
  is created (as persistent_tier does), not with this module."""
  from emergency_ckpt.local import handler as local_handler  # noqa: PLC0415

  return local_handler
