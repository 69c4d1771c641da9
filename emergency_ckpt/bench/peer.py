"""The peer restore's raw bound: the same bytes over plain TCP sockets,
between the processes that do the benchmark's peer restore.

After a slice loses its ramdisks, each of its processes pulls its bytes
from the process at the same position in every intact slice (the manager's
stream transport pulls from the device at the same mesh coordinates, its
shards spread round-robin over the intact slices). Here each receiver gets
one contiguous range of its bytes from each of those senders, over
`streams` connections per sender (sendall() from the sender's buffer,
recv_into() a preallocated buffer), on loopback: the benchmark's processes
share one machine. The bound pairs the transfer with the senders' read of
the same bytes from their ramdisks: a peer restore needs both, so it can be
no faster than the slower of the two.

Called by: the raw-bounds job (workers.raw_bounds), every process; the
rendezvous (`publish`, `lookup`) is the job's coordination service there.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import time
from collections.abc import Callable, Sequence

import numpy as np

from emergency_ckpt.bench import measure

_HEADER = struct.Struct("<qq")  # receiver, start offset of the connection's range
_CONNECT_TIMEOUT_S = 120.0

Plan = dict[int, list[tuple[int, int, int]]]


def plan(slices: Sequence[Sequence[int]], lost: int, nbytes: int) -> Plan:
  """Who sends which bytes to whom after slice `lost` loses its ramdisks.

  Args:
    slices: per slice, its processes in order (state.slice_processes).
    lost: the slice that lost its copy.
    nbytes: the bytes each process holds (the same in every process).

  Returns:
    {receiver: [(sender, start, stop)]}: each process of slice `lost` gets
    one contiguous range of its bytes from the process at its position in
    each other slice, in slice order.
  """
  intact = [s for i, s in enumerate(slices) if i != lost]
  if not intact:
    raise ValueError("a peer transfer needs at least one intact slice")
  out: Plan = {}
  for pos, receiver in enumerate(slices[lost]):
    ranges = _even(nbytes, len(intact))
    out[receiver] = [(s[pos], a, b) for s, (a, b) in zip(intact, ranges) if b > a]
  return out


def _even(nbytes: int, n: int) -> list[tuple[int, int]]:
  """[0, nbytes) cut into `n` contiguous ranges (page-multiple sizes but the
  last; trailing ones may be empty)."""
  got = measure.split(nbytes, n)
  return got + [(nbytes, nbytes)] * (n - len(got))


def sends_of(p: Plan, me: int) -> list[tuple[int, int, int]]:
  """(receiver, start, stop) of every range `me` sends."""
  return [(r, a, b) for r, got in p.items() for s, a, b in got if s == me]


def substreams(start: int, stop: int, streams: int) -> list[tuple[int, int]]:
  """A sender-receiver range cut into one range per connection (both ends
  compute the same cut)."""
  return [(start + a, start + b) for a, b in measure.split(stop - start, streams)]


@dataclasses.dataclass
class Links:
  """This process's connections of one transfer: what it sends and receives
  on each, as (socket, start, stop) of the buffers."""

  sends: list[tuple[socket.socket, int, int]]
  receives: list[tuple[socket.socket, int, int]]

  def close(self) -> None:
    for sock, _, _ in self.sends + self.receives:
      sock.close()


def connect(
  p: Plan,
  me: int,
  streams: int,
  publish: Callable[[str, str], None],
  lookup: Callable[[str], str],
  host: str = "127.0.0.1",
) -> Links:
  """Opens this process's connections of a transfer (untimed). A sender
  listens and publishes its port under its process number; a receiver looks
  its senders' ports up and connects `streams` times to each, naming the
  range it wants. Every process may call it (those in no pair get no links).
  Order: listen and publish, connect (the listen backlog takes it), accept;
  so no two processes wait on each other.

  Args:
    p: the plan (plan()).
    me: this process.
    streams: connections per sender-receiver pair.
    publish: sets a rendezvous key to a value (keys are unique per transfer
      only if the caller's are: pass a prefixed function).
    lookup: a key's value, waiting until it is set.
    host: the address senders listen on.

  Returns:
    The links; the pool of threads move() uses is already started.
  """
  sends = sends_of(p, me)
  wanted = {(r, a): b for r, s, e in sends for a, b in substreams(s, e, streams)}
  listener = None
  if wanted:
    listener = socket.create_server((host, 0), backlog=max(16, len(wanted)))
    listener.settimeout(_CONNECT_TIMEOUT_S)
    publish(str(me), str(listener.getsockname()[1]))
  receives = []
  for sender, start, stop in p.get(me, []):
    port = int(lookup(str(sender)))
    for a, b in substreams(start, stop, streams):
      sock = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S)
      sock.sendall(_HEADER.pack(me, a))
      sock.settimeout(None)
      receives.append((sock, a, b))
  out = []
  try:
    while len(out) < len(wanted):
      conn, _ = listener.accept()
      conn.settimeout(_CONNECT_TIMEOUT_S)
      receiver, a = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
      conn.settimeout(None)
      if (receiver, a) not in wanted:
        conn.close()
        raise RuntimeError(f"process {me}: unexpected peer connection {(receiver, a)}")
      out.append((conn, a, wanted[(receiver, a)]))
  finally:
    if listener is not None:
      listener.close()
  links = Links(out, receives)
  measure.start_threads(len(links.sends) + len(links.receives))
  return links


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = sock.recv_into(view[got:])
    if not k:
      raise ConnectionError("peer closed the connection")
    got += k
  return bytes(buf)


def move(links: Links, send_buf: np.ndarray, recv_buf: np.ndarray) -> int:
  """Moves the bytes: every connection at once, one thread each; returns
  the bytes this process received. The timed part of the bound."""
  out, into = memoryview(send_buf), memoryview(recv_buf)

  def send(sock: socket.socket, a: int, b: int) -> int:
    sock.sendall(out[a:b])
    return 0

  def receive(sock: socket.socket, a: int, b: int) -> int:
    got = 0
    while a + got < b:
      k = sock.recv_into(into[a + got : b])
      if not k:
        raise ConnectionError(f"peer closed after {got} of {b - a} bytes")
      got += k
    return got

  calls = [(send, *x) for x in links.sends] + [(receive, *x) for x in links.receives]
  return measure.parallel([lambda c=c: c[0](*c[1:]) for c in calls])


def timed_transfer(
  p: Plan,
  me: int,
  streams: int,
  send_buf: np.ndarray,
  recv_buf: np.ndarray,
  publish: Callable[[str, str], None],
  lookup: Callable[[str], str],
  start: Callable[[], object] = lambda: None,
) -> float | None:
  """connect(), `start()` (the job's start-together barrier), move(), close:
  the seconds this process took to receive its bytes (None if it receives
  none; senders still send)."""
  links = connect(p, me, streams, publish, lookup)
  try:
    start()
    t0 = time.perf_counter()
    got = move(links, send_buf, recv_buf)
    dt = time.perf_counter() - t0
  finally:
    links.close()
  want = sum(b - a for _, a, b in links.receives)
  if got != want:
    raise RuntimeError(f"process {me}: received {got} of {want} bytes")
  return dt if links.receives else None
