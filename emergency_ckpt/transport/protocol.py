"""The wire protocol of every peer stream: framing, the token handshake,
the manifest trailer, and the socket helpers.

Every connection starts with the client's hello, MAGIC and the 256-bit
token the listener published for this transfer through the JAX
coordination service (the job's own channel); a listener serves only a
client that presents it (Listener). Then JSON documents, each framed by a
4-byte big-endian length (send_json, recv_json; at most _MAX_HEADER), and
raw bytes whose length a document announced. Nothing here unpickles or
runs anything it receives.

A listener binds one address (the interface that routes to the JAX
coordinator, or PeerOptions.host) and a port the kernel picks, or the first
free one of PeerOptions.ports.

Sockets run in blocking mode with the kernel's own timeouts (settle): a
large send, a sendfile or a MSG_WAITALL receive is one system call that
waits in the kernel instead of taking the GIL back for every partial
transfer.

Called by: stream.py (a restore's peer transfer), redundancy/partner.py and
redundancy/xor_wire.py, redundancy/xor.py (their sends and receivers).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

logger = logging.getLogger("emergency_ckpt")

MAGIC = b"ECPEER1\n"
TOKEN_BYTES = 32
_MAX_HEADER = 64 << 20  # a request or reply header (JSON) larger than this is refused
_LEN = struct.Struct("!I")
_SEND_PIECE = 4 << 20  # bytes per send() call of send_buffer


def settle(sock: socket.socket, timeout_s: float) -> None:
  """Puts a connected socket in blocking mode with the kernel's own send
  and receive timeouts (SO_SNDTIMEO, SO_RCVTIMEO), so a large send, a
  sendfile or a MSG_WAITALL receive is one system call that waits in the
  kernel: a Python-level timeout makes the socket non-blocking underneath,
  and every partial transfer then takes the GIL back, which is much slower
  beside a busy Python thread. A later wait longer than `timeout_s` raises
  TimeoutError (recv_some) or OSError.

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
    sock: the socket.
    view: a writable buffer.

  Returns:
    The bytes received (0: the peer closed, nothing came).

  Raises:
    TimeoutError: nothing came within the timeout.
  """
  try:
    return sock.recv_into(view, 0, socket.MSG_WAITALL)
  except BlockingIOError:  # SO_RCVTIMEO expired with nothing received
    raise TimeoutError(f"no bytes from {_peer(sock)} within the timeout") from None


def _peer(sock: socket.socket) -> str:
  try:
    return "%s:%s" % sock.getpeername()[:2]  # noqa: UP031
  except OSError:
    return "the peer"


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
  got = 0
  while got < len(view):
    n = recv_some(sock, view[got:])
    if not n:
      raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
    got += n


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
  buf = bytearray(n)
  _recv_exact(sock, memoryview(buf))
  return bytes(buf)


def send_json(sock: socket.socket, doc: Any) -> None:
  """Sends one framed JSON document (a header, request, reply or trailer).

  Args:
    sock: the socket.
    doc: the document.

  Raises:
    OSError: the send failed.
  """
  raw = json.dumps(doc).encode()
  sock.sendall(_LEN.pack(len(raw)) + raw)


def recv_json(sock: socket.socket) -> Any:
  """Receives one framed JSON document.

  Args:
    sock: the socket.

  Returns:
    The document.

  Raises:
    ConnectionError: the peer closed, or announced more than _MAX_HEADER.
    OSError: the receive failed or timed out.
    ValueError: not JSON.
  """
  (n,) = _LEN.unpack(_recv_bytes(sock, _LEN.size))
  if n > _MAX_HEADER:
    raise ConnectionError(f"header of {n} bytes exceeds {_MAX_HEADER}")
  return json.loads(_recv_bytes(sock, n))


class Listener:
  """Accepts connections on one address until close(), each on a thread of
  its own, and hands those that present its 256-bit token to `_handle`.
  Subclasses set `_timeout_s` and `_prefix`, then call `_start`."""

  _timeout_s: float
  _prefix: str

  def _start(self, host: str, ports: tuple[int, int] | None) -> None:
    """Listens, and serves on a thread until close()."""
    self._token = secrets.token_bytes(TOKEN_BYTES)
    self._sock = _listen(host, ports)
    self.host = host
    self.port = self._sock.getsockname()[1]
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._accept, name="ec-peer-listen", daemon=True)
    self._thread.start()

  def offer(self) -> dict:
    """Returns what clients need to connect (published through the
    coordination service): host, port and the token (hex)."""
    return {"host": self.host, "port": self.port, "token": self._token.hex()}

  def _accept(self) -> None:
    while not self._stop.is_set():
      try:
        conn, _ = self._sock.accept()
      except TimeoutError:
        continue
      except OSError:
        return  # closed
      threading.Thread(
        target=self._connection, args=(conn,), name="ec-peer-conn", daemon=True
      ).start()

  def _connection(self, conn: socket.socket) -> None:
    with conn:
      settle(conn, self._timeout_s)
      try:
        hello = _recv_bytes(conn, len(MAGIC) + TOKEN_BYTES)
      except OSError:
        return
      if hello[: len(MAGIC)] != MAGIC or not hmac.compare_digest(hello[len(MAGIC) :], self._token):
        logger.warning("%s refused a connection without the token", self._prefix)
        return
      self._handle(conn)

  def _handle(self, conn: socket.socket) -> None:
    raise NotImplementedError

  def close(self) -> None:
    """Stops accepting and returns once the accept thread ended (at once:
    shutting the socket down wakes a blocked accept, where closing it alone
    waits out its poll, _listen). Connections being served finish on their
    own."""
    self._stop.set()
    with contextlib.suppress(OSError):  # not connected on some systems: close() still ends it
      self._sock.shutdown(socket.SHUT_RDWR)
    self._sock.close()
    self._thread.join()


def _listen(host: str, ports: tuple[int, int] | None) -> socket.socket:
  """A listening socket on `host`: any port (None), else the first free port
  of the inclusive range `ports`. Raises OSError naming the range when every
  port of it is taken."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  candidates = [0] if ports is None else range(ports[0], ports[1] + 1)
  for port in candidates:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
      sock.bind((host, port))
      sock.listen(64)
      sock.settimeout(0.05)
      return sock
    except OSError as e:
      sock.close()
      if ports is None or e.errno not in (errno.EADDRINUSE, errno.EACCES):
        raise
  raise OSError(
    errno.EADDRINUSE,
    f"no free port in peer.ports {ports[0]}-{ports[1]} on {host}: every process of"
    " a host that serves needs one; widen the range",
  )


