"""Local tier: each process writes the shards it holds to its own ramdisk folder.

Layout (per process):
  <directory>/<run_id>/process_<i>/step_<N>/shards.bin     raw shard bytes
  <directory>/<run_id>/process_<i>/step_<N>/manifest.json  tree, shards, CRC32Cs
  <directory>/<run_id>/process_<i>/.tmp-step_<N>-<uuid>/   a save in progress
  <directory>/<run_id>/process_<i>/.tmp-spare-<uuid>/      a retired step's file, reused
A step exists only once its folder is renamed from .tmp-*, after both files
are written, so a crash never leaves a listed partial step. One step's
format: format.py; the spare files a save writes over: spares.py; what the
folder keeps for other processes: blocks.py; the copies other processes
left on this host: discovery.py.

The writer thread saves a host snapshot (staging.py) through Orbax's
checkpointer API (checkpointer.py, with no process sync, barrier or shared
Orbax state: uneven local saves never disturb the persistent tier's
barriers) driving the handler (handler.py), which pwrite()s the buffer,
each shard's CRC32C summed on the chunk it writes, then the manifest, into
a `.tmp-step_<N>-<hex>` folder renamed into place. Reads need no Orbax
(read.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from emergency_ckpt.cluster.topology import Topology
from emergency_ckpt.core import failpoints, gc_pause, layout
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local import blocks, discovery, folders
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import owner as local_owner
from emergency_ckpt.local import read as local_read
from emergency_ckpt.local.discovery import Copy, Parity
from emergency_ckpt.local.format import LocalStep
from emergency_ckpt.local.spares import Spares
from emergency_ckpt.options import LocalTierOptions
from emergency_ckpt.runtime.background import Background
from emergency_ckpt.runtime.staging import HostSnapshot

if TYPE_CHECKING:
  from emergency_ckpt.local.checkpointer import LocalCheckpointer

logger = logging.getLogger("emergency_ckpt")


@dataclasses.dataclass(frozen=True)
class WriteResult:
  """How one local save ended (write_async's future and callback)."""

  step: int
  ok: bool
  nbytes: int
  durable_s: float
  error: str | None = None
  manifest: bytes | None = None  # the raw manifest written (redundancy trailers send it)


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
    checkpointer. Reading never needs Orbax. Raises UnsafeDirectoryError
    (owner.secure_makedirs)."""
    self._options = options
    self._topology = topology
    self._run_id = run_id
    self.directory = layout.process_dir(
      os.path.abspath(options.root), run_id, topology.process_index
    )
    self._make_folders()
    self._own_background = background is None
    self._background = Background(topology.log_prefix()) if background is None else background
    self._writer = self._background.lane("local-write")
    # one per write that may run at once
    self._spares = Spares(self.directory, max_spares=options.staging_buffers)
    # the copies on this host beyond this process's own steps (usable_steps)
    self._host = discovery.HostCopies(self.directory, run_id=run_id, topology=topology)
    # Orbax's checkpointer API over this folder alone (handler.py), opened
    # on first use: loading Orbax is off the restore path.
    self._orbax_ready = orbax_ready
    self._checkpointer: LocalCheckpointer | None = None
    self._open_lock = threading.Lock()
    self._owner = local_owner.take(self.directory, topology.log_prefix())
    if self._owner is not None:  # what crashed incarnations left here and in dead folders
      self._host.clean_up()

  def _open(self) -> LocalCheckpointer:
    """The tier's Orbax checkpointer, created on first use (after
    `orbax_ready`), on the writer thread: blocks on loading Orbax the first
    time."""
    if self._checkpointer is None and self._orbax_ready is not None:
      self._orbax_ready()  # never under the lock: the warm-up may take a while
    with self._open_lock:
      if self._checkpointer is None:
        from emergency_ckpt.local.checkpointer import LocalCheckpointer  # noqa: PLC0415

        self._checkpointer = LocalCheckpointer(
          process_index=self._topology.process_index, barrier_prefix=f"ec_local_{self._run_id}"
        )
      return self._checkpointer

  # ---- listing -------------------------------------------------------------
  def step_dir(self, step: int) -> str:
    """Returns the folder of this process's own `step` (present or not)."""
    return layout.local_step_dir(self.directory, step)

  def steps(self) -> list[int]:
    """Returns this process's committed steps (renamed into place with a
    manifest), oldest first."""
    return folders.list_local_steps(self.directory)

  def manifest(self, step: int) -> dict:
    """Returns the manifest body of this process's own `step`.

    Raises:
      OSError: it is absent.
      CorruptCheckpointError: it is torn or altered.
    """
    return local_format.read_manifest(self.step_dir(step))

  def step_bytes(self, step: int) -> int | None:
    """Returns the bytes of `step`'s files, or None if this process holds no
    such step (its own, or the copy usable_steps() last found elsewhere)."""
    if step in self.steps():
      d = self.step_dir(step)
    elif step in self._host.adopted():
      d = self._host.sources[step]
    else:
      return None
    try:
      return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    except OSError:  # deleted meanwhile
      return None

  def usable_steps(self) -> tuple[list[int], dict[int, str]]:
    """Lists this process's own folder, then those other processes of this
    run left on this host (discovery.py), remembering where each step's
    copy is for read(), and every copy and parity block (copies(), parity()).

    Returns:
      (readable steps, {step: why not} for this process's own steps that
      it cannot read).
    """
    with gc_pause.paused():  # a manifest of many leaves per step
      return self._host.scan()

  def parity(self) -> dict[int, dict[int, Parity]]:
    """Returns {step: {saved process: Parity}}: the XOR parity blocks
    usable_steps() found in this host's process folders (redundancy/xor.py)."""
    return self._host.parity

  def copies(self) -> dict[int, dict[int, tuple[str, Copy]]]:
    """Returns {step: {saved process: (folder, Copy)}}: every copy of this
    run usable_steps() found on this host, whatever topology wrote it (what
    a restore onto another mesh reshards: core/reshard.py)."""
    return self._host.copies

  def set_colocated(self, processes: Iterable[int]) -> None:
    """The processes of this job on this machine (the placement check's
    group): their folders are live, never taken as copies, even before
    their managers hold them.

    Args:
      processes: their process indices.
    """
    self._host.set_colocated(processes)

  def held_steps(self) -> list[int]:
    """Returns this process's own steps, and those usable_steps() found in
    other processes' folders on this host or written on another mesh
    (copies()): what retention manages."""
    return sorted(set(self.steps()) | set(self._host.adopted()) | set(self._host.copies))

  # ---- save ----------------------------------------------------------------
  def write_async(
    self, staged: HostSnapshot, on_done: Callable[[WriteResult], None] | None = None
  ) -> concurrent.futures.Future:
    """Writes a host snapshot in the background, then releases it (its
    buffer may be reused). Blocks on nothing.

    Args:
      staged: the snapshot (staging.py).
      on_done: called on the writer thread with the result.

    Returns:
      A future of the WriteResult (a failed write is logged, not raised).
    """

    def run() -> WriteResult:
      t0 = time.perf_counter()
      try:
        self._write(staged)
        # read now: retention may drop the step before its redundancy is sent
        manifest = local_format.raw_manifest(self.step_dir(staged.step))
        result = WriteResult(
          staged.step, True, staged.layout.nbytes, time.perf_counter() - t0, manifest=manifest
        )
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
    self._ensure_folder(staged.step)
    if os.path.lexists(final):  # a leftover of an earlier incarnation: Orbax
      self.delete(staged.step, recycle=True)  # never overwrites; its file may serve
    spare = self._spares.take(staged.layout.nbytes)
    args = _handler().LocalShardsSave(
      staged,
      run_id=self._run_id,
      process_index=self._topology.process_index,
      slice_index=self._topology.slice_index,
      topology=self._recorded_topology(),
      spare=None if spare is None else os.path.join(spare, local_format.SHARDS),
    )
    try:
      self._open().save(final, args=args)
    finally:
      if spare is not None:  # empty unless the save failed before taking its file
        shutil.rmtree(spare, ignore_errors=True)
    failpoints.hit("local.after_rename", staged.step)

  def _make_folders(self) -> None:
    """The root (may be /dev/shm itself), the run's and this process's
    folders, each checked (owner.secure_makedirs)."""
    local_owner.secure_makedirs(self._options.root, shared_ok=True)
    for p in (os.path.dirname(self.directory), self.directory):
      local_owner.secure_makedirs(p)

  def _ensure_folder(self, step: int) -> None:
    """Makes this process's folder again if it vanished while the job ran
    (a ramdisk clean-up, an operator's rm): a warning, and the writes go
    on; the steps it held are gone (the peers and the persistent tier
    still have theirs). One lstat per write. Raises OSError
    (UnsafeDirectoryError: a symlink or someone else's folder in its place).
    """
    try:
      if stat.S_ISDIR(os.lstat(self.directory).st_mode):
        return
    except FileNotFoundError:
      pass
    logger.warning(
      "%s the local folder %s vanished while the job ran (deleted by a ramdisk"
      " clean-up or by hand?); it is made again for step %d and the steps it held"
      " are gone: restores use the peers and the persistent tier for them",
      self._topology.log_prefix(),
      self.directory,
      step,
    )
    self._make_folders()
    old, self._owner = self._owner, local_owner.take(self.directory, self._topology.log_prefix())
    local_owner.release(old)

  def _recorded_topology(self) -> dict:
    """The fingerprint, with the slice grid (reshard.py) when known."""
    fp = self._topology.fingerprint()
    if self._topology.slice_grid is not None:
      fp["slice_grid"] = list(self._topology.slice_grid)
    return fp

  def wait(self) -> None:
    """Blocks until every queued write finished."""
    self._writer.wait_queued()

  # ---- read ----------------------------------------------------------------
  def read(self, step: int, paths: Sequence[str], abstract: Sequence[Any]) -> LocalStep:
    """Reads and verifies this process's shards of `step` for `abstract`
    (read.read_step: shards.bin mapped, no copy; on CPU the restored arrays
    alias its pages, so it is never recycled afterwards). Blocks on one
    checksum pass.

    Args:
      step: a step usable_steps() lists.
      paths: the keystr paths of the flat `abstract`.
      abstract: abstract arrays with shardings, one per leaf.

    Returns:
      The verified shards.

    Raises:
      CorruptCheckpointError: bad bytes, or not a plain step folder.
      OSError: files absent.
      TopologyMismatchError: needed shards absent.
      StateMismatchError: tree, shape or dtype differ.
    """
    where = self._host.sources.get(step, self.step_dir(step))
    if os.path.islink(where) or not os.path.isdir(where):
      raise CorruptCheckpointError(
        f"{where} is not a step folder the local tier wrote (a symlink, or not a folder)"
      )
    with gc_pause.paused():
      return local_read.read_step(
        where, abstract=list(abstract), paths=list(paths), on_map=self._spares.note_mapped
      )

  def read_copy(self, where: str, *, verify: bool = True) -> LocalStep:
    """Every shard of the copy in `where`; its file is never recycled
    afterwards. Blocks on one checksum pass.

    Args:
      where: a folder copies() lists.
      verify: False: not checked yet (see read.read_step).

    Returns:
      Every saved shard.

    Raises:
      OSError: files absent.
      CorruptCheckpointError: bad bytes, or not a plain step folder.
    """
    if os.path.islink(where) or not os.path.isdir(where):
      raise CorruptCheckpointError(f"{where} is not a step folder the local tier wrote")
    return local_read.read_step(where, on_map=self._spares.note_mapped, verify=verify)

  def xor_files(self, where: str, parity: Parity) -> dict[tuple[int, str], Any]:
    """The files a rebuild reads in place, mapped (never recycled
    afterwards), the parity block checked against its CRC32C.

    Args:
      where: the folder of the copy `parity` belongs with (copies()).
      parity: a block parity() lists.

    Returns:
      {(process, "data"): the copy's shards.bin, (process, "parity"): the
      block}, as uint8 arrays.

    Raises:
      OSError: a file is absent.
      CorruptCheckpointError: the block fails its checksum.
    """
    with open(os.path.join(where, local_format.SHARDS), "rb") as f:
      st = os.fstat(f.fileno())
      self._spares.note_mapped(st)
      data = local_format.map_open(f, st.st_size, where)
    block = blocks.map_parity(parity.where, parity.body, self._spares.note_mapped)
    return {(parity.copy.process, "data"): data, (parity.copy.process, "parity"): block}

  def mapped(self, st: os.stat_result) -> bool:
    """Returns whether a read mapped the file of `st` (restored arrays may
    alias its pages: it must never be written over). Any thread.

    Args:
      st: the file's stat.
    """
    return self._spares.mapped(st)

  # ---- delete --------------------------------------------------------------
  def delete(self, step: int, *, recycle: bool = False) -> None:
    """Deletes one of this process's steps (renamed away first), or else the
    copy of it usable_steps() found in another process's folder.

    Args:
      step: the step.
      recycle: keep its shards.bin as a spare for a later save to write
        into, unless this process mapped it (read()) or enough spares exist.

    Raises:
      OSError: it could not be renamed or removed.
    """
    doomed = folders.rename_out_of_namespace(self.step_dir(step))
    self._host.drop(step)
    if doomed is None:
      return
    if recycle and self._spares.keep(doomed):
      return
    folders.remove_renamed(doomed)

  def apply_retention(self, keep: set[int], among: Sequence[int] | None = None) -> list[int]:
    """Deletes held steps (held_steps()) not in `keep`, own files kept as spares
    for later saves; then torn folders and dead folders' leftovers (discovery.py).

    Args:
      keep: the steps to keep.
      among: the listing `keep` was computed from (a step written since is
        never touched); None: a fresh listing.

    Returns:
      The deleted steps.
    """
    doomed = [s for s in (self.held_steps() if among is None else among) if s not in keep]
    for s in doomed:
      self.delete(s, recycle=True)  # own, else a copy another process left here
    self._host.sweep(keep, doomed)
    return doomed

  def drop_newer_leftovers(self, restored: int, keep: Collection[int]) -> None:
    """After a restore of `restored`: removes the newer step folders that
    dead processes' folders on this host hold, damaged ones included
    (discovery.HostCopies.drop_newer); `keep` (restorable steps) stays."""
    self._host.drop_newer(restored, keep)

  def close(self) -> None:
    """Waits for writes, then removes the spares and lets go of the folder."""
    self.wait()
    with self._open_lock:
      if self._checkpointer is not None:
        self._checkpointer.close()
    self._spares.close()
    local_owner.release(self._owner)
    self._owner = None
    if self._own_background:
      self._background.close()


def _handler() -> Any:
  """The handler module. It loads Orbax, so it is imported when a tier is
  created (as the persistent tier does), not with this module."""
  from emergency_ckpt.local import handler as local_handler  # noqa: PLC0415

  return local_handler
