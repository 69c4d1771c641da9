"""XOR parity redundancy (local.redundancy = "xor"): sending chunks to the
group, keeping parity blocks, and rebuilding a lost member at restore.

Save: member i of a group of k sends chunk `assigned(i, j)` of its
shards.bin to every other member j (xor_parity.py): after its local write
(send: os.sendfile of a byte range), or beside it from the staged snapshot
the file is written from (send_snapshot, local.redundancy_overlap); the
step's manifest follows each chunk once the write is done (or the error
that ended it: the members then drop the step). Member j's receiver XORs
the k-1 chunks of a step into one block and writes
  <process dir of j>/xor/step_<N>/parity.bin   the parity block
  <process dir of j>/xor/step_<N>/group.json   the group, every member's size
                                                and manifest, the block's CRC32C
(a `.tmp-step_<N>-<hex>` folder renamed into place), keeps the newest
`keep` steps, and only then answers the k-1 senders: a sender's step is
protected once all its chunks are in durable parity blocks.

Restore: a member whose copy is lost is rebuilt by the process that took
its place (same process count), else by the first surviving member of its
group (in group order), which then serves the rebuilt copy like any other
(reshard_stream.py decides; `r.source == "parity"`). The rebuilder pulls
the parity blocks and the other chunks from the survivors (RangeServer),
XORs them in as they arrive (and what it holds itself, read in place),
and checks every rebuilt shard against the CRC32C in the lost member's
manifest.

Security: as stream.py (a token published through the coordination
service; JSON requests, raw bytes, nothing executed).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import mmap
import os
import shutil
import socket
import threading
from collections.abc import Callable, Mapping, Sequence

import crc32c
import numpy as np

from emergency_ckpt.core import layout
from emergency_ckpt.core import parity as xp
from emergency_ckpt.errors import CorruptCheckpointError, PeerTransferError
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import read as local_read
from emergency_ckpt.local.format import LocalStep
from emergency_ckpt.runtime import staging
from emergency_ckpt.transport import stream

logger = logging.getLogger("emergency_ckpt")

XOR_DIR = layout.XOR_DIR
PARITY_FILE = "parity.bin"
GROUP_FILE = "group.json"
_GIVEN_UP_KEPT = 16  # steps given up whose late chunks are still refused
_PIECE = 4 << 20  # received in one call (stream.recv_some), XORed while in cache


def xor_dir(process_dir: str) -> str:
  return os.path.join(process_dir, XOR_DIR)


def read_group(step_dir: str) -> dict:
  """A parity folder's group.json, checked (CorruptCheckpointError if torn)."""
  path = os.path.join(step_dir, GROUP_FILE)
  with open(path, "rb") as f:
    raw = f.read()
  try:
    doc = json.loads(raw)
    body, crc = doc["body"], doc["crc32c"]
  except (ValueError, KeyError, TypeError) as e:
    raise CorruptCheckpointError(f"{path}: unreadable ({e})") from None
  if crc32c.crc32c(json.dumps(body, sort_keys=True).encode()) != crc:
    raise CorruptCheckpointError(f"{path}: checksum mismatch")
  return body


