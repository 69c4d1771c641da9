"""A man in the middle of the peer transport (issue 37): a TCP relay that
passes the handshake on unchanged and may rewrite what the listener sends
after it, and a router that sends every connection one module opens through
a relay of its own target.

  relay = Relay((host, port), tamper_first_shard(fix_header=False))
  offer = dict(server.offer(), port=relay.port)      # one client, by hand

  router = Router(tamper_first_shard(fix_header=False))
  undo = router.install(emergency_ckpt.transport.protocol)   # every connect()
  ...; router.tampered                               # replies it changed

The relay accepts any number of connections, each served by a thread of
its own; the listener's reply is held until the listener closes, then
rewritten (`tamper(bytes) -> bytes`) and forwarded. Used by
tests/test_transport_security.py (one pull) and tests/test_hostile_restore.py
(inside a real job's restoring process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import struct
import threading
from collections.abc import Callable

import crc32c

from emergency_ckpt.transport import handshake, session

HANDSHAKE_IN = len(handshake.MAGIC) + handshake.NONCE_BYTES  # the listener's challenge
HANDSHAKE_OUT = HANDSHAKE_IN + handshake.PROOF_BYTES  # all the listener sends before a document


@dataclasses.dataclass
class Exchange:
  """One relayed connection: what each side sent (the listener's bytes as
  it sent them), and whether the relay changed the listener's reply."""

  from_client: bytearray = dataclasses.field(default_factory=bytearray)
  from_server: bytearray = dataclasses.field(default_factory=bytearray)
  tampered: bool = False
  error: str | None = None


class Relay:
  """A TCP relay on 127.0.0.1 between clients and one listener (`target`).
  The listener's challenge and proof go through as they come; the rest of
  its bytes are held until it closes, then passed through `tamper` (None:
  unchanged) and forwarded. Accepts connections until close()."""

  def __init__(
    self,
    target: tuple[str, int],
    tamper: Callable[[bytes], bytes] | None = None,
    timeout_s: float = 60,
  ):
    self.target, self.tamper, self.timeout_s = tuple(target), tamper, timeout_s
    self.exchanges: list[Exchange] = []
    self._done = threading.Condition()
    self._finished = 0
    self._stop = threading.Event()
    self._sock = socket.create_server(("127.0.0.1", 0))
    self.port = self._sock.getsockname()[1]
    self._thread = threading.Thread(target=self._accept, name="mitm-accept", daemon=True)
    self._thread.start()

  @property
  def tampered(self) -> int:
    """Replies this relay changed."""
    with self._done:
      return sum(ex.tampered for ex in self.exchanges)

  @property
  def finished(self) -> int:
    """Connections relayed to their end."""
    with self._done:
      return self._finished

  def wait_finished(self, n: int, timeout_s: float = 10) -> bool:
    """Waits until `n` connections were relayed to their end."""
    with self._done:
      return self._done.wait_for(lambda: self._finished >= n, timeout_s)

  def _accept(self) -> None:
    while not self._stop.is_set():
      try:
        client, _ = self._sock.accept()
      except OSError:
        return  # closed
      ex = Exchange()
      with self._done:
        self.exchanges.append(ex)
      threading.Thread(target=self._relay, args=(client, ex), name="mitm-conn", daemon=True).start()

  def _relay(self, client: socket.socket, ex: Exchange) -> None:
    server = None
    try:
      server = socket.create_connection(self.target, timeout=self.timeout_s)
      up = threading.Thread(
        target=self._pipe, args=(client, server, ex.from_client), name="mitm-up", daemon=True
      )
      up.start()
      while True:
        got = server.recv(1 << 16)
        if not got:
          break
        before = len(ex.from_server)
        ex.from_server += got
        if before < HANDSHAKE_OUT:  # the handshake: forwarded as it comes
          client.sendall(got[: HANDSHAKE_OUT - before])
      rest = bytes(ex.from_server[HANDSHAKE_OUT:])
      out = self.tamper(rest) if self.tamper and rest else rest
      ex.tampered = out != rest
      client.sendall(out)
      with contextlib.suppress(OSError):
        client.shutdown(socket.SHUT_WR)
      up.join(5)
    except OSError as e:
      ex.error = f"{type(e).__name__}: {e}"
    finally:
      client.close()
      if server is not None:
        server.close()
      with self._done:
        self._finished += 1
        self._done.notify_all()

  @staticmethod
  def _pipe(src: socket.socket, dst: socket.socket, record: bytearray) -> None:
    try:
      while got := src.recv(1 << 16):
        record += got
        dst.sendall(got)
      dst.shutdown(socket.SHUT_WR)
    except OSError:
      pass

  def close(self) -> None:
    """Stops accepting (connections being relayed finish on their own)."""
    self._stop.set()
    with contextlib.suppress(OSError):
      self._sock.shutdown(socket.SHUT_RDWR)
    self._sock.close()
    self._thread.join(5)


class _SocketModule:
  """The socket module as a module that imported it sees it, but with
  create_connection going through a Router."""

  def __init__(self, router: Router):
    self._router = router

  def create_connection(self, address, *args, **kwargs):
    return self._router.create_connection(address, *args, **kwargs)

  def __getattr__(self, name):
    return getattr(socket, name)


