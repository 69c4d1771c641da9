"""The local tier's step format as an Orbax checkpoint handler.

A local copy is written and read through Orbax's checkpointer API: a
synchronous `LocalCheckpointer` (an `ocp.Checkpointer`) driving
`LocalShardsHandler`, called on the local tier's own writer thread. The
format is local_format's, byte for byte (raw `shards.bin`, `manifest.json`
with a CRC32C per shard); Orbax adds no file. Any local copy also opens with
plain Orbax:

  ocp.Checkpointer(LocalShardsHandler()).restore(step_dir)  # every shard
  ocp.Checkpointer(LocalShardsHandler()).restore(
      step_dir, args=LocalShardsRestore(abstract=abstract_tree))  # this process's

Both return a verified local_format.LocalStep; `metadata()` gives the manifest.

What it costs (256 MiB per save on /dev/shm, 2 cores; medians of interleaved
runs against the plain writer thread it replaced): durable 1.00-1.04x as late,
+0.4-0.7 ms fixed per save, no extra stall, no barrier and no thread (also
../shared/notes/orbax-local-handler.md). That holds only with the settings here:
- every process is its own Orbax world (`primary_host=None`,
  `active_processes={this process}`, a per-process barrier prefix): each
  process sync in Orbax's checkpointer paths is skipped;
- `synchronize_next_awaitable_signal_operation_id` does nothing: Orbax's
  operation id is one counter per process, shared with the persistent
  tier's checkpointer, whose signal keys between processes carry it (the
  primary announces the step folder's creation under its id); a local save
  that moved it on one process only (uneven saves, or one racing the upload
  thread) made the persistent tier's barriers time out;
- a metadata store that writes nothing (no `_CHECKPOINT_METADATA`, no
  warnings) and `LocalTemporaryPath`: a `.tmp-<name>-<hex>` folder created
  0700, which the tier's start-up cleanup removes after a crash, finalized
  by one plain rename (no `commit_success.txt`).

Imports Orbax: the tier loads this module when it is created; offline tools
(local_format, layout) never do.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import crc32c
import orbax.checkpoint as ocp
from etils import epath

from emergency_ckpt.core import failpoints, layout
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import read as local_read
from emergency_ckpt.local.format import LocalStep

if TYPE_CHECKING:
  from emergency_ckpt.runtime.staging import HostSnapshot


def _absl_flags_parsed() -> None:
  # Orbax reads absl flags; outside absl.app.run they must count as parsed.
  try:
    from absl import flags  # noqa: PLC0415

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
  except ImportError:  # pragma: no cover - absl ships with orbax
    pass


_absl_flags_parsed()

_CHUNK = 4 << 20  # a written piece is still in cache for its CRC32C


# ---- the handler ------------------------------------------------------------------
class LocalShardsHandler(ocp.CheckpointHandler):
  """Writes and reads one process's local step folder (local_format).

  Stateless: one instance may serve a save on one thread while another
  thread reads. Called by: an Orbax checkpointer (the local tier's
  LocalCheckpointer, or a plain ocp.Checkpointer); blocks on the file I/O.
  """

  def save(self, directory: epath.Path, args: LocalShardsSave) -> None:
    """Writes `shards.bin` (into `args.spare` if given: the file is moved
    into `directory` first) and then `manifest.json`, both fsync'ed.
    Raises OSError on an I/O error (the caller discards the folder)."""
    where = os.fspath(directory)
    path = os.path.join(where, local_format.SHARDS)
    if args.spare is not None:
      try:
        os.rename(args.spare, path)  # same file system: the file, not its bytes
      except FileNotFoundError:  # gone (the ramdisk was wiped): a new file then
        pass
    snapshot = args.snapshot
    crcs = write_shards(path, snapshot)
    body = local_format.manifest_body(
      snapshot.layout,
      crcs,
      step=snapshot.step,
      run_id=args.run_id,
      process_index=args.process_index,
      slice_index=args.slice_index,
      topology=args.topology,
    )
    with open(os.path.join(where, local_format.MANIFEST), "wb") as f:
      f.write(local_format.encode_manifest(body))
      f.flush()
      os.fsync(f.fileno())

  def restore(self, directory: epath.Path, args: LocalShardsRestore | None = None) -> LocalStep:
    """The step's shards, verified (local_read.read_step: those `args`
    describe, or every saved shard if it gives no abstract state)."""
    args = LocalShardsRestore() if args is None else args
    return local_read.read_step(
      os.fspath(directory), abstract=args.abstract, paths=args.paths, on_map=args.on_map
    )

  def metadata(self, directory: epath.Path) -> dict:
    """The step's manifest body (tree, shapes, dtypes, shards, identity);
    reads no shard."""
    return local_format.read_manifest(os.fspath(directory))

  def finalize(self, directory: epath.Path) -> None:
    """Nothing: both files are durable when save() returns; the rename into
    place is LocalTemporaryPath.finalize (Orbax calls it next)."""


@ocp.args.register_with_handler(LocalShardsHandler, for_save=True)
@dataclasses.dataclass
class LocalShardsSave(ocp.args.CheckpointArgs):
  """What a local save writes: a host snapshot and the manifest's identity."""

  snapshot: HostSnapshot
  """This process's shards (staging.py); the handler only reads its buffer."""
  run_id: str
  process_index: int
  slice_index: int
  topology: dict
  """Topology.fingerprint(): a copy serves only the topology that wrote it."""
  spare: str | None = None
  """A retired step's shards.bin to write into (same file system; moved into
  the new step folder): its tmpfs pages are reused, none allocated."""