class _Block:
  """A step's parity block while its chunks arrive, added straight into the
  pages of its file (a shared mapping of `<tmp>/parity.bin`): the receiver's
  spare (a retired block: its tmpfs pages exist, so nothing is allocated,
  and nothing is copied into the file at the end) when it keeps one, else a
  fresh file. Every chunk is sent from its first byte to its last, so the
  bytes the chunks reached so far are [0, hw): a piece below `hw` is XORed
  in, one beyond it is copied (over the spare's old bytes: no zeroing)."""

  def __init__(self, tmp: str, reused: bool, length: int):
    """`reused`: `<tmp>/parity.bin` is a spare (else it is made)."""
    self.tmp = tmp
    path = os.path.join(tmp, PARITY_FILE)
    self._f = open(path, "r+b" if reused else "w+b")  # noqa: SIM115 - closed by finish/discard
    self._mm: mmap.mmap | None = None
    self.acc = np.zeros(0, np.uint8)
    self.hw = 0
    self.grow(length)

  def add(self, pos: int, data: np.ndarray) -> None:
    """One piece of a chunk, at `pos` of the block. The caller holds the
    step's lock and sends each chunk's pieces in order from 0."""
    end = pos + len(data)
    split = min(max(self.hw, pos), end)
    if split > pos:
      xp.xor_into(self.acc[pos:split], data[: split - pos])
    if end > split:
      self.acc[split:end] = data[split - pos :]
    self.hw = max(self.hw, end)

  def grow(self, length: int) -> None:
    """At least `length` bytes mapped (a longer file is mapped whole; a
    shorter one is extended: the kernel zero-fills the new bytes)."""
    if length <= len(self.acc):
      return
    fd = self._f.fileno()
    size = os.fstat(fd).st_size
    if size < length:
      os.ftruncate(fd, length)
      size = length
    self._release()
    self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    self.acc = np.frombuffer(self._mm, np.uint8)

  def _release(self) -> None:
    mm, self._mm = self._mm, None
    self.acc = np.zeros(0, np.uint8)
    if mm is not None:
      with contextlib.suppress(BufferError):  # a view still alive: the collector closes it
        mm.close()

  def finish(self, length: int) -> int:
    """The block's first `length` bytes as the file (longer files are cut),
    durable (bytes no chunk reached are zero); returns their CRC32C."""
    self.grow(length)
    if self.hw < length:
      self.acc[self.hw : length] = 0
    crc = crc32c.crc32c(self.acc[:length])
    self._release()
    fd = self._f.fileno()
    if os.fstat(fd).st_size != length:
      os.ftruncate(fd, length)
    os.fsync(fd)
    self._f.close()
    return crc

  def discard(self) -> None:
    """Drops the block and its folder (a torn or abandoned step)."""
    self._release()
    self._f.close()
    shutil.rmtree(self.tmp, ignore_errors=True)


class _NotWritten(OSError):
  """A member's local write of the step failed (its chunk's trailer)."""


class _GivenUp(OSError):
  """The step was given up while this chunk arrived (its rest was read)."""


class _Pending:
  """One step's parity block while its chunks arrive."""

  def __init__(self, k: int):
    self.k = k
    self.block: _Block | None = None  # made by the first chunk to arrive
    self.seen: dict[int, dict] = {}  # sender's member index -> its header
    self.arriving: set[int] = set()  # members whose chunk is being received
    self.lock = threading.Lock()  # guards block
    self.done = threading.Event()
    self.error: str | None = None

  def give_up(self, why: str) -> None:
    """Poisons the step: its block and folder go, every waiting sender is told."""
    with self.lock:
      if self.error is None:
        self.error = why
      if self.block is not None:
        self.block.discard()
        self.block = None
    self.done.set()


