"""Local tier: each process writes the shards it holds to its own ramdisk folder.

Layout (per process; nobody else reads it):
  <directory>/<run_id>/process_<i>/step_<N>/shards.bin     raw shard bytes
  <directory>/<run_id>/process_<i>/step_<N>/manifest.json  tree, shards, CRC32Cs
  <directory>/<run_id>/process_<i>/.tmp-step_<N>-<uuid>/   a save in progress

A step exists only once its folder is renamed from .tmp-*, after both files are
written, so a crash never leaves a listed partial step. Every shard carries a
CRC32C (hardware, ~8 GB/s here; zlib's CRC32 was 3x slower and a third of a
local save) checked on read; the manifest carries a CRC32 over its own body.

Saves copy the shards straight into the ramdisk: after each save a
background thread preallocates the next step's .tmp-*/shards.bin and maps it
shared, so the save's copy IS the write (committing it is a checksum pass,
the manifest and a rename). The ramdisk holds that one prepared file extra.
If it cannot be made (ENOSPC), the save stages in host memory and write()s.

Reads map shards.bin (no copy into a private buffer): on CPU the restored
arrays alias those pages (copy-on-write), so a restore costs one checksum pass.
Files are never modified in place (written to .tmp-*, renamed, deleted by
rename + unlink), so a mapping never sees its file shrink.

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
from emergency_ckpt.errors import (
  CorruptCheckpointError,
  StateMismatchError,
  TopologyMismatchError,
  UnsafeDirectoryError,
)
from emergency_ckpt.options import LocalTierOptions
from emergency_ckpt.topology import Topology

logger = logging.getLogger("emergency_ckpt")

FORMAT = "emergency_ckpt.local/1"
_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 64 << 20
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
  save's file): on this 2-core machine, preparing at normal priority right
  after a peer restore made the restore's tail (block_until_ready) a median
  0.24-0.34 s instead of 0.12-0.13 s, the whole restore 0.87-0.92 s instead
  of 0.64-0.66 s. Elsewhere a no-op."""
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
  """A step copied to host memory, waiting to be written."""

  step: int
  layout: shards_lib.Layout
  buffer: np.ndarray
  stall_s: float
  target: _Target | None = None
  """Set when `buffer` is a mapped, preallocated shards.bin (no write needed)."""


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def _map_populated(fd: int, nbytes: int) -> mmap.mmap:
  """A shared read-write mapping of `fd` whose page-table entries all exist,
  writable. MADV_POPULATE_WRITE (write faults) takes 0.09 cpu-s per 256 MiB
  of tmpfs here, MAP_POPULATE (read faults) 0.13, and the copy into either
  then takes no fault (0.02 s); MAP_POPULATE is the fallback where the
  kernel lacks the madvise."""
  prot = mmap.PROT_READ | mmap.PROT_WRITE
  if sys.platform.startswith("linux"):
    mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    try:
      mapped.madvise(MADV_POPULATE_WRITE)
      return mapped
    except OSError:  # EINVAL before Linux 5.14 (or it could not populate)
      mapped.close()
  flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
  return mmap.mmap(fd, nbytes, flags=flags, prot=prot)


