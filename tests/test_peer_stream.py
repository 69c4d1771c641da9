"""peer_stream: the pull plan (pure) and the wire protocol (real sockets, one process)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import numpy as np
import pytest

from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CorruptCheckpointError, PeerTransferError
from emergency_ckpt.local.format import LocalStep, shard_checksum
from emergency_ckpt.transport import handshake, protocol, routing
from emergency_ckpt.transport import pull as peer_pull
from emergency_ckpt.transport import stream as peer_stream


@dataclasses.dataclass(frozen=True)
class Dev:
  id: int
  process_index: int


def _mesh(slices: int, per_slice: int, devices_per_process: int) -> np.ndarray:
  """(replica, data) devices; process = device id // devices_per_process."""
  ids = np.arange(slices * per_slice).reshape(slices, per_slice)
  return np.vectorize(lambda i: Dev(int(i), int(i) // devices_per_process), otypes=[object])(ids)


def _layout(mesh: np.ndarray, slice_: int, leaves: int, nbytes: int = 64) -> shards_lib.Layout:
  """One slot per device of `slice_` (each device holds its own shard)."""
  out, offset = [], 0
  for leaf in range(leaves):
    slots = []
    for j, dev in enumerate(mesh[slice_]):
      slots.append(shards_lib.ShardSlot(((j, j + 1),), offset, nbytes, (dev,)))
      offset += nbytes
    out.append(
      shards_lib.LeafLayout(f"['l{leaf}']", (len(mesh[slice_]),), np.dtype(np.uint8), tuple(slots))
    )
  return shards_lib.Layout(tuple(out), offset)


def test_plan_pulls_from_the_process_at_the_same_coordinates():
  mesh = _mesh(2, 4, 2)  # 2 slices x 2 processes x 2 devices
  plan = routing.plan_pulls(_layout(mesh, 1, 3), mesh, 0, [0], rank=0)
  # process 2 (slice 1, devices 4-5) mirrors process 0 (devices 0-1), process 3 mirrors 1
  assert sorted(plan) == [0, 1]
  assert {slot.devices[0].process_index for _, slot in plan[0]} == {2}
  assert all(slot.devices[0].id in (4, 5) for _, slot in plan[0])
  assert len(plan[0]) == len(plan[1]) == 6


def test_plan_pulls_spreads_over_intact_slices():
  mesh = _mesh(4, 2, 2)  # 4 slices of one process with 2 devices
  plan = routing.plan_pulls(_layout(mesh, 3, 4), mesh, 0, [0, 1, 2], rank=0)
  counts = {sender: len(items) for sender, items in plan.items()}
  assert counts == {0: 3, 1: 3, 2: 2}  # 8 shards over 3 senders
  every = sorted((leaf, slot.index) for items in plan.values() for leaf, slot in items)
  assert len(every) == 8 and len(set(every)) == 8


def test_plan_pulls_rank_rotates_the_first_sender():
  mesh = _mesh(4, 2, 2)
  a = routing.plan_pulls(_layout(mesh, 2, 1), mesh, 0, [0, 1], rank=0)
  b = routing.plan_pulls(_layout(mesh, 3, 1), mesh, 0, [0, 1], rank=1)
  first = lambda plan: min(plan, key=lambda s: min(slot.offset for _, slot in plan[s]))  # noqa: E731
  assert first(a) != first(b)


def test_plan_pulls_needs_an_intact_slice():
  mesh = _mesh(2, 2, 2)
  with pytest.raises(PeerTransferError):
    routing.plan_pulls(_layout(mesh, 1, 1), mesh, 0, [], rank=0)


# ---- the wire protocol ---------------------------------------------------------------


def _local(step: int = 7) -> tuple[LocalStep, list[str], list[dict]]:
  """A sender's verified step: two leaves of two shards each."""
  rng = np.random.default_rng(0)
  paths = ["['a']", "['b']"]
  arrays, leaves = [], []
  for path in paths:
    by_index, shards = {}, []
    for j in range(2):
      arr = rng.integers(0, 2**32, 1000, dtype=np.uint32).view(np.float32)
      index = ((j * 1000, (j + 1) * 1000),)
      by_index[index] = arr
      shards.append(
        {
          "index": [list(r) for r in index],
          "offset": 0,
          "nbytes": arr.nbytes,
          **shard_checksum(arr.view(np.uint8)),
        }
      )
    arrays.append(by_index)
    leaves.append({"path": path, "shards": shards})
  return LocalStep(step, {"leaves": leaves}, arrays), paths, arrays


def _items(arrays) -> tuple[list, int]:
  """(items, nbytes): every shard, laid out back to back in a receive buffer."""
  items, offset = [], 0
  for leaf_no, by_index in enumerate(arrays):
    for index, arr in by_index.items():
      items.append((leaf_no, shards_lib.ShardSlot(index, offset, arr.nbytes, ())))
      offset += arr.nbytes
  return items, offset


@pytest.fixture
def served():
  local, paths, arrays = _local()
  server = peer_stream.Server("127.0.0.1", local, paths, timeout_s=10, log_prefix="[test]")
  yield server, paths, arrays
  server.close()


def test_pull_receives_every_shard_bit_exactly(served):
  server, paths, arrays = served
  items, nbytes = _items(arrays)
  buffer = np.zeros(nbytes, np.uint8)
  peer_pull.pull(server.offer(), 0, 7, items, paths, buffer, timeout_s=10)
  want = np.concatenate([arr.view(np.uint8) for by in arrays for arr in by.values()])
  assert buffer.tobytes() == want.tobytes()


def test_receive_over_several_streams_per_sender(served, monkeypatch):
  """A sender's shards split over three connections still land bit-exactly."""
  server, paths, arrays = served
  items, nbytes = _items(arrays)
  monkeypatch.setattr(peer_pull, "streams_per_sender", lambda: 3)
  monkeypatch.setattr(peer_pull, "STREAM_MIN_BYTES", 1)
  opened = []
  real = peer_pull.pull
  monkeypatch.setattr(peer_pull, "pull", lambda *a, **k: opened.append(len(a[3])) or real(*a, **k))
  layout = shards_lib.Layout((), nbytes)
  buffer = peer_pull.receive({0: server.offer()}, layout, paths, {0: items}, step=7, timeout_s=10)
  want = np.concatenate([arr.view(np.uint8) for by in arrays for arr in by.values()])
  assert buffer.tobytes() == want.tobytes()
  assert sorted(opened) == [1, 1, 2]  # 4 shards over 3 connections


def test_split_streams_keeps_order_and_balances_bytes(monkeypatch):
  slot = lambda n: shards_lib.ShardSlot(((0, 1),), 0, n, ())  # noqa: E731
  items = [(i, slot(n)) for i, n in enumerate([40, 10, 10, 40, 50, 50])]
  assert peer_pull.split_streams(items, 3) == [items]  # under STREAM_MIN_BYTES: one stream
  big = [(i, slot(peer_pull.STREAM_MIN_BYTES)) for i in range(8)]
  assert [len(r) for r in peer_pull.split_streams(big, 4)] == [2, 2, 2, 2]
  monkeypatch.setattr(peer_pull, "STREAM_MIN_BYTES", 1)
  runs = peer_pull.split_streams(items, 3)
  assert [item for run in runs for item in run] == items
  assert [sum(s.nbytes for _, s in run) for run in runs] == [100, 50, 50]
  assert peer_pull.split_streams(items, 1) == [items]
  assert len(peer_pull.split_streams(items[:2], 8)) == 2  # never more runs than shards


def test_a_client_without_the_token_gets_nothing(served):
  server, paths, arrays = served
  offer = dict(server.offer(), token="00" * protocol.TOKEN_BYTES)
  items, nbytes = _items(arrays)
  with pytest.raises(ConnectionError):
    peer_pull.pull(offer, 0, 7, items, paths, np.zeros(nbytes, np.uint8), timeout_s=10)
  with socket.create_connection((server.host, server.port), timeout=5) as raw:
    raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
    got = _until_closed(raw)
    # nothing served: the listener's challenge (its magic and a fresh nonce) only
    assert got[: len(protocol.MAGIC)] == protocol.MAGIC
    assert len(got) == len(protocol.MAGIC) + handshake.NONCE_BYTES


def _until_closed(raw: socket.socket) -> bytes:
  """Every byte a listener sends before it closes the connection."""
  got = b""
  while True:
    try:
      more = raw.recv(1 << 16)
    except ConnectionResetError:  # closed with our bytes unread
      return got
    if not more:
      return got
    got += more


def test_a_request_for_another_step_is_refused(served):
  server, paths, arrays = served
  items, nbytes = _items(arrays)
  with pytest.raises(PeerTransferError, match="serves step 7"):
    peer_pull.pull(server.offer(), 0, 8, items, paths, np.zeros(nbytes, np.uint8), timeout_s=10)


def test_a_shard_the_sender_lacks_is_refused(served):
  server, paths, arrays = served
  items, nbytes = _items(arrays)
  leaf_no, slot = items[0]
  items[0] = (leaf_no, dataclasses.replace(slot, index=((5, 9),)))
  with pytest.raises(PeerTransferError, match="no shard"):
    peer_pull.pull(server.offer(), 0, 7, items, paths, np.zeros(nbytes, np.uint8), timeout_s=10)


def test_a_shard_damaged_on_the_wire_fails_its_checksum(served, monkeypatch):
  server, paths, arrays = served
  monkeypatch.setattr(
    peer_stream.failpoints, "armed", lambda name, step: name == "peer.corrupt_send"
  )
  items, nbytes = _items(arrays)
  with pytest.raises(CorruptCheckpointError, match="fails its checksum on arrival"):
    peer_pull.pull(server.offer(), 3, 7, items, paths, np.zeros(nbytes, np.uint8), timeout_s=10)


def test_an_offer_with_an_error_names_the_sender():
  with pytest.raises(PeerTransferError, match="process 5 cannot serve: no address"):
    peer_pull.pull({"error": "no address"}, 5, 7, [], [], np.zeros(0, np.uint8), timeout_s=1)


def test_the_server_listens_on_the_given_address_only(served):
  server, _, _ = served
  assert server.host == "127.0.0.1"
  assert server._sock.getsockname()[0] == "127.0.0.1"


# ---- the address a server advertises ------------------------------------------------


@pytest.fixture
def coordinator(monkeypatch):
  import jax  # noqa: PLC0415

  state = jax._src.distributed.global_state  # noqa: SLF001

  def set_address(address):
    monkeypatch.setattr(state, "coordinator_address", address, raising=False)

  return set_address


def test_peer_host_override_wins(coordinator):
  from emergency_ckpt.cluster.topology import peer_host  # noqa: PLC0415

  coordinator("127.0.0.1:1234")
  assert peer_host("10.1.2.3") == "10.1.2.3"


def test_peer_host_is_the_interface_routing_to_the_coordinator(coordinator):
  from emergency_ckpt.cluster.topology import peer_host  # noqa: PLC0415

  coordinator("127.0.0.1:1234")
  assert peer_host(None) == "127.0.0.1"
  coordinator("localhost:1234")
  assert peer_host(None) in ("127.0.0.1", "::1")


def test_peer_host_unresolvable_coordinator_is_none(coordinator, caplog):
  from emergency_ckpt.cluster.topology import peer_host  # noqa: PLC0415

  coordinator("no-such-host.invalid:1234")
  assert peer_host(None) is None
  assert "set peer.host" in caplog.text


def test_a_malformed_request_is_refused_without_killing_the_server(served):
  server, paths, arrays = served
  with protocol.connect(server.offer(), timeout_s=5, step=7) as conn:
    conn.send_json({"step": 7, "shards": [[0]]})  # not [leaf, path, index]
    assert _until_closed(conn.sock) == b""  # no reply: dropped
  items, nbytes = _items(arrays)  # the server still serves a good request
  peer_pull.pull(server.offer(), 0, 7, items, paths, np.zeros(nbytes, np.uint8), timeout_s=10)


def _free_port_run(n: int) -> int:
  """The first of `n` consecutive ports that are free on 127.0.0.1 now."""
  for start in range(42000, 60000, n + 7):
    socks = []
    try:
      for port in range(start, start + n):
        s = socket.socket()
        socks.append(s)
        s.bind(("127.0.0.1", port))
      return start
    except OSError:
      continue
    finally:
      for s in socks:
        s.close()
  raise RuntimeError("no free port run")


@contextlib.contextmanager
def _held(port: int):
  """Something else listens on 127.0.0.1:`port` meanwhile."""
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", port))
    busy.listen(1)
    yield


def test_the_server_listens_within_peer_ports_and_skips_a_busy_port():
  local, paths, arrays = _local()
  low = _free_port_run(3)
  with _held(low):
    server = peer_stream.Server(
      "127.0.0.1", local, paths, timeout_s=10, log_prefix="[t]", ports=(low, low + 2)
    )
  try:
    assert server.port == low + 1
    items, nbytes = _items(arrays)
    buffer = np.zeros(nbytes, np.uint8)
    peer_pull.pull(server.offer(), 0, 7, items, paths, buffer, timeout_s=10)
  finally:
    server.close()


def test_a_full_peer_ports_range_names_the_option():
  local, paths, _ = _local()
  low = _free_port_run(1)
  with _held(low), pytest.raises(OSError, match=f"no free port in peer.ports {low}-{low}"):
    peer_stream.Server("127.0.0.1", local, paths, timeout_s=10, log_prefix="[t]", ports=(low, low))


def test_a_gated_shard_is_sent_once_ready_and_a_failed_one_never():
  """persistent_share serves shards still being read: each waits for its
  gate; the receiver has nothing before it opens, and a failed read drops
  the connection instead of sending unchecked bytes."""
  import concurrent.futures  # noqa: PLC0415
  import threading  # noqa: PLC0415

  local, paths, arrays = _local()
  keys = [(n, index) for n, by_index in enumerate(arrays) for index in by_index]
  gates = {key: concurrent.futures.Future() for key in keys}
  server = peer_stream.Server(
    "127.0.0.1", local, paths, timeout_s=10, log_prefix="[test]", ready=gates
  )
  try:
    items, nbytes = _items(arrays)
    buffer = np.zeros(nbytes, np.uint8)
    done = threading.Event()
    errors = []

    def pull():
      try:
        peer_pull.pull(server.offer(), 0, 7, items, paths, buffer, timeout_s=10)
      except Exception as e:  # noqa: BLE001
        errors.append(e)
      done.set()

    threading.Thread(target=pull, daemon=True).start()
    assert not done.wait(0.5) and not buffer.any()  # nothing sent while gated
    for gate in gates.values():
      gate.set_result(True)
    assert done.wait(10) and not errors, errors
    want = np.concatenate([arr.view(np.uint8) for by in arrays for arr in by.values()])
    assert buffer.tobytes() == want.tobytes()
  finally:
    server.close()
  gates = {key: concurrent.futures.Future() for key in keys}
  gates[keys[0]].set_exception(CorruptCheckpointError("read failed its CRC32C"))
  server = peer_stream.Server(
    "127.0.0.1", local, paths, timeout_s=10, log_prefix="[test]", ready=gates
  )
  try:
    with pytest.raises((ConnectionError, OSError)):
      peer_pull.pull(server.offer(), 0, 7, items, paths, np.zeros(nbytes, np.uint8), timeout_s=10)
  finally:
    server.close()


def test_plan_split_cuts_contiguous_runs_of_equal_bytes():
  mesh = _mesh(2, 2, 2)  # 2 slices of one process with 2 devices
  layout = _layout(mesh, 0, 4)  # 8 slots of 64 bytes
  mine0, pulls0 = routing.plan_split(layout, mesh, 0, 2, 0)
  mine1, pulls1 = routing.plan_split(_layout(mesh, 1, 4), mesh, 0, 2, 1)
  order = [(n, s.index) for n, leaf in enumerate(layout.leaves) for s in leaf.slots]
  assert sorted(mine0) == sorted(order[:4]) and sorted(mine1) == sorted(order[4:])
  assert list(pulls0) == [1] and list(pulls1) == [0]  # from the counterpart
  assert [(n, s.index) for n, s in pulls0[1]] == order[4:]


def _boxes(server, request: list) -> tuple[dict, list[bytes]]:
  """A raw request of [leaf, path, index, box] items: (reply, the bytes)."""
  with peer_pull.request(server.offer(), 0, 7, request, timeout_s=10) as (sock, records):
    got = []
    for record in records:
      buf = np.empty(record["nbytes"], np.uint8)
      protocol.recv_into(sock, buf)
      got.append((record, buf.tobytes()))
  return got


def test_an_unverified_shard_is_checked_before_a_part_is_cut_and_sent_whole_as_recorded():
  """A partner's copy is not checked when read (reshard_stream): the server
  checks a shard before cutting a part of it, and sends a whole one with
  the checksum recorded at save, which the receiver checks."""
  local, paths, arrays = _local()
  good, bad = ((0, 1000),), ((1000, 2000),)
  arrays[0][bad].view(np.uint32)[10] ^= 1  # damaged after its checksum was recorded
  unverified = {(0, good), (0, bad)}
  server = peer_stream.Server(
    "127.0.0.1", local, paths, timeout_s=10, log_prefix="[t]", unverified=unverified
  )
  try:
    part = [[0, paths[0], [list(r) for r in good], [[10, 20]]]]
    ((record, raw),) = _boxes(server, part)  # checked whole first, then cut
    assert raw == arrays[0][good][10:20].tobytes() and record == {
      "nbytes": 40,
      **shard_checksum(raw),
    }
    with pytest.raises(PeerTransferError, match="fails its checksum"):
      _boxes(server, [[0, paths[0], [list(r) for r in bad], [[1010, 1020]]]])
    whole = [[0, paths[0], [list(r) for r in bad], [list(r) for r in bad]]]
    ((record, raw),) = _boxes(server, whole)  # sent as saved: its recorded checksum
    recorded = local.manifest["leaves"][0]["shards"][1]["crc32c"]
    assert record["crc32c"] == recorded and shard_checksum(raw)["crc32c"] != recorded
  finally:
    server.close()


class _Mute(protocol.Listener):
  """A listener that takes a connection (token checked) and then neither
  reads nor answers until released."""

  def __init__(self):
    self._timeout_s, self._prefix = 30, "[mute]"
    self.release = threading.Event()
    self._start("127.0.0.1", None)

  def _handle(self, conn):
    self.release.wait(30)


def test_a_peer_that_stops_answering_raises_timeout_not_a_hang(tmp_path):
  """The sockets wait in the kernel (settle: SO_RCVTIMEO, SO_SNDTIMEO), so a
  silent peer still ends a receive, and a peer that stops reading ends a
  sendfile, each with TimeoutError once the timeout passes."""
  big = tmp_path / "big.bin"
  big.write_bytes(bytes(64 << 20))  # far more than the socket buffers hold
  mute = _Mute()
  try:
    with pytest.raises(TimeoutError, match="within the timeout"):
      with peer_pull.request(mute.offer(), 0, 7, [], timeout_s=0.3):
        pass
    with pytest.raises(TimeoutError, match="within the timeout"):
      protocol.send_file(mute.offer(), {}, str(big), 0, 64 << 20, timeout_s=0.3)
  finally:
    mute.release.set()
    mute.close()


def test_close_wakes_the_accept_thread(served):
  """close() shuts the listening socket down, which wakes a thread blocked
  in accept() (closing it alone leaves the thread there until its poll
  ends: made 60 s here, so only the wake-up passes)."""
  server, _, _ = served
  server._sock.settimeout(60)
  with socket.create_connection((server.host, server.port), timeout=5):
    pass  # one accept() round, so the thread goes back into accept() with the long poll
  time.sleep(0.3)  # lets it get there
  closing = threading.Thread(target=server.close)
  closing.start()
  closing.join(10)
  assert not closing.is_alive() and not server._thread.is_alive()
