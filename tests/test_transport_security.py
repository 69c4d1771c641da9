"""Issue 37: the peer transport against a hostile neighbour. Real sockets:
no secret / a wrong one, a replayed exchange, a man in the middle that
changes a shard and fixes its CRC32C, oversized headers and parity blocks,
a flood of idle connections and an accept() that fails with EMFILE; and a
real 1-slice x 4-process job with partner redundancy, each process limited
to 1,024 open files, flooded with 1,100 idle connections per listener."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest

from emergency_ckpt.core import parity as xp
from emergency_ckpt.errors import CorruptCheckpointError, PeerTransferError
from emergency_ckpt.redundancy import xor_wire
from emergency_ckpt.transport import handshake, listener, protocol, session
from emergency_ckpt.transport import pull as peer_pull
from emergency_ckpt.transport import stream as peer_stream
from tests.harness.mitm import HANDSHAKE_IN, Relay, tamper_first_shard
from tests.test_peer_stream import _items, _local, _until_closed


def _served(integrity: str = "mac"):
  local, paths, arrays = _local()
  server = peer_stream.Server(
    "127.0.0.1",
    local,
    paths,
    timeout_s=10,
    log_prefix="[t]",
    security=protocol.Security(integrity),
  )
  return server, paths, arrays


def _want(arrays) -> bytes:
  return np.concatenate([a.view(np.uint8) for by in arrays for a in by.values()]).tobytes()


def _pull(offer, paths, arrays, timeout_s=10) -> bytes:
  items, nbytes = _items(arrays)
  buffer = np.zeros(nbytes, np.uint8)
  peer_pull.pull(offer, 0, 7, items, paths, buffer, timeout_s=timeout_s)
  return buffer.tobytes()


# ---- authentication ------------------------------------------------------------------


def test_no_token_or_a_wrong_one_is_refused_and_the_peer_still_served(caplog):
  server, paths, arrays = _served()
  try:
    wrong = dict(server.offer(), token="11" * handshake.TOKEN_BYTES)
    with pytest.raises(PeerTransferError, match="refused this client's proof|did not prove"):
      _pull(wrong, paths, arrays)
    # no token: an old client's hello (MAGIC + nothing), or nothing at all
    for hello in (b"ECPEER1\n" + bytes(32), b""):
      with socket.create_connection((server.host, server.port), timeout=10) as raw:
        raw.sendall(hello)
        raw.shutdown(socket.SHUT_WR)
        assert len(_until_closed(raw)) == HANDSHAKE_IN  # the challenge only
    # a server without the secret: the client refuses it (mutual)
    impostor = dict(server.offer())
    other, _, _ = _served()
    try:
      impostor["port"] = other.port  # another listener, another secret
      with pytest.raises(PeerTransferError):
        _pull(impostor, paths, arrays)
    finally:
      other.close()
    assert _pull(server.offer(), paths, arrays) == _want(arrays)
    assert server.healthy()
  finally:
    server.close()


def test_a_replayed_exchange_is_refused(caplog):
  server, paths, arrays = _served()
  try:
    relay = Relay((server.host, server.port))
    offer = dict(server.offer(), port=relay.port)
    assert _pull(offer, paths, arrays) == _want(arrays)  # recorded on the way
    assert relay.wait_finished(1, 10)
    recorded = bytes(relay.exchanges[0].from_client)
    assert len(recorded) > HANDSHAKE_IN
    with socket.create_connection((server.host, server.port), timeout=10) as raw:
      raw.sendall(recorded)  # the same proof, over the listener's new nonce
      with contextlib.suppress(OSError):  # the listener may have refused and closed already
        raw.shutdown(socket.SHUT_WR)
      assert len(_until_closed(raw)) <= HANDSHAKE_IN  # at most the challenge: nothing served
    assert "no proof of the secret" in caplog.text  # refused as a replay
    assert _pull(server.offer(), paths, arrays) == _want(arrays)
  finally:
    server.close()


# ---- a man in the middle -------------------------------------------------------------


@pytest.mark.parametrize("fix_header", [False, True], ids=["crc-forged-in-shard", "crc-in-header"])
def test_a_man_in_the_middle_who_fixes_the_crc_is_detected(fix_header):
  server, paths, arrays = _served()
  try:
    relay = Relay((server.host, server.port), tamper_first_shard(fix_header))
    offer = dict(server.offer(), port=relay.port)
    what = "a document fails its MAC" if fix_header else "payload bytes fail their MAC"
    with pytest.raises(CorruptCheckpointError, match=what):
      _pull(offer, paths, arrays)
    assert _pull(server.offer(), paths, arrays) == _want(arrays)  # the next source: bit-exact
  finally:
    server.close()


def test_with_integrity_crc_a_forged_crc_passes_so_mac_is_the_default():
  """Why "mac" is the default: under "crc" a shard changed with its CRC32C
  forged arrives unseen (documents stay MAC'd)."""
  assert protocol.Security().integrity == "mac"
  server, paths, arrays = _served("crc")
  try:
    relay = Relay((server.host, server.port), tamper_first_shard(False, "crc"))
    got = _pull(dict(server.offer(), port=relay.port), paths, arrays)
    assert got != _want(arrays)
  finally:
    server.close()


# ---- sizes from the wire ---------------------------------------------------------------


def _session_pair(integrity: str = "mac") -> tuple[session.Session, session.Session]:
  a, b = socket.socketpair()
  for s in (a, b):
    session.settle(s, 5)
  key = os.urandom(32)
  return (
    session.Session(a, key, client=True, integrity=integrity, what="[client]"),
    session.Session(b, key, client=False, integrity=integrity, what="[listener]"),
  )


def test_an_oversized_header_is_refused_before_its_body_is_received():
  client, server = _session_pair()
  try:
    client.sock.sendall(struct.pack("!I", 1 << 30))  # announces 1 GiB, sends none of it
    tracemalloc.start()
    t0 = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="exceeds the limit of 1048576"):
      server.recv_json()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.monotonic() - t0 < 2  # refused from the length: no wait for the body
    assert peak < 64 << 10
  finally:
    client.sock.close()
    server.sock.close()