@ocp.args.register_with_handler(LocalShardsHandler, for_restore=True)
@dataclasses.dataclass
class LocalShardsRestore(ocp.args.CheckpointArgs):
  """Which shards to read: those of `abstract` on this process. With no
  abstract state, every shard the step holds."""

  abstract: Any = None
  """Abstract arrays with shardings: a pytree, or with `paths` the flat list."""
  paths: Sequence[str] | None = None
  """keystr paths of the flat `abstract` (shards.leaf_paths); None: `abstract`
  is a pytree."""
  on_map: Callable[[os.stat_result], None] | None = None
  """Called with the shards.bin file's stat before it is mapped (the local
  tier never recycles a file it handed out)."""


def write_shards(path: str, staged: HostSnapshot) -> list[list[int]]:
  """pwrite()s the staged buffer's first `layout.nbytes` bytes to `path`
  (created, or a recycled file), the padding between shards included, so
  the file holds exactly the bytes XOR parity sent from the buffer during
  the write was made of (redundancy_overlap); returns each shard's CRC32C,
  computed on the piece just written while it is still in cache. Blocks on
  the writes."""
  buf = staged.buffer
  nbytes = staged.layout.nbytes
  crash_at = nbytes // 2 if failpoints.armed("local.mid_write", staged.step) else None
  crcs = [[0] * len(leaf.slots) for leaf in staged.layout.leaves]
  spans = sorted(
    (slot.offset, slot.offset + slot.nbytes, i, j)
    for i, leaf in enumerate(staged.layout.leaves)
    for j, slot in enumerate(leaf.slots)
  )
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
  try:

    def write(pos: int, end: int, shard: tuple[int, int] | None) -> None:
      crc = 0
      while pos < end:
        piece = buf[pos : min(end, pos + _CHUNK)]
        if shard is not None:
          crc = crc32c.crc32c(piece, crc)
        pos += os.pwrite(fd, piece, pos)
        if crash_at is not None and pos >= crash_at:
          failpoints.hit("local.mid_write", staged.step)  # a crash test: half written
      if shard is not None:
        crcs[shard[0]][shard[1]] = crc

    pos = 0
    for start, end, i, j in spans:
      write(pos, start, None)  # the padding before the shard
      write(start, end, (i, j))
      pos = end
    write(pos, nbytes, None)
    if os.fstat(fd).st_size != nbytes:  # a longer recycled file
      os.ftruncate(fd, nbytes)
    os.fsync(fd)  # a no-op on tmpfs, needed on a disk
    return crcs
  finally:
    os.close(fd)


# ---- the temporary folder ------------------------------------------------------------
def _tmp_name(final_name: str) -> str:
  step = layout.step_of_dir_name(final_name)
  if step is not None:
    return layout.tmp_step_dir_name(step)  # .tmp-step_<N>-<hex>
  return f"{layout.TMP_PREFIX}{final_name}-{os.urandom(4).hex()}"


def _final_name(tmp_name: str) -> str:
  if not tmp_name.startswith(layout.TMP_PREFIX) or "-" not in tmp_name[len(layout.TMP_PREFIX) :]:
    raise ValueError(f"{tmp_name!r} is not a local temporary folder (.tmp-<name>-<hex>)")
  return tmp_name[len(layout.TMP_PREFIX) :].rsplit("-", 1)[0]


