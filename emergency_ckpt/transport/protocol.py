"""The wire protocol of every peer stream: connecting, and the messages
built on a Session.

A listener (listener.py) publishes its offer through the JAX coordination
service (the job's own channel): host, port, a fresh 256-bit secret
("token"), what it serves ("purpose", "receiver") and how ("integrity";
"tls": a certificate fingerprint, with peer.encryption). The secret never
travels on the data path: each connection starts with a challenge-response
in both directions (handshake.py), then carries framed JSON documents and
raw payloads, each with a MAC under the connection's own key (session.py).
Nothing here unpickles or runs anything it receives.

A client whose connection was closed before the listener's challenge (a
listener busy with a flood of connections) tries again until its timeout.

Called by: stream.py (a restore's peer transfer), redundancy/partner.py,
redundancy/xor_wire.py and redundancy/xor.py (their sends and receivers).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

import numpy as np

from emergency_ckpt.errors import PeerTransferError
from emergency_ckpt.transport import handshake, tls
from emergency_ckpt.transport.handshake import MAGIC, TOKEN_BYTES
from emergency_ckpt.transport.listener import Listener, Security
from emergency_ckpt.transport.session import MAX_DOCUMENT, MAX_HEADER, Session, recv_some, settle

__all__ = [
  "MAGIC",
  "MAX_DOCUMENT",
  "MAX_HEADER",
  "TOKEN_BYTES",
  "Listener",
  "Security",
  "Session",
  "recv_some",
  "settle",
]

_RETRY_S = (0.02, 1.0)  # a client's first and longest pause between tries


@contextlib.contextmanager
def connect(offer: dict, *, timeout_s: float, sender=None, step: int | None = None):
  """An authenticated connection to the Listener of `offer`. Blocks until
  both ends proved themselves; tries again (short pauses, growing) while
  the listener closes before its challenge, until `timeout_s`.

  Args:
    offer: the listener's offer (Listener.offer).
    timeout_s: the connect, send and receive timeout.
    sender: who connects (bound into the handshake; the listener may check
      it against the headers), if known.
    step: the step the connection is for, if known.

  Yields:
    The Session.

  Raises:
    PeerTransferError: the listener did not prove itself, or refused ours.
    OSError: the connection failed.
  """
  what = f"the {offer.get('purpose', 'peer')} listener at {offer['host']}:{offer['port']}"
  claim = {"sender": sender, "step": step}
  deadline = time.monotonic() + timeout_s
  pause = _RETRY_S[0]
  while True:
    sock = socket.create_connection((offer["host"], offer["port"]), timeout=timeout_s)
    try:
      settle(sock, timeout_s)
      if "tls" in offer:
        sock = tls.connect(sock, offer["tls"], what)
      key = handshake.join(sock, offer, claim, what=what)
    except handshake.NotServed:
      sock.close()
      if time.monotonic() + pause > deadline:
        raise PeerTransferError(f"{what} served no handshake within {timeout_s} s") from None
      time.sleep(pause)
      pause = min(2 * pause, _RETRY_S[1])
      continue
    except BaseException:
      sock.close()
      raise
    break
  with sock:
    yield Session(sock, key, client=True, integrity=offer.get("integrity", "mac"), what=what)


def send_json(conn: Session, doc) -> None:
  """Sends one document (Session.send_json)."""
  conn.send_json(doc)


def recv_json(conn: Session, limit: int = MAX_HEADER):
  """Receives one document of at most `limit` bytes (Session.recv_json)."""
  return conn.recv_json(limit)


def recv_into(conn: Session, view: np.ndarray) -> None:
  """Receives one payload into a buffer, its MAC checked (Session.recv_payload).

  Raises:
    CorruptCheckpointError: the bytes fail their MAC.
    ConnectionError: the peer closed first.
    TimeoutError: nothing came within the timeout.
  """
  conn.recv_payload(view)


def send_file(
  offer: dict,
  header: dict,
  path: str,
  offset: int,
  length: int,
  *,
  timeout_s: float,
  trailer: Callable[[], dict] | None = None,
  sender=None,
) -> dict:
  """Sends one message from a file: `header`, a byte range (one payload),
  a trailer; then waits for the answer. Called by: a redundancy send (the
  redundancy lane); blocks until the answer or the timeout.

  Args:
    offer: the receiving Listener's offer.
    header: the message's header (JSON; its "step" is bound into the
      handshake).
    path: the file.
    offset: the range's first byte.
    length: its bytes.
    timeout_s: the socket timeout.
    trailer: makes the JSON document sent after the bytes (None: none).
    sender: who sends (bound into the handshake).

  Returns:
    The receiver's JSON answer.

  Raises:
    OSError: the transfer failed (TimeoutError if the receiver stops
      reading).
  """
  step = header.get("step")
  with open(path, "rb") as f, connect(offer, timeout_s=timeout_s, sender=sender, step=step) as s:
    s.send_json(header)
    sent = s.send_file(f.fileno(), offset, length)
    if sent != length:
      raise ConnectionError(f"the file ended after {sent} of {length} bytes")
    if trailer is not None:
      s.send_json(trailer())
    return s.recv_json()


def manifest_trailer(manifest: Callable[[], bytes]) -> Callable[[], dict]:
  """The trailer (send_file, send_buffer) that carries a step's raw manifest.

  Args:
    manifest: returns the raw manifest once the step's local write is
      done; the error it raises is sent instead (the receiver then drops
      the step: recv_manifest).

  Returns:
    The trailer function.
  """

  def trailer() -> dict:
    try:
      return {"manifest": manifest().hex()}
    except Exception as e:  # noqa: BLE001 - the receiver is told why
      return {"error": f"{type(e).__name__}: {e}"}

  return trailer


def recv_manifest(conn: Session, what: str) -> bytes:
  """The raw manifest a manifest_trailer sent after the bytes (at most
  MAX_DOCUMENT).

  Args:
    conn: the session.
    what: names the failure, e.g. "process 3 did not write step 7".

  Returns:
    The manifest's raw bytes (not decoded).

  Raises:
    OSError: naming `what` and the sender's error, if its local write failed.
    CorruptCheckpointError: oversized, or altered on the wire.
  """
  tail = conn.recv_json(MAX_DOCUMENT)
  if not isinstance(tail, dict) or not isinstance(tail.get("manifest"), str):
    why = tail.get("error") if isinstance(tail, dict) else tail
    raise OSError(f"{what}: {why}")
  try:
    return bytes.fromhex(tail["manifest"])
  except ValueError:
    raise OSError(f"{what}: a trailer that is not hex") from None


def send_buffer(
  offer: dict,
  header: dict,
  data: np.ndarray,
  *,
  timeout_s: float,
  trailer: Callable[[], dict],
  sent: Callable[[], None] = lambda: None,
  sender=None,
) -> dict:
  """As send_file, from memory.

  Args:
    offer: the receiving Listener's offer.
    header: the message's header (JSON).
    data: the bytes, a contiguous uint8 array.
    timeout_s: the socket timeout.
    trailer: makes the JSON document sent after the bytes; it may block,
      e.g. until the file those bytes are written to is complete.
    sent: called once the bytes are out (the caller may let go of `data`).
    sender: who sends (bound into the handshake).

  Returns:
    The receiver's JSON answer.

  Raises:
    OSError: the transfer failed.
  """
  step = header.get("step")
  with connect(offer, timeout_s=timeout_s, sender=sender, step=step) as s:
    s.send_json(header)
    s.send_payload(data)
    sent()
    s.send_json(trailer())
    return s.recv_json()
