"""Issue 17.2: a persistent step is read from the bucket once per job, not
once per slice. 2 slices x 2 processes, every ramdisk lost, the persistent
tier on a real GCS protocol server (fake-gcs-server) behind two counting
proxies, one per slice: with persistent.shared_read each slice reads about
half of the shards (shared_read_slices 2, the split) or slice 0 reads them
all (the measured rule at this size: one reader) and the other slice gets
the rest over the stream transport (checksums checked on arrival); without
it every process reads all its own shards. Bytes each slice read through
its proxy (responses, headers included) are counted per restore; every
restore is bit-exact, and a shard damaged on the wire makes every process
read its own shards instead, in both modes. Pure tests of the reader plan
(routing.plan_split) and the rule (routing.reader_slices) first."""

from __future__ import annotations

import os

import pytest

from emergency_ckpt.demo.launcher import run_job
from emergency_ckpt.transport import routing
from tests.test_peer_stream import _layout, _mesh

MODEL = 6 * 256 * 512 * 3  # BIG_SPECS: three float32 and three bfloat16 leaves


def _order(layout):
  return [(n, s.index) for n, leaf in enumerate(layout.leaves) for s in leaf.slots]


def test_one_reader_slice_reads_everything_and_serves_every_other_slice():
  mesh = _mesh(4, 2, 1)  # 4 slices x 2 processes x 1 device
  layouts = [_layout(mesh, s, 3) for s in range(4)]  # 6 slots of 64 bytes each
  plans = [routing.plan_split(layouts[s], mesh, 0, 4, s, readers=1) for s in range(4)]
  mine0, pulls0 = plans[0]
  assert sorted(mine0) == sorted(_order(layouts[0])) and pulls0 == {}
  for s in (1, 2, 3):
    mine, pulls = plans[s]
    assert mine == set()
    assert sorted(pulls) == [0, 1]  # slice 0's processes, at the same coordinates
    got = sorted((n, slot.index) for p in pulls.values() for n, slot in p)
    assert got == sorted(_order(layouts[s]))


def test_two_reader_slices_of_four_cut_two_runs():
  mesh = _mesh(4, 1, 1)  # 4 slices x 1 process
  layouts = [_layout(mesh, s, 4) for s in range(4)]  # 4 slots per slice
  plans = [routing.plan_split(layouts[s], mesh, 0, 4, s, readers=2) for s in range(4)]
  order = _order(layouts[0])
  assert sorted(plans[0][0]) == sorted(order[:2]) and sorted(plans[1][0]) == sorted(order[2:])
  assert plans[2][0] == plans[3][0] == set()
  for s in (2, 3):
    pulls = plans[s][1]
    assert [(n, x.index) for n, x in pulls[0]] == order[:2]
    assert [(n, x.index) for n, x in pulls[1]] == order[2:]
  # readers=None is every slice: today's split
  assert routing.plan_split(layouts[3], mesh, 0, 4, 3) == routing.plan_split(
    layouts[3], mesh, 0, 4, 3, readers=4
  )
  with pytest.raises(ValueError, match="readers"):
    routing.plan_split(layouts[0], mesh, 0, 4, 0, readers=5)


def test_reader_slices_rule():
  mib = 1 << 20
  assert routing.reader_slices(4, 1 << 40, 1) == 1  # configured wins
  assert routing.reader_slices(2, 1, 8) == 2  # capped at the slice count
  # the measured rule: one reader below 2 x 256 MiB, then a reader per 256 MiB
  assert routing.reader_slices(2, 4 * mib) == 1
  assert routing.reader_slices(2, 511 * mib) == 1
  assert routing.reader_slices(2, 512 * mib) == 2
  assert routing.reader_slices(4, 768 * mib) == 3
  assert routing.reader_slices(4, 1 << 40) == 4
  assert routing.reader_slices(64, 1 << 30) == 4
  assert routing.reader_slices(64, 0) == 1


