"""The pipelined payload path of a peer session (transport/session.py):
pieces MAC'd on a helper thread while the next one moves, the receiver's
running checksum (transport/stream.py RunningChecksum) summed piece by
piece; an altered byte, a wrong checksum or a failing check still fail."""

from __future__ import annotations

import os
import socket
import threading
import zlib

import crc32c
import numpy as np
import pytest

from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local.format import RunningChecksum, checksum_ok
from emergency_ckpt.transport import session as session_lib

KEY = os.urandom(32)


def _pair(integrity: str = "mac", *, flip_at: int | None = None):
  """A sender and a receiver Session over loopback sockets; with
  `flip_at`, a relay between them flips that byte of the stream."""
  a, b = socket.socketpair()
  if flip_at is None:
    send_sock, recv_sock = a, b
  else:
    c, d = socket.socketpair()
    send_sock, recv_sock = a, d

    def relay():
      seen = 0
      while True:
        chunk = bytearray(b.recv(1 << 16))
        if not chunk:
          c.close()
          return
        if seen <= flip_at < seen + len(chunk):
          chunk[flip_at - seen] ^= 0x10
        seen += len(chunk)
        c.sendall(chunk)

    threading.Thread(target=relay, daemon=True).start()
  for s in (send_sock, recv_sock):
    session_lib.settle(s, 10)
  sender = session_lib.Session(send_sock, KEY, client=True, integrity=integrity, what="test send")
  receiver = session_lib.Session(
    recv_sock, KEY, client=False, integrity=integrity, what="test receive"
  )
  return sender, receiver


def _send_async(sender, data):
  errors = []

  def run():
    try:
      sender.send_payload(data)
    except OSError as e:
      errors.append(e)

  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t, errors


@pytest.mark.parametrize("integrity", ["mac", "crc"])
def test_payload_arrives_whole_and_check_sees_every_piece_in_order(integrity):
  data = np.frombuffer(os.urandom((5 << 20) + 12345), np.uint8)  # not a multiple of a piece
  sender, receiver = _pair(integrity)
  t, errors = _send_async(sender, data)
  out = np.empty_like(data)
  pieces = []
  receiver.recv_payload(out, lambda p: pieces.append(bytes(p)))
  t.join(10)
  assert not errors
  assert np.array_equal(out, data)
  assert b"".join(pieces) == data.tobytes()
  assert len(pieces) > 1  # more than one piece: the pipeline ran


def test_a_flipped_payload_byte_fails_the_mac():
  data = np.frombuffer(os.urandom(3 << 20), np.uint8)
  sender, receiver = _pair("mac", flip_at=(2 << 20) + 7)
  t, _ = _send_async(sender, data)
  with pytest.raises(CorruptCheckpointError, match="fail their MAC"):
    receiver.recv_payload(np.empty_like(data))
  t.join(10)


def test_a_failing_check_is_raised_after_the_payload():
  data = np.frombuffer(os.urandom(2 << 20), np.uint8)
  sender, receiver = _pair("mac")
  t, _ = _send_async(sender, data)

  def check(piece):
    raise ValueError("bad piece")

  with pytest.raises(ValueError, match="bad piece"):
    receiver.recv_payload(np.empty_like(data), check)
  t.join(10)


def test_payload_tags_are_bound_to_their_sequence():
  """The same bytes sent twice carry different tags (one-time keys)."""
  data = np.frombuffer(os.urandom(1000), np.uint8)
  a, b = socket.socketpair()
  for s in (a, b):
    session_lib.settle(s, 10)
  sender = session_lib.Session(a, KEY, client=True, integrity="mac", what="t")
  sender.send_payload(data)
  sender.send_payload(data)
  raw = bytearray()
  want = 2 * (len(data) + session_lib.PAYLOAD_TAG_BYTES)
  while len(raw) < want:
    raw += b.recv(want - len(raw))
  first = raw[len(data) : len(data) + session_lib.PAYLOAD_TAG_BYTES]
  second = raw[-session_lib.PAYLOAD_TAG_BYTES :]
  assert raw[: len(data)] == raw[len(data) + 16 : 2 * len(data) + 16]
  assert first != second


@pytest.mark.parametrize("kind", ["crc32c", "crc32"])
def test_running_checksum_matches_the_whole_buffer_check(kind):
  rng = np.random.default_rng(3)
  data = rng.integers(0, 256, 100_003, dtype=np.uint8)
  value = crc32c.crc32c(data) if kind == "crc32c" else zlib.crc32(data)
  for record in ({kind: value}, {kind: value ^ 1}):
    running = RunningChecksum(record)
    cuts = sorted(rng.integers(0, len(data), 7))
    for a, b in zip([0, *cuts], [*cuts, len(data)]):
      running.update(memoryview(data)[a:b])
    assert running.ok() == checksum_ok(data, record)


def test_running_checksum_without_a_checksum_is_never_ok():
  running = RunningChecksum({"nbytes": 3})
  running.update(b"abc")
  assert not running.ok()


def test_pieces_are_whole_when_the_socket_returns_little_per_call(monkeypatch):
  """A TLS socket returns one record (16 KiB) per call: the receiver still
  hands whole pieces to its helper thread, not one job per record."""
  real = session_lib.recv_some
  monkeypatch.setattr(session_lib, "recv_some", lambda sock, view: real(sock, view[: 16 << 10]))
  data = np.frombuffer(os.urandom((3 << 20) + 5), np.uint8)
  sender, receiver = _pair("mac")
  t, errors = _send_async(sender, data)
  out = np.empty_like(data)
  sizes = []
  receiver.recv_payload(out, lambda p: sizes.append(len(p)))
  t.join(10)
  assert not errors and np.array_equal(out, data)
  assert sizes == [1 << 20] * 3 + [5]
