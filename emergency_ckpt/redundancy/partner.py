"""Partner redundancy (local.redundancy = "partner"): each process's local
step also lives in its partner's ramdisk, on another machine of its slice.

After a local write, the writer's process streams the step's shards.bin
(`os.sendfile`: the kernel copies from the ramdisk to the socket), or,
with local.redundancy_overlap, the staged snapshot that file is written
from, beside the write; the step's manifest follows the bytes (once the
write is done, or the write's error: the partner drops the step). The
partner writes them under its own folder (local/blocks.py):
  <process dir of the partner>/partner/process_<sender>/step_<N>/
(a `.tmp-step_<N>-<hex>` folder renamed into place once both files are
fsync'ed and every shard matched its CRC32C, summed as the bytes arrived),
keeps the newest `keep` steps per sender (the retired one's folder kept as
the spare the next step is written over), and answers. The local tier
lists those folders as copies of the sender's step (local/discovery.py),
so a restore that lost the sender's host rebuilds it from there (the
restore's reshard transfer, `r.source == "partner"`); every shard is
checked against the CRC32C its writer recorded where it is received or
used.

Who partners whom: `choose_partner` (pure): the next process of the slice,
in slice order, that runs on another machine.

Security: as every peer stream (transport/protocol.py), each receiver
listens on one address for the manager's lifetime and serves only senders
that prove they hold the secret it published through the JAX coordination
service (a challenge-response per connection, bound to the sender and the
step it claims, which the header must then name); the header, the bytes
and the trailer each carry a MAC under the connection's key. The header's
sizes are checked against each other before any byte is taken (its spans
within its byte count, a spare reused only if it already has that size:
nothing is allocated ahead of the bytes that arrive), and the trailer's
manifest is decoded and checked against the header before it is stored.
Nothing received is executed.

Called by: the manager (one Receiver per process while redundancy is on;
send() on the redundancy lane after each local write).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
from collections.abc import Callable, Mapping, Sequence

from emergency_ckpt.core import failpoints, layout
from emergency_ckpt.errors import PeerTransferError
from emergency_ckpt.local import blocks, folders
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local.incoming import StreamChecksums
from emergency_ckpt.transport import protocol

logger = logging.getLogger("emergency_ckpt")

_CHUNK = 4 << 20  # received in one call (protocol.recv_some), summed and written while in cache


def choose_partner(
  me: int, slice_processes: Sequence[int], same_machine: Mapping[int, object]
) -> int | None:
  """Who keeps this process's steps: the process after `me` in its slice's
  order (wrapping) that runs on another machine. Pure.

  Args:
    me: this process.
    slice_processes: its slice's processes, in slice order.
    same_machine: the processes on `me`'s machine (placement's group).

  Returns:
    The partner, or None if every process of the slice shares `me`'s
    machine.
  """
  procs = list(slice_processes)
  k = procs.index(me)
  for i in range(1, len(procs)):
    other = procs[(k + i) % len(procs)]
    if other not in same_machine:
      return other
  return None


class Receiver(protocol.Listener):
  """Receives partner steps into this process's folder until close()."""

  _purpose = "partner"

  def __init__(
    self,
    process_dir: str,
    host: str,
    *,
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
      process_dir: this process's folder (copies go to its `partner`).
      host: the address to listen on.
      keep: steps kept per sender.
      timeout_s: the socket timeout.
      log_prefix: this process's log prefix.
      ports: the port range to listen on (None: any).
      mapped: whether a restore mapped a file (its pages may be aliased by
        restored arrays): such a retired copy is never written over.
      security: peer.integrity and peer.encryption (None: the defaults).
    """
    self._dir = process_dir
    self._mapped = mapped or (lambda st: False)
    self._keep = keep
    self._timeout_s = timeout_s
    self._prefix = log_prefix
    _cleanup(process_dir)
    self._start(host, ports, security)

  def _handle(self, conn: protocol.Session) -> None:
    """One sender's step: header (its shards' spans), bytes, then its
    manifest (or the error that ended its local write); answers once the
    step is durable here. Runs on the connection's thread; blocks on the
    sender (the socket timeout)."""
    try:
      step, sender, nbytes, spans = _checked_header(conn.recv_json(), conn.claim)
      self._store(conn, step, sender, nbytes, spans)
      conn.send_json({"ok": True})
    except Exception as e:  # noqa: BLE001 - the sender sees no "ok" and reports it
      logger.warning("%s partner: a step was not stored: %s", self._prefix, e)
      with contextlib.suppress(OSError):
        conn.send_json({"error": str(e)})

  def _store(self, conn, step: int, sender: int, nbytes: int, spans) -> None:
    """Writes the step into a temporary folder as its bytes arrive, summing
    each shard's CRC32C on the way (still in cache: no second pass over the
    file), checks them against the manifest that follows and renames the
    folder into place."""
    if failpoints.armed("partner.refuse", step):
      raise OSError("failpoint partner.refuse")  # a test: the partner cannot store it
    folder = blocks.partner_dir(self._dir, sender)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    tmp = os.path.join(folder, layout.tmp_step_dir_name(step))
    os.mkdir(tmp, 0o700)
    try:
      checks = StreamChecksums(spans, tmp)
      path = os.path.join(tmp, local_format.SHARDS)
      reused = folders.take_spare(folder, local_format.SHARDS, path, self._mapped, nbytes)
      rx = conn.payload_in(nbytes)
      with open(path, "r+b" if reused else "wb") as f:
        if reused and nbytes:  # the spare's pages exist: map them, one copy per byte
          _receive_mapped(rx, f, nbytes, checks)
        else:
          _receive(rx, f, nbytes, checks)
        rx.finish()  # the bytes' MAC: a man in the middle fails here
        f.flush()
        os.fsync(f.fileno())
      manifest, body = _trailer(conn, step, sender, nbytes)
      checks.check(body)  # never keep a torn or damaged copy
      with open(os.path.join(tmp, local_format.MANIFEST), "wb") as f:
        f.write(manifest)
        f.flush()
        os.fsync(f.fileno())
      folders.replace_step(tmp, layout.local_step_dir(folder, step))
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    retired = folders.list_local_steps(folder)[: -self._keep]
    folders.retire_steps(folder, retired, local_format.SHARDS, self._mapped)


def _checked_header(header, claim: dict) -> tuple[int, int, int, list[tuple[int, int]]]:
  """(step, sender, nbytes, spans) of a sender's header, checked: the
  types, every span within the byte count, and the sender and step the
  connection's handshake was bound to. Raises ValueError naming the field."""
  if not isinstance(header, dict):
    raise ValueError(f"a header that is a {type(header).__name__}")
  step, sender, nbytes, spans = (header.get(k) for k in ("step", "process", "nbytes", "spans"))
  if not all(type(v) is int and v >= 0 for v in (step, sender, nbytes)) or not isinstance(
    spans, list
  ):
    raise ValueError(f"a malformed header {str(header)[:200]}")
  if (sender, step) != (claim.get("sender"), claim.get("step")):
    raise ValueError(
      f"the header names process {sender} step {step}; the connection was opened for"
      f" process {claim.get('sender')} step {claim.get('step')}"
    )
  out = []
  for span in spans:
    if not (isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)):
      raise ValueError(f"a malformed span {str(span)[:80]}")
    off, n = span
    if off < 0 or n < 0 or off + n > nbytes:
      raise ValueError(f"a span {off}+{n} outside the step's {nbytes} bytes")
    out.append((off, n))
  return step, sender, nbytes, out