class ParityReceiver(stream.Listener):
  """Keeps this member's parity blocks: accumulates the chunks the other
  members send, stores the block once all k-1 arrived, answers them, and
  only then prepares the next step's spare (see _retire)."""

  def __init__(
    self,
    process_dir: str,
    host: str,
    *,
    member: int,
    group: Sequence[int],
    keep: int,
    timeout_s: float,
    log_prefix: str,
    ports: tuple[int, int] | None = None,
    mapped: Callable[[os.stat_result], bool] | None = None,
  ):
    """`mapped(stat)`: whether a restore mapped that file (a rebuild maps
    parity blocks in place): such a block is never recycled as a spare."""
    self._dir = xor_dir(process_dir)
    self._member, self._group = member, list(group)
    self._keep, self._timeout_s, self._prefix = keep, timeout_s, log_prefix
    self._mapped = mapped or (lambda st: False)
    self._lock = threading.Lock()
    self._retire_lock = threading.Lock()
    self._retires = 0  # stored steps whose _retire has not ended (guarded by _lock)
    self._idle = threading.Condition(self._lock)
    self._pending: dict[int, _Pending] = {}
    # Steps given up, until every member's chunk of that attempt came:
    # step -> (why, the members that came). A late chunk is refused at once
    # (rather than starting a step that waits for a chunk already given up);
    # a chunk of a member that came is a new attempt.
    self._given_up: dict[int, tuple[str, set[int]]] = {}
    layout.remove_tmp(self._dir)
    self._start(host, ports)

  def _handle(self, conn: socket.socket) -> None:
    """One member's chunk of a step; answers once the block is durable."""
    stored = False
    try:
      header = stream._recv_json(conn)  # noqa: SLF001
      pending, stored = self._add(header, conn)
      if not pending.done.wait(self._timeout_s):
        missing = sorted(set(range(pending.k)) - {self._member} - set(pending.seen))
        why = f"step {header['step']}: chunks of members {missing} never came"
        self._give_up(int(header["step"]), pending, why)
        raise TimeoutError(pending.error)
      if pending.error:
        raise OSError(pending.error)
      stream._send_json(conn, {"ok": True})  # noqa: SLF001
    except Exception as e:  # noqa: BLE001 - the sender sees no "ok" and reports it
      logger.warning("%s xor: a parity block was not stored: %s", self._prefix, e)
      with contextlib.suppress(OSError):
        stream._send_json(conn, {"error": str(e)})  # noqa: SLF001
    finally:
      if stored:  # every sender has its answer: off the save's path
        self._retire()

  def _add(self, header: dict, conn: socket.socket) -> tuple[_Pending, bool]:
    """Receives one member's chunk from `conn`, XORed into the step's block
    piece by piece as it arrives (each piece still in cache); the last
    chunk of the step stores the block. Returns (the step's pending block,
    whether this call stored it)."""
    step, i, k = int(header["step"]), int(header["member"]), len(self._group)
    length = int(header["length"])
    if header["group"] != self._group or i == self._member or not 0 <= i < k:
      raise ValueError(f"a chunk from member {i} of group {header['group']}, not of {self._group}")
    with self._lock:
      why = self._late(step, i, k)  # a late chunk of an attempt given up
      if why is None:
        pending = self._pending.setdefault(step, _Pending(k))
        if i in pending.seen or i in pending.arriving:
          raise ValueError(f"member {i} sent step {step} twice")
        pending.arriving.add(i)
    if why is None:
      with pending.lock:
        why = pending.error  # given up since
        if why is None:
          self._open(pending, step, length)
    if why is not None:  # refused: read (so the sender gets the answer), dropped
      _drain(conn, length)
      raise OSError(why)
    view = memoryview(bytearray(min(_PIECE, max(length, 1))))
    piece = np.frombuffer(view, np.uint8)
    pos = 0
    try:
      while pos < length:
        n = stream.recv_some(conn, view[: min(len(view), length - pos)])
        if not n:
          raise ConnectionError(f"connection closed after {pos} of {length} bytes")
        pos += n
        with pending.lock:
          dropped = pending.block is None
          if not dropped:
            pending.block.add(pos - n, piece[:n])
        if dropped:  # given up meanwhile: the rest read (the sender gets the answer)
          _drain(conn, length - pos)
          raise _GivenUp(pending.error or f"step {step} was given up")
      # After the bytes, the sender's manifest of the step, once its local
      # write is complete (or why it failed: the step is given up at once).
      try:
        manifest = stream.recv_manifest(conn, f"member {i} did not write step {step}")
      except OSError as e:
        raise _NotWritten(str(e)) from None
    except BaseException as e:  # a torn chunk poisons the step's block: drop it
      why = (
        str(e)
        if isinstance(e, (_NotWritten, _GivenUp))
        else f"member {i}'s chunk of step {step} was cut off ({e})"
      )
      self._give_up(step, pending, why)
      raise
    with self._lock:
      pending.arriving.discard(i)
      pending.seen[i] = {**header, "manifest": manifest.hex()}
      complete = len(pending.seen) == k - 1 and self._pending.get(step) is pending
      if complete:
        del self._pending[step]
        self._retires += 1
    if complete:
      try:
        self._store(step, pending)
      except Exception as e:  # noqa: BLE001 - every waiting sender is told
        pending.give_up(f"{type(e).__name__}: {e}")
      pending.done.set()
    return pending, complete

  def _open(self, pending: _Pending, step: int, length: int) -> None:
    """Under pending.lock: the step's block, made by its first chunk (over
    the spare, if there is one), else grown to `length`."""
    if pending.block is not None:
      pending.block.grow(length)
      return
    os.makedirs(self._dir, mode=0o700, exist_ok=True)
    tmp = os.path.join(self._dir, layout.tmp_step_dir_name(step))
    os.mkdir(tmp, 0o700)
    try:
      dest = os.path.join(tmp, PARITY_FILE)
      reused = layout.take_spare(self._dir, PARITY_FILE, dest, self._mapped)
      pending.block = _Block(tmp, reused, length)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise

  def _late(self, step: int, i: int, k: int) -> str | None:
    """Under _lock: why member `i`'s chunk of `step` is refused (a late
    chunk of an attempt given up), or None."""
    dead = self._given_up.get(step)
    if dead is None:
      return None
    why, came = dead
    if i in came:  # it sends the step again: a new attempt
      del self._given_up[step]
      return None
    came.add(i)
    if len(came) >= k - 1:
      del self._given_up[step]
    return why

  def _give_up(self, step: int, pending: _Pending, why: str) -> None:
    """Drops `step`'s block and tells its waiting senders `why`; the
    members' chunks still to come are refused (_late)."""
    with self._lock:
      if self._pending.get(step) is pending:
        del self._pending[step]
        came = set(pending.seen) | set(pending.arriving)
        if len(came) < pending.k - 1:
          self._given_up[step] = (why, came)
          for old in sorted(self._given_up)[:-_GIVEN_UP_KEPT]:
            del self._given_up[old]
    pending.give_up(why)

  def _store(self, step: int, pending: _Pending) -> None:
    headers = pending.seen
    sizes = {str(i): int(h["nbytes"]) for i, h in headers.items()}
    length = xp.block_length(
      [int(headers[i]["nbytes"]) if i in headers else 0 for i in range(pending.k)], self._member
    )
    with pending.lock:
      block, pending.block = pending.block, None
    if block is None:
      raise OSError(pending.error or f"step {step} was given up")
    try:
      crc = block.finish(length)
      body = {
        "step": step,
        "group": self._group,
        "member": self._member,
        "sizes": sizes,
        "manifests": {str(i): h["manifest"] for i, h in headers.items()},
        "parity_nbytes": length,
        "parity_crc32c": crc,
      }
      with open(os.path.join(block.tmp, GROUP_FILE), "wb") as f:
        f.write(_signed(body))
        f.flush()
        os.fsync(f.fileno())
      layout.replace_step(block.tmp, layout.local_step_dir(self._dir, step))
    except BaseException:
      block.discard()
      raise

  def _retire(self) -> None:
    """Drops the parity steps beyond the newest `keep`, keeping the newest
    of those as the spare the next step's block is written into (measured
    on 16 cores: writing a fresh 43 MiB block to tmpfs took 17-35 ms of
    the save's 60-75 ms of XOR work). Runs after the senders were answered.
    A block a restore mapped is never reused."""
    try:
      with self._retire_lock:
        retired = parity_steps(self._dir)[: -self._keep]
        layout.retire_steps(self._dir, retired, PARITY_FILE, self._mapped)
    except OSError as e:  # a step left for the next retire
      logger.warning("%s xor: old parity blocks not retired: %s", self._prefix, e)
    finally:
      with self._idle:
        self._retires -= 1
        self._idle.notify_all()

  def close(self) -> None:
    """Stops accepting; waits (up to the timeout) for stored steps' retires
    (an exiting process leaves no step it meant to drop)."""
    super().close()
    with self._idle:
      self._idle.wait_for(lambda: self._retires == 0, timeout=self._timeout_s)


