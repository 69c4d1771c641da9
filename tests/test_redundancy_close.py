"""A clean close() keeps this process's redundancy receiver open until the
processes of its slice are done sending, so the job's last step commits
even when one process closes well before its sender has sent it.

Real 1-slice x 4-process jax.distributed jobs (each process a machine of
its own), real files on /dev/shm. Process 0 lags: its state write of step 4
sleeps 3 s (a failpoint), so its save of step 5 starts after the other
processes have already closed their managers.
"""

from __future__ import annotations

import os

import pytest

from emergency_ckpt.demo.launcher import run_job
from tests import restart_helpers as rh


@pytest.mark.parametrize("redundancy", ["partner", "xor"])
def test_the_last_step_commits_when_its_receiver_closes_first(shm_dir, redundancy, fault_matrix):
  args = {
    "slices": 1,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "steps": [1, 2, 3, 4, 5],
    "persistent_interval": 3,
    "local_keep": 3,
    "redundancy": redundancy,
    "sim_hosts": True,
    "wait_each": True,
  }
  saved = run_job(
    "tests.scenarios:save_steps",
    4,
    args,
    timeout_s=240,
    env={0: {"EC_FAILPOINTS": "state.before_write@4:sleep3"}},
  ).check()
  assert all(r["saved"] == [1, 2, 3, 4, 5] for r in saved), saved
  state = os.path.join(args["persistent"], "state")
  committed = sorted(int(s) for s in os.listdir(state) if os.path.exists(f"{state}/{s}/COMMIT"))
  observed = f"committed steps {committed}"
  if redundancy == "partner":  # process 0's copy of step 5 reached its partner, process 1
    folder = os.path.join(rh.process_dir(args, 1), "partner", "process_0")
    held = sorted(n for n in os.listdir(folder) if n.startswith("step_"))
    observed += f"; process 0's copies on its partner: {held}"
  fault_matrix.check(
    f"redundancy.{redundancy}_close_lagging",
    observed,
    committed[-1:] == [5] and (redundancy != "partner" or "step_5" in held),
  )
