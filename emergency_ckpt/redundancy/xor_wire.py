"""The XOR chunk message between group members at save, and the member's
receiver of it (ParityReceiver).

One message per (sender, member) pair and step, a sender's all sent at
once (send_chunks): the header (JSON: step, member, group, nbytes,
length), the chunk's `length` bytes, then the trailer
(protocol.manifest_trailer: the sender's manifest once its local write is
complete, or the error that ended it), answered by {"ok": true} once the
receiver's parity block is durable, else {"error": why}. The receiver XORs each chunk into the step's block piece by
piece as it arrives (local/blocks.py keeps the files), stores the block
once all k-1 chunks came, answers every sender, and only then retires old
blocks. A torn chunk, a member's failed write or a timeout gives the step
up: its block goes and every waiting sender is told.

Security: as every peer stream (transport/protocol.py: a secret published
through the coordination service, proven by both ends on every connection,
which is bound to the member and step it claims; a MAC on the header, the
chunk and the trailer; nothing executed). Sizes from the wire are not
trusted: a chunk's length must be the one the receiver computes from the
sender's byte count (core/parity.py); the block grows only as bytes arrive
(never to a length a header names ahead of them); the sender's manifest is
decoded and checked against its header before it is kept, and the stored
block's length comes from those checked sizes.

Called by: redundancy/xor.py (send_chunks, on the redundancy lane),
redundancy/links.py (one ParityReceiver per member).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from emergency_ckpt.core import layout
from emergency_ckpt.core import parity as xp
from emergency_ckpt.errors import PeerTransferError
from emergency_ckpt.local import blocks, folders
from emergency_ckpt.local import format as local_format
from emergency_ckpt.transport import protocol

logger = logging.getLogger("emergency_ckpt")

PIECE = 4 << 20
"""Bytes received in one call (protocol.recv_some), XORed while in cache."""
_GIVEN_UP_KEPT = 16  # steps given up whose late chunks are still refused


def send_chunks(
  offers: Mapping[int, dict],
  group: Sequence[int],
  member: int,
  step: int,
  nbytes: int,
  send_one: Callable[[dict, dict, int, int], dict],
) -> int:
  """Sends each other member its chunk of this member's bytes of a step, all
  at once, and checks every answer.

  Args:
    offers: {process: its ParityReceiver's offer}.
    group: the group's processes, in group order.
    member: this process's index in `group`.
    step: the step.
    nbytes: this member's shards.bin bytes.
    send_one: sends one message, `send_one(offer, header, offset, length)`
      (protocol.send_file or send_buffer with the manifest trailer), and
      returns the member's answer.

  Returns:
    The bytes sent.

  Raises:
    PeerTransferError: a member cannot receive, or did not store its block.
    OSError: a connection failed.
  """
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


class _NotWritten(OSError):
  """A member's local write of the step failed (its chunk's trailer)."""


class _GivenUp(OSError):
  """The step was given up while this chunk arrived (its rest was read)."""


class _Pending:
  """One step's parity block while its chunks arrive."""

  def __init__(self, k: int):
    self.k = k
    self.block: blocks.ParityBlock | None = None  # made by the first chunk to arrive
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