def _drain(conn: socket.socket, length: int) -> None:
  """Reads and drops a chunk's `length` bytes and its trailer."""
  buf = np.empty(min(_PIECE, max(length, 1)), np.uint8)
  for pos in range(0, length, len(buf)):
    stream.recv_into(conn, buf[: min(len(buf), length - pos)])
  stream._recv_json(conn)  # noqa: SLF001


def _signed(body: dict) -> bytes:
  raw = json.dumps(body, sort_keys=True).encode()
  return json.dumps({"body": body, "crc32c": crc32c.crc32c(raw)}).encode()


def parity_steps(folder: str) -> list[int]:
  """Steps with a parity block in an `xor` folder, oldest first."""
  out = []
  for name in os.listdir(folder) if os.path.isdir(folder) else ():
    step = layout.step_of_dir_name(name)
    if step is not None and os.path.isfile(os.path.join(folder, name, GROUP_FILE)):
      out.append(step)
  return sorted(out)


def send(
  offers: Mapping[int, dict], group: Sequence[int], member: int, step_dir: str, *, timeout_s: float
) -> int:
  """Sends this member's chunks of the written step in `step_dir` to the
  other members (their `offers`, by process), each followed by the step's
  manifest, and waits until every one stored its parity block; returns
  the bytes sent. Raises PeerTransferError or OSError. Called by: the
  redundancy lane, after the local write."""
  with open(os.path.join(step_dir, local_format.MANIFEST), "rb") as f:
    raw = f.read()
  step = local_format.decode_manifest(raw, step_dir)["step"]
  path = os.path.join(step_dir, local_format.SHARDS)
  nbytes = os.path.getsize(path)

  def one(offer: dict, header: dict, off: int, length: int) -> dict:
    return stream.send_file(
      offer,
      header,
      path,
      off,
      length,
      timeout_s=timeout_s,
      trailer=stream.manifest_trailer(lambda: raw),
    )

  return _send_chunks(offers, group, member, step, nbytes, one)


