"""A peer listener: accepts connections on one address, authenticates each
within bounds (handshake.py), and hands its Session to the subclass.

Work before authentication is bounded: at most PREAUTH_MAX connections are
authenticated at once (more are closed at once) and each has HANDSHAKE_S
seconds; the accept loop outlives EMFILE / ENFILE (it backs off briefly),
thread-start failures and any exception, logs refusals at most once per
REFUSAL_LOG_S seconds with their count, and reports an accept thread that
ended anyway (healthy(), error).

Called by: its subclasses (stream.Server, xor.RangeServer,
partner.Receiver, xor_wire.ParityReceiver), through their constructors and
close(); the manager's health through healthy().
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import socket
import threading
import time

from emergency_ckpt.transport import handshake, tls
from emergency_ckpt.transport.handshake import TOKEN_BYTES
from emergency_ckpt.transport.session import Session, peer_name, settle

logger = logging.getLogger("emergency_ckpt")

PREAUTH_MAX = 16
"""Connections a listener authenticates at once; more are closed at once."""
SERVING_MAX = 512
"""Authenticated connections a listener serves at once; more are closed."""
HANDSHAKE_S = 5.0
"""Seconds a connection has to prove itself (not the collective timeout)."""
REFUSAL_LOG_S = 30.0
"""At most one warning per this many seconds about refused connections."""
_ACCEPT_BACKOFF_S = 0.05  # after EMFILE / ENFILE / ENOBUFS / ENOMEM


class Security:
  """How a listener authenticates and protects (peer.integrity and
  peer.encryption): "mac" or "crc"; "none" or "tls"."""

  __slots__ = ("encryption", "integrity")

  def __init__(self, integrity: str = "mac", encryption: str = "none"):
    self.integrity, self.encryption = integrity, encryption

  @classmethod
  def of(cls, peer_options) -> Security:
    """The security a PeerOptions names."""
    return cls(peer_options.integrity, peer_options.encryption)


class Listener:
  """Accepts connections on one address until close(): authenticates each
  (bounded: PREAUTH_MAX at once, HANDSHAKE_S each) on a thread of its own,
  then hands its Session to `_handle`. Subclasses set `_timeout_s` and
  `_prefix` (and `_purpose`), then call `_start`."""

  _timeout_s: float
  _prefix: str
  _purpose: str = "peer"

  def _start(
    self, host: str, ports: tuple[int, int] | None, security: Security | None = None
  ) -> None:
    """Listens, and serves on a thread until close() (OSError if it cannot)."""
    security = security or Security()
    self._token = secrets.token_bytes(TOKEN_BYTES)
    self._integrity = security.integrity
    self._fingerprint = tls.server_context()[1] if security.encryption == "tls" else None
    self._sock = _listen(host, ports)
    self.host = host
    self.port = self._sock.getsockname()[1]
    self.error: str | None = None
    self._count_lock = threading.Lock()
    self._preauth = 0  # connections being authenticated (guarded by _count_lock)
    self._serving = 0  # authenticated connections being served
    self._refused: dict[str, int] = {}
    self.refusals = 0
    """Connections refused so far (no proof, a timeout, over a cap): for
    the manager's health report."""
    self._refusal_logged = 0.0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._accept, name="ec-peer-listen", daemon=True)
    self._thread.start()

  def offer(self) -> dict:
    """What clients need to connect (published through the coordination
    service): host, port, the secret (hex), the context and the security."""
    offer = {
      "host": self.host,
      "port": self.port,
      "token": self._token.hex(),
      "purpose": self._purpose,
      "receiver": self._prefix,
      "integrity": self._integrity,
    }
    if self._fingerprint is not None:
      offer["tls"] = self._fingerprint
    return offer

  def healthy(self) -> bool:
    """Whether the listener still accepts (False once its accept thread
    ended other than by close(): `error` says why). Called by: the
    manager's health report; never blocks."""
    return self.error is None and (self._thread.is_alive() or self._stop.is_set())

  def _accept(self) -> None:
    """The accept loop: never ends before close(), whatever accept() or a
    thread start raises; records why in `error` if it does anyway."""
    try:
      while not self._stop.is_set():
        try:
          self._accept_one()
        except Exception as e:  # noqa: BLE001 - the loop outlives any error
          self._refuse(f"accept error {type(e).__name__}")
          time.sleep(_ACCEPT_BACKOFF_S)
    except BaseException as e:
      self.error = f"the accept thread ended: {type(e).__name__}: {e}"
      logger.error("%s peer listener %s", self._prefix, self.error)  # ends: healthy() says so

  def _accept_one(self) -> None:
    try:
      conn, _ = self._sock.accept()
    except TimeoutError:
      return
    except OSError as e:
      if self._stop.is_set() or e.errno in (errno.EBADF, errno.EINVAL):
        self._stop.wait(_ACCEPT_BACKOFF_S)  # closed (close() sets _stop first)
        return
      self._refuse(f"accept failed ({errno.errorcode.get(e.errno, e.errno)})")
      self._stop.wait(_ACCEPT_BACKOFF_S)  # EMFILE, ENFILE, ENOBUFS...: back off, go on
      return
    with self._count_lock:
      full = self._preauth >= PREAUTH_MAX
      if not full:
        self._preauth += 1
    if full:
      conn.close()
      self._refuse("too many connections being authenticated")
      return
    try:
      threading.Thread(
        target=self._connection, args=(conn,), name="ec-peer-conn", daemon=True
      ).start()
    except BaseException:
      with self._count_lock:
        self._preauth -= 1
      conn.close()
      raise

  def _refuse(self, why: str) -> None:
    """Counts a refusal; logs the counts at most once per REFUSAL_LOG_S."""
    with self._count_lock:
      self._refused[why] = self._refused.get(why, 0) + 1
      self.refusals += 1
      now = time.monotonic()
      if now - self._refusal_logged < REFUSAL_LOG_S:
        return
      self._refusal_logged, counts, self._refused = now, self._refused, {}
    logger.warning(
      "%s peer listener %s:%s refused connections: %s",
      self._prefix,
      self.host,
      self.port,
      ", ".join(f"{n} x {w}" for w, n in sorted(counts.items())),
    )

  def _connection(self, conn: socket.socket) -> None:
    """One connection: authenticated within HANDSHAKE_S, then served."""
    authed, sock = False, conn
    try:
      with conn:
        try:
          settle(conn, HANDSHAKE_S)
          sock = tls.accept(conn) if self._fingerprint is not None else conn
          what = f"{self._prefix} peer connection from {peer_name(conn)}"
          key, claim = handshake.serve(sock, self._token, self.offer(), what=what)
        except PermissionError:
          self._refuse("no proof of the secret")
          return
        except (OSError, ValueError):
          self._refuse("handshake failed or timed out")
          return
        with self._count_lock:
          self._preauth -= 1
          authed = True
          full = self._serving >= SERVING_MAX
          if not full:
            self._serving += 1
        if full:
          self._refuse("too many connections being served")
          return
        try:
          settle(sock, self._timeout_s)
          session = Session(sock, key, client=False, integrity=self._integrity, what=what)
          session.claim = claim
          self._handle(session)
        finally:
          with self._count_lock:
            self._serving -= 1
    finally:
      if sock is not conn:  # the TLS socket holds the descriptor now
        with contextlib.suppress(OSError):
          sock.close()
      if not authed:
        with self._count_lock:
          self._preauth -= 1

  def _handle(self, conn: Session) -> None:
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
      sock.listen(512)
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
