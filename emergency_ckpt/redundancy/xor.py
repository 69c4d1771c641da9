"""XOR parity redundancy (local.redundancy = "xor"), the scheme: what each
member sends after a local write, and rebuilding a lost member at restore.

Save: member i of a group of k sends chunk `assigned(i, j)` of its
shards.bin to every other member j (core/parity.py): after its local write
(send: os.sendfile of a byte range), or beside it from the staged snapshot
the file is written from (send_snapshot, local.redundancy_overlap); the
step's manifest follows each chunk once the write is done (or the error
that ended it: the members then drop the step). Member j's receiver XORs
the k-1 chunks of a step into one parity block, stores it (the chunk
message and its receiver: xor_wire.py; the files: local/blocks.py), keeps
the newest `keep` steps, and only then answers the k-1 senders: a sender's
step is protected once all its chunks are in durable parity blocks.

Restore: a member whose copy is lost is rebuilt by the process that took
its place (same process count), else by the first surviving member of its
group (in group order), which then serves the rebuilt copy like any other
(the restore's reshard transfer decides; `r.source == "parity"`). The
rebuilder pulls the parity blocks and the other chunks from the survivors
(RangeServer), XORs them in as they arrive (and what it holds itself, read
in place), and checks every rebuilt shard against the CRC32C in the lost
member's manifest.

Security: as every peer stream (transport/protocol.py: a secret published
through the coordination service and proven by both ends of every
connection; a MAC on every request, reply and byte range; nothing
executed).

Called by: redundancy/links.py (send, send_snapshot, send_failure, on the
redundancy lane) and the restore's reshard transfer (RangeServer, rebuild).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from emergency_ckpt.core import parity as xp
from emergency_ckpt.errors import PeerTransferError
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import read as local_read
from emergency_ckpt.local.format import LocalStep
from emergency_ckpt.redundancy import xor_wire
from emergency_ckpt.redundancy.xor_wire import PIECE
from emergency_ckpt.runtime import buffers
from emergency_ckpt.transport import protocol, stream

logger = logging.getLogger("emergency_ckpt")


def send(
  offers: Mapping[int, dict], group: Sequence[int], member: int, step_dir: str, *, timeout_s: float
) -> int:
  """Sends this member's chunks of a written step to the other members,
  each followed by the step's manifest, and waits until every one stored
  its parity block. Called by: the redundancy lane, after the local write.

  Args:
    offers: {process: its ParityReceiver's offer}.
    group: the group's processes, in group order.
    member: this process's index in `group`.
    step_dir: the written step's folder.
    timeout_s: the socket timeout.

  Returns:
    The bytes sent.

  Raises:
    PeerTransferError: a member cannot receive, or did not store its block.
    OSError: the step's files or a connection failed.
  """
  with open(os.path.join(step_dir, local_format.MANIFEST), "rb") as f:
    raw = f.read()
  step = local_format.decode_manifest(raw, step_dir)["step"]
  path = os.path.join(step_dir, local_format.SHARDS)
  nbytes = os.path.getsize(path)

  def one(offer: dict, header: dict, off: int, length: int) -> dict:
    return protocol.send_file(
      offer,
      header,
      path,
      off,
      length,
      timeout_s=timeout_s,
      trailer=protocol.manifest_trailer(lambda: raw),
      sender=member,
    )

  return xor_wire.send_chunks(offers, group, member, step, nbytes, one)


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
  """As send(), from the staged bytes of a step whose local write runs
  meanwhile (the file will hold exactly these bytes): each chunk's bytes go
  at once, each chunk's trailer once `manifest()` returns. Called by: the
  redundancy lane, beside the local write.

  Args:
    offers: {process: its ParityReceiver's offer}.
    group: the group's processes, in group order.
    member: this process's index in `group`.
    step: the step.
    data: its staged bytes (uint8).
    manifest: blocks until the write is complete and returns the raw
      manifest; an exception's text is sent instead, and the members drop
      the step at once.
    timeout_s: the socket timeout.
    sent: called once every chunk's bytes are out, or one failed (the
      caller may let go of `data`).

  Returns:
    The bytes sent.

  Raises:
    PeerTransferError: a member cannot receive, or did not store its block.
    OSError: a connection failed.
  """
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
      return protocol.send_buffer(
        offer,
        header,
        data[off : off + length],
        timeout_s=timeout_s,
        trailer=protocol.manifest_trailer(manifest),
        sent=bytes_out,
        sender=member,
      )
    finally:
      if not out[0]:  # failed before its last byte: done with `data` too
        bytes_out()

  try:
    return xor_wire.send_chunks(offers, group, member, step, len(data), one)
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
  by: the redundancy lane, after a failed local write.

  Args:
    offers: {process: its ParityReceiver's offer}.
    group: the group's processes, in group order.
    member: this process's index in `group`.
    step: the step.
    why: the write's error.
    timeout_s: the socket timeout.
  """

  def failed() -> bytes:
    raise OSError(why)

  try:
    send_snapshot(offers, group, member, step, np.empty(0, np.uint8), failed, timeout_s=timeout_s)
  except (OSError, PeerTransferError) as e:  # the members answer with the error: expected
    logger.debug("xor: step %d's failure told to the group: %s", step, e)


class RangeServer(stream.Server):
  """Serves byte ranges of this host's data and parity files of one step,
  by saved process (for a rebuild), to clients that prove they hold its
  secret."""

  _purpose = "xor-range"

  def __init__(
    self,
    host: str,
    step: int,
    files: Mapping[tuple[int, str], np.ndarray],
    *,
    timeout_s: float,
    log_prefix: str,
    ports: tuple[int, int] | None = None,
    security: protocol.Security | None = None,
  ):
    """Listens at once (OSError if it cannot).

    Args:
      host: the address to listen on.
      step: the step served.
      files: {(saved process, "data" | "parity"): the file's bytes}.
      timeout_s: the socket timeout.
      log_prefix: this process's log prefix.
      ports: the port range to listen on (None: any).
      security: peer.integrity and peer.encryption (None: the defaults).
    """
    self._ready = {}
    self._timeout_s = timeout_s
    self._prefix = log_prefix
    self._step = step
    self._files = dict(files)
    self._start(host, ports, security)

  def _answer(self, request):
    if not isinstance(request, dict) or request.get("step") != self._step:
      return {"error": f"this process serves step {self._step}"}, [], []
    records, views = [], []
    for process, kind, offset, length in request.get("ranges", []):
      if not all(type(v) is int for v in (process, offset, length)) or not isinstance(kind, str):
        return {"error": "a malformed range"}, [], []
      buf = self._files.get((process, kind))
      if buf is None or offset < 0 or length < 0 or offset + length > len(buf):
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
    self.out = buffers.aligned_zeros(nbytes)
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
  piece = np.empty(PIECE, np.uint8)
  with protocol.connect(offer, timeout_s=timeout_s, step=step) as sock:
    sock.send_json({"step": step, "ranges": ranges})
    reply = sock.recv_json(protocol.MAX_DOCUMENT)
    if not isinstance(reply, dict) or "error" in reply:
      why = reply.get("error") if isinstance(reply, dict) else reply
      raise PeerTransferError(f"process {holder} refused: {why}")
    records = reply.get("shards")
    if not isinstance(records, list) or len(records) != len(ranges):
      raise PeerTransferError(
        f"process {holder} answered {str(records)[:80]} for {len(ranges)} ranges"
      )
    for (_, _, _, length), record, t in zip(ranges, records, into):
      if not isinstance(record, dict) or record.get("nbytes") != length:
        raise PeerTransferError(f"process {holder} answered {record} for {length} bytes")
      rx = sock.payload_in(length)
      while rx.pos < length:
        pos = rx.pos
        n = rx.recv_some(piece[: min(PIECE, length - pos)])
        target.xor(t, pos, piece[:n])
      rx.finish()  # a range changed on the wire fails here, before the CRC32Cs


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
  """Rebuilds a lost member from the other members' data and parity blocks,
  every shard checked against the lost member's manifest. Only the bytes
  a rebuilt chunk covers are read (a parity block or another member's
  chunk may be longer); the ranges fetched stream into the rebuilt chunks
  as they arrive, from every holder at once, while this thread XORs in the
  bytes held here.

  Args:
    step: the step.
    lost: the lost member's saved process.
    group: the group's saved processes, in group order.
    sizes: every member's shards.bin bytes, by index in `group`.
    manifest: the lost member's manifest body (from a group.json).
    offers: {saved process: the offer of a RangeServer holding its files}.
    timeout_s: the socket timeout.
    here: {(saved process, "data" | "parity"): bytes} this process holds,
      read in place rather than fetched (unchecked on their own: a bad
      byte fails the rebuilt shard's CRC32C).

  Returns:
    The lost member's step, verified.

  Raises:
    PeerTransferError: a holder cannot serve or refused.
    CorruptCheckpointError: a rebuilt shard fails its checksum.
    OSError: a connection failed.
  """
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