def send_snapshot(
  offers: Mapping[int, dict],
  group: Sequence[int],
  member: int,
  step: int,
  data: np.ndarray,
  manifest: Callable[[], bytes],
  *,
  timeout_s: float,
  sent: Callable[[], None] = lambda: None,
) -> int:
  """As send(), from the staged bytes `data` of a step whose local write
  runs meanwhile (the file will hold exactly these bytes): each chunk's
  bytes go at once, then `sent()` (once every chunk's bytes are out, or
  one failed: the caller may let go of `data`), and each chunk's trailer
  is `manifest()` (it blocks until the write is complete and returns the
  raw manifest; an exception's text is sent instead, and the members drop
  the step at once). Raises PeerTransferError or OSError. Called by: the
  redundancy lane, beside the local write."""
  left = [len(group) - 1]  # chunks whose bytes may still be read from `data`
  lock = threading.Lock()

  def let_go(one_done: bool) -> None:
    with lock:
      if left[0] <= 0:  # already let go
        return
      left[0] = left[0] - 1 if one_done else 0
      if left[0]:
        return
    sent()

  def one(offer: dict, header: dict, off: int, length: int) -> dict:
    out = [False]

    def bytes_out() -> None:
      out[0] = True
      let_go(True)

    try:
      return stream.send_buffer(
        offer,
        header,
        data[off : off + length],
        timeout_s=timeout_s,
        trailer=stream.manifest_trailer(manifest),
        sent=bytes_out,
      )
    finally:
      if not out[0]:  # failed before its last byte: done with `data` too
        bytes_out()

  try:
    return _send_chunks(offers, group, member, step, len(data), one)
  finally:  # every sending thread has ended (a chunk may not have started)
    let_go(False)


def send_failure(
  offers: Mapping[int, dict],
  group: Sequence[int],
  member: int,
  step: int,
  why: str,
  *,
  timeout_s: float,
) -> None:
  """Tells the other members that this member's local write of `step`
  failed (an empty chunk whose trailer is the error): they drop the step's
  blocks at once and answer its other senders so, instead of waiting for
  this member's chunk until the timeout. Errors are only logged. Called
  by: the redundancy lane, after a failed local write."""

  def failed() -> bytes:
    raise OSError(why)

  try:
    send_snapshot(offers, group, member, step, np.empty(0, np.uint8), failed, timeout_s=timeout_s)
  except (OSError, PeerTransferError) as e:  # the members answer with the error: expected
    logger.debug("xor: step %d's failure told to the group: %s", step, e)


