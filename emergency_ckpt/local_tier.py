"""Local tier: each process writes the shards it holds to its own ramdisk folder.

Layout (per process; nobody else reads it):
  <directory>/<run_id>/process_<i>/step_<N>/shards.bin     raw shard bytes
  <directory>/<run_id>/process_<i>/step_<N>/manifest.json  tree, shards, CRC32Cs
  <directory>/<run_id>/process_<i>/.tmp-step_<N>-<uuid>/   a save in progress
  <directory>/<run_id>/process_<i>/.tmp-spare-<uuid>/      a retired step's file, reused

A step exists only once its folder is renamed from .tmp-*, after both files are
written, so a crash never leaves a listed partial step. Every shard carries a
CRC32C (hardware, ~8 GB/s here; zlib's CRC32 was 3x slower and a third of a
local save) checked on read; the manifest carries a CRC32 over its own body.

A save copies the shards into a reused, already-faulted host staging buffer
(the only stall: a memcpy); a background thread then pwrite()s the buffer
into the ramdisk, computing each shard's CRC32C on the chunk it writes. The
file it writes into is, in steady state, the shards.bin of a step that local
retention retired (kept as a spare instead of unlinked): the kernel copies
into tmpfs pages that already exist, so no page is allocated, zeroed or
mapped into this process. Per 256 MiB process here: 0.05 cpu-s for that
write, 0.13 into a fresh file; mapping a preallocated file instead (the
design before) cost 0.19 cpu-s of fallocate and page-table work per save.
The price is memory: the staging buffer stays allocated between saves (as
DCP's cached staging buffers do), beside the kept steps and one spare file.

A file this process has mapped to restore from is never reused: restored
arrays alias its pages through a private mapping, which would see the
overwrite. Such a step is unlinked when retired (its pages live on for the
mapping).

Reads map shards.bin (no copy into a private buffer): on CPU the restored
arrays alias those pages (copy-on-write), so a restore costs one checksum pass.

Why not Orbax here: Orbax's local handlers (zarr3 + zstd through tensorstore,
with barriers across processes) measured 6.2x a raw ramdisk write on this
hardware; a ramdisk copy is only useful if it is nearly free. The persistent
tier stays in Orbax's standard format.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import mmap
import os
import re
import shutil
import stat
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import numpy as np

from emergency_ckpt import failpoints
from emergency_ckpt import shards as shards_lib
from emergency_ckpt.colocated import StagingWindow
from emergency_ckpt.errors import (
  CorruptCheckpointError,
  StateMismatchError,
  TopologyMismatchError,
  UnsafeDirectoryError,
)
from emergency_ckpt.options import LocalTierOptions
from emergency_ckpt.topology import Topology, job_key

logger = logging.getLogger("emergency_ckpt")

FORMAT = "emergency_ckpt.local/1"
_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 4 << 20  # a written piece is still in cache for its CRC32C
_PAGE = mmap.PAGESIZE


def shard_checksum(data) -> dict:
  """The checksum record of one shard's bytes (any buffer)."""
  return {"crc32c": crc32c.crc32c(data)}


def checksum_ok(data, record: dict) -> bool:
  """True if `data` matches the shard record's checksum (CRC32C, or the
  CRC32 of manifests written before 0.2)."""
  if "crc32c" in record:
    return crc32c.crc32c(data) == record["crc32c"]
  if "crc32" in record:
    return zlib.crc32(data) == record["crc32"]
  return False


BACKGROUND_NICE = 19


def lower_thread_priority() -> None:
  """Runs the calling thread at the lowest CPU priority (Linux: nice is per
  thread). For background work that only prepares for later (the next
  save's staging buffer): on this 2-core machine, preparing at normal
  priority right after a peer restore made the restore's tail
  (block_until_ready) a median 0.24-0.34 s instead of 0.12-0.13 s, the whole
  restore 0.87-0.92 s instead of 0.64-0.66 s (measured when preparing meant
  allocating and mapping a ramdisk file). Elsewhere a no-op."""
  if not sys.platform.startswith("linux"):
    return
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
  except OSError as e:  # e.g. a sandbox forbids it: only slower
    logger.debug("cannot lower the priority of %s: %s", threading.current_thread().name, e)


