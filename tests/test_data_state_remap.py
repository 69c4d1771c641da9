"""Issue 16.3: data-iterator state on a new process count. A job of 2
processes (2 slices x 1) saves; a job of 4 processes (2 slices x 2) restores
from the persistent tier (the local copies belong to the old topology). With
restore(data_state_remap=...) each process gets what the hook computes from
every saved process's state; without it, None (as documented)."""

from __future__ import annotations

import os

from emergency_ckpt.demo.launcher import run_job


def test_a_new_process_count_gets_its_data_state_from_the_remap_hook(shm_dir):
  args = {
    "slices": 2,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "steps": [1, 2, 3, 4],
    "persistent_interval": 2,
  }
  run_job("tests.scenarios:save_steps", 2, args, timeout_s=240).check()
  results = run_job(
    "tests.remap_scenarios:restore_remapped",
    4,
    dict(args, local_root=os.path.join(shm_dir, "local-new")),
    timeout_s=240,
  ).check()
  saved_total = sum(4 * 1000 + p for p in range(2))  # scenarios.data_state: pos = step*1000 + pid
  for proc, r in enumerate(results):
    got = r["remapped"]
    assert (got["step"], got["source"], got["bad"]) == (4, "persistent", []), got
    assert got["data_state"] == {"pos": saved_total // 4 + proc, "of": 4, "saved_processes": 2}
    assert sorted(got["seen"]) == [0, 1], got  # every saved process's state, read once each
    assert r["plain"] == {"step": 4, "data_state": None}, r["plain"]
