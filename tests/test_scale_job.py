"""Issue 15: a real jax.distributed job of 32 processes (1 CPU device each,
8 slices x 4 processes) saves, loses two slices' ramdisks, and restores them
from peer slices bit-exactly; and the real-job scale benchmark
(benchmarks/scale_real.py) runs at a tiny size.

Nothing here is timed: the benchmark's figures are only checked for shape.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.scale_real import measure_real_jobs
from emergency_ckpt.demo.launcher import run_job

SLICES = 8
PER_SLICE = 4
PROCESSES = SLICES * PER_SLICE
WIPED = [0, 5]  # the primary slice and another one: new hosts, empty ramdisks
STEPS = [1, 2, 3]
TIMEOUT_S = 300


def test_32_processes_lose_two_slices_restore_from_peers(shm_dir, tmp_path):
  args = {
    "slices": SLICES,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": str(tmp_path / "persistent"),
    "steps": STEPS,
    "persistent_interval": 2,
    "collective_timeout_s": 120,
    "state_commit_timeout_s": 60,
  }
  saved = run_job(
    "tests.scale_scenarios:save_job",
    PROCESSES,
    args,
    devices_per_process=1,
    timeout_s=TIMEOUT_S,
  ).check()
  assert [r["saved"] for r in saved] == [STEPS] * PROCESSES
  # Every step's hints and exchanges are deleted once used: the keys left in
  # the coordination service do not grow with the steps saved.
  keys = saved[0]["service_keys"]
  assert keys[-1] <= keys[1] < 2 * PROCESSES, keys
  slice_of = [r["slice"] for r in saved]
  assert sorted(slice_of) == [s for s in range(SLICES) for _ in range(PER_SLICE)]
  assert sorted(os.listdir(os.path.join(args["persistent"], "tensors"))) == ["2"]

  restored = run_job(
    "tests.scale_scenarios:restart_job",
    PROCESSES,
    {**args, "wipe_slices": WIPED},
    devices_per_process=1,
    timeout_s=TIMEOUT_S,
  ).check()
  last = STEPS[-1]
  for process, rec in enumerate(restored):
    where = f"process {process} (slice {rec['slice']})"
    assert rec["slice"] == slice_of[process], where
    assert rec["latest"] == last, where
    assert rec["step"] == last, where
    assert rec["source"] == ("peer" if rec["slice"] in WIPED else "local"), where
    assert rec["shards"] == 5, where  # one shard of each of the 5 leaves: all compared
    assert rec["mismatches"] == [], where
    assert rec["data_state"] == rec["expected_data_state"], where
    assert rec["data_state"]["pos"] == last * 1000 + process, where
  assert {r["source"] for r in restored} == {"peer", "local"}


def test_real_job_benchmark_smoke(shm_dir, tmp_path):
  """measure_real_jobs at 2 and 4 processes (2 slices each), a few KiB."""
  out = measure_real_jobs(
    (2, 4),
    total_mib=1 / 16,
    slices_of={2: 2, 4: 2},
    wipe_slices=1,
    root=str(tmp_path),
    shm_root=shm_dir,
    latest_reps=1,
    job_reps=2,
  )
  for n in ("2", "4"):
    fig = out[n]
    assert fig["processes"] == int(n) and fig["slices"] == 2
    assert fig["restored_step"] == 1
    assert fig["sources"] == {"local": int(n) // 2, "peer": int(n) // 2}
    for key in ("manager_init_s", "latest_step_s", "latest_step_again_s", "restore_s"):
      assert fig[key]["max"] >= fig[key]["median"] > 0
    for key in ("latest_step_cpu_s", "restore_cpu_s"):
      assert fig[key]["max"] >= fig[key]["median"] > 0
    assert fig["reps"] == 2 and len(fig["restore_s"]["reps_max"]) == 2
    # the figure is the median over the runs (of two: their mean)
    assert fig["restore_s"]["max"] == pytest.approx(sum(fig["restore_s"]["reps_max"]) / 2)
  ratio = out["ratio_4_2"]
  assert set(ratio) >= {"latest_step_s", "restore_s", "restore_cpu_s"}
  each = ratio["restore_s"]["reps"]  # the per-run ratios, and their median
  assert len(each) == 2 and ratio["restore_s"]["max"] == pytest.approx(sum(each) / 2)
  assert each == pytest.approx(
    [a / b for a, b in zip(out["4"]["restore_s"]["reps_max"], out["2"]["restore_s"]["reps_max"])]
  )
  from benchmarks.scale_report import _real_jobs  # noqa: PLC0415

  text = _real_jobs(out)
  assert any(line.startswith("CPU per process") for line in text)
  assert any(line.startswith("4 over 2, max over processes, each run: ") for line in text)
