"""Moving a step to slices that lost it: direct TCP streams between hosts.

Each process of a slice that lost the step pulls every shard it needs from a
process of an intact slice. The state is replicated over the replica axis, so
the device at the same mesh coordinates in another slice holds the same
shard: a receiver finds its senders from the mesh alone (no global device
map), spreading shards round-robin over the intact slices. Bytes go from the
sender's verified local file (the pages its own restore mapped) into one
page-aligned buffer of the receiver, laid out like the local tier's file, and
the restored arrays alias it on CPU (one copy on each side, in the kernel).
Each shard is checked against the CRC32C of the sender's manifest on arrival.

Measured against the XLA collective permute (peer.py, gloo's TCP on CPU),
interleaved in one job (2 slices x 2 processes, 256 MiB per process, slice 1
wiped): transfer 0.21 s vs 0.415 s (medians of 5), whole restore 0.405 s vs
0.585 s. collective.py stays available (peer.transport = "collective") for
networks where hosts cannot open ports to each other.

Security: every process of an intact slice listens during the transfer only,
on one address (the interface that routes to the JAX coordinator, or
PeerOptions.host) and a port the kernel picks (or the first
free one of PeerOptions.ports), and serves only a client that presents
the 256-bit token it published for this transfer through the JAX
coordination service (the job's own channel). Nothing here unpickles or runs
anything it receives: requests are JSON, replies are raw bytes.

Agreement: after the bytes, one exchange (only failures are sent) tells
every process whether every receiver got everything; if not, every process
raises PeerTransferError, so all fall back together (the manager then reads
the persistent tier, or tries an older step).

Called by: every process. Coordination: each serving process publishes its
offer (one call), each receiver reads the offers of its own senders only
(one call each), then the agreement (three calls at most).
Blocks until every receiver has its shards, or one failed.
"""

from __future__ import annotations

import concurrent.futures
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from emergency_ckpt.core import failpoints
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CollectiveTimeoutError, CorruptCheckpointError, PeerTransferError
from emergency_ckpt.local.format import LocalStep, checksum_ok, shard_checksum
from emergency_ckpt.runtime.staging import aligned_empty
from emergency_ckpt.transport.routing import plan_pulls

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
  and every partial transfer then takes the GIL back (measured: 3 x 43 MiB
  over loopback beside a busy Python thread, 0.7-1.05 s with Python's
  timeout and 1 MiB receives, 0.17-0.27 s this way with 4-16 MiB ones).
  A wait longer than `timeout_s` raises TimeoutError (recv_some) or
  OSError."""
  secs = min(max(0.001, float(timeout_s)), 1e9)  # an endless timeout: 31 years
  tv = struct.pack("@ll", int(secs), int((secs - int(secs)) * 1e6))
  sock.settimeout(None)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_some(sock: socket.socket, view) -> int:
  """Fills `view` (a writable buffer) from a socket settle() set up, in one
  call that returns early only when the peer closed (0: nothing came) or
  after the timeout with part of it; raises TimeoutError if nothing came
  within the timeout."""
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


def _send_json(sock: socket.socket, doc: Any) -> None:
  raw = json.dumps(doc).encode()
  sock.sendall(_LEN.pack(len(raw)) + raw)


def _recv_json(sock: socket.socket) -> Any:
  (n,) = _LEN.unpack(_recv_bytes(sock, _LEN.size))
  if n > _MAX_HEADER:
    raise ConnectionError(f"header of {n} bytes exceeds {_MAX_HEADER}")
  return json.loads(_recv_bytes(sock, n))


def _index_key(index) -> tuple[tuple[int, int], ...]:
  return tuple((int(a), int(b)) for a, b in index)


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
    """What clients need to connect (published through the coordination service)."""
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
    waits out its 50 ms poll). Connections being served finish on their own."""
    self._stop.set()
    with contextlib.suppress(OSError):  # not connected on some systems: close() still ends it
      self._sock.shutdown(socket.SHUT_RDWR)
    self._sock.close()
    self._thread.join()