def _send_chunks(
  offers: Mapping[int, dict],
  group: Sequence[int],
  member: int,
  step: int,
  nbytes: int,
  send_one: Callable[[dict, dict, int, int], dict],
) -> int:
  """Each other member's chunk of this member's `nbytes` bytes of `step`,
  `send_one(offer, header, offset, length)` (returning the member's
  answer), all at once; the bytes sent. Raises PeerTransferError."""
  k = len(group)

  def one(j: int) -> int:
    proc = group[j]
    offer = offers.get(proc) or {"error": "it published no address"}
    if "error" in offer:
      raise PeerTransferError(f"group member {proc} cannot receive: {offer['error']}")
    off, length = xp.chunk(nbytes, k, xp.assigned(member, j, k))
    header = {
      "step": step,
      "member": member,
      "group": list(group),
      "nbytes": nbytes,
      "length": length,
    }
    reply = send_one(offer, header, off, length)
    if not reply.get("ok"):
      raise PeerTransferError(f"group member {proc} did not store its parity block: {reply}")
    return length

  others = [j for j in range(k) if j != member]
  with concurrent.futures.ThreadPoolExecutor(len(others), "ec-xor-send") as pool:
    # Every chunk is sent even when one fails (pool.map would cancel those
    # not started yet: their members would then wait for them until the
    # timeout instead of dropping the step at once).
    futures = [pool.submit(one, j) for j in others]
    return sum(f.result() for f in futures)


class RangeServer(stream.Server):
  """Serves byte ranges of this host's data and parity files of one step,
  by saved process (for a rebuild), to clients that present its token."""

  def __init__(
    self,
    host: str,
    step: int,
    files: Mapping[tuple[int, str], np.ndarray],
    *,
    timeout_s: float,
    log_prefix: str,
    ports: tuple[int, int] | None = None,
  ):
    """`files`: {(saved process, "data" | "parity"): the file's bytes}."""
    self._ready = {}
    self._timeout_s = timeout_s
    self._prefix = log_prefix
    self._step = step
    self._files = dict(files)
    self._start(host, ports)

  def _answer(self, request):
    if not isinstance(request, dict) or request.get("step") != self._step:
      return {"error": f"this process serves step {self._step}"}, [], []
    records, views = [], []
    for process, kind, offset, length in request.get("ranges", []):
      buf = self._files.get((int(process), kind))
      if buf is None or offset < 0 or offset + length > len(buf):
        return {"error": f"no {kind} bytes {offset}+{length} of process {process} here"}, [], []
      records.append({"nbytes": int(length)})  # checked as the rebuilt shards, not per range
      views.append(buf[offset : offset + length])
    return {"shards": records}, views, [None] * len(views)


class _Target:
  """The bytes of the lost member being rebuilt, one lock per chunk: every
  source of a chunk (its parity block and the other chunks in it) is XORed
  into it as it arrives, from whichever thread received it."""

  def __init__(self, nbytes: int, k: int):
    # page-aligned: the rebuilt shards become jax CPU arrays without a copy
    self.out = staging.aligned_zeros(nbytes)
    self.chunks = [
      self.out[off : off + n] for off, n in (xp.chunk(nbytes, k, t) for t in range(k - 1))
    ]
    self._locks = [threading.Lock() for _ in self.chunks]

  def xor(self, t: int, pos: int, data: np.ndarray) -> None:
    with self._locks[t]:
      xp.xor_into(self.chunks[t][pos:], data)


