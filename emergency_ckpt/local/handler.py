"""The local tier's step format as an Orbax checkpoint handler.

A local copy is written and read through Orbax's checkpointer API: a
synchronous `LocalCheckpointer` (checkpointer.py: an `ocp.Checkpointer`
that touches no barrier or shared Orbax state) driving `LocalShardsHandler`,
called on the local tier's own writer thread. The format is format.py's,
byte for byte (raw `shards.bin`, `manifest.json` with a CRC32C per shard);
Orbax adds no file. Any local copy also opens with plain Orbax:

  ocp.Checkpointer(LocalShardsHandler()).restore(step_dir)  # every shard
  ocp.Checkpointer(LocalShardsHandler()).restore(
      step_dir, args=LocalShardsRestore(abstract=abstract_tree))  # this process's

Both return a verified format.LocalStep; `metadata()` gives the manifest.

Why not Orbax's own handlers: zarr3 + zstd through tensorstore, with
barriers across processes, is many times slower than a raw ramdisk write,
and a ramdisk copy is only useful if it is nearly free. Orbax's
CheckpointManager (its own retention, a `default/` subfolder, a fixed cost
per save, settings shared with the persistent tier's manager) is not used
either.

Imports Orbax: the tier loads this module when it is created; offline tools
(format.py, core/layout.py) never do.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import crc32c
import orbax.checkpoint as ocp
from etils import epath

from emergency_ckpt.core import failpoints
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
  """Writes and reads one process's local step folder (format.py).

  Stateless: one instance may serve a save on one thread while another
  thread reads. Called by: an Orbax checkpointer (the local tier's
  LocalCheckpointer, or a plain ocp.Checkpointer); blocks on the file I/O.
  """

  def save(self, directory: epath.Path, args: LocalShardsSave) -> None:
    """Writes `shards.bin` (into `args.spare` if given: the file is moved
    into `directory` first) and then `manifest.json`, both fsync'ed.

    Args:
      directory: the step's (temporary) folder.
      args: what to write.

    Raises:
      OSError: an I/O error (the caller discards the folder).
    """
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
    """Reads a step's shards, verified (read.read_step).

    Args:
      directory: the step's folder.
      args: which shards (None, or no abstract state: every saved shard).

    Returns:
      The verified shards.

    Raises:
      OSError, CorruptCheckpointError, TopologyMismatchError,
      StateMismatchError: as read.read_step.
    """
    args = LocalShardsRestore() if args is None else args
    return local_read.read_step(
      os.fspath(directory), abstract=args.abstract, paths=args.paths, on_map=args.on_map
    )

  def metadata(self, directory: epath.Path) -> dict:
    """Reads a step's manifest; no shard.

    Args:
      directory: the step's folder.

    Returns:
      Its body (tree, shapes, dtypes, shards, identity).

    Raises:
      OSError, CorruptCheckpointError: as format.read_manifest.
    """
    return local_format.read_manifest(os.fspath(directory))

  def finalize(self, directory: epath.Path) -> None:
    """Nothing: both files are durable when save() returns; the rename into
    place is LocalTemporaryPath.finalize (Orbax calls it next).

    Args:
      directory: the step's (temporary) folder.
    """


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
  """pwrite()s the staged buffer's first `layout.nbytes` bytes to a file,
  the padding between shards included, so the file holds exactly the bytes
  XOR parity sent from the buffer during the write was made of
  (redundancy_overlap). Blocks on the writes.

  Args:
    path: the file (created, or a recycled one).
    staged: the host snapshot.

  Returns:
    Per leaf, each shard's CRC32C, computed on the piece just written while
    it is still in cache.

  Raises:
    OSError: a write failed.
  """
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
