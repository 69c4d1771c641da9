"""Retention, best_step, metadata and delete in multi-process jobs on a real
GCS protocol server (fake-gcs-server): what is left in the bucket is listed
straight from the server."""

from __future__ import annotations

from emergency_ckpt.demo.launcher import run_job
from tests.test_gcs import TIMEOUT_S, _objects


def test_retention_best_metadata_delete_on_gcs(gcs_server, gcs_bucket, shm_dir):
  args = {"slices": 2, "local_root": shm_dir, "persistent": f"{gcs_bucket}/run"}
  results = run_job("tests.retention_scenarios:retention_job", 4, args, timeout_s=TIMEOUT_S).check()
  first = results[0]
  for r in results[1:]:  # every process got the same answers
    assert {k: r[k] for k in ("all_steps", "best_step", "metadata_4")} == {
      k: first[k] for k in ("all_steps", "best_step", "metadata_4")
    }
  # Persistent: newest 2 (14, 16), every 6th (6, 12), best 2 by min loss (4, 8);
  # local (max_to_keep 2): 15, 16, plus possibly 13: local retention runs as
  # a write lands and keeps the newest step whose state is committed, and
  # slice 1 runs ahead of the primary's commits. Step 16 was then deleted.
  steps = first["all_steps"]
  assert set(steps) - {13} == {4, 6, 8, 12, 14, 15, 16}, steps
  assert first["best_step"] == 4
  md = first["metadata_4"]
  assert md["persistent"] and md["state_committed"] and md["restorable"]
  # Slice 0 dropped its local copy of 4; slice 1 may still hold one (see above).
  assert md["local_slices"] in ([], [1]) and (md["local_bytes"] > 0) == bool(md["local_slices"])
  assert md["metrics"] == {"loss": 0.25} and md["persistent_bytes"] > 0
  assert md["topology"]["process_count"] == 4
  md16 = first["metadata_16"]
  assert md16["local_slices"] == [0, 1] and md16["persistent"] and md16["local_bytes"] > 0
  # 13 (slice 1's lingering copy) may also be gone by now: each commit wakes
  # local retention on every process, so 16's commit can drop it meanwhile.
  after = first["after_delete_16"]
  assert set(after) <= set(steps) - {16} and set(steps) - set(after) <= {13, 16}, (steps, after)
  for r in results:
    assert r["restored"] == {"step": 15, "source": "local", "mismatches": [], "data_state_ok": True}
    # From persistent, or from slice 1's lingering local copy (peer for slice 0).
    slice_index = results.index(r) // 2
    if md["local_slices"]:
      source = "local" if slice_index == 1 else "peer"
    else:
      source = "persistent"
    assert r["restored_best"] == {
      "step": 4,
      "source": source,
      "mismatches": [],
      "data_state_ok": True,
    }

  names = _objects(gcs_server, gcs_bucket, "run/")
  tensor_steps = sorted({int(n.split("/")[2]) for n in names if n.startswith("run/tensors/")})
  assert tensor_steps == [4, 6, 8, 12, 14], tensor_steps
  for step in tensor_steps:
    assert f"run/tensors/{step}/commit_success.txt" in names
  state_steps = sorted({int(n.split("/")[2]) for n in names if n.startswith("run/state/")})
  assert 16 not in state_steps and set(tensor_steps) <= set(state_steps), state_steps


def test_delete_refuses_the_only_restorable_step_on_gcs(gcs_server, gcs_bucket, shm_dir):
  args = {"slices": 2, "local_root": shm_dir, "persistent": f"{gcs_bucket}/run"}
  results = run_job("tests.retention_scenarios:delete_only_step", 4, args, timeout_s=TIMEOUT_S)
  for r in results.check():
    assert "only restorable step" in r["refused"] and "force=True" in r["refused"]
    assert r["still"] == [2]
    assert r["after_force"] == []
  names = _objects(gcs_server, gcs_bucket, "run/")
  assert not [n for n in names if n.startswith(("run/tensors/2/", "run/state/2/"))], names