def _fetch(
  offer: dict,
  holder: int,
  step: int,
  ranges: list,
  into: list,
  target: _Target,
  *,
  timeout_s: float,
) -> None:
  """Receives the byte ranges [[process, kind, offset, length]] from a
  RangeServer, each XORed into the rebuilt chunk `into[n]` names piece by
  piece as it arrives (in cache). No checksum per range: a wrong byte in
  any source makes the rebuilt bytes differ from the lost member's, which
  its manifest's CRC32C per shard catches (rebuild's last step), and a
  CRC pass per range would cost the servers and this process one more
  read of every byte."""
  if "error" in offer:
    raise PeerTransferError(f"process {holder} cannot serve: {offer['error']}")
  piece = np.empty(_PIECE, np.uint8)
  with stream.connect(offer, timeout_s=timeout_s) as sock:
    stream._send_json(sock, {"step": step, "ranges": ranges})  # noqa: SLF001
    reply = stream._recv_json(sock)  # noqa: SLF001
    if "error" in reply:
      raise PeerTransferError(f"process {holder} refused: {reply['error']}")
    for (_, _, _, length), record, t in zip(ranges, reply["shards"], into):
      if record.get("nbytes") != length:
        raise PeerTransferError(f"process {holder} answered {record} for {length} bytes")
      pos = 0
      while pos < length:
        n = min(_PIECE, length - pos)
        stream.recv_into(sock, piece[:n])
        target.xor(t, pos, piece[:n])
        pos += n


def rebuild(
  step: int,
  lost: int,
  group: Sequence[int],
  sizes: Mapping[int, int],
  manifest: dict,
  offers: Mapping[int, dict],
  *,
  timeout_s: float,
  here: Mapping[tuple[int, str], np.ndarray] | None = None,
) -> LocalStep:
  """Member `lost` of `group` (saved processes) rebuilt from the other
  members' data and parity blocks (served by RangeServers: `offers` by
  saved process), every shard checked against `manifest`'s CRC32Cs.
  `sizes`: every member's shards.bin bytes. `here`: {(saved process,
  "data" | "parity"): bytes} this process holds, read in place rather than
  fetched (unchecked on their own: a bad byte fails the rebuilt shard's
  CRC32C). Only the bytes a rebuilt chunk covers are read (a parity block
  or another member's chunk may be longer); the ranges fetched stream
  into the rebuilt chunks as they arrive, from every holder at once, while
  this thread XORs in the bytes held here. Raises PeerTransferError,
  CorruptCheckpointError or OSError."""
  k = len(group)
  m = list(group).index(lost)
  target = _Target(sizes[m], k)
  here = here or {}
  requests: dict[int, tuple[list, list]] = {}  # holder: (ranges, the chunk each goes into)
  local: list[tuple[int, np.ndarray]] = []
  for t, (j, others) in enumerate(xp.rebuild_sources(m, k)):
    want = len(target.chunks[t])
    sources = [(group[j], "parity", 0, want)]
    for i, ti in others:
      off, length = xp.chunk(sizes[i], k, ti)
      sources.append((group[i], "data", off, min(length, want)))
    for process, kind, off, length in sources:
      buf = here.get((process, kind))
      if buf is not None and off + length <= len(buf):
        local.append((t, buf[off : off + length]))
      elif length:
        ranges, into = requests.setdefault(process, ([], []))
        ranges.append([process, kind, off, length])
        into.append(t)
  pool = concurrent.futures.ThreadPoolExecutor(max(1, len(requests)), "ec-xor-fetch")
  try:
    futures = [
      pool.submit(
        _fetch,
        offers.get(p) or {"error": "no address"},
        p,
        step,
        r,
        into,
        target,
        timeout_s=timeout_s,
      )
      for p, (r, into) in requests.items()
    ]
    for t, data in local:
      target.xor(t, 0, data)
    for f in futures:
      f.result()
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
  where = f"step {step} of process {lost} rebuilt from parity"
  return LocalStep(step, manifest, local_read.verify_buffer(manifest, target.out, where))


def mapped(path: str) -> np.ndarray:
  """A file's bytes, mapped read-only."""
  size = os.path.getsize(path)
  return local_format.map_file(path, size, os.path.dirname(path)) if size else np.empty(0, np.uint8)
