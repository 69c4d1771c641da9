"""Multi-process jobs against a real GCS protocol server (fake-gcs-server).

The persistent directory is gs://<fresh bucket>/run; the `gcs_server` fixture
puts STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL in os.environ, which
the job's processes inherit.
"""

from __future__ import annotations

from emergency_ckpt.demo.launcher import run_job
from tests.harness.gcs_server import list_objects

TIMEOUT_S = 240


def _objects(server, bucket_url: str, prefix: str) -> list[str]:
  """Object names under `prefix`, listed straight from the server."""
  return sorted(list_objects(server, bucket_url, prefix))


def test_save_and_restore_on_gcs(gcs_server, gcs_bucket, shm_dir):
  args = {
    "slices": 2,
    "local_root": shm_dir,
    "persistent": f"{gcs_bucket}/run",
    "steps": [1, 2, 3, 4],
    "persistent_keep": 1,  # Orbax deletes step 2 on GCS once step 4 is saved
  }
  saved = run_job("tests.scenarios:save_steps", 4, args, timeout_s=TIMEOUT_S).check()
  assert [r["saved"] for r in saved] == [[1, 2, 3, 4]] * 4
  assert [r["slice"] for r in saved] == [0, 0, 1, 1]

  # What landed in the bucket: run.json, every process's JSON and a COMMIT
  # per step (a COMMIT needs a fresh listing of the other processes' files),
  # and Orbax's newest persistent step (interval 2, keep 1), finalized.
  names = _objects(gcs_server, gcs_bucket, "run/")
  assert "run/run.json" in names
  for step in (1, 2, 3, 4):
    for p in range(4):
      assert f"run/state/{step}/process_{p}-of-4.json" in names, names
    assert f"run/state/{step}/COMMIT" in names, names
  tensor_steps = {n.split("/")[2] for n in names if n.startswith("run/tensors/")}
  assert tensor_steps == {"4"}, sorted(tensor_steps)
  assert "run/tensors/4/commit_success.txt" in names, names
  assert any(n.startswith("run/tensors/4/default/") for n in names), names
  assert not any(".tmp" in n for n in names), names

  args["variants"] = [
    {"name": "all_wiped", "wipe_slices": [0, 1]},
    {"name": "intact"},
  ]
  out = run_job("tests.scenarios:restore_variants", 4, args, timeout_s=TIMEOUT_S).check()
  assert len(out) == 4
  for proc, records in enumerate(out):
    by_name = {r["name"]: r for r in records}
    assert set(by_name) == {"all_wiped", "intact"}, records
    for name, source in (("all_wiped", "persistent"), ("intact", "local")):
      r = by_name[name]
      assert "error" not in r, (proc, r)
      assert r["step"] == 4, (proc, r)
      assert r["latest"] == 4, (proc, r)
      assert 4 in r.get("all_steps", [4]), (proc, r)
      assert r["source"] == source, (proc, r)
      assert r["mismatches"] == [], (proc, r)
      assert r["data_state"] == r["expected_data_state"], (proc, r)


def test_missing_bucket_fails_fast(gcs_server, shm_dir):
  bucket = "no-such-bucket-xyz"
  args = {
    "slices": 1,
    "local_root": shm_dir,
    "persistent": f"gs://{bucket}/run",
    "steps": [1, 2],
  }
  job = run_job("tests.scenarios:save_steps", 1, args, devices_per_process=2, timeout_s=120)
  assert not job.timed_out, f"hung for {job.wall_s:.0f}s:\n{job.logs[0][-4000:]}"
  assert job.returncodes == [1], job.logs[0][-4000:]
  error = job.errors[0] or ""
  assert "StorageError" in error, error
  assert bucket in error, error
  assert job.wall_s < 60, f"took {job.wall_s:.0f}s to fail"