def _restore(
  args, proxies, shared: bool, env=None, readers: int | None = None
) -> tuple[list[dict], list[int], list[str]]:
  """One restore job; `proxies`: slice 0's (processes 0-1) and slice 1's
  (processes 2-3), in front of the same server: the bytes each slice read."""
  before = [p.stats()["bytes_down"] for p in proxies]
  job = run_job(
    "tests.verify_scenarios:restore_once",
    4,
    dict(args, shared_read=shared, shared_read_slices=readers),
    env={i: dict(proxies[i // 2].env, **(env or {}).get(i, {})) for i in range(4)},
    timeout_s=240,
  )
  results = job.check()
  return results, [p.stats()["bytes_down"] - b for p, b in zip(proxies, before)], job.logs


def _bit_exact(results) -> None:
  for r in results:
    assert (r["step"], r["source"], r["bad"], r["data_state_ok"]) == (
      2,
      "persistent",
      [],
      True,
    ), r


def test_every_slice_reading_persistent_reads_the_model_once(
  gcs_server, gcs_proxy, gcs_bucket, shm_dir, fault_matrix
):
  from tests.harness.gcs_proxy import GcsProxy  # noqa: PLC0415

  args = {
    "slices": 2,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": f"{gcs_bucket}/run",
    "steps": [1, 2],
    "persistent_interval": 2,
    "specs": "big",
  }
  run_job(
    "tests.verify_scenarios:save", 4, args, env={i: gcs_proxy.env for i in range(4)}, timeout_s=240
  ).check()
  with GcsProxy(gcs_server.url) as second:
    proxies = (gcs_proxy, second)
    split, split_bytes, _ = _restore(args, proxies, True, readers=2)
    each, each_bytes, _ = _restore(args, proxies, False)
    # The measured rule at 2.36 MB on 2 slices: slice 0 reads every shard.
    assert routing.reader_slices(2, MODEL) == 1
    one, one_bytes, one_logs = _restore(args, proxies, True)
    # A bit flipped on the wire by process 0: its receivers' arrival check
    # fails, and every process reads all its own shards from the bucket.
    wire = {0: {"EC_FAILPOINTS": "peer.corrupt_send@2"}}
    fallback, fallback_bytes, logs = _restore(args, proxies, True, wire, readers=2)
    one_fallback, one_fallback_bytes, one_fb_logs = _restore(args, proxies, True, wire)
  print(f"bytes per slice: split {split_bytes}, per process {each_bytes}, one reader {one_bytes},")
  print(f"  fallbacks {fallback_bytes} (split), {one_fallback_bytes} (one reader); model {MODEL}")
  fell_back = any("shared read of persistent step 2 failed" in log for log in logs)
  fault_matrix.check(
    "persistent.shared_read_wire",
    f"fell back: {fell_back}; results: {[(r['step'], r['source'], r['bad']) for r in fallback]};"
    f" {sum(fallback_bytes)} bytes read (model {MODEL})",
    fell_back and all((r["step"], r["bad"]) == (2, []) for r in fallback),
  )
  for got in (logs, one_fb_logs):
    assert "fails its checksum on arrival" in "".join(got)
    assert any("shared read of persistent step 2 failed" in log for log in got)
  assert not any("shared read of persistent step 2 failed" in log for log in one_logs)
  for results in (split, each, one, fallback, one_fallback):
    _bit_exact(results)
  # Per process, every slice reads the whole model: 2x, each slice 1x.
  assert min(each_bytes) >= MODEL, (each_bytes, MODEL)
  overhead = max(each_bytes) - MODEL  # metadata, state files, listings: per slice
  for fb in (fallback_bytes, one_fallback_bytes):  # the failed attempt, then 1x per slice
    assert min(fb) >= MODEL, (fb, MODEL)
  # Split: each slice about half; once in all.
  assert sum(split_bytes) <= MODEL + 2 * overhead + MODEL // 10, (split_bytes, each_bytes)
  assert all(b >= MODEL // 3 for b in split_bytes), split_bytes
  # One reader: slice 0 reads the model once, slice 1 no tensor bytes at all.
  assert one_bytes[0] <= MODEL + overhead + MODEL // 20, (one_bytes, each_bytes)
  assert one_bytes[1] <= overhead, (one_bytes, each_bytes)
  assert sum(one_bytes) <= MODEL + 2 * overhead, (one_bytes, each_bytes)
