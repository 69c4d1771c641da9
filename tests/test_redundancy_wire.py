"""The redundancy transports in one process, at sizes beyond a socket's send
buffer (a step of tens of MiB: a bare os.sendfile loop on a socket with a
timeout failed with EAGAIN there): partner.send into a Receiver, and
xor.send among the ParityReceivers of a group of 3, then a rebuild of each
member from the others through RangeServers. Real files, real sockets."""

from __future__ import annotations

import os

import crc32c
import numpy as np
import pytest

from emergency_ckpt.core import parity as xor_parity
from emergency_ckpt.errors import PeerTransferError
from emergency_ckpt.local import blocks as local_blocks
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import read as local_read
from emergency_ckpt.redundancy import partner, xor, xor_wire

MIB = 1 << 20


def _step(
  folder: str, process: int, nbytes: int, seed: int, step: int = 7, crc_of: bytes | None = None
) -> tuple[str, bytes]:
  """A local step folder of one float32 leaf of `nbytes` random bytes (its
  manifest's checksum that of `crc_of`, if given: a damaged copy)."""
  data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
  where = os.path.join(folder, f"process_{process}", f"step_{step}")
  os.makedirs(where)
  with open(os.path.join(where, local_format.SHARDS), "wb") as f:
    f.write(data)
  n = nbytes // 4
  body = {
    "format": local_format.FORMAT,
    "step": step,
    "run_id": "r",
    "process_index": process,
    "nbytes": nbytes,
    "leaves": [
      {
        "path": "['w']",
        "shape": [n],
        "dtype": "float32",
        "shards": [
          {
            "index": [[0, n]],
            "offset": 0,
            "nbytes": nbytes,
            "crc32c": crc32c.crc32c(crc_of or data),
          }
        ],
      }
    ],
  }
  with open(os.path.join(where, local_format.MANIFEST), "wb") as f:
    f.write(local_format.encode_manifest(body))
  return where, data