class Server(Listener):
  """Serves this process's verified shards of one step to receivers that
  present its token, until close(). Per process; no collective."""

  def __init__(
    self,
    host: str,
    local: LocalStep,
    paths: Sequence[str],
    *,
    timeout_s: float,
    log_prefix: str,
    ports: tuple[int, int] | None = None,
    ready: Mapping[tuple[int, tuple], concurrent.futures.Future] | None = None,
    unverified: set[tuple[int, tuple]] = frozenset(),
  ):
    """`ready`: {(leaf number, index): future} of shards still being
    written into `local`'s buffer: each is sent once its future is done
    (a failed one drops the connection), so serving starts before they
    all exist (persistent_share's pipelined read). `unverified`: (leaf
    number, index) of shards not checked yet: sent whole with their
    recorded checksum (the receiver checks it), checked here first before
    a part of one is cut."""
    self._ready = dict(ready or {})
    self._unverified = set(unverified)
    self._timeout_s = timeout_s
    self._prefix = log_prefix
    self._step = local.step
    records = {
      (leaf["path"], _index_key(s["index"])): s
      for leaf in local.manifest["leaves"]
      for s in leaf["shards"]
    }
    self._shards: dict[tuple[int, tuple], tuple[np.ndarray, dict, np.ndarray]] = {}
    for leaf_no, (path, by_index) in enumerate(zip(paths, local.arrays)):
      for index, arr in by_index.items():
        raw = arr.reshape(-1).view(np.uint8)
        self._shards[(leaf_no, index)] = (raw, records[(path, index)], arr)
    self._paths = list(paths)
    self._start(host, ports)

  def _handle(self, conn: socket.socket) -> None:
    """One authenticated request: its shards (or byte ranges), in order."""
    try:
      if failpoints.armed("peer.refuse", self._step):
        return  # a test: the sender drops the connection
      request = _recv_json(conn)
      reply, views, gates = self._answer(request)
      _send_json(conn, reply)
      corrupt = failpoints.armed("peer.corrupt_send", self._step)
      for raw, gate in zip(views, gates):
        if gate is not None:
          gate.result(timeout=self._timeout_s)  # raises if its read failed: drop
        if corrupt:  # a test: one flipped bit on the wire
          raw = raw.copy()
          raw[len(raw) // 2] ^= 1
          corrupt = False
        conn.sendall(memoryview(raw))
    except (OSError, ValueError, TypeError, KeyError, IndexError) as e:  # a malformed request too
      logger.warning("%s peer transfer: a send failed: %s", self._prefix, e)
    except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as e:
      logger.warning("%s peer transfer: a shard never became ready: %r", self._prefix, e)
    except Exception as e:  # noqa: BLE001 - a gate's read failed: the receiver sees a drop
      logger.warning("%s peer transfer: not sending a shard whose read failed: %s", self._prefix, e)

  def _answer(self, request: Any) -> tuple[dict, list[np.ndarray], list]:
    if not isinstance(request, dict) or request.get("step") != self._step:
      error = f"this process serves step {self._step}, not {request.get('step')!r}"
      return {"error": error}, [], []
    records, views, gates = [], [], []
    for item in request.get("shards", []):
      leaf_no, path, index = item[:3]
      box = item[3] if len(item) > 3 else None  # a part of the shard (reshard.py)
      key = (leaf_no, _index_key(index))
      got = self._shards.get(key)
      if got is None or self._paths[leaf_no] != path or (box is not None and key in self._ready):
        return {"error": f"no shard {index} of leaf {path} here"}, [], []
      raw, record, arr = got
      if box is not None and _index_key(box) == key[1]:
        box = None  # the whole shard: as saved, with the checksum recorded at save
      if box is None:
        records.append({k: v for k, v in record.items() if k in ("nbytes", "crc32c", "crc32")})
      else:  # verified when read (or now): checksummed again as sent
        if key in self._unverified:
          if not checksum_ok(raw, record):
            return {"error": f"shard {index} of leaf {path} here fails its checksum"}, [], []
          self._unverified.discard(key)
        part = arr[tuple(slice(a - i0, b - i0) for (a, b), (i0, _) in zip(box, key[1]))]
        raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        records.append({"nbytes": raw.nbytes, **shard_checksum(raw)})
      views.append(raw)
      gates.append(self._ready.get(key))
    return {"shards": records}, views, gates


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
def request(offer: dict, sender: int, step: int, shards: list, *, timeout_s: float):
  """A connection to `sender` (its `offer`) that asked for `shards` ([leaf
  number, path, index] or [..., box]) of `step`: yields (socket, one record
  per shard: nbytes and checksum), the bytes to follow in that order.
  Raises PeerTransferError or OSError."""
  if "error" in offer:
    raise PeerTransferError(f"process {sender} cannot serve: {offer['error']}")
  with connect(offer, timeout_s=timeout_s) as sock:
    _send_json(sock, {"step": step, "shards": shards})
    reply = _recv_json(sock)
    if "error" in reply:
      raise PeerTransferError(f"process {sender} refused: {reply['error']}")
    records = reply.get("shards", [])
    if len(records) != len(shards):
      raise PeerTransferError(f"process {sender} answered {len(records)} of {len(shards)} shards")
    yield sock, records


@contextlib.contextmanager
def connect(offer: dict, *, timeout_s: float):
  """A socket to a Listener (its `offer`) that presented the token. Raises OSError."""
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
  """Connects to a Listener (its `offer`), sends `header` (JSON), bytes
  [offset, offset + length) of the file at `path`, then `trailer()` (JSON)
  if given, and returns the JSON answer. os.sendfile on the blocking socket
  settle() made: one call sends the range (the kernel waits whenever the
  send buffer is full; socket.sendfile would wait without a limit once the
  kernel's timeout expired). Raises OSError (TimeoutError if the receiver
  stops reading)."""
  with open(path, "rb") as f, connect(offer, timeout_s=timeout_s) as sock:
    _send_json(sock, header)
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
      _send_json(sock, trailer())
    return _recv_json(sock)


def manifest_trailer(manifest: Callable[[], bytes]) -> Callable[[], dict]:
  """The trailer (send_file, send_buffer) that carries a step's raw
  manifest once `manifest()` returns it, or the error it raised (the
  receiver then drops the step: recv_manifest)."""

  def trailer() -> dict:
    try:
      return {"manifest": manifest().hex()}
    except Exception as e:  # noqa: BLE001 - the receiver is told why
      return {"error": f"{type(e).__name__}: {e}"}

  return trailer


def recv_manifest(sock: socket.socket, what: str) -> bytes:
  """The raw manifest a manifest_trailer sent after the bytes; OSError
  naming `what` (e.g. "process 3 did not write step 7") and the sender's
  error if its local write failed."""
  tail = _recv_json(sock)
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
  """As send_file, from memory: `header`, the bytes of the contiguous uint8
  array `data`, then `sent()` (the caller may let go of `data`) and
  `trailer()` (JSON; it may block, e.g. until the file those bytes are
  written to is complete), and returns the JSON answer. Raises OSError."""
  view = memoryview(data)
  with connect(offer, timeout_s=timeout_s) as sock:
    _send_json(sock, header)
    pos = 0
    while pos < len(view):
      try:
        pos += sock.send(view[pos : pos + _SEND_PIECE])
      except BlockingIOError:  # SO_SNDTIMEO expired with nothing sent
        raise TimeoutError(
          f"{_peer(sock)} read none of the last bytes within the timeout"
        ) from None
    sent()
    _send_json(sock, trailer())
    return _recv_json(sock)


def recv_into(sock: socket.socket, view: np.ndarray) -> None:
  """Fills the contiguous uint8 array `view` from `sock`."""
  _recv_exact(sock, memoryview(view))


def pull(
  offer: dict,
  sender: int,
  step: int,
  items: Sequence[tuple[int, shards_lib.ShardSlot]],
  paths: Sequence[str],
  buffer: np.ndarray,
  *,
  timeout_s: float,
) -> None:
  """Receives `items` (leaf number, slot) of `step` from `sender` into their
  slots of `buffer`, each verified against the sender's checksum. Raises
  PeerTransferError, CorruptCheckpointError or OSError."""
  shards = [[leaf_no, paths[leaf_no], [list(r) for r in slot.index]] for leaf_no, slot in items]
  with request(offer, sender, step, shards, timeout_s=timeout_s) as (sock, records):
    for (leaf_no, slot), record in zip(items, records):
      where = f"leaf {paths[leaf_no]} shard {slot.index} of step {step} from process {sender}"
      if record.get("nbytes") != slot.nbytes:
        raise CorruptCheckpointError(
          f"{where}: {record.get('nbytes')} bytes, expected {slot.nbytes}"
        )
      view = buffer[slot.offset : slot.offset + slot.nbytes]
      _recv_exact(sock, memoryview(view))
      if not checksum_ok(view, record):
        raise CorruptCheckpointError(f"{where} fails its checksum on arrival")


def receive(
  offers: dict[int, dict | None],
  layout: shards_lib.Layout,
  paths: Sequence[str],
  pulls: dict[int, list],
  *,
  step: int,
  timeout_s: float,
  buffer: np.ndarray | None = None,
) -> np.ndarray:
  """This receiver's shards of `step` (`pulls`: routing.plan_pulls), pulled
  from every sender at once into one page-aligned buffer laid out as
  `layout` (`buffer`, if given, already holds the other slots)."""
  if buffer is None:
    buffer = aligned_empty(layout.nbytes)
  if not pulls:
    return buffer
  pool = concurrent.futures.ThreadPoolExecutor(len(pulls), "ec-peer-recv")
  try:
    futures = []
    for sender, items in pulls.items():
      offer = offers.get(sender) or {"error": "it published no address (not an intact slice?)"}
      futures.append(
        pool.submit(pull, offer, sender, step, items, paths, buffer, timeout_s=timeout_s)
      )
    for f in concurrent.futures.as_completed(futures):
      f.result()  # the first failure ends the transfer
  finally:
    pool.shutdown(wait=False, cancel_futures=True)  # never wait on a failed transfer's stragglers
  return buffer


def transfer(
  step: int,
  abstract: Sequence[Any],
  paths: Sequence[str],
  local: LocalStep | None,
  *,
  mesh,
  topology,
  collectives,
  intact: Sequence[int],
  lost: Sequence[int],
  host: str | None,
  timeout_s: float,
  ports: tuple[int, int] | None = None,
) -> list:
  """Returns the step's arrays on every process: processes of intact slices
  keep `local` (their verified shards) and serve them; processes of `lost`
  slices pull theirs. Raises PeerTransferError on every process if any
  receiver failed. Called by: every process."""
  me = topology.process_index
  server, offer = None, None
  if topology.slice_index in intact:
    try:
      if host is None:
        raise OSError("no address: set peer.host (see PeerOptions)")
      server = Server(
        host, local, paths, timeout_s=timeout_s, log_prefix=topology.log_prefix(), ports=ports
      )
      offer = server.offer()
    except OSError as e:
      offer = {"error": f"cannot listen on {host!r}: {e}"}
  arrays, error, pulls = None, None, {}
  if topology.slice_index in lost:
    receivers = sorted(p for s in lost for p in topology.slice_processes[s])
    layout = shards_lib.layout_for(paths, abstract)
    pulls = plan_pulls(
      layout,
      np.asarray(mesh.devices),
      topology.replica_axis_index,
      list(intact),
      receivers.index(me),
    )
  try:
    # Each receiver reads only the offers of its own senders.
    try:
      offers = collectives.exchange_some(
        f"peer_offer_{step}", offer, wanted=sorted(pulls), timeout_s=timeout_s
      )
    except CollectiveTimeoutError as e:
      offers, error = {}, f"process {me}: no address from its senders ({e})"
    if topology.slice_index in lost and error is None:
      try:
        buffer = receive(offers, layout, paths, pulls, step=step, timeout_s=timeout_s)
        arrays = shards_lib.assemble_buffer(abstract, layout, buffer)
      except (OSError, PeerTransferError) as e:  # CorruptCheckpointError is an OSError
        error = f"process {me} ({type(e).__name__}): {e}"
        logger.warning("%s peer transfer of step %d failed: %s", topology.log_prefix(), step, e)
    outcome = collectives.gather_sparse(f"peer_done_{step}", error)
  finally:
    if server is not None:
      server.close()
  failed = [e for _, e in sorted(outcome.items())]
  if failed:
    raise PeerTransferError(
      f"the transfer of step {step} to slices {list(lost)} failed: " + "; ".join(failed)
    )
  if arrays is None:  # an intact slice keeps its own verified shards
    arrays = [shards_lib.assemble(a, by_index) for a, by_index in zip(abstract, local.arrays)]
  return arrays