def test_an_oversized_parity_block_is_refused_without_allocating(tmp_path, monkeypatch):
  """A member (with the secret) announces a 64 GiB chunk and sends a few
  bytes; or a chunk whose length its byte count does not make. The block
  grows only with the bytes that came; the wrong length is refused before
  any byte is read."""
  grown: list[int] = []
  real_open, real_grow = xor_wire.blocks.open_block, xor_wire.blocks.ParityBlock.grow
  monkeypatch.setattr(
    xor_wire.blocks, "open_block", lambda f, s, n, m: grown.append(n) or real_open(f, s, n, m)
  )
  monkeypatch.setattr(
    xor_wire.blocks.ParityBlock, "grow", lambda self, n: grown.append(n) or real_grow(self, n)
  )
  receiver = xor_wire.ParityReceiver(
    str(tmp_path / "p0"),
    "127.0.0.1",
    member=0,
    group=[0, 1],
    keep=2,
    timeout_s=5,
    log_prefix="[m0]",
  )
  try:
    big = 64 << 30
    header = {"step": 9, "member": 1, "group": [0, 1], "nbytes": big, "length": big}
    with protocol.connect(receiver.offer(), timeout_s=10, sender=1, step=9) as conn:
      conn.send_json(header)
      conn.sock.sendall(bytes(1000))
      conn.sock.shutdown(socket.SHUT_WR)
      assert _until_closed(conn.sock)  # the error answer, then closed
    assert max(grown) <= 1000, grown
    wrong = dict(header, nbytes=4096, length=1 << 30)  # 4096 bytes make a 4096-byte chunk
    with protocol.connect(receiver.offer(), timeout_s=10, sender=1, step=9) as conn:
      conn.send_json(wrong)
      assert "4096" in str(conn.recv_json()["error"])
    assert max(grown) <= 1000 and xp.chunk(4096, 2, 0)[1] == 4096
    assert receiver.healthy()
  finally:
    receiver.close()


def test_a_header_naming_another_member_than_the_handshake_is_refused(tmp_path):
  receiver = xor_wire.ParityReceiver(
    str(tmp_path / "p0"),
    "127.0.0.1",
    member=0,
    group=[0, 1],
    keep=2,
    timeout_s=5,
    log_prefix="[m0]",
  )
  try:
    header = {"step": 9, "member": 1, "group": [0, 1], "nbytes": 8, "length": 8}
    with protocol.connect(receiver.offer(), timeout_s=10, sender=1, step=8) as conn:
      conn.send_json(header)
      assert "opened for member 1 step 8" in conn.recv_json()["error"]
  finally:
    receiver.close()


# ---- bounded work before authentication -------------------------------------------------


def test_idle_connections_do_not_starve_the_peer_and_refusals_are_logged_rarely(caplog):
  server, paths, arrays = _served()
  idle = []
  try:
    for _ in range(300):
      s = socket.socket()
      s.setblocking(False)
      s.connect_ex((server.host, server.port))
      idle.append(s)
    t0 = time.monotonic()
    assert _pull(server.offer(), paths, arrays, timeout_s=30) == _want(arrays)
    assert time.monotonic() - t0 < listener.HANDSHAKE_S + 5
    assert server.healthy()
    refusals = [r for r in caplog.records if "refused connections" in r.getMessage()]
    assert 1 <= len(refusals) <= 2, [r.getMessage() for r in refusals]
  finally:
    for s in idle:
      s.close()
    server.close()


class _Failing:
  """A listening socket whose accept() fails `n` times with `errno_`."""

  def __init__(self, sock, n, errno_):
    self._sock, self.n, self.errno = sock, n, errno_

  def accept(self):
    if self.n:
      self.n -= 1
      raise OSError(self.errno, os.strerror(self.errno))
    return self._sock.accept()

  def __getattr__(self, name):
    return getattr(self._sock, name)