def _trailer(conn: protocol.Session, step: int, sender: int, nbytes: int) -> tuple[bytes, dict]:
  """The sender's manifest after the bytes (raw, decoded), checked against
  the header; OSError if its local write failed."""
  raw = protocol.recv_manifest(conn, f"process {sender} did not write step {step}")
  body = local_format.decode_manifest(raw, "partner trailer")
  if (body.get("step"), body.get("process_index"), body.get("nbytes")) != (step, sender, nbytes):
    raise ValueError(f"the header names step {step} of process {sender}, its manifest another")
  return raw, body


def _cleanup(process_dir: str) -> None:
  """Removes what a crashed incarnation left in the partner folders (steps
  being received, spares, deletions: `.tmp-*`)."""
  root = os.path.join(process_dir, blocks.PARTNER_DIR)
  for name in folders.names(root):
    folder = os.path.join(root, name)
    if layout.process_of_dir_name(name) is not None and not os.path.islink(folder):
      folders.remove_tmp(folder)


def _receive_mapped(rx, f, nbytes: int, checks) -> None:
  """`nbytes` of the payload `rx` straight into the pages of `f` (a spare
  of that size: they exist), through a shared mapping: one copy per byte,
  summed (CRC32C and MAC) in cache."""
  mm = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
  try:
    with memoryview(mm) as whole:
      pos = 0
      while pos < nbytes:
        view = whole[pos : min(nbytes, pos + _CHUNK)]
        n = rx.recv_some(view)
        checks.update(pos, view[:n])
        view.release()
        pos += n
  finally:
    mm.close()


