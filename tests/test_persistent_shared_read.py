"""Issue 17.2: a persistent step is read from the bucket once per job, not
once per slice. 2 slices x 2 processes, every ramdisk lost, the persistent
tier on a real GCS protocol server (fake-gcs-server) behind the counting
proxy: with persistent.shared_read each slice reads about half of the
shards and gets the rest from the other slice (checksums checked on
arrival); without it every process reads all its own shards. Bytes the
processes read through the proxy (responses, headers included) are counted
per restore; every restore is bit-exact, and a shard damaged on the wire
makes every process read its own shards instead."""

from __future__ import annotations

import os

from emergency_ckpt.testing.launcher import run_job

MODEL = 6 * 256 * 512 * 3  # BIG_SPECS: three float32 and three bfloat16 leaves


def _restore(args, proxy, shared: bool, env=None) -> tuple[list[dict], int, list[str]]:
  before = proxy.stats()["bytes_down"]
  job = run_job(
    "tests.verify_scenarios:restore_once",
    4,
    dict(args, shared_read=shared),
    env={i: dict(proxy.env, **(env or {}).get(i, {})) for i in range(4)},
    timeout_s=240,
  )
  results = job.check()
  return results, proxy.stats()["bytes_down"] - before, job.logs


def test_every_slice_reading_persistent_reads_the_model_once(
  gcs_proxy, gcs_bucket, shm_dir, fault_matrix
):
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
  shared, shared_bytes, _ = _restore(args, gcs_proxy, True)
  each, each_bytes, _ = _restore(args, gcs_proxy, False)
  # A bit flipped on the wire by process 0: its receivers' arrival check
  # fails, and every process reads all its own shards from the bucket.
  wire = {0: {"EC_FAILPOINTS": "peer.corrupt_send@2"}}
  fallback, fallback_bytes, logs = _restore(args, gcs_proxy, True, wire)
  fell_back = any("shared read of persistent step 2 failed" in log for log in logs)
  fault_matrix.check(
    "persistent.shared_read_wire",
    f"fell back: {fell_back}; results: {[(r['step'], r['source'], r['bad']) for r in fallback]};"
    f" {fallback_bytes} bytes read (model {MODEL})",
    fell_back and all((r["step"], r["bad"]) == (2, []) for r in fallback),
  )
  assert "fails its checksum on arrival" in "".join(logs)
  assert fallback_bytes >= 2 * MODEL, fallback_bytes
  for results in (shared, each, fallback):
    for r in results:
      assert (r["step"], r["source"], r["bad"], r["data_state_ok"]) == (
        2,
        "persistent",
        [],
        True,
      ), r
  # Per process, every slice reads the whole model: 2x. Shared: once, plus
  # what each process reads anyway (metadata, state files, listings).
  assert each_bytes >= 2 * MODEL, (each_bytes, MODEL)
  overhead = each_bytes - 2 * MODEL
  assert shared_bytes <= MODEL + overhead + MODEL // 10, (shared_bytes, each_bytes, MODEL)
