"""One authenticated peer connection after its handshake: framed JSON
documents and raw payloads, each followed by a MAC under the connection's
session key.

Every unit sent on a connection (a JSON document, or a payload: the bytes of
one shard, range or chunk) carries its own sequence number, so a unit
dropped, repeated or moved is detected like a changed byte. A document is
its 4-byte big-endian length, its bytes, then its tag; its length is
checked against the caller's limit before any byte of it is received. A
payload's length is known to both sides beforehand (a document announced
it, and the receiver checked it against what it computed itself); its
bytes go raw, then its tag, and the receiver sums the MAC over each piece
as it arrives (still in cache, beside its CRC32C).

Documents are MAC'd with HMAC-SHA256. Payloads (the bulk of the bytes) are
MAC'd with GMAC (AES-256-GCM over the bytes as associated data, nothing
encrypted; the `cryptography` package, OpenSSL's AES-NI and carry-less
multiply code): on the 2-core VM about 1.5 times as fast as Poly1305 and
five times as fast as HMAC-SHA256 (benchmarks/transport_security.py). Every payload gets its own key:
HMAC-SHA256 of its direction's key over its sequence number, never used
twice (the session key is fresh per connection, the sequence number per
unit), so GCM's fixed nonce is never reused under a key. With integrity "crc" the
documents keep their tags and payloads go without one (their CRC32Cs then
catch accidents only, not a man in the middle).

Sockets are in blocking mode with the kernel's own timeouts (settle): a
large send or a MSG_WAITALL receive is one system call that waits in the
kernel instead of taking the GIL back for every partial transfer.

Called by: transport/handshake.py (makes a Session), and every peer
stream's two ends through protocol.py (stream.py, redundancy/*).
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.transport.overlap import Overlap

MAX_HEADER = 1 << 20
"""Largest header or request a receiver accepts (a partner or XOR header, a
reply): refused from its length, before any of it is received."""
MAX_DOCUMENT = 32 << 20
"""Largest document a receiver accepts where the caller allows more than a
header (a restore's request of every shard, a trailer carrying a manifest)."""
TAG_BYTES = 32
"""A document's tag (HMAC-SHA256)."""
PAYLOAD_TAG_BYTES = 16
"""A payload's tag (GMAC under the payload's one-time key)."""
INTEGRITY = ("mac", "crc")
_LEN = struct.Struct("!I")
_SEQ = struct.Struct("!QcQ")  # sequence number, kind, length (a payload's: after its bytes)
_PAYLOAD_END = struct.Struct("!Q")  # a payload's length, MAC'd after its bytes
_PIECE = 4 << 20  # bytes per system call of a payload, MAC'd while in cache
_RECV_PIECE = 1 << 20  # bytes per receive: MAC'd and checksummed while the next one arrives
_NONCE = bytes(12)  # GCM's nonce: the key is the payload's own


class PayloadMac:
  """A payload's tag, summed piece by piece: GMAC (AES-256-GCM with the
  bytes as associated data) under a key used for this payload only.

  Args:
    key: 32 bytes, never used for another payload.
  """

  def __init__(self, key: bytes):
    self._gcm = Cipher(algorithms.AES(key), modes.GCM(_NONCE)).encryptor()

  def update(self, piece) -> None:
    """Adds the payload's next bytes."""
    self._gcm.authenticate_additional_data(piece)

  def finalize(self) -> bytes:
    """The tag (PAYLOAD_TAG_BYTES). Call once, after the last update."""
    self._gcm.finalize()
    return self._gcm.tag


def settle(sock: socket.socket, timeout_s: float) -> None:
  """Puts a connected socket in blocking mode with the kernel's own send
  and receive timeouts (SO_SNDTIMEO, SO_RCVTIMEO), so a large send, a
  sendfile or a MSG_WAITALL receive is one system call that waits in the
  kernel: a Python-level timeout makes the socket non-blocking underneath,
  and every partial transfer then takes the GIL back, which is much slower
  beside a busy Python thread. A later wait longer than `timeout_s` raises
  TimeoutError (recv_some) or OSError. Called by: both ends, after connect
  or accept, and again once the handshake is done.

  Args:
    sock: a connected socket.
    timeout_s: the send and receive timeout.
  """
  secs = min(max(0.001, float(timeout_s)), 1e9)  # an endless timeout: 31 years
  tv = struct.pack("@ll", int(secs), int((secs - int(secs)) * 1e6))
  sock.settimeout(None)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_some(sock: socket.socket, view) -> int:
  """Fills `view` from a socket settle() set up, in one call that returns
  early only when the peer closed or after the timeout with part of it.

  Args:
    sock: the socket (a TLS one too: then one record at a time).
    view: a writable buffer.

  Returns:
    The bytes received (0: the peer closed, nothing came).

  Raises:
    TimeoutError: nothing came within the timeout.
  """
  try:
    if isinstance(sock, ssl.SSLSocket):
      return sock.recv_into(view)
    return sock.recv_into(view, 0, socket.MSG_WAITALL)
  except BlockingIOError:  # SO_RCVTIMEO expired with nothing received
    raise TimeoutError(f"no bytes from {peer_name(sock)} within the timeout") from None
  except ssl.SSLWantReadError:
    raise TimeoutError(f"no bytes from {peer_name(sock)} within the timeout") from None


def peer_name(sock: socket.socket) -> str:
  """`host:port` of the other end, for messages."""
  try:
    return "%s:%s" % sock.getpeername()[:2]  # noqa: UP031
  except OSError:
    return "the peer"


def recv_exact(sock: socket.socket, view: memoryview) -> None:
  """Fills `view` from `sock`; ConnectionError if the peer closes first."""
  got = 0
  while got < len(view):
    n = recv_some(sock, view[got:])
    if not n:
      raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
    got += n


def send_all(sock: socket.socket, view) -> None:
  """Sends a buffer in pieces; TimeoutError if the peer stops reading."""
  view = memoryview(view).cast("B")
  pos = 0
  while pos < len(view):
    try:
      pos += sock.send(view[pos : pos + _PIECE])
    except (BlockingIOError, ssl.SSLWantWriteError):  # SO_SNDTIMEO expired, nothing sent
      raise TimeoutError(
        f"{peer_name(sock)} read none of the last bytes within the timeout"
      ) from None


class Session:
  """A connection both ends authenticated, keyed for this connection only.

  Made by handshake.py; used by one thread at a time on each end."""

  def __init__(self, sock: socket.socket, key: bytes, *, client: bool, integrity: str, what: str):
    """Args:
    sock: the connected socket (settled).
    key: the session key (handshake.session_key).
    client: whether this end connected (the two directions use two keys).
    integrity: "mac" (documents and payloads MAC'd) or "crc" (documents only).
    what: names the connection in errors (who, for what, which step).
    """
    self.sock = sock
    self.what = what
    self.integrity = integrity
    out, into = (b"c2s", b"s2c") if client else (b"s2c", b"c2s")
    self._out_key = hmac.digest(key, b"ecpeer direction " + out, "sha256")
    self._in_key = hmac.digest(key, b"ecpeer direction " + into, "sha256")
    self._out_seq = 0
    self._in_seq = 0
    self.claim: dict = {}
    """The client's claim (listener side): {"sender": ..., "step": ...}."""

  # ---- what both ends call --------------------------------------------------------

  def fileno(self) -> int:
    """The socket's descriptor."""
    return self.sock.fileno()

  def settle(self, timeout_s: float) -> None:
    """Sets the socket's kernel timeouts (settle)."""
    settle(self.sock, timeout_s)

  def send_json(self, doc: Any) -> None:
    """Sends one document and its tag. Blocks until the kernel took it.

    Raises:
      OSError: the send failed.
    """
    raw = json.dumps(doc).encode()
    tag = self._mac(self._out_key, self._next_out(), b"J", len(raw), raw)
    send_all(self.sock, _LEN.pack(len(raw)) + raw + tag)

  def recv_json(self, limit: int = MAX_HEADER) -> Any:
    """Receives one document and checks its tag. Blocks until it came.

    Args:
      limit: the largest document accepted: a longer one is refused from
        its announced length, before any of its bytes are received.

    Raises:
      CorruptCheckpointError: oversized, or its tag does not match.
      ConnectionError, OSError: the peer closed, or the receive timed out.
      ValueError: not JSON (after a good tag: a peer's bug).
    """
    head = bytearray(_LEN.size)
    recv_exact(self.sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > limit:
      raise CorruptCheckpointError(
        f"{self.what}: a document of {n} bytes exceeds the limit of {limit}: refused unread"
      )
    buf = bytearray(n + TAG_BYTES)
    recv_exact(self.sock, memoryview(buf))
    raw, tag = bytes(buf[:n]), bytes(buf[n:])
    if not hmac.compare_digest(tag, self._mac(self._in_key, self._next_in(), b"J", n, raw)):
      raise CorruptCheckpointError(f"{self.what}: a document fails its MAC (altered on the wire)")
    return json.loads(raw)

  def send_payload(self, data) -> None:
    """Sends one payload (`data`, any buffer) and its tag. Blocks until
    the kernel took it (TimeoutError if the peer stops reading).

    Each piece is MAC'd on a helper thread while it is sent (overlap.py)."""
    mac = self._start(self._out_key, self._next_out())
    view = memoryview(data).cast("B")
    if mac is None:
      send_all(self.sock, view)
    else:
      with Overlap() as overlap:
        for pos in range(0, len(view), _PIECE):
          piece = view[pos : pos + _PIECE]
          overlap.then(mac.update, piece)
          send_all(self.sock, piece)
    self._finish_out(mac, len(view))

  def send_file(self, fd: int, offset: int, length: int) -> int:
    """Sends `length` bytes of an open file from `offset` as one payload,
    and its tag: os.sendfile where nothing reads the bytes (integrity "crc"
    over plain TCP), else read in pieces and MAC'd while in cache.

    Returns:
      The bytes sent (fewer: the file ended).

    Raises:
      TimeoutError: the peer stopped reading.
      OSError: the send failed.
    """
    mac = self._start(self._out_key, self._next_out())
    sent = 0
    if mac is None and not isinstance(self.sock, ssl.SSLSocket):
      while sent < length:
        try:
          n = os.sendfile(self.sock.fileno(), fd, offset + sent, length - sent)
        except BlockingIOError:  # SO_SNDTIMEO expired with nothing sent
          raise TimeoutError(
            f"{peer_name(self.sock)} read none of the last bytes within the timeout"
          ) from None
        if not n:
          break
        sent += n
    else:
      buf = bytearray(min(_PIECE, max(length, 1)))
      view = memoryview(buf)
      while sent < length:
        n = os.preadv(fd, [view[: min(len(view), length - sent)]], offset + sent)
        if not n:
          break
        if mac is not None:
          mac.update(view[:n])
        send_all(self.sock, view[:n])
        sent += n
    if sent == length:
      self._finish_out(mac, length)
    return sent

  def payload_in(self, length: int) -> Incoming:
    """Starts receiving one payload of `length` bytes (the receiver's own
    figure): Incoming.recv_some pieces, then Incoming.finish."""
    return Incoming(self, length, self._start(self._in_key, self._next_in()))

  def recv_payload(self, view, check: Callable[[memoryview], None] | None = None) -> None:
    """Receives one payload into `view` (its length the receiver's own
    figure) and checks its tag. Blocks until it came.

    Each piece is MAC'd (and given to `check`) on a helper thread while the
    next piece is received (overlap.py): the bytes are summed while still in
    cache, and the kernel's copy of the next piece runs meanwhile.

    Args:
      view: the buffer the payload fills.
      check: called with each piece in order once it arrived (e.g. a
        running CRC32C of the bytes), on the helper thread.

    Raises:
      CorruptCheckpointError: its tag does not match.
      ConnectionError: the peer closed first.
      TimeoutError: nothing came within the timeout.
    """
    view = memoryview(view).cast("B")
    rx = self.payload_in(len(view))
    with Overlap() as overlap:
      while rx.pos < len(view):
        start, end = rx.pos, min(len(view), rx.pos + _RECV_PIECE)
        while rx.pos < end:  # a whole piece (TLS returns one record per call)
          rx.recv_raw(view[rx.pos : end])
        overlap.then(rx.digest, view[start:end], check)
    rx.finish()

  # ---- the MACs ---------------------------------------------------------------------

  def _next_out(self) -> int:
    self._out_seq += 1
    return self._out_seq

  def _next_in(self) -> int:
    self._in_seq += 1
    return self._in_seq

  def _start(self, key: bytes, seq: int) -> PayloadMac | None:
    """A payload's MAC, under a key made for this payload alone."""
    if self.integrity != "mac":
      return None
    return PayloadMac(hmac.digest(key, _SEQ.pack(seq, b"B", 0), "sha256"))

  def _finish_out(self, mac: PayloadMac | None, length: int) -> None:
    if mac is not None:
      mac.update(_PAYLOAD_END.pack(length))
      send_all(self.sock, mac.finalize())

  @staticmethod
  def _mac(key: bytes, seq: int, kind: bytes, n: int, raw: bytes) -> bytes:
    return hmac.digest(key, _SEQ.pack(seq, kind, n) + raw, "sha256")


class Incoming:
  """One payload being received (Session.payload_in): its pieces MAC'd as
  they arrive, its tag checked by finish()."""

  def __init__(self, session: Session, length: int, mac):
    self._s, self.length, self._mac, self.pos = session, length, mac, 0
    self.session = session

  def recv_some(self, view) -> int:
    """Receives the payload's next bytes into `view` (at most what is left
    of it), in one system call, and MACs them; returns how many. Blocks
    until they came.

    Raises:
      ConnectionError: the peer closed first.
      TimeoutError: nothing came within the timeout.
    """
    view = memoryview(view).cast("B")
    n = self.recv_raw(view)
    self.digest(view[:n])
    return n

  def recv_raw(self, view) -> int:
    """As recv_some, without the MAC: the caller gives every piece received
    to digest(), in order, before finish()."""
    view = memoryview(view).cast("B")[: self.length - self.pos]
    n = recv_some(self._s.sock, view)
    if not n and len(view):
      raise ConnectionError(
        f"{self._s.what}: connection closed after {self.pos} of {self.length} bytes"
      )
    self.pos += n
    return n

  def digest(self, piece, check: Callable[[memoryview], None] | None = None) -> None:
    """MACs the next piece received (recv_raw), then gives it to `check`."""
    if self._mac is not None:
      self._mac.update(piece)
    if check is not None:
      check(piece)

  def finish(self) -> None:
    """Checks the payload's tag, once all its bytes came.

    Raises:
      CorruptCheckpointError: it does not match (a changed, dropped or
        moved byte), naming the connection.
    """
    if self._mac is None:
      return
    self._mac.update(_PAYLOAD_END.pack(self.length))
    tag = bytearray(PAYLOAD_TAG_BYTES)
    recv_exact(self._s.sock, memoryview(tag))
    if not hmac.compare_digest(bytes(tag), self._mac.finalize()):
      raise CorruptCheckpointError(
        f"{self._s.what}: {self.length} payload bytes fail their MAC (altered on the wire)"
      )