@dataclasses.dataclass
class _Target:
  """A preallocated shards.bin in its own .tmp- folder, mapped shared: a
  save copies the shards straight into the ramdisk file, so committing it
  needs no write() of the bytes (one copy instead of two). Prepared in the
  background after each save, for the next one."""

  tmp: str
  nbytes: int
  fd: int
  mapped: mmap.mmap | None = None
  buffer: np.ndarray | None = None
  readers: int = 0  # besides the write (a background upload viewing it)
  written: bool = False

  @classmethod
  def create(cls, directory: str, nbytes: int) -> _Target:
    tmp = os.path.join(directory, f".tmp-next-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp, 0o700)
    try:
      fd = os.open(os.path.join(tmp, "shards.bin"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
      try:
        os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not as SIGBUS mid-copy
      except BaseException:
        os.close(fd)
        raise
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    return cls(tmp, nbytes, fd)

  def map(self) -> np.ndarray:
    """Maps the file shared, every page writable in the page tables, and
    returns it as bytes, so the save's copy takes no page fault. Costs ~0.17
    cpu-s per 256 MiB here (with fallocate), 8x the copy: prepared files are
    mapped in the background (see _prepare_next); only the first save of a
    layout without prepare() maps inline."""
    if self.buffer is None:
      self.mapped = _map_populated(self.fd, self.nbytes)
      self.buffer = np.frombuffer(self.mapped, dtype=np.uint8)
    return self.buffer

  def close(self) -> None:
    """Closes the file (the mapping lives while arrays still view it)."""
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1

  def discard(self) -> None:
    self.close()
    shutil.rmtree(self.tmp, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class WriteResult:
  step: int
  ok: bool
  nbytes: int
  durable_s: float
  error: str | None = None


class _BufferPool:
  """Host staging buffers. At most `count` local writes hold one at a time
  (acquire blocks while all are writing); a buffer that something else still
  reads (a background persistent upload, see hold) goes back to the free list
  only when that reader lets go too."""

  def __init__(self, count: int):
    self._sem = threading.Semaphore(count)
    self._count = count
    self._lock = threading.Lock()
    self._free: list[np.ndarray] = []
    self._holders: dict[int, int] = {}  # id(buffer) -> readers besides the write
    self._writing: set[int] = set()  # id(buffer) of buffers a local write holds

  def acquire(self, nbytes: int) -> np.ndarray:
    self._sem.acquire()
    with self._lock:
      i = next((i for i, b in enumerate(self._free) if b.nbytes == nbytes), None)
      if i is None:
        self._free.clear()  # the layout changed: drop old sizes
        buf = None
      else:
        buf = self._free.pop(i)
    if buf is None:
      buf = aligned_empty(nbytes)
    with self._lock:
      self._writing.add(id(buf))
    return buf

  def acquire_slot(self) -> None:
    """A write slot without a pool buffer (the save stages into a mapped file)."""
    self._sem.acquire()

  def release_slot(self) -> None:
    self._sem.release()

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
    self._next_lock = threading.Lock()
    self._next: _Target | None = None
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
  def stage(self, step: int, paths: Sequence[str], arrays: Sequence[Any]) -> Staged:
    """Copies this process's shards to a host buffer. Blocks on that copy only
    (and on a free buffer, if `staging_buffers` writes are still running)."""
    t0 = time.perf_counter()
    layout = shards_lib.layout_for(paths, arrays)
    target = self._take_target(layout.nbytes)
    if target is None:  # no file (0 bytes, or the ramdisk is full): a host buffer
      buffer = self._pool.acquire(layout.nbytes)
    else:
      self._pool.acquire_slot()
      try:
        buffer = target.map()
      except BaseException:
        self._pool.release_slot()
        target.discard()
        raise
    try:
      if target is not None:  # now a save in progress of `step`, by its name
        named = os.path.join(self.directory, f".tmp-step_{step}-{uuid.uuid4().hex[:8]}")
        os.rename(target.tmp, named)
        target.tmp = named
      if target is not None and failpoints.armed("local.mid_write", step):
        # A crash test: die with half the shards copied into the .tmp file.
        half = max(1, len(layout.leaves) // 2)
        shards_lib.stage(arrays[:half], layout, buffer)
        failpoints.hit("local.mid_write", step)
      shards_lib.stage(arrays, layout, buffer)
    except BaseException:
      self._release(Staged(step, layout, buffer, 0.0, target))
      if target is not None:
        target.discard()
      raise
    return Staged(step, layout, buffer, time.perf_counter() - t0, target)

  def _take_target(self, nbytes: int) -> _Target | None:
    """The prepared file if it fits `nbytes`, else a new one (the first save,
    or a new layout), else None (0 bytes, or it cannot be created)."""
    with self._next_lock:
      target, self._next = self._next, None
    if target is not None and target.nbytes == nbytes:
      return target
    if target is not None:
      target.discard()
    if nbytes == 0:
      return None
    try:
      return _Target.create(self.directory, nbytes)
    except OSError as e:
      logger.warning(
        "%s cannot preallocate %d bytes in %s (%s): staging in host memory; the"
        " local write will likely fail too.",
        self._topology.log_prefix(),
        nbytes,
        self.directory,
        e,
      )
      return None

  def prepare(self, paths: Sequence[str], abstract: Sequence[Any]) -> None:
    """Starts preparing (in the background) the file that a save of this
    layout will copy into, so that the first save does not stall on
    allocating and mapping it (seconds for fresh memory). Blocks on nothing."""
    nbytes = shards_lib.layout_for(paths, abstract).nbytes
    with self._next_lock:
      if self._closed or nbytes == 0:
        return
    self._preparer.submit(self._prepare_next, nbytes)

  def _prepare_next(self, nbytes: int) -> None:
    """Background: the file the next save of `nbytes` copies into."""
    with self._next_lock:
      if self._closed or (self._next is not None and self._next.nbytes == nbytes):
        return
    try:
      target = _Target.create(self.directory, nbytes)
    except OSError as e:
      logger.debug("%s cannot prepare the next local file: %s", self._topology.log_prefix(), e)
      return
    try:  # here, not in the save: populating the page tables costs ~5x the copy
      target.map()
    except BaseException:
      target.discard()
      raise
    with self._next_lock:
      old, self._next = self._next, target
      if self._closed:
        old, self._next = target, None
    if old is not None:
      old.discard()

  def _release(self, staged: Staged) -> None:
    if staged.target is None:
      self._pool.release(staged.buffer)
    else:
      self._pool.release_slot()

  def hold(self, staged: Staged) -> Callable[[], None]:
    """Keeps `staged.buffer` from reuse (for another reader, e.g. a
    background upload) until the returned function is called, once."""
    target = staged.target
    if target is not None:  # a mapped file is never reused (it lives as long
      # as arrays view it); the next one is prepared once nobody reads this
      # one, so two steps' pages are never mapped at once
      with self._next_lock:
        target.readers += 1

      def release() -> None:
        with self._next_lock:
          target.readers -= 1
          ready = target.readers == 0 and target.written
        if ready:
          self._retire(target)

      return release
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
    self._release(staged)
    target = staged.target
    if target is not None:
      target.discard()  # arrays still viewing it keep the pages
      with self._next_lock:
        target.written = True
        ready = target.readers == 0
      if ready:
        self._retire(target)

  def _retire(self, target: _Target) -> None:
    """`target` is written (or discarded) and no reader is left: its pages
    leave this process's page tables and the next file is prepared. A view
    that outlives its reader (tensorstore keeps written source arrays
    referenced until its cache lets go, often until a GC cycle) must not keep
    a second step's pages resident beside the next prepared file: for a
    shared file mapping, MADV_DONTNEED only drops the page-table entries; the
    bytes stay in the file and a later access maps them in again."""
    mapped, target.mapped, target.buffer = target.mapped, None, None
    if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
      try:
        mapped.madvise(mmap.MADV_DONTNEED)
      except (OSError, ValueError) as e:  # ValueError: already closed
        logger.debug("%s madvise(DONTNEED) failed: %s", self._topology.log_prefix(), e)
    self._preparer.submit(self._prepare_next, target.nbytes)

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
        self._release(staged)
        target = staged.target
        if target is not None:
          target.close()
          with self._next_lock:
            target.written = True
            ready = target.readers == 0
          if ready:
            self._retire(target)
      if on_done is not None:
        on_done(result)
      return result

    return self._executor.submit(run)

  def _write(self, staged: Staged) -> None:
    final = self.step_dir(staged.step)
    target = staged.target
    if target is None:
      tmp = os.path.join(self.directory, f".tmp-step_{staged.step}-{uuid.uuid4().hex[:8]}")
    else:
      tmp = target.tmp  # the bytes are already in its shards.bin
    failpoints.hit("local.before_write", staged.step)
    if target is None:
      os.mkdir(tmp, 0o700)
    try:
      buf = staged.buffer
      leaves = []
      for leaf in staged.layout.leaves:
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
                **shard_checksum(buf[slot.offset : slot.offset + slot.nbytes]),
              }
              for slot in leaf.slots
            ],
          }
        )
      if target is not None:
        target.mapped.flush()  # msync: a no-op on tmpfs, needed on a disk
        os.fsync(target.fd)
      else:
        self._write_bytes(tmp, staged)
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

  def _write_bytes(self, tmp: str, staged: Staged) -> None:
    """The staged host buffer into tmp/shards.bin (when no file was mapped)."""
    buf = staged.buffer
    fd = os.open(os.path.join(tmp, "shards.bin"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
      view = memoryview(buf)
      pos = 0
      chunk = _CHUNK
      if failpoints.armed("local.mid_write", staged.step):
        chunk = max(1, buf.nbytes // 2)
      while pos < buf.nbytes:
        pos += os.write(fd, view[pos : pos + chunk])
        failpoints.hit("local.mid_write", staged.step)
      os.fsync(fd)
    finally:
      os.close(fd)

  def wait(self) -> None:
    """Blocks until every queued write finished."""
    self._executor.submit(lambda: None).result()

  def wait_idle(self) -> None:
    """wait(), then until the next save's file is prepared too (background
    work a save started: a caller timing CPU or RAM should count it)."""
    self.wait()
    self._preparer.submit(lambda: None).result()

  # ---- read ----------------------------------------------------------------
  def read(self, step: int, paths: Sequence[str], abstract: Sequence[Any]) -> LocalStep:
    """Reads and verifies this process's shards of `step` for `abstract`.

    Raises CorruptCheckpointError (bad bytes), TopologyMismatchError (needed
    shards absent) or StateMismatchError (tree/shape/dtype differ).
    """
    where = self.step_dir(step)
    body = self.manifest(step)
    saved = {leaf["path"]: leaf for leaf in body["leaves"]}
    check_tree_matches(list(saved), paths, where)
    layout = shards_lib.layout_for(paths, abstract)
    buf = map_file(os.path.join(where, "shards.bin"), body["nbytes"], where)
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
  def delete(self, step: int) -> None:
    """Deletes one of this process's steps (renamed away first)."""
    delete_step_dir(self.step_dir(step))

  def apply_retention(self, keep: set[int], among: Sequence[int] | None = None) -> list[int]:
    """Deletes committed steps not in `keep`, considering only `among` (the
    listing `keep` was computed from: a step written since is never touched)
    or, if None, a fresh listing. Returns the deleted steps."""
    doomed = [s for s in (self.steps() if among is None else among) if s not in keep]
    for s in doomed:
      self.delete(s)
    return doomed

  def close(self) -> None:
    self._executor.shutdown(wait=True)
    with self._next_lock:
      self._closed = True
      target, self._next = self._next, None
    self._preparer.shutdown(wait=True)
    with self._next_lock:
      late, self._next = self._next, None
    for t in (target, late):
      if t is not None:
        t.discard()


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


def delete_step_dir(path: str) -> None:
  """Deletes one local step folder as LocalTier.delete does: renamed out of
  the step namespace first (a crash mid-delete never leaves a listed, partial
  step; the `.tmp-` leftover is removed when a manager next starts), then
  removed. No-op if absent. For offline tools (`emergency-ckpt gc`): raises
  OSError if the folder cannot be renamed or removed."""
  path = os.path.abspath(path)
  if not os.path.lexists(path):
    return
  parent, name = os.path.split(path)
  doomed = os.path.join(parent, f".tmp-delete-{name}-{uuid.uuid4().hex[:8]}")
  os.rename(path, doomed)
  if os.path.islink(doomed):  # never follow a planted link
    os.unlink(doomed)
  else:
    shutil.rmtree(doomed)
