"""The benchmark's measuring helpers: RSS, the one- and N-thread raw copies,
and the peer restore's socket transfer (forked senders on loopback)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

from emergency_ckpt.bench import measure, peer


def test_peak_rss_catches_a_transient_peak_without_a_sampling_thread():
  """64 MiB touched and freed inside the window shows in the peak, though
  RSS is back down when the window closes."""
  before = measure.rss_bytes()
  peak = measure.PeakRss().start()
  block = np.ones(64 << 20, np.uint8)  # touched: resident
  del block
  after = measure.rss_bytes()
  got = peak.stop()
  assert after < before + (32 << 20), "the block should be gone again"
  assert got >= before + (60 << 20), (got, before)
  if peak.method == "VmHWM":
    assert peak._thread is None  # nothing ran during the window


def _parts() -> list[np.ndarray]:
  """Parts of odd sizes and dtypes, so thread ranges cut through them."""
  rng = np.random.default_rng(7)
  return [
    rng.random(100_003, dtype=np.float32),
    rng.integers(0, 255, 12_345, dtype=np.uint8),
    rng.random((300, 7)),
  ]


def test_split_covers_the_bytes_in_page_multiple_ranges():
  page = 4096
  got = measure.split(10 * page + 5, 3)
  assert got == [(0, 4 * page), (4 * page, 8 * page), (8 * page, 10 * page + 5)]
  assert measure.split(10, 8) == [(0, 10)]  # never an empty range
  assert measure.split(0, 4) == []


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_threaded_copies_move_the_same_bytes_as_one_thread(tmp_path, threads):
  parts = _parts()
  want = np.concatenate([p.reshape(-1).view(np.uint8) for p in parts])
  dst = np.zeros(want.nbytes, np.uint8)
  measure.memcpy(dst, parts, threads)
  assert np.array_equal(dst, want)
  path = str(tmp_path / "raw.bin")
  measure.write_file(path, parts, threads)
  assert (tmp_path / "raw.bin").read_bytes() == want.tobytes()
  back = np.zeros(want.nbytes, np.uint8)
  assert measure.read_file(path, back, threads) == want.nbytes
  assert np.array_equal(back, want)
  # a range only: the rest of the buffer is left alone
  back[:] = 0
  assert measure.read_file(path, back, threads, 5_000, 300_001) == 295_001
  assert np.array_equal(back[5_000:300_001], want[5_000:300_001])
  assert not back[:5_000].any() and not back[300_001:].any()


def test_threaded_copies_run_on_several_threads():
  """The N-thread copy really runs its ranges on N pool threads at once."""
  seen: set[str] = set()
  gate = threading.Barrier(3)

  def copy(a, b):
    seen.add(threading.current_thread().name)
    gate.wait(timeout=10)  # fails unless 3 ranges run at the same time
    return b - a

  assert measure._each(copy, measure.split(3 * 4096, 3), 3) == 3 * 4096
  assert len(seen) == 3 and all(n.startswith("bench-bound") for n in seen)
  assert measure.bound_threads() == min(os.cpu_count() or 1, 8)


def test_peer_plan_pairs_the_lost_slice_with_the_same_position_in_each_intact_one():
  # 2x2: slices [0, 1] and [2, 3]; slice 1 lost: 2 <- 0, 3 <- 1, all bytes
  assert peer.plan([[0, 1], [2, 3]], 1, 1 << 20) == {2: [(0, 0, 1 << 20)], 3: [(1, 0, 1 << 20)]}
  # 4x1: slice 3 lost: a contiguous share from each of the three others
  got = peer.plan([[0], [1], [2], [3]], 3, 3 << 20)
  assert got == {3: [(0, 0, 1 << 20), (1, 1 << 20, 2 << 20), (2, 2 << 20, 3 << 20)]}
  assert peer.sends_of(got, 1) == [(3, 1 << 20, 2 << 20)]
  assert peer.sends_of(got, 3) == []
  assert peer.substreams(100, 100 + 3 * 4096, 2) == [(100, 100 + 8192), (100 + 8192, 100 + 12288)]
  with pytest.raises(ValueError):
    peer.plan([[0]], 0, 10)


def _file_rendezvous(root):
  def publish(key, value):
    tmp = os.path.join(root, f".{key}.tmp")
    with open(tmp, "w") as f:
      f.write(value)
    os.replace(tmp, os.path.join(root, key))

  def lookup(key):
    path = os.path.join(root, key)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
      assert time.monotonic() < deadline, f"nobody published {key}"
      time.sleep(0.01)
    with open(path) as f:
      return f.read()

  return publish, lookup


def _data(nbytes: int) -> np.ndarray:
  return np.random.default_rng(11).integers(0, 255, nbytes, dtype=np.uint8)


def _sender(p, me, streams, nbytes, root, results):
  publish, lookup = _file_rendezvous(root)
  buf = _data(nbytes)
  got = peer.timed_transfer(p, me, streams, buf, np.zeros(nbytes, np.uint8), publish, lookup)
  results.put((me, got))


@pytest.mark.parametrize(
  "slices,streams", [([[0], [1]], 1), ([[0], [1]], 3), ([[0], [1], [2], [3]], 2)]
)
def test_socket_transfer_between_processes_delivers_every_byte(tmp_path, slices, streams):
  """Senders in forked processes, the receiver here: the bytes arrive
  intact, over `streams` connections per pair, and only the receiver
  reports a time."""
  nbytes = (5 << 20) + 123
  lost = len(slices) - 1
  receiver = slices[lost][0]
  p = peer.plan(slices, lost, nbytes)
  ctx = multiprocessing.get_context("fork")
  results = ctx.Queue()
  senders = [
    ctx.Process(target=_sender, args=(p, s[0], streams, nbytes, str(tmp_path), results))
    for s in slices[:lost]
  ]
  for proc in senders:
    proc.start()
  try:
    publish, lookup = _file_rendezvous(str(tmp_path))
    into = np.zeros(nbytes, np.uint8)
    got = peer.timed_transfer(p, receiver, streams, np.zeros(0, np.uint8), into, publish, lookup)
    assert got is not None and got > 0
    assert np.array_equal(into, _data(nbytes))
    assert sorted(results.get(timeout=60) for _ in senders) == [(s[0], None) for s in slices[:lost]]
  finally:
    for proc in senders:
      proc.join(timeout=60)
      if proc.is_alive():
        proc.kill()
  assert all(proc.exitcode == 0 for proc in senders)


def test_bench_peer_integrity_flag():
  """`--peer-integrity` picks emergency_ckpt's peer.integrity (default mac)."""
  from emergency_ckpt.bench import run  # noqa: PLC0415

  assert run.parse_args([]).peer_integrity == "mac"
  assert run.parse_args(["--peer-integrity", "crc"]).peer_integrity == "crc"
  with pytest.raises(SystemExit):
    run.parse_args(["--peer-integrity", "none"])