def _receive(rx, f, nbytes: int, checks: StreamChecksums) -> None:
  """`nbytes` of the payload `rx` into the file `f`, through one small
  buffer that stays in cache while its bytes are summed and written (the
  file grows only as bytes arrive)."""
  view = memoryview(bytearray(min(_CHUNK, max(nbytes, 1))))
  pos = 0
  while pos < nbytes:
    n = rx.recv_some(view[: min(len(view), nbytes - pos)])
    checks.update(pos, view[:n])
    f.write(view[:n])
    pos += n


def send(offer: dict, partner: int, step_dir: str, *, timeout_s: float) -> int:
  """Sends a written local step to the partner and waits until it is
  durable there. Called by: the redundancy lane, after the local write.

  Args:
    offer: the partner's Receiver's offer.
    partner: its process (for messages).
    step_dir: the step's folder.
    timeout_s: the socket timeout.

  Returns:
    The bytes sent.

  Raises:
    PeerTransferError: the partner cannot receive, or did not store it.
    OSError: the step's files or the connection failed.
  """
  _check_offer(offer, partner)
  with open(os.path.join(step_dir, local_format.MANIFEST), "rb") as f:
    raw = f.read()
  body = local_format.decode_manifest(raw, step_dir)
  path = os.path.join(step_dir, local_format.SHARDS)
  nbytes = os.path.getsize(path)
  spans = StreamChecksums.spans_of(body)
  header = _header(body["step"], body["process_index"], nbytes, spans)
  reply = protocol.send_file(
    offer,
    header,
    path,
    0,
    nbytes,
    timeout_s=timeout_s,
    trailer=protocol.manifest_trailer(lambda: raw),
    sender=body["process_index"],
  )
  return _answered(reply, partner, body["step"], nbytes)


def send_snapshot(
  offer: dict,
  partner: int,
  step: int,
  process: int,
  data,
  spans: Sequence[tuple[int, int]],
  manifest: Callable[[], bytes],
  *,
  timeout_s: float,
  sent: Callable[[], None] = lambda: None,
) -> int:
  """As send(), from the staged bytes of a step while its local write runs
  (the file will hold exactly these bytes). Called by: the redundancy
  lane, beside the local write.

  Args:
    offer: the partner's Receiver's offer.
    partner: its process (for messages).
    step: the step.
    process: this process (the step's writer).
    data: the staged bytes (uint8).
    spans: the shards' (offset, nbytes) in `data`.
    manifest: blocks until the write is done and returns the raw
      manifest; an exception's text goes instead, and the partner drops
      the step.
    timeout_s: the socket timeout.
    sent: called once the bytes are out (or failed): `data` may go.

  Returns:
    The bytes sent.

  Raises:
    PeerTransferError: the partner cannot receive, or did not store it.
    OSError: the connection failed.
  """
  _check_offer(offer, partner)

  out = [False]

  def bytes_out() -> None:  # once: after the last byte, or on a failure before it
    if not out[0]:
      out[0] = True
      sent()

  header = _header(step, process, len(data), spans)
  try:
    reply = protocol.send_buffer(
      offer,
      header,
      data,
      timeout_s=timeout_s,
      trailer=protocol.manifest_trailer(manifest),
      sent=bytes_out,
      sender=process,
    )
  finally:
    bytes_out()
  return _answered(reply, partner, step, len(data))


def _check_offer(offer: dict, partner: int) -> None:
  if "error" in offer:
    raise PeerTransferError(f"partner process {partner} cannot receive: {offer['error']}")


def _header(step: int, process: int, nbytes: int, spans: Sequence[tuple[int, int]]) -> dict:
  return {"step": step, "process": process, "nbytes": nbytes, "spans": [list(x) for x in spans]}


def _answered(reply: dict, partner: int, step: int, nbytes: int) -> int:
  if not isinstance(reply, dict) or not reply.get("ok"):
    raise PeerTransferError(f"partner process {partner} did not store step {step}: {reply}")
  return nbytes