def aligned_empty(nbytes: int) -> np.ndarray:
  """An uninitialised uint8 buffer whose start is page-aligned (so views at
  shards.ALIGN offsets can be aliased by jax CPU arrays without a copy)."""
  raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
  start = (-raw.ctypes.data) % _PAGE
  return raw[start : start + nbytes]


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


def _canonical(body: dict) -> bytes:
  return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(body: dict) -> bytes:
  return json.dumps({"body": body, "crc32": zlib.crc32(_canonical(body))}).encode()


def decode_manifest(raw: bytes, where: str) -> dict:
  try:
    doc = json.loads(raw)
    body = doc["body"]
    ok = zlib.crc32(_canonical(body)) == doc["crc32"]
  except (ValueError, KeyError, TypeError) as e:
    raise CorruptCheckpointError(f"{where}: unreadable manifest ({e})") from None
  if not ok:
    raise CorruptCheckpointError(f"{where}: manifest checksum mismatch")
  if body.get("format") != FORMAT:
    raise CorruptCheckpointError(f"{where}: unknown format {body.get('format')!r}")
  return body


@dataclasses.dataclass
class Staged:
  """A step copied to a host staging buffer, waiting to be written."""

  step: int
  layout: shards_lib.Layout
  buffer: np.ndarray
  stall_s: float


@dataclasses.dataclass(frozen=True)
class WriteResult:
  step: int
  ok: bool
  nbytes: int
  durable_s: float
  error: str | None = None


def _fault_in(buf: np.ndarray) -> None:
  """Touches every page of `buf` (its contents are garbage either way), so a
  later copy into it takes no page fault. numpy's large allocations ask for
  transparent huge pages: 0.03 s per 256 MiB here."""
  if buf.nbytes:
    buf[::_PAGE] = 0
    buf[-1] = 0


class _BufferPool:
  """Reused host staging buffers. At most `count` local writes hold one at a
  time (acquire blocks while all are writing); a buffer that something else
  still reads (a background persistent upload, see hold) goes back to the
  free list only when that reader lets go too."""

  def __init__(self, count: int):
    self._sem = threading.Semaphore(count)
    self._count = count
    self._lock = threading.Lock()
    self._ready = threading.Condition(self._lock)  # a preallocated buffer landed
    self._preparing: set[int] = set()  # sizes preallocate() is faulting in now
    self._free: list[np.ndarray] = []
    self._holders: dict[int, int] = {}  # id(buffer) -> readers besides the write
    self._writing: set[int] = set()  # id(buffer) of buffers a local write holds

  def _take_free(self, nbytes: int) -> np.ndarray | None:
    with self._lock:
      while nbytes in self._preparing:  # faulting it in here would cost the same, and double it
        self._ready.wait()
      i = next((i for i, b in enumerate(self._free) if b.nbytes == nbytes), None)
      if i is None:
        self._free.clear()  # the layout changed: drop old sizes
        return None
      return self._free.pop(i)

  def acquire(self, nbytes: int) -> np.ndarray:
    self._sem.acquire()
    buf = self._take_free(nbytes)
    if buf is None:  # the first save of a layout without preallocate(): faults in the copy
      buf = aligned_empty(nbytes)
    with self._lock:
      self._writing.add(id(buf))
    return buf

  def preallocate(self, nbytes: int) -> None:
    """Makes sure a free, faulted-in buffer of `nbytes` exists (so the next
    acquire's copy takes no page fault). Blocks on allocating and touching it."""
    with self._lock:
      if nbytes in self._preparing or any(b.nbytes == nbytes for b in self._free):
        return
      self._preparing.add(nbytes)
    buf = None
    try:
      buf = aligned_empty(nbytes)
      _fault_in(buf)
    finally:
      with self._lock:
        self._preparing.discard(nbytes)
        if buf is not None:
          self._free = [b for b in self._free if b.nbytes == nbytes]
          self._put_back(buf)
        self._ready.notify_all()

  def hold(self, buf: np.ndarray) -> None:
    """One more reader of `buf`; it must call unhold(buf) when done."""
    with self._lock:
      self._holders[id(buf)] = self._holders.get(id(buf), 0) + 1

  def unhold(self, buf: np.ndarray) -> None:
    with self._lock:
      left = self._holders[id(buf)] - 1
      if left:
        self._holders[id(buf)] = left
        return
      del self._holders[id(buf)]
      if id(buf) not in self._writing:
        self._put_back(buf)

  def _put_back(self, buf: np.ndarray) -> None:
    if len(self._free) <= self._count:
      self._free.append(buf)

  def release(self, buf: np.ndarray) -> None:
    """The local write of `buf` is done (frees a write slot at once)."""
    with self._lock:
      self._writing.discard(id(buf))
      if id(buf) not in self._holders:
        self._put_back(buf)
    self._sem.release()

  def clear(self) -> None:
    with self._lock:
      self._free.clear()