def test_partner_send_of_a_large_step(tmp_path):
  where, data = _step(str(tmp_path / "sender"), 3, 24 * MIB, 0)
  receiver = partner.Receiver(
    str(tmp_path / "partner_host"), "127.0.0.1", keep=2, timeout_s=30, log_prefix="[t]"
  )
  try:
    assert partner.send(receiver.offer(), 1, where, timeout_s=30) == len(data)
  finally:
    receiver.close()
  kept = os.path.join(local_blocks.partner_dir(str(tmp_path / "partner_host"), 3), "step_7")
  got = local_read.read_step(kept)  # every shard verified
  assert got.arrays[0][((0, len(data) // 4),)].tobytes() == data


def test_partner_steps_are_written_over_the_spare_and_checked_on_arrival(tmp_path):
  """Retired steps' files are written over (one spare per sender), each new
  step bit-exact; a step whose bytes do not match its manifest is refused
  and leaves nothing behind."""
  host = str(tmp_path / "partner_host")
  receiver = partner.Receiver(host, "127.0.0.1", keep=2, timeout_s=30, log_prefix="[t]")
  kept = local_blocks.partner_dir(host, 3)
  sent = {}
  try:
    for step in range(1, 6):
      where, sent[step] = _step(str(tmp_path / f"s{step}"), 3, 6 * MIB, step, step)
      partner.send(receiver.offer(), 1, where, timeout_s=30)
      names = sorted(os.listdir(kept))
      spares = [n for n in names if n.startswith(".tmp-spare-")]
      assert len(spares) == (step > 2), names
    bad, _ = _step(str(tmp_path / "bad"), 3, 6 * MIB, 99, 6, crc_of=b"other bytes")
    with pytest.raises(PeerTransferError, match="checksum"):
      partner.send(receiver.offer(), 1, bad, timeout_s=30)
  finally:
    receiver.close()
  assert sorted(n for n in os.listdir(kept) if not n.startswith(".tmp-spare-")) == [
    "step_4",
    "step_5",
  ]
  for step in (4, 5):
    got = local_read.read_step(os.path.join(kept, f"step_{step}"))
    assert got.arrays[0][((0, 6 * MIB // 4),)].tobytes() == sent[step]


def test_a_partner_copy_a_restore_mapped_is_never_written_over(tmp_path):
  """Restored arrays may alias a mapped copy's pages: such a file is unlinked
  when retired, never kept as the spare."""
  host = str(tmp_path / "partner_host")
  receiver = partner.Receiver(
    host, "127.0.0.1", keep=1, timeout_s=30, log_prefix="[t]", mapped=lambda st: True
  )
  try:
    for step in range(1, 4):
      where, _ = _step(str(tmp_path / f"s{step}"), 3, MIB, step, step)
      partner.send(receiver.offer(), 1, where, timeout_s=30)
  finally:
    receiver.close()
  assert sorted(os.listdir(local_blocks.partner_dir(host, 3))) == ["step_3"]


def _range_servers(data: list[bytes], blocks: dict, members: list[int]) -> dict:
  """A RangeServer of step 7 per member, serving its data and parity block."""
  return {
    i: xor.RangeServer(
      "127.0.0.1",
      7,
      {(i, "data"): np.frombuffer(data[i], np.uint8), (i, "parity"): blocks[i]},
      timeout_s=30,
      log_prefix=f"[s{i}]",
    )
    for i in members
  }


@pytest.mark.parametrize("k", [2, 3])
def test_xor_send_and_rebuild_of_large_steps(tmp_path, k):
  sizes = [20 * MIB + 12, 9 * MIB + 4, 16 * MIB][:k]
  steps = [_step(str(tmp_path / f"host_{i}"), i, n, i) for i, n in enumerate(sizes)]
  group = list(range(k))
  receivers = [
    xor_wire.ParityReceiver(
      os.path.dirname(steps[i][0]),
      "127.0.0.1",
      member=i,
      group=group,
      keep=2,
      timeout_s=60,
      log_prefix=f"[m{i}]",
    )
    for i in range(k)
  ]
  try:
    offers = {i: r.offer() for i, r in enumerate(receivers)}
    import concurrent.futures  # noqa: PLC0415

    with concurrent.futures.ThreadPoolExecutor(k) as pool:
      sent = list(pool.map(lambda i: xor.send(offers, group, i, steps[i][0], timeout_s=60), group))
    assert sent == [sum(xor_parity.chunk(sizes[i], k, t)[1] for t in range(k - 1)) for i in group]
  finally:
    for r in receivers:
      r.close()
  data = [d for _, d in steps]
  blocks = {}
  for j in group:
    folder = os.path.join(local_blocks.xor_dir(os.path.dirname(steps[j][0])), "step_7")
    with open(os.path.join(folder, local_blocks.PARITY_FILE), "rb") as f:
      blocks[j] = np.frombuffer(f.read(), np.uint8)
    assert blocks[j].tobytes() == xor_parity.parity(j, data).tobytes()
    body = local_blocks.read_group(folder)
    assert body["parity_crc32c"] == crc32c.crc32c(blocks[j])
  for lost in group:  # each member rebuilt from the others' data and blocks
    servers = _range_servers(data, blocks, [i for i in group if i != lost])
    try:
      manifest = local_format.read_manifest(steps[lost][0])
      got = xor.rebuild(
        7,
        lost,
        group,
        dict(enumerate(sizes)),
        manifest,
        {i: s.offer() for i, s in servers.items()},
        timeout_s=30,
      )
    finally:
      for s in servers.values():
        s.close()
    assert got.arrays[0][((0, sizes[lost] // 4),)].tobytes() == data[lost]


@pytest.mark.parametrize("damaged", [False, True])
def test_xor_rebuild_reads_the_rebuilders_own_blocks_in_place(tmp_path, damaged):
  """The rebuilding survivor's own data and parity come from `here`, never
  over the wire (its member has no server at all); the others' come from
  their RangeServers. A flipped byte in its own parity (not checked on its
  own) fails the rebuilt shard's CRC32C: an error, never a wrong byte."""
  from emergency_ckpt.errors import CorruptCheckpointError  # noqa: PLC0415

  k, lost, rebuilder = 3, 0, 1
  sizes = [6 * MIB + 8, 5 * MIB, 7 * MIB + 4]
  steps = [_step(str(tmp_path / f"host_{i}"), i, n, 10 + i) for i, n in enumerate(sizes)]
  data = [d for _, d in steps]
  blocks = {j: xor_parity.parity(j, data) for j in range(k)}
  here = {(rebuilder, "data"): np.frombuffer(data[rebuilder], np.uint8)}
  here[(rebuilder, "parity")] = blocks[rebuilder].copy()
  if damaged:
    here[(rebuilder, "parity")][100] ^= 0x10
  servers = _range_servers(data, blocks, [i for i in range(k) if i not in (lost, rebuilder)])
  offers = {i: s.offer() for i, s in servers.items()}
  offers[rebuilder] = {"error": "fetched what it holds"}
  try:
    manifest = local_format.read_manifest(steps[lost][0])
    call = lambda: xor.rebuild(  # noqa: E731
      7, lost, list(range(k)), dict(enumerate(sizes)), manifest, offers, timeout_s=30, here=here
    )
    if damaged:
      with pytest.raises(CorruptCheckpointError):
        call()
      return
    got = call()
  finally:
    for s in servers.values():
      s.close()
  assert got.arrays[0][((0, sizes[lost] // 4),)].tobytes() == data[lost]


def test_xor_rebuild_refuses_bytes_damaged_on_the_wire(tmp_path, monkeypatch):
  """The ranges stream into the rebuilt chunks as they arrive, with no
  checksum per range; one flipped bit on the wire fails the rebuilt
  shard's CRC32C from the lost member's manifest: an error naming the
  shard, never a rebuilt copy."""
  from emergency_ckpt.errors import CorruptCheckpointError  # noqa: PLC0415

  k, lost = 3, 2
  sizes = [6 * MIB + 8, 5 * MIB, 7 * MIB + 4]
  steps = [_step(str(tmp_path / f"host_{i}"), i, n, 20 + i) for i, n in enumerate(sizes)]
  data = [d for _, d in steps]
  blocks = {j: xor_parity.parity(j, data) for j in range(k)}
  monkeypatch.setattr(
    xor.stream.failpoints, "armed", lambda name, step: name == "peer.corrupt_send"
  )
  servers = _range_servers(data, blocks, [0, 1])
  try:
    with pytest.raises(CorruptCheckpointError, match=r"rebuilt from parity.*fails its checksum"):
      xor.rebuild(
        7,
        lost,
        list(range(k)),
        dict(enumerate(sizes)),
        local_format.read_manifest(steps[lost][0]),
        {i: s.offer() for i, s in servers.items()},
        timeout_s=30,
      )
  finally:
    for s in servers.values():
      s.close()


def _xor_group(tmp_path, k: int, keep: int, mapped=None) -> list:
  return [
    xor_wire.ParityReceiver(
      str(tmp_path / f"host_{i}" / f"process_{i}"),
      "127.0.0.1",
      member=i,
      group=list(range(k)),
      keep=keep,
      timeout_s=60,
      log_prefix=f"[m{i}]",
      mapped=mapped,
    )
    for i in range(k)
  ]


def _send_step(tmp_path, receivers, step: int, sizes: list[int]) -> list[bytes]:
  """Every member's step `step` (fresh random bytes of `sizes`) sent to the
  group at once; returns the data."""
  import concurrent.futures  # noqa: PLC0415

  k = len(receivers)
  offers = {i: r.offer() for i, r in enumerate(receivers)}
  steps = [
    _step(str(tmp_path / f"src{step}" / f"host_{i}"), i, n, 100 * step + i, step)
    for i, n in enumerate(sizes)
  ]
  with concurrent.futures.ThreadPoolExecutor(k) as pool:
    list(
      pool.map(lambda i: xor.send(offers, list(range(k)), i, steps[i][0], timeout_s=60), range(k))
    )
  return [d for _, d in steps]


def _block(tmp_path, member: int, step: int) -> tuple[bytes, int, dict]:
  folder = os.path.join(
    local_blocks.xor_dir(str(tmp_path / f"host_{member}" / f"process_{member}")), f"step_{step}"
  )
  path = os.path.join(folder, local_blocks.PARITY_FILE)
  with open(path, "rb") as f:
    return f.read(), os.stat(path).st_ino, local_blocks.read_group(folder)


def _spares(tmp_path, member: int) -> list[str]:
  root = local_blocks.xor_dir(str(tmp_path / f"host_{member}" / f"process_{member}"))
  return [n for n in os.listdir(root) if n.startswith(".tmp-spare-")]


def _wait_for(cond, what: str) -> None:
  import time  # noqa: PLC0415

  deadline = time.monotonic() + 30
  while not cond():
    assert time.monotonic() < deadline, what
    time.sleep(0.01)


def test_xor_blocks_are_written_into_the_retired_block(tmp_path):
  """Once a step is retired (beyond `keep`), its block file is kept and the
  next step's chunks are written straight into its pages (the first to
  reach a byte copied over the old one, the others XORed in): the new
  block is the same file (inode), and it holds exactly the new parity,
  also when the block grows or shrinks from one step to the next."""
  k, keep = 3, 2
  receivers = _xor_group(tmp_path, k, keep)
  sizes_of = {
    1: [4 * MIB, 4 * MIB, 4 * MIB],
    2: [4 * MIB, 4 * MIB, 4 * MIB],
    3: [4 * MIB, 4 * MIB, 4 * MIB],
    4: [6 * MIB + 12, 5 * MIB, 4 * MIB],  # longer blocks than the spare
    5: [2 * MIB, 3 * MIB + 4, 2 * MIB],  # shorter
    6: [3 * MIB, 3 * MIB, 3 * MIB],
  }
  inodes: dict[tuple[int, int], int] = {}
  try:
    for step, sizes in sizes_of.items():
      if step > keep + 1:  # the step retired after step - 1 is the spare by now
        _wait_for(lambda: all(_spares(tmp_path, j) for j in range(k)), f"spares before {step}")
      data = _send_step(tmp_path, receivers, step, sizes)
      for j in range(k):
        raw, ino, body = _block(tmp_path, j, step)
        want = xor_parity.parity(j, data).tobytes()
        assert raw == want, (step, j)
        assert body["parity_nbytes"] == len(want) and body["parity_crc32c"] == crc32c.crc32c(raw)
        inodes[(step, j)] = ino
  finally:
    for r in receivers:
      r.close()
  for j in range(k):
    # step 1 retired after step 3 stored: step 4 is written into its file,
    # step 5 into step 2's, step 6 into step 3's
    assert [inodes[(s, j)] for s in (4, 5, 6)] == [inodes[(s, j)] for s in (1, 2, 3)], j
    root = local_blocks.xor_dir(str(tmp_path / f"host_{j}" / f"process_{j}"))
    steps = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    assert steps == ["step_5", "step_6"]
    assert [
      n for n in os.listdir(root) if n.startswith(".tmp-") and not n.startswith(".tmp-spare-")
    ] == []


def test_a_parity_block_a_restore_mapped_is_never_recycled(tmp_path):
  """A rebuild maps parity blocks in place (LocalTier.xor_files): such a
  block is dropped when retired, never zeroed and written over by a later
  step (what a mapping of step 1's block sees stays step 1's parity)."""
  k = 2
  receivers = _xor_group(tmp_path, k, keep=1, mapped=lambda st: True)
  held = {}
  try:
    data = _send_step(tmp_path, receivers, 1, [MIB, MIB])
    for j in range(k):
      root = local_blocks.xor_dir(str(tmp_path / f"host_{j}" / f"process_{j}"))
      held[j] = open(os.path.join(root, "step_1", local_blocks.PARITY_FILE), "rb")  # noqa: SIM115
    for step in (2, 3, 4):
      _send_step(tmp_path, receivers, step, [MIB, MIB])
  finally:
    for r in receivers:
      r.close()
  for j in range(k):
    with held[j] as f:
      assert os.pread(f.fileno(), MIB, 0) == xor_parity.parity(j, data).tobytes()
    assert _spares(tmp_path, j) == []


def test_a_torn_chunk_leaves_no_block_and_the_step_can_be_sent_again(tmp_path):
  """A sender that stops mid-chunk poisons the step's block: its folder is
  removed, no step is listed, and the same step sent again is stored."""
  k = 2
  receivers = _xor_group(tmp_path, k, keep=2)
  try:
    short = os.path.join(str(tmp_path), "short.bin")
    with open(short, "wb") as f:
      f.write(b"\1" * MIB)
    header = {
      "step": 9,
      "member": 1,
      "group": [0, 1],
      "nbytes": 2 * MIB,
      "length": 2 * MIB,
    }
    with pytest.raises(OSError):
      from emergency_ckpt.transport import protocol  # noqa: PLC0415

      protocol.send_file(receivers[0].offer(), header, short, 0, 2 * MIB, timeout_s=30, sender=1)
    root = local_blocks.xor_dir(str(tmp_path / "host_0" / "process_0"))
    _wait_for(  # made for the chunk, then removed with it
      lambda: os.path.isdir(root) and not os.listdir(root) and not receivers[0]._pending,  # noqa: SLF001
      "the torn block's folder is gone",
    )
    data = _send_step(tmp_path, receivers, 9, [2 * MIB, 2 * MIB])
    assert _block(tmp_path, 0, 9)[0] == xor_parity.parity(0, data).tobytes()
  finally:
    for r in receivers:
      r.close()


def test_a_parity_receiver_removes_what_a_crashed_one_left(tmp_path):
  """Blocks being received, spares and deletions (`.tmp-*`) of a crashed
  incarnation go when the next receiver starts; stored steps stay."""
  root = local_blocks.xor_dir(str(tmp_path / "host_0" / "process_0"))
  for name in ("step_3", ".tmp-step_4-abcd", ".tmp-spare-0123", ".tmp-delete-step_2-ff"):
    os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, name, local_blocks.PARITY_FILE), "wb") as f:
      f.write(b"x")
  (receiver,) = _xor_group(tmp_path, 1, keep=2)
  receiver.close()
  assert sorted(os.listdir(root)) == ["step_3"]


def _send_snapshots(receivers, step: int, data: list[bytes], manifest, sent) -> list:
  """Every member sends `data[i]` from memory (xor.send_snapshot) at once,
  `manifest(i)` its trailer and `sent(i)` its callback; returns each
  member's result (bytes sent, or the exception raised)."""
  import concurrent.futures  # noqa: PLC0415

  k = len(receivers)
  offers = {i: r.offer() for i, r in enumerate(receivers)}

  def one(i: int):
    try:
      return xor.send_snapshot(
        offers,
        list(range(k)),
        i,
        step,
        np.frombuffer(data[i], np.uint8),
        lambda: manifest(i),
        timeout_s=60,
        sent=lambda: sent(i),
      )
    except Exception as e:  # noqa: BLE001 - returned to the test
      return e

  with concurrent.futures.ThreadPoolExecutor(k) as pool:
    return list(pool.map(one, range(k)))


def test_xor_chunks_go_from_memory_while_the_step_is_written(tmp_path):
  """redundancy_overlap: each member's chunks go from the staged bytes
  before its local write is done (the manifest, each chunk's trailer,
  blocks until then): every member's bytes are out (`sent`, once each)
  while every manifest is still waited for; the blocks then hold exactly
  the parity and group.json each member's manifest."""
  import threading  # noqa: PLC0415

  k, step = 3, 4
  receivers = _xor_group(tmp_path, k, keep=2)
  steps = [
    _step(str(tmp_path / "src" / f"host_{i}"), i, 3 * MIB + 8 * i, 40 + i, step) for i in range(k)
  ]
  raws = []
  for where, _ in steps:
    with open(os.path.join(where, local_format.MANIFEST), "rb") as f:
      raws.append(f.read())
  written = threading.Event()
  sent = [0] * k
  lock = threading.Lock()

  def on_sent(i: int) -> None:
    with lock:
      sent[i] += 1

  def manifest(i: int) -> bytes:
    assert written.wait(60), "the manifest was never released"
    return raws[i]

  import concurrent.futures  # noqa: PLC0415

  try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      fut = pool.submit(_send_snapshots, receivers, step, [d for _, d in steps], manifest, on_sent)
      _wait_for(lambda: all(sent), "every member's bytes out before its write is done")
      written.set()
      got = fut.result(timeout=60)
    assert got == [len(steps[i][1]) for i in range(k)], got
    assert sent == [1] * k
    for j in range(k):
      raw, _, body = _block(tmp_path, j, step)
      assert raw == xor_parity.parity(j, [d for _, d in steps]).tobytes(), j
      assert body["manifests"] == {str(i): raws[i].hex() for i in range(k) if i != j}
  finally:
    written.set()
    for r in receivers:
      r.close()


def test_a_member_whose_write_failed_drops_the_step_at_once(tmp_path):
  """With redundancy_overlap, a member whose local write fails sends the
  error instead of its manifest: the members it sent to drop the step's
  block and answer every sender with an error at once (not after the
  timeout); the step is stored by no member that lacks a chunk, and sent
  again it is stored."""
  import time  # noqa: PLC0415

  k, step = 3, 6
  receivers = _xor_group(tmp_path, k, keep=2)
  steps = [_step(str(tmp_path / "src" / f"host_{i}"), i, 2 * MIB, 60 + i, step) for i in range(k)]
  raws = []
  for where, _ in steps:
    with open(os.path.join(where, local_format.MANIFEST), "rb") as f:
      raws.append(f.read())

  def manifest(i: int) -> bytes:
    if i == 1:
      raise OSError("No space left on device")
    return raws[i]

  try:
    t0 = time.monotonic()
    got = _send_snapshots(receivers, step, [d for _, d in steps], manifest, lambda i: None)
    assert time.monotonic() - t0 < 30  # the receivers' timeout is 60 s
    for i, r in enumerate(got):
      assert isinstance(r, PeerTransferError), (i, r)
    assert "No space left on device" in str(got[0])
    for j in (0, 2):  # member 1's chunk reached these
      root = local_blocks.xor_dir(str(tmp_path / f"host_{j}" / f"process_{j}"))
      _wait_for(
        lambda root=root: not any(n.startswith(("step_", ".tmp-step")) for n in os.listdir(root)),
        f"member {j}: no block",
      )
    ok = _send_snapshots(receivers, step, [d for _, d in steps], lambda i: raws[i], lambda i: None)
    assert ok == [2 * MIB] * k, ok
    for j in range(k):
      assert _block(tmp_path, j, step)[0] == xor_parity.parity(j, [d for _, d in steps]).tobytes()
  finally:
    for r in receivers:
      r.close()


def test_every_chunk_is_sent_when_one_member_fails_at_once(monkeypatch):
  """A member whose chunk to one member fails still sends its chunks to the
  others (they then drop the step at once instead of waiting for it until
  the timeout). The sending pool is cut to one thread so the second chunk
  starts only after the first failed: the CI failure of stop 30, where
  pool.map cancelled a chunk not yet started under load."""
  import concurrent.futures  # noqa: PLC0415

  real = concurrent.futures.ThreadPoolExecutor

  class OneThread(real):
    def __init__(self, max_workers=None, *args, **kwargs):
      super().__init__(1, *args, **kwargs)

  monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", OneThread)
  offers = {p: {"host": "h", "port": p, "token": ""} for p in (10, 11, 12)}
  asked = []

  def send_one(offer: dict, header: dict, off: int, length: int) -> dict:
    asked.append(offer["port"])
    if offer["port"] == 10:
      raise OSError("member 0 refused")
    return {"error": "member 1 did not write step 6"}

  with pytest.raises(OSError, match="member 0 refused"):
    xor_wire.send_chunks(offers, [10, 11, 12], 1, 6, 64, send_one)
  assert asked == [10, 12]


def test_a_member_whose_write_failed_tells_its_group_after_the_write(tmp_path):
  """Sending after the write (no overlap), a member whose local write
  failed sends an empty chunk with the error (xor.send_failure): the
  others' sends fail at once instead of after the receivers' timeout."""
  import concurrent.futures  # noqa: PLC0415
  import time  # noqa: PLC0415

  k, step = 3, 8
  receivers = _xor_group(tmp_path, k, keep=2)
  offers = {i: r.offer() for i, r in enumerate(receivers)}
  steps = [_step(str(tmp_path / "src" / f"host_{i}"), i, MIB, 80 + i, step) for i in range(k)]

  def one(i: int):
    try:
      if i == 1:
        return xor.send_failure(offers, list(range(k)), 1, step, "disk full", timeout_s=60)
      return xor.send(offers, list(range(k)), i, steps[i][0], timeout_s=60)
    except Exception as e:  # noqa: BLE001 - returned to the test
      return e

  try:
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(k) as pool:
      got = list(pool.map(one, range(k)))
    assert time.monotonic() - t0 < 30  # the receivers' timeout is 60 s
    assert got[1] is None
    for i in (0, 2):
      assert isinstance(got[i], PeerTransferError) and "disk full" in str(got[i]), got[i]
  finally:
    for r in receivers:
      r.close()


def test_a_chunk_of_a_step_given_up_is_refused_and_a_new_attempt_stored(tmp_path):
  """After member 1 said its write of the step failed, member 2's chunk of
  that step (arriving later) is answered with the error at once, not kept
  waiting for member 1's chunk until the timeout; the step sent again by
  both is stored."""
  import time  # noqa: PLC0415

  k, step = 3, 9
  receivers = _xor_group(tmp_path, k, keep=2)
  offers = {i: r.offer() for i, r in enumerate(receivers)}
  group = list(range(k))
  steps = [_step(str(tmp_path / "src" / f"host_{i}"), i, MIB, 90 + i, step) for i in range(k)]
  try:
    xor.send_failure(offers, group, 1, step, "disk full", timeout_s=60)
    import concurrent.futures  # noqa: PLC0415

    def late(i: int):
      try:
        return xor.send(offers, group, i, steps[i][0], timeout_s=60)
      except PeerTransferError as e:
        return e

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      got = list(pool.map(late, (0, 2)))
    assert time.monotonic() - t0 < 30  # the receivers' timeout is 60 s
    assert all(isinstance(e, PeerTransferError) and "disk full" in str(e) for e in got), got
    data = [d for _, d in steps]
    with concurrent.futures.ThreadPoolExecutor(k) as pool:
      got = list(pool.map(lambda i: xor.send(offers, group, i, steps[i][0], timeout_s=60), group))
    assert got == [MIB] * k
    for j in range(k):
      assert _block(tmp_path, j, step)[0] == xor_parity.parity(j, data).tobytes()
  finally:
    for r in receivers:
      r.close()


def test_a_partner_copy_goes_from_memory_while_the_step_is_written(tmp_path):
  """redundancy_overlap with "partner": the bytes go from the staged buffer
  before the write is done (`sent` before the manifest is released), the
  manifest follows; the kept copy is bit-exact and checked on arrival. A
  manifest whose checksums do not match the bytes, or the error of a
  failed write, is refused and leaves no step."""
  import concurrent.futures  # noqa: PLC0415
  import threading  # noqa: PLC0415

  host = str(tmp_path / "partner_host")
  receiver = partner.Receiver(host, "127.0.0.1", keep=2, timeout_s=30, log_prefix="[t]")
  kept = local_blocks.partner_dir(host, 3)
  try:
    where, data = _step(str(tmp_path / "s"), 3, 6 * MIB, 1, 7)
    with open(os.path.join(where, local_format.MANIFEST), "rb") as f:
      raw = f.read()
    spans = [(0, 6 * MIB)]
    written, out = threading.Event(), threading.Event()

    def manifest() -> bytes:
      assert written.wait(30), "the manifest was never released"
      return raw

    buf = np.frombuffer(data, np.uint8)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      fut = pool.submit(
        partner.send_snapshot, receiver.offer(), 1, 7, 3, buf, spans, manifest,
        timeout_s=30, sent=out.set,
      )  # fmt: skip
      assert out.wait(30), "the bytes went out before the write was done"
      written.set()
      assert fut.result(timeout=30) == len(data)
    got = local_read.read_step(os.path.join(kept, "step_7"))
    assert got.arrays[0][((0, len(data) // 4),)].tobytes() == data

    bad, _ = _step(str(tmp_path / "bad"), 3, 6 * MIB, 99, 8, crc_of=b"other bytes")
    with open(os.path.join(bad, local_format.MANIFEST), "rb") as f:
      bad_raw = f.read()
    with pytest.raises(PeerTransferError, match="checksum"):
      partner.send_snapshot(receiver.offer(), 1, 8, 3, buf, spans, lambda: bad_raw, timeout_s=30)

    def failed() -> bytes:
      raise OSError("No space left on device")

    with pytest.raises(PeerTransferError, match="No space left"):
      partner.send_snapshot(receiver.offer(), 1, 9, 3, buf, spans, failed, timeout_s=30)
  finally:
    receiver.close()
  assert sorted(n for n in os.listdir(kept) if not n.startswith(".tmp-spare-")) == ["step_7"]