class ParityReceiver(protocol.Listener):
  """Keeps this member's parity blocks: accumulates the chunks the other
  members send, stores the block once all k-1 arrived, answers them, and
  only then prepares the next step's spare (see _retire)."""

  _purpose = "xor"

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
    security: protocol.Security | None = None,
  ):
    """Removes what a crashed incarnation left, then listens (OSError if it
    cannot).

    Args:
      process_dir: this member's process folder (blocks go to its `xor`).
      host: the address to listen on.
      member: this process's index in its group.
      group: the group's processes, in group order.
      keep: parity steps kept.
      timeout_s: how long a step waits for its chunks; the socket timeout.
      log_prefix: this process's log prefix.
      ports: the port range to listen on (None: any).
      mapped: whether a restore mapped a file (a rebuild maps parity
        blocks in place): such a block is never recycled as a spare.
      security: peer.integrity and peer.encryption (None: the defaults).
    """
    self._dir = blocks.xor_dir(process_dir)
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
    folders.remove_tmp(self._dir)
    self._start(host, ports, security)

  def _handle(self, conn: protocol.Session) -> None:
    """One member's chunk of a step; answers once the block is durable.
    Runs on the connection's thread; blocks on the sender and on the
    step's other chunks (the timeout)."""
    stored = False
    try:
      header = conn.recv_json()
      pending, stored = self._add(header, conn)
      if not pending.done.wait(self._timeout_s):
        missing = sorted(set(range(pending.k)) - {self._member} - set(pending.seen))
        why = f"step {header['step']}: chunks of members {missing} never came"
        self._give_up(int(header["step"]), pending, why)
        raise TimeoutError(pending.error)
      if pending.error:
        raise OSError(pending.error)
      conn.send_json({"ok": True})
    except Exception as e:  # noqa: BLE001 - the sender sees no "ok" and reports it
      logger.warning("%s xor: a parity block was not stored: %s", self._prefix, e)
      with contextlib.suppress(OSError):
        conn.send_json({"error": str(e)})
    finally:
      if stored:  # every sender has its answer: off the save's path
        self._retire()

  def _add(self, header: dict, conn: protocol.Session) -> tuple[_Pending, bool]:
    """Receives one member's chunk from `conn`, XORed into the step's block
    piece by piece as it arrives (each piece still in cache); the last
    chunk of the step stores the block. Returns (the step's pending block,
    whether this call stored it)."""
    step, i, length = _checked_header(header, conn.claim, self._group, self._member)
    k = len(self._group)
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
          self._open(pending, step)
    if why is not None:  # refused: read (so the sender gets the answer), dropped
      _drain(conn.payload_in(length))
      raise OSError(why)
    view = memoryview(bytearray(min(PIECE, max(length, 1))))
    piece = np.frombuffer(view, np.uint8)
    rx = conn.payload_in(length)
    try:
      while rx.pos < length:
        n = rx.recv_some(view[: min(len(view), length - rx.pos)])
        pos = rx.pos
        with pending.lock:
          dropped = pending.block is None
          if not dropped:
            block = pending.block
            if pos > len(block.acc):  # grown as the bytes come, never ahead of them
              block.grow(min(length, max(pos, 2 * len(block.acc))))
            block.add(pos - n, piece[:n])
        if dropped:  # given up meanwhile: the rest read (the sender gets the answer)
          _drain(rx)
          raise _GivenUp(pending.error or f"step {step} was given up")
      rx.finish()  # the chunk's MAC, before the step counts it
      # After the bytes, the sender's manifest of the step, once its local
      # write is complete (or why it failed: the step is given up at once).
      try:
        raw = protocol.recv_manifest(conn, f"member {i} did not write step {step}")
      except OSError as e:
        raise _NotWritten(str(e)) from None
      manifest = _checked_manifest(raw, header, self._group[i])
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
      pending.seen[i] = {**header, "manifest": raw.hex(), "nbytes": manifest["nbytes"]}
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

  def _open(self, pending: _Pending, step: int) -> None:
    """Under pending.lock: the step's block, made empty by its first chunk
    (over the spare, if there is one); every chunk grows it as its bytes
    arrive (_add), never ahead of them."""
    if pending.block is None:
      pending.block = blocks.open_block(self._dir, step, 0, self._mapped)

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
    body = {
      "step": step,
      "group": self._group,
      "member": self._member,
      "sizes": sizes,
      "manifests": {str(i): h["manifest"] for i, h in headers.items()},
    }
    block.store(layout.local_step_dir(self._dir, step), length, body)

  def _retire(self) -> None:
    """Drops the parity steps beyond the newest `keep`, the newest of them
    kept as the spare the next step's block is written into
    (blocks.retire_blocks). Runs after the senders were answered: off the
    save's path."""
    try:
      with self._retire_lock:
        blocks.retire_blocks(self._dir, self._keep, self._mapped)
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


def _drain(rx) -> None:
  """Reads and drops what is left of a chunk's payload `rx`, its MAC and
  its trailer."""
  buf = memoryview(bytearray(min(PIECE, max(rx.length - rx.pos, 1))))
  while rx.pos < rx.length:
    rx.recv_some(buf[: rx.length - rx.pos])
  rx.finish()
  rx.session.recv_json(protocol.MAX_DOCUMENT)


def _checked_header(header, claim: dict, group: list, me: int) -> tuple[int, int, int]:
  """(step, member, length) of a chunk's header, checked: its types, its
  group, the member and step the connection's handshake was bound to, and
  its length against the one this receiver computes from the member's byte
  count. Raises ValueError naming what is wrong, before any byte is taken."""
  if not isinstance(header, dict):
    raise ValueError(f"a header that is a {type(header).__name__}")
  step, i, nbytes, length = (header.get(f) for f in ("step", "member", "nbytes", "length"))
  k = len(group)
  if not all(type(v) is int and v >= 0 for v in (step, i, nbytes, length)):
    raise ValueError(f"a malformed chunk header {str(header)[:200]}")
  if header.get("group") != group or i == me or not i < k:
    raise ValueError(
      f"a chunk from member {i} of group {header.get('group')!r:.80}, not of {group}"
    )
  if (i, step) != (claim.get("sender"), claim.get("step")):
    raise ValueError(
      f"the header names member {i} step {step}; the connection was opened for"
      f" member {claim.get('sender')} step {claim.get('step')}"
    )
  want = xp.chunk(nbytes, k, xp.assigned(i, me, k))[1]
  if length != want:
    raise ValueError(f"member {i} announces a chunk of {length} bytes; its {nbytes} make {want}")
  return step, i, length


def _checked_manifest(raw: bytes, header: dict, process: int) -> dict:
  """A chunk's trailer manifest, decoded and checked (local/format.py's
  schema) and against its header: the step, the writer and its byte count.
  Raises CorruptCheckpointError (or ValueError) naming the mismatch."""
  body = local_format.decode_manifest(raw, f"member {header['member']}'s trailer")
  got = (body.get("step"), body.get("process_index"), body.get("nbytes"))
  if got != (header["step"], process, header["nbytes"]):
    raise ValueError(
      f"member {header['member']}'s manifest names step, process, bytes {got}; its header"
      f" {(header['step'], process, header['nbytes'])}"
    )
  return body