class LocalTemporaryPath(ocp.path.atomicity.AtomicRenameTemporaryPath):
  """Orbax's atomic-rename protocol with the local tier's names: a save
  writes into `.tmp-<name>-<hex>` beside the final folder (a `.tmp-*` name:
  never listed as a step, removed by the tier's start-up cleanup), created
  0700, renamed into place once complete. Adds no file (no
  commit_success.txt, no step metadata) and starts no thread.

  Called by: Orbax's Checkpointer.save, on the saving thread."""

  @classmethod
  def from_final(
    cls,
    final_path: epath.PathLike,
    *,
    checkpoint_metadata_store: Any = None,
    file_options: Any = None,
    snapshot_type: Any = None,
  ) -> LocalTemporaryPath:
    final = epath.Path(final_path)
    return cls(
      final.parent / _tmp_name(final.name),
      final,
      checkpoint_metadata_store=checkpoint_metadata_store,
      file_options=file_options,
    )

  @classmethod
  def from_temporary(
    cls, temporary_path: epath.PathLike, *, file_options: Any = None, snapshot_type: Any = None
  ) -> LocalTemporaryPath:
    tmp = epath.Path(temporary_path)
    return cls(tmp, tmp.parent / _final_name(tmp.name), file_options=file_options)

  @classmethod
  async def validate(cls, temporary_path: epath.PathLike) -> None:
    path = os.fspath(temporary_path)
    name = os.path.basename(path)
    if os.path.islink(path) or not layout.is_tmp_name(name) or not os.path.isdir(path):
      raise ocp.path.atomicity.ValidationError(f"{path} is not a local temporary folder")

  @classmethod
  async def validate_final(cls, final_path: epath.PathLike) -> None:
    path = os.fspath(final_path)
    name = os.path.basename(path)
    if (
      os.path.islink(path)
      or layout.is_tmp_name(name)
      or layout.ORBAX_TMP_MARK in name
      or not os.path.isdir(path)
    ):
      raise ocp.path.atomicity.ValidationError(
        f"{path} is not a finished local step folder (a symlink, a temporary name, or no folder)"
      )

  async def create(self) -> epath.Path:
    """Creates the temporary folder, 0700 (FileExistsError if it exists:
    its name is fresh)."""
    os.mkdir(self.get(), 0o700)
    return self.get()

  async def finalize(self) -> None:
    """Renames the finished folder into place (the commit: the step is listed
    from now on). Raises OSError if the final name is taken by a folder that
    is not empty."""
    failpoints.hit("local.before_rename", layout.step_of_dir_name(self.get_final().name))
    os.rename(self.get(), self.get_final())


# ---- the checkpointer ------------------------------------------------------------------
class LocalCheckpointer(ocp.Checkpointer):
  """A synchronous Orbax checkpointer for one process's own folder: no
  collective, no barrier, no thread, and Orbax's shared operation id left
  alone. save() on failure removes its temporary folder.

  Called by: the local tier's writer thread (save) and restoring threads
  (restore); blocks on the file I/O only."""

  def __init__(
    self,
    *,
    process_index: int,
    barrier_prefix: str = "ec_local",
    handler: LocalShardsHandler | None = None,
  ):
    """`process_index`: this process's index (Orbax's process_index(), i.e.
    jax.process_index()); it alone takes part in each save."""
    super().__init__(
      LocalShardsHandler() if handler is None else handler,
      multiprocessing_options=ocp.options.MultiprocessingOptions(
        primary_host=None,  # every process writes its own folder
        active_processes={process_index},  # so Orbax skips every process sync
        barrier_sync_key_prefix=f"{barrier_prefix}_p{process_index}",
      ),
      checkpoint_metadata_store=ocp.metadata.metadata_store(
        enable_write=False, blocking_write=True
      ),
      temporary_path_class=LocalTemporaryPath,
    )
    self._saving = threading.local()

  def synchronize_next_awaitable_signal_operation_id(self) -> None:
    """Does nothing. Orbax's version advances the process-wide operation id
    that the persistent tier's checkpointer puts in the keys its processes
    signal each other under: a local save on one process only (or one that
    raced the upload thread) would make them look for each other's signals
    under different ids, and the persistent barriers time out
    (tests/test_local_handler.py). A save with no barrier needs no id."""

  def get_temporary_path(self, directory: epath.Path) -> Any:
    tmp = super().get_temporary_path(directory)
    self._saving.tmp = tmp.get()
    return tmp

  def save(self, directory: epath.PathLike, *args: Any, **kwargs: Any) -> None:
    """Orbax's save; if it raises, the temporary folder (and whatever was
    written into it) is removed. Raises ValueError if `directory` exists."""
    self._saving.tmp = None
    try:
      super().save(directory, *args, **kwargs)
    except BaseException:
      tmp = self._saving.tmp
      if tmp is not None:
        shutil.rmtree(os.fspath(tmp), ignore_errors=True)
      raise
    finally:
      self._saving.tmp = None