@dataclasses.dataclass(frozen=True)
class LocalStep:
  """A verified local step: views into one host buffer, per leaf and index."""

  step: int
  manifest: dict
  arrays: list[dict[shards_lib.Index, np.ndarray]]


class LocalTier:
  """One process's ramdisk folder. All methods are per process: no collectives."""

  def __init__(self, options: LocalTierOptions, *, run_id: str, topology: Topology):
    self._options = options
    self._topology = topology
    self._run_id = run_id
    self.directory = os.path.join(
      os.path.abspath(options.directory), run_id, f"process_{topology.process_index}"
    )
    secure_makedirs(options.directory, shared_ok=True)  # may be /dev/shm itself
    for p in (os.path.dirname(self.directory), self.directory):
      secure_makedirs(p)
    self._pool = _BufferPool(options.staging_buffers)
    self._executor = concurrent.futures.ThreadPoolExecutor(
      max_workers=1, thread_name_prefix="ec-local-write"
    )
    self._preparer = concurrent.futures.ThreadPoolExecutor(
      max_workers=1, thread_name_prefix="ec-local-prepare", initializer=lower_thread_priority
    )
    self._spare_lock = threading.Lock()
    self._spares: list[str] = []  # .tmp-spare-* folders, each holding a retired shards.bin
    self._max_spares = options.staging_buffers  # one per write that may run at once
    self._mapped: set[tuple[int, int]] = set()  # (st_dev, st_ino) of files read() mapped
    self._window = StagingWindow(job_key())  # co-located processes' staging copies
    self._closed = False
    self._cleanup_tmp()

  # ---- listing -------------------------------------------------------------
  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, f"step_{step}")

  def steps(self) -> list[int]:
    """Committed steps (folders renamed into place with a manifest)."""
    out = []
    try:
      names = os.listdir(self.directory)
    except FileNotFoundError:  # the ramdisk was wiped under us
      return []
    for name in names:
      m = _STEP_RE.match(name)
      if m and os.path.isfile(os.path.join(self.directory, name, "manifest.json")):
        out.append(int(m.group(1)))
    return sorted(out)

  def manifest(self, step: int) -> dict:
    path = os.path.join(self.step_dir(step), "manifest.json")
    with open(path, "rb") as f:
      return decode_manifest(f.read(), path)

  def usable_steps(self) -> tuple[list[int], dict[int, str]]:
    """(steps whose manifest is valid and matches this job, {step: why not})."""
    good, bad = [], {}
    fingerprint = self._topology.fingerprint()
    for step in self.steps():
      try:
        body = self.manifest(step)
      except (OSError, CorruptCheckpointError) as e:
        bad[step] = str(e)
        continue
      if body["topology"] != fingerprint or body["run_id"] != self._run_id:
        bad[step] = (
          f"saved with topology {body['topology']}, this job has {fingerprint};"
          " a local copy only serves the topology that wrote it: restore this"
          " step from the persistent tier"
        )
        continue
      good.append(step)
    return good, bad

  def _cleanup_tmp(self) -> None:
    for name in os.listdir(self.directory):
      if name.startswith(".tmp-"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  # ---- save ----------------------------------------------------------------
  def reserve(self, paths: Sequence[str], arrays: Sequence[Any]) -> tuple:
    """A staging buffer for this layout, for stage(reserved=...). Blocks
    while `staging_buffers` local writes are still running: call it before
    staging() (a write waits for the staging window to close)."""
    layout = shards_lib.layout_for(paths, arrays)
    return layout, self._pool.acquire(layout.nbytes)

  def stage(
    self, step: int, paths: Sequence[str], arrays: Sequence[Any], reserved: tuple | None = None
  ) -> Staged:
    """Copies this process's shards to a host staging buffer (`reserved`,
    from reserve(), or one taken here). Blocks on that copy only (and, if
    not reserved, on a free buffer while `staging_buffers` writes run)."""
    t0 = time.perf_counter()
    layout, buffer = reserved if reserved is not None else self.reserve(paths, arrays)
    try:
      shards_lib.stage(arrays, layout, buffer)
    except BaseException:
      self._pool.release(buffer)
      raise
    return Staged(step, layout, buffer, time.perf_counter() - t0)

  def staging(self):
    """A context in which this process counts as staging: co-located
    processes of the job hold their background work until it ends (see
    colocated.py). Called by: the thread that calls stage(). Never blocks;
    nothing inside it may wait for this process's own background work
    (reserve() and the previous upload come first)."""
    return self._window.staging()

  def wait_others_staged(self, staged: Staged) -> float:
    """Blocks until no process of this run on this machine is copying a
    step (capped at 1 s + 4x this process's own copy time); returns the
    seconds waited. Called by: background threads, before memory-heavy
    work on `staged` (see colocated.py)."""
    return self._window.wait_closed(1.0 + 4 * staged.stall_s)

  def prepare(self, paths: Sequence[str], abstract: Sequence[Any]) -> None:
    """Starts allocating and faulting in (in the background) the staging
    buffer that a save of this layout copies into, so that the first save
    does not take a page fault per page inside its stall. Blocks on nothing."""
    nbytes = shards_lib.layout_for(paths, abstract).nbytes
    if self._closed or nbytes == 0:
      return
    self._preparer.submit(self._pool.preallocate, nbytes)

  def hold(self, staged: Staged) -> Callable[[], None]:
    """Keeps `staged.buffer` from reuse (for another reader, e.g. a
    background upload) until the returned function is called, once."""
    self._pool.hold(staged.buffer)
    return lambda: self._pool.unhold(staged.buffer)

  def snapshot_arrays(self, staged: Staged, abstract: Sequence[Any]) -> list[Any]:
    """Global jax.Arrays for `abstract` built from the staged host copy (on
    CPU they alias it: hold() the buffer while they live)."""
    return [
      shards_lib.assemble(
        a, {slot.index: shards_lib.view(staged.buffer, leaf, slot) for slot in leaf.slots}
      )
      for a, leaf in zip(abstract, staged.layout.leaves)
    ]

  def discard(self, staged: Staged) -> None:
    """Gives back a staged step that will not be written locally."""
    self._pool.release(staged.buffer)

  def write_async(
    self, staged: Staged, on_done: Callable[[WriteResult], None] | None = None
  ) -> concurrent.futures.Future:
    """Writes a staged step in the background; the future gives a WriteResult."""

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
        self._pool.release(staged.buffer)
      if on_done is not None:
        on_done(result)
      return result

    return self._executor.submit(run)

  def _write(self, staged: Staged) -> None:
    final = self.step_dir(staged.step)
    failpoints.hit("local.before_write", staged.step)
    self.wait_others_staged(staged)
    tmp = self._open_save_dir(staged.step, staged.layout.nbytes)
    try:
      crcs = self._write_shards(os.path.join(tmp, "shards.bin"), staged)
      leaves = []
      for leaf, leaf_crcs in zip(staged.layout.leaves, crcs):
        leaves.append(
          {
            "path": leaf.path,
            "shape": list(leaf.shape),
            "dtype": shards_lib.dtype_name(leaf.dtype),
            "shards": [
              {
                "index": [list(r) for r in slot.index],
                "offset": slot.offset,
                "nbytes": slot.nbytes,
                "crc32c": crc,
              }
              for slot, crc in zip(leaf.slots, leaf_crcs)
            ],
          }
        )
      body = {
        "format": FORMAT,
        "step": staged.step,
        "run_id": self._run_id,
        "process_index": self._topology.process_index,
        "slice_index": self._topology.slice_index,
        "topology": self._topology.fingerprint(),
        "nbytes": staged.layout.nbytes,
        "saved_at": time.time(),
        "leaves": leaves,
      }
      with open(os.path.join(tmp, "manifest.json"), "wb") as f:
        f.write(encode_manifest(body))
        f.flush()
        os.fsync(f.fileno())
      failpoints.hit("local.before_rename", staged.step)
      if os.path.exists(final):  # a leftover of an earlier incarnation
        shutil.rmtree(final)
      os.rename(tmp, final)
      failpoints.hit("local.after_rename", staged.step)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise

  def _open_save_dir(self, step: int, nbytes: int) -> str:
    """The .tmp-step_<step>-* folder of a save in progress: a spare (a
    retired step's folder whose shards.bin has exactly `nbytes`) renamed to
    it, or a new folder."""
    tmp = os.path.join(self.directory, f".tmp-step_{step}-{uuid.uuid4().hex[:8]}")
    while True:
      with self._spare_lock:
        spare = self._spares.pop() if self._spares else None
      if spare is None:
        os.mkdir(tmp, 0o700)
        return tmp
      try:
        if os.stat(os.path.join(spare, "shards.bin")).st_size == nbytes:
          os.rename(spare, tmp)
          return tmp
      except OSError:  # gone (the ramdisk was wiped): try the next one
        pass
      shutil.rmtree(spare, ignore_errors=True)  # another layout's size

  def _write_shards(self, path: str, staged: Staged) -> list[list[int]]:
    """pwrite()s every shard of the staged buffer to `path` (created, or a
    recycled file: every byte a shard needs is overwritten; the padding
    between shards is never read) and returns each shard's CRC32C, computed
    on the chunk just written while it is still in cache."""
    buf = staged.buffer
    nbytes = staged.layout.nbytes
    crash_at = nbytes // 2 if failpoints.armed("local.mid_write", staged.step) else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
      crcs = []
      for leaf in staged.layout.leaves:
        leaf_crcs = []
        for slot in leaf.slots:
          crc, pos, end = 0, slot.offset, slot.offset + slot.nbytes
          while pos < end:
            piece = buf[pos : min(end, pos + _CHUNK)]
            crc = crc32c.crc32c(piece, crc)
            pos += os.pwrite(fd, piece, pos)
            if crash_at is not None and pos >= crash_at:
              failpoints.hit("local.mid_write", staged.step)  # a crash test: half written
          leaf_crcs.append(crc)
        crcs.append(leaf_crcs)
      if os.fstat(fd).st_size != nbytes:  # a new file: its trailing padding
        os.ftruncate(fd, nbytes)
      os.fsync(fd)  # a no-op on tmpfs, needed on a disk
      return crcs
    finally:
      os.close(fd)

  def wait(self) -> None:
    """Blocks until every queued write finished."""
    self._executor.submit(lambda: None).result()

  def wait_idle(self) -> None:
    """wait(), then until a prepared staging buffer is ready too (background
    work a caller timing CPU or RAM should count)."""
    self.wait()
    self._preparer.submit(lambda: None).result()

  # ---- read ----------------------------------------------------------------
  def read(self, step: int, paths: Sequence[str], abstract: Sequence[Any]) -> LocalStep:
    """Reads and verifies this process's shards of `step` for `abstract`.
    Its shards.bin is never recycled afterwards (the arrays alias it).

    Raises CorruptCheckpointError (bad bytes), TopologyMismatchError (needed
    shards absent) or StateMismatchError (tree/shape/dtype differ).
    """
    where = self.step_dir(step)
    body = self.manifest(step)
    saved = {leaf["path"]: leaf for leaf in body["leaves"]}
    check_tree_matches(list(saved), paths, where)
    layout = shards_lib.layout_for(paths, abstract)
    with open(os.path.join(where, "shards.bin"), "rb") as f:
      st = os.fstat(f.fileno())
      with self._spare_lock:
        self._mapped.add((st.st_dev, st.st_ino))
      buf = _map_open(f, body["nbytes"], where)
    out = []
    for leaf in layout.leaves:
      rec = saved[leaf.path]
      if (
        tuple(rec["shape"]) != leaf.shape or shards_lib.dtype_from_name(rec["dtype"]) != leaf.dtype
      ):
        raise StateMismatchError(
          f"leaf {leaf.path}: saved as {rec['dtype']}{rec['shape']}, abstract_state"
          f" asks for {leaf.dtype}{list(leaf.shape)}. Pass the abstract_state"
          " of the train state that was saved."
        )
      by_index = {tuple(tuple(r) for r in s["index"]): s for s in rec["shards"]}
      arrays = {}
      for slot in leaf.slots:
        s = by_index.get(slot.index)
        if s is None:
          raise TopologyMismatchError(
            f"{where}: leaf {leaf.path} has no shard {slot.index}; it was"
            " saved with another sharding. Restore it from the persistent tier."
          )
        data = buf[s["offset"] : s["offset"] + s["nbytes"]]
        if not checksum_ok(data, s):
          raise CorruptCheckpointError(
            f"{where}/shards.bin: leaf {leaf.path} shard {slot.index} fails its checksum"
          )
        arrays[slot.index] = data.view(leaf.dtype).reshape(shards_lib.shard_shape(slot.index))
      out.append(arrays)
    return LocalStep(step, body, out)

  # ---- delete --------------------------------------------------------------
  def delete(self, step: int, *, recycle: bool = False) -> None:
    """Deletes one of this process's steps (renamed away first). With
    `recycle`, its shards.bin is kept as a spare for a later save to write
    into, unless this process mapped it (read()) or enough spares exist."""
    doomed = rename_out_of_namespace(self.step_dir(step))
    if doomed is None:
      return
    if recycle and self._keep_as_spare(doomed):
      return
    _remove(doomed)

  def _keep_as_spare(self, doomed: str) -> bool:
    if os.path.islink(doomed):
      return False
    try:
      st = os.stat(os.path.join(doomed, "shards.bin"), follow_symlinks=False)
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
      spare = os.path.join(self.directory, f".tmp-spare-{uuid.uuid4().hex[:12]}")
      try:
        os.rename(doomed, spare)
        for name in os.listdir(spare):
          if name != "shards.bin":
            os.unlink(os.path.join(spare, name))
      except OSError:
        return False
      self._spares.append(spare)
    return True

  def apply_retention(self, keep: set[int], among: Sequence[int] | None = None) -> list[int]:
    """Deletes committed steps not in `keep`, considering only `among` (the
    listing `keep` was computed from: a step written since is never touched)
    or, if None, a fresh listing; their files become spares for later saves.
    Returns the deleted steps."""
    doomed = [s for s in (self.steps() if among is None else among) if s not in keep]
    for s in doomed:
      self.delete(s, recycle=True)
    return doomed

  def close(self) -> None:
    """Waits for writes, then removes the spares and drops the staging buffers."""
    self._executor.shutdown(wait=True)
    self._preparer.shutdown(wait=True)
    with self._spare_lock:
      self._closed = True
      spares, self._spares = self._spares, []
    for spare in spares:
      shutil.rmtree(spare, ignore_errors=True)
    self._pool.clear()
    self._window.close()


def check_tree_matches(saved_paths: Sequence[str], paths: Sequence[str], where: str) -> None:
  """Raises StateMismatchError naming leaves missing on either side."""
  if list(saved_paths) == list(paths):
    return
  missing = sorted(set(saved_paths) - set(paths))
  extra = sorted(set(paths) - set(saved_paths))
  raise StateMismatchError(
    f"{where}: abstract_state does not match the saved tree."
    f" Saved but not asked for: {missing[:5]}; asked for but not saved:"
    f" {extra[:5]}. Pass the abstract_state of the train state that was saved."
  )


def map_file(path: str, nbytes: int, where: str) -> np.ndarray:
  """`path`'s bytes as a uint8 array backed by a private (copy-on-write)
  mapping: nothing is copied, and writes through the array never reach the
  file. Raises CorruptCheckpointError if the size is not `nbytes`."""
  with open(path, "rb") as f:
    return _map_open(f, nbytes, where)


def _map_open(f, nbytes: int, where: str) -> np.ndarray:
  size = os.fstat(f.fileno()).st_size
  if size != nbytes:
    raise CorruptCheckpointError(
      f"{where}/shards.bin has the wrong size ({size} bytes, manifest says {nbytes})"
    )
  if nbytes == 0:
    return np.empty(0, dtype=np.uint8)
  # No MAP_POPULATE: on a writable private mapping it would copy every page.
  mapped = mmap.mmap(
    f.fileno(), nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
  )
  return np.frombuffer(mapped, dtype=np.uint8)


def verify_step_dir(path: str) -> tuple[dict | None, list[str]]:
  """(manifest body or None, problems) for one local step folder, checking
  the manifest and every shard's CRC32 without JAX. Any process may call it."""
  problems: list[str] = []
  try:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
      body = decode_manifest(f.read(), path)
  except (OSError, CorruptCheckpointError) as e:
    return None, [str(e)]
  try:
    buf = map_file(os.path.join(path, "shards.bin"), body["nbytes"], path)
  except OSError as e:
    return body, [f"{path}/shards.bin: {e}"]
  except CorruptCheckpointError as e:
    return body, [str(e)]
  for leaf in body["leaves"]:
    for s in leaf["shards"]:
      if not checksum_ok(buf[s["offset"] : s["offset"] + s["nbytes"]], s):
        problems.append(f"{path}: leaf {leaf['path']} shard {s['index']} fails its checksum")
  return body, problems


def rename_out_of_namespace(path: str) -> str | None:
  """Renames a step folder to a `.tmp-delete-` name beside it (a crash
  mid-delete never leaves a listed, partial step; the leftover is removed
  when a manager next starts); returns the new path, or None if absent."""
  path = os.path.abspath(path)
  if not os.path.lexists(path):
    return None
  parent, name = os.path.split(path)
  doomed = os.path.join(parent, f".tmp-delete-{name}-{uuid.uuid4().hex[:8]}")
  os.rename(path, doomed)
  return doomed


def _remove(doomed: str) -> None:
  if os.path.islink(doomed):  # never follow a planted link
    os.unlink(doomed)
  else:
    shutil.rmtree(doomed)


def delete_step_dir(path: str) -> None:
  """Deletes one local step folder as LocalTier.delete does: renamed out of
  the step namespace first, then removed. No-op if absent. For offline tools
  (`emergency-ckpt gc`): raises OSError if the folder cannot be renamed or
  removed."""
  doomed = rename_out_of_namespace(path)
  if doomed is not None:
    _remove(doomed)