class Router:
  """Sends each connection through a Relay of its target (one relay per
  target address, made on first use, each with `tamper`)."""

  def __init__(self, tamper: Callable[[bytes], bytes] | None = None):
    self.tamper = tamper
    self.relays: dict[tuple[str, int], Relay] = {}
    self._lock = threading.Lock()

  def relay_for(self, target: tuple[str, int]) -> Relay:
    target = (str(target[0]), int(target[1]))
    with self._lock:
      if target not in self.relays:
        self.relays[target] = Relay(target, self.tamper)
      return self.relays[target]

  def create_connection(self, address, *args, **kwargs) -> socket.socket:
    """socket.create_connection to `address`, through its relay."""
    relay = self.relay_for(address)
    return socket.create_connection(("127.0.0.1", relay.port), *args, **kwargs)

  def install(self, module) -> Callable[[], None]:
    """Routes every socket.create_connection of `module` (one that did
    `import socket`) through this router; returns the undo."""
    original = module.socket
    module.socket = _SocketModule(self)

    def undo() -> None:
      module.socket = original

    return undo

  @property
  def exchanges(self) -> list[Exchange]:
    with self._lock:
      relays = list(self.relays.values())
    return [ex for r in relays for ex in list(r.exchanges)]

  @property
  def tampered(self) -> int:
    """Replies changed, over every relay."""
    return sum(ex.tampered for ex in self.exchanges)

  def close(self) -> None:
    with self._lock:
      relays = list(self.relays.values())
    for r in relays:
      r.close()


# ---- tampering with a stream reply ------------------------------------------------------


def forge_crc(data: bytearray, at: int, fix: int) -> None:
  """Flips a byte of `data` at `at`, then rewrites the 4 bytes at `fix` so
  its CRC32C is what it was (CRC is affine over GF(2): a linear solve)."""
  want = crc32c.crc32c(bytes(data))
  data[at] ^= 0x5A
  base = crc32c.crc32c(bytes(data))
  cols = []  # the CRC change each bit at `fix` makes
  for bit in range(32):
    data[fix + bit // 8] ^= 1 << (bit % 8)
    cols.append(crc32c.crc32c(bytes(data)) ^ base)
    data[fix + bit // 8] ^= 1 << (bit % 8)
  rows = [(cols[b], 1 << b) for b in range(32)]  # Gaussian elimination over GF(2)
  basis: dict[int, tuple[int, int]] = {}
  for v, combo in rows:
    for hb in sorted(basis, reverse=True):
      if v >> hb & 1:
        v, combo = v ^ basis[hb][0], combo ^ basis[hb][1]
    if v:
      basis[v.bit_length() - 1] = (v, combo)
  target, combo = want ^ base, 0
  for hb in sorted(basis, reverse=True):
    if target >> hb & 1:
      target, combo = target ^ basis[hb][0], combo ^ basis[hb][1]
  assert target == 0
  for bit in range(32):
    if combo >> bit & 1:
      data[fix + bit // 8] ^= 1 << (bit % 8)
  assert crc32c.crc32c(bytes(data)) == want


def tamper_first_shard(fix_header: bool, integrity: str = "mac") -> Callable[[bytes], bytes]:
  """A Relay's tamper for a stream listener's reply (stream.Server: a reply
  document and its tag, then one payload per shard, each followed by its
  tag under integrity "mac"): one byte of the first shard changed, and its
  CRC32C made to match again: in the shard itself (4 forged bytes; the
  first shard of at least 5 bytes, as a shorter one's CRC32C cannot be
  kept), or in the reply header (its record's crc32c). Bytes that are no
  such reply pass unchanged."""
  tag = session.TAG_BYTES if integrity == "mac" else 0  # after each payload

  def tamper(rest: bytes) -> bytes:
    try:
      (n,) = struct.unpack("!I", rest[:4])
      reply = json.loads(rest[4 : 4 + n])
      records = [int(r["nbytes"]) for r in reply["shards"]]
    except (struct.error, ValueError, KeyError, TypeError):
      return rest  # not a reply with shards (an error answer, a cut stream)
    least = 1 if fix_header else 5
    i = next((j for j, size in enumerate(records) if size >= least), None)
    if i is None:
      return rest
    size = records[i]
    start = 4 + n + session.TAG_BYTES + sum(s + tag for s in records[:i])
    if start + size > len(rest):
      return rest
    shard = bytearray(rest[start : start + size])
    if fix_header:
      shard[10 if size > 10 else 0] ^= 0x5A
      reply["shards"][i]["crc32c"] = crc32c.crc32c(bytes(shard))
      raw = json.dumps(reply).encode()
      head = struct.pack("!I", len(raw)) + raw + rest[4 + n : start]  # the old tag
      return head + bytes(shard) + rest[start + size :]
    at, fix = (10, 100) if size >= 104 else (0, size - 4)
    forge_crc(shard, at, fix)
    return rest[:start] + bytes(shard) + rest[start + size :]

  return tamper