@contextlib.contextmanager
def connect(offer: dict, *, timeout_s: float):
  """A connection to a Listener that presented its token.

  Args:
    offer: the listener's offer (Listener.offer).
    timeout_s: the connect, send and receive timeout.

  Yields:
    The socket, settled (settle).

  Raises:
    OSError: the connection failed.
  """
  with socket.create_connection((offer["host"], offer["port"]), timeout=timeout_s) as sock:
    settle(sock, timeout_s)
    sock.sendall(MAGIC + bytes.fromhex(offer["token"]))
    yield sock


def send_file(
  offer: dict,
  header: dict,
  path: str,
  offset: int,
  length: int,
  *,
  timeout_s: float,
  trailer: Callable[[], dict] | None = None,
) -> dict:
  """Sends one message from a file: `header`, a byte range, a trailer; then
  waits for the answer. os.sendfile on the blocking socket settle() made:
  one call sends the range (the kernel waits whenever the send buffer is
  full; socket.sendfile would wait without a limit once the kernel's
  timeout expired).

  Args:
    offer: the receiving Listener's offer.
    header: the message's header (JSON).
    path: the file.
    offset: the range's first byte.
    length: its bytes.
    timeout_s: the socket timeout.
    trailer: makes the JSON document sent after the bytes (None: none).

  Returns:
    The receiver's JSON answer.

  Raises:
    OSError: the transfer failed (TimeoutError if the receiver stops
      reading).
  """
  with open(path, "rb") as f, connect(offer, timeout_s=timeout_s) as sock:
    send_json(sock, header)
    sent = 0
    while sent < length:
      try:
        n = os.sendfile(sock.fileno(), f.fileno(), offset + sent, length - sent)
      except BlockingIOError:  # SO_SNDTIMEO expired with nothing sent
        raise TimeoutError(
          f"{_peer(sock)} read none of the last bytes within the timeout"
        ) from None
      if not n:  # the file ended
        break
      sent += n
    if sent != length:
      raise ConnectionError(f"the receiver stopped reading after {sent} of {length} bytes")
    if trailer is not None:
      send_json(sock, trailer())
    return recv_json(sock)


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


def recv_manifest(sock: socket.socket, what: str) -> bytes:
  """The raw manifest a manifest_trailer sent after the bytes.

  Args:
    sock: the socket.
    what: names the failure, e.g. "process 3 did not write step 7".

  Returns:
    The manifest's raw bytes (not decoded).

  Raises:
    OSError: naming `what` and the sender's error, if its local write failed.
  """
  tail = recv_json(sock)
  if not isinstance(tail, dict) or not isinstance(tail.get("manifest"), str):
    why = tail.get("error") if isinstance(tail, dict) else tail
    raise OSError(f"{what}: {why}")
  return bytes.fromhex(tail["manifest"])


def send_buffer(
  offer: dict,
  header: dict,
  data: np.ndarray,
  *,
  timeout_s: float,
  trailer: Callable[[], dict],
  sent: Callable[[], None] = lambda: None,
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

  Returns:
    The receiver's JSON answer.

  Raises:
    OSError: the transfer failed.
  """
  view = memoryview(data)
  with connect(offer, timeout_s=timeout_s) as sock:
    send_json(sock, header)
    pos = 0
    while pos < len(view):
      try:
        pos += sock.send(view[pos : pos + _SEND_PIECE])
      except BlockingIOError:  # SO_SNDTIMEO expired with nothing sent
        raise TimeoutError(
          f"{_peer(sock)} read none of the last bytes within the timeout"
        ) from None
    sent()
    send_json(sock, trailer())
    return recv_json(sock)


def recv_into(sock: socket.socket, view: np.ndarray) -> None:
  """Fills a buffer from a socket.

  Args:
    sock: the socket.
    view: a contiguous uint8 array.

  Raises:
    ConnectionError: the peer closed first.
    TimeoutError: nothing came within the timeout.
  """
  _recv_exact(sock, memoryview(view))