def test_the_accept_loop_survives_emfile_thread_failures_and_errors(monkeypatch):
  import errno  # noqa: PLC0415

  server, paths, arrays = _served()
  try:
    server._sock = _Failing(server._sock, 20, errno.EMFILE)  # noqa: SLF001
    assert _pull(server.offer(), paths, arrays) == _want(arrays)
    real = threading.Thread.start
    fails = [3]

    def start(self):
      if self.name == "ec-peer-conn" and fails[0]:
        fails[0] -= 1
        raise RuntimeError("can't start new thread")
      real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    assert _pull(server.offer(), paths, arrays, timeout_s=30) == _want(arrays)  # the client retries
    assert fails[0] == 0 and server.healthy() and server.error is None
  finally:
    monkeypatch.undo()
    server.close()


def test_a_dead_accept_thread_is_reported():
  server, _, _ = _served()
  try:

    class Dies:
      def accept(self):
        raise SystemExit("gone")

      def __getattr__(self, name):
        return getattr(server_sock, name)

    server_sock = server._sock  # noqa: SLF001
    server._sock = Dies()  # noqa: SLF001
    server._thread.join(5)  # noqa: SLF001
    assert not server.healthy() and "SystemExit" in server.error
  finally:
    server._sock = server_sock  # noqa: SLF001
    server.close()


# ---- a real job, flooded -----------------------------------------------------------------


def flooded_partner_saves(args: dict) -> dict:
  """Job target: each process limited to 1,024 open files; publishes its
  partner receiver's address, waits for the outsider's flood, then saves
  every step and records the newest committed step after each."""
  import resource  # noqa: PLC0415

  import emergency_ckpt as ec  # noqa: PLC0415
  from tests import scenarios  # noqa: PLC0415

  _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
  mesh = scenarios.mesh_for(1)
  me = scenarios.pid()
  with ec.CheckpointManager(scenarios.options(args), mesh=mesh) as mngr:
    receiver = mngr._redundancy.receiver  # noqa: SLF001
    where = os.path.join(args["flood_dir"], f"listener_{me}.json")
    with open(where + ".tmp", "w") as f:
      json.dump({"host": receiver.host, "port": receiver.port}, f)
    os.rename(where + ".tmp", where)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(args["flood_dir"], "flooded")):
      assert time.monotonic() < deadline, "the outsider never flooded"
      time.sleep(0.1)
    committed = []
    for step in args["steps"]:
      mngr.save(step, scenarios.make_state(mesh, step), data_state=scenarios.data_state(step))
      mngr.wait_until_finished()
      committed.append(mngr.latest_step())
    return {
      "committed": committed,
      "healthy": receiver.healthy(),
      "refusals": receiver.refusals,
      "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    }


def test_a_job_flooded_with_idle_connections_commits_every_step_with_its_redundancy(shm_dir):
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415
  from tests import restart_helpers as rh  # noqa: PLC0415

  processes, per_listener = 4, 1100
  args = {
    "slices": 1,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "flood_dir": os.path.join(shm_dir, "flood"),
    "steps": [1, 2, 3, 4],
    "persistent_interval": 3,
    "local_keep": 3,
    "redundancy": "partner",
    "sim_hosts": True,
  }
  os.makedirs(args["flood_dir"])
  done: dict = {}
  job = threading.Thread(
    target=lambda: done.update(
      r=run_job(f"{__name__}:flooded_partner_saves", processes, args, timeout_s=300)
    ),
    daemon=True,
  )
  job.start()
  idle = []
  try:
    deadline = time.monotonic() + 180
    listeners = []
    for p in range(processes):
      where = os.path.join(args["flood_dir"], f"listener_{p}.json")
      while not os.path.exists(where):
        assert time.monotonic() < deadline and job.is_alive(), "no listener published"
        time.sleep(0.1)
      with open(where) as f:
        listeners.append(json.load(f))
    for addr in listeners:  # the outsider: 1,100 idle connections to each listener
      for _ in range(per_listener):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((addr["host"], addr["port"]))
        idle.append(s)
    open(os.path.join(args["flood_dir"], "flooded"), "w").close()
    job.join(320)
    results = done["r"].check()
  finally:
    for s in idle:
      s.close()
  assert len(idle) == processes * per_listener
  for p, r in enumerate(results):
    assert r["committed"] == args["steps"], (p, r)
    assert r["healthy"] and r["nofile"] == 1024, (p, r)
    assert r["refusals"] >= 500, (p, r)  # the flood reached it
  for p in range(processes):  # every step of every process also in its partner's ramdisk
    partner = (p + 1) % processes
    folder = os.path.join(rh.process_dir(args, partner), "partner", f"process_{p}")
    held = sorted(n for n in os.listdir(folder) if n.startswith("step_"))
    assert held == ["step_1", "step_2", "step_3", "step_4"], (p, held)
