"""Local retention and the commits of lagging steps settle each uncommitted step.

A step whose state file a process wrote may commit at any moment; local
retention must not delete it then (a restart would find the newest
committed step missing on that process and resume from an older one), and
a step retention deleted must not commit. Unit tests of the settlement
(retention/claims.py, the plan), then a real 2-process job whose primary's
commit of one step lags while training saves 12 more.
"""

from __future__ import annotations

import os

from emergency_ckpt.core import failpoints
from emergency_ckpt.demo.launcher import run_job
from emergency_ckpt.local import folders
from emergency_ckpt.retention import plans
from emergency_ckpt.retention.claims import CommitClaims
from emergency_ckpt.retention.rules import Rules


def test_claims_are_kept_until_settled_and_released_on_a_failed_write():
  claims = CommitClaims()
  assert claims.claim(3) and claims.claim(4)
  # retention planned to delete 3, 4 and 5; 3 and 4 were claimed meanwhile
  assert claims.drop([3, 4, 5]) == {3, 4}
  claims.release(4)  # its state write failed
  assert claims.claimed() == frozenset({3})
  # 5 was deleted before its state lane got to it: it must never commit
  assert not claims.claim(5)
  assert claims.claimed() == frozenset({3})
  assert claims.claim(6)
  claims.settle(3)  # 3 committed: below it nothing commits later
  assert claims.claimed() == frozenset({6})
  claims.settle(None)
  assert claims.claimed() == frozenset({6})
  claims.settle(5)  # the drops at or below a commit are forgotten too
  assert claims.claimed() == frozenset({6}) and claims.claim(5)


def test_the_local_plan_protects_claimed_steps_newer_than_the_newest_commit():
  rules = Rules(max_to_keep=1)
  steps = list(range(1, 13))
  plan = plans.local_plan(steps, rules, is_committed=lambda s: s <= 2, claimed={1, 3, 4})
  # max_to_keep + 1 uncommitted: the claimed ones first (the rule's newest 1 on top)
  assert plan.keep == frozenset({2, 3, 4, 12})
  assert "its state is written here" in plan.reasons[3]
  unclaimed = plans.local_plan(steps, rules, is_committed=lambda s: s <= 2)
  assert unclaimed.keep == frozenset({2, 11, 12})
  # a budget larger than what waits: every uncommitted step is kept
  roomy = plans.local_plan([1, 2, 3, 4], Rules(max_to_keep=0), is_committed=lambda s: s <= 1)
  assert roomy.keep == frozenset({1, 2, 3, 4})


def test_failpoint_sleep_is_parsed_and_waits():
  assert failpoints.parse("state.before_commit@3:sleep0.5") == {
    ("state.before_commit", 3): "sleep0.5"
  }
  try:
    failpoints.parse("state.before_commit@3:sleepy")
  except ValueError as e:
    assert "sleepN" in str(e)
  else:
    raise AssertionError("a malformed sleep was accepted")


def _lag_args(
  shm_dir: str, name: str, *, last: int, pace_s: float, commit_timeout_s: float, phase: str
) -> dict:
  """commit_lag_run's args: 1 slice, local max_to_keep 1, steps 1..last
  saved pace_s apart, no persistent step; its folders made under shm_dir."""
  root = os.path.join(shm_dir, name)
  os.makedirs(root, exist_ok=True)
  return {
    "slices": 1,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "persistent"),
    "persistent_interval": 1000,
    "local_keep": 1,
    "state_commit_timeout_s": commit_timeout_s,
    "collective_timeout_s": 20,
    "steps": list(range(1, last + 1)),
    "pace_s": pace_s,
    "phase": phase,
  }


def test_a_lagging_commit_never_commits_a_step_retention_deleted_meanwhile(module_shm_dir):
  """1 slice x 2 processes, local max_to_keep 1, a step saved every 0.3 s:
  the primary's commit of step 3 waits 8 s, and the primary dies right
  after it commits. Meanwhile each process claimed every step it wrote the
  state of (their COMMITs may come at any moment), so local retention
  kept them all, 3 included; the restart restores
  step 3 from the ramdisks. Before the claims, retention deleted 3 during
  the lag, it committed anyway, and the restart found its newest committed
  step on no ramdisk (the soak's "regressed" finding)."""
  args = _lag_args(
    module_shm_dir, "commit_lag", last=14, pace_s=0.3, commit_timeout_s=60, phase="save"
  )
  saved = run_job(
    "tests.fault_scenarios:commit_lag_run",
    2,
    args,
    env={0: {"EC_FAILPOINTS": "state.before_commit@3:sleep8,state.after_commit@3:kill"}},
    timeout_s=60,
  )
  assert saved.returncodes[0] != 0, "the primary's failpoint never fired"
  for p in (0, 1):
    held = folders.list_local_steps(
      os.path.join(args["local_root"], f"host_{p}", "test-run", f"process_{p}")
    )
    # committed 2, then every step whose state is written: their COMMITs may still come
    assert held == list(range(2, 15)), (p, held)
  restored = run_job(
    "tests.fault_scenarios:commit_lag_run", 2, dict(args, phase="restore"), timeout_s=120
  ).check()
  for r in restored:
    assert r["step"] == 3 and r["source"].startswith("local"), r
    assert not r["mismatches"] and r["data_state"] == r["expected_data_state"], r


def test_a_step_deleted_before_its_state_was_written_never_commits(module_shm_dir):
  """1 slice x 2 processes, local max_to_keep 1, a step saved every 0.1 s:
  process 1's state lane stalls 4 s at step 3 while it saves ~40 more steps,
  so its retention deletes steps 4.. before their state files are written.
  Those steps must not commit (process 1 vetoes them; the primary would die
  right after COMMIT of step 10, one of them); the lane then catches up and
  the newest steps commit; the restart restores the last step from the
  ramdisks. Before the drops were marked, process 1 wrote those steps' state
  files late, they committed, and a job stopped then restored an older step
  (the soak's other "regressed" finding)."""
  last = 60
  args = _lag_args(
    module_shm_dir, "state_lag", last=last, pace_s=0.1, commit_timeout_s=30, phase="save_close"
  )
  saved = run_job(
    "tests.fault_scenarios:commit_lag_run",
    2,
    args,
    env={
      0: {"EC_FAILPOINTS": "state.after_commit@10:kill"},
      1: {"EC_FAILPOINTS": "state.before_write@3:sleep4"},
    },
    timeout_s=120,
  )
  assert saved.returncodes == [0, 0], (saved.returncodes, saved.errors, saved.logs[1][-2000:])
  assert "local retention deleted it before its state file was written" in saved.logs[1]
  restored = run_job(
    "tests.fault_scenarios:commit_lag_run", 2, dict(args, phase="restore"), timeout_s=120
  ).check()
  for r in restored:
    assert r["step"] == last and r["source"].startswith("local"), r
    assert not r["mismatches"] and r["data_state"] == r["expected_data_state"], r


def _lacking_copy_job(shm_dir: str, name: str, last: int, process_1_failpoints: str) -> list:
  """lacking_copy_run on 1 slice x 2 processes: local max_to_keep 1,
  persistent every 4th step, steps 1..last 0.1 s apart; process 1's state
  lane stalls 1.5 s at step 3 (its retention deletes step 4 before that
  step's state file is written: a persistent step commits anyway, the
  persistent tier holding it) and both processes hold step 4's upload 4 s."""
  root = os.path.join(shm_dir, name)
  args = {
    "slices": 1,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "persistent"),
    "persistent_interval": 4,
    "persistent_when_busy": "skip",
    "local_keep": 1,
    "state_commit_timeout_s": 6,
    "collective_timeout_s": 20,
    "steps": last,
    "step_s": 0.1,
    "settle_s": 1.5,
  }
  held = "persistent.before_save@4:sleep4"
  job = run_job(
    "tests.fault_scenarios:lacking_copy_run",
    2,
    args,
    env={0: {"EC_FAILPOINTS": held}, 1: {"EC_FAILPOINTS": f"{held},{process_1_failpoints}"}},
    timeout_s=120,
  )
  assert job.returncodes == [0, 0], (job.returncodes, job.errors, job.logs[1][-3000:])
  return job.results


def test_a_persistent_step_a_process_lacks_commits_only_once_uploaded(module_shm_dir):
  """The soak's third "regressed" finding: process 1's retention deleted its
  copy of persistent step 4 before its state file was written; the step
  committed at once (the persistent tier would hold it), the job died before
  the upload was finalized, and the restart found step 4 committed, held
  whole nowhere, and resumed from an older step. Now its COMMIT waits for
  the upload: while the upload is held, step 4 is not committed."""
  recs = _lacking_copy_job(module_shm_dir, "lacking", 8, "state.before_write@3:sleep1.5")
  held = {r["process"]: r["samples"][0] for r in recs}
  assert held[1]["held"] is False, held  # the precondition: process 1 lacks step 4
  assert held[0]["finalized"] is False, held  # ... and the upload is still held
  assert held[0]["committed"] is False, held  # the fix: no COMMIT without a whole copy
  primary = next(r for r in recs if r["process"] == 0)
  after = primary["samples"][1]  # once finalized, it commits (newer steps committed first)
  assert after["finalized"] and after["committed"], primary["samples"]
  for r in recs:
    r_ = r["restored"]
    assert r_["step"] == max(r["all_steps"]) > 4, (r_, r["all_steps"])
    assert not r_["mismatches"] and r_["data_state"] == r_["expected_data_state"], r_


def test_the_deferred_commit_lands_once_the_upload_is_finalized(module_shm_dir):
  """As above, with steps 1..6 and process 1's state write of step 6 failing
  (step 6 never commits, 5 was vetoed): once step 4's upload is finalized
  its COMMIT lands, and a fresh job restores step 4 bit-exact."""
  recs = _lacking_copy_job(
    module_shm_dir, "deferred", 6, "state.before_write@3:sleep1.5,state.before_write@6:raise"
  )
  by = {r["process"]: r for r in recs}
  assert by[1]["samples"][0]["held"] is False, by[1]["samples"]
  assert by[0]["samples"][0]["committed"] is False, by[0]["samples"]
  after = by[0]["samples"][1]
  assert after["finalized"] and after["committed"], by[0]["samples"]
  assert "wait_error" in by[1], by[1]  # its failed state write of step 6, raised
  for r in recs:
    assert 4 in r["all_steps"] and 6 not in r["all_steps"], r["all_steps"]
    r_ = r["restored"]
    assert r_["step"] == 4, r_
    assert not r_["mismatches"] and r_["data_state"] == r_["expected_data_state"], r_


def test_a_failed_state_write_gives_its_step_up_at_once(module_shm_dir):
  """Process 1's state write of step 3 fails (its bucket or disk): the step
  can never commit. The primary once waited state_commit_timeout_s (600 s
  here, the default) for its file, holding every later COMMIT, and the job
  (timeout 120 s) timed out; now the failing process vetoes the step, the
  primary gives it up at once, steps 4 and 5 commit and restore."""
  root = os.path.join(module_shm_dir, "state-write")
  args = {
    "slices": 1,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "persistent"),
    "persistent_interval": 1000,
    "state_commit_timeout_s": 600,
    "steps": [1, 2, 3, 4, 5],
  }
  job = run_job(
    "tests.fault_scenarios:state_write_fails_run",
    2,
    args,
    env={1: {"EC_FAILPOINTS": "state.before_write@3:raise"}},
    timeout_s=120,
  )
  assert job.returncodes == [0, 0], (job.returncodes, job.errors, job.logs[0][-3000:])
  by = {r["process"]: r for r in job.results}
  assert "failpoint state.before_write@3" in by[1]["errors"].get("3", ""), by[1]["errors"]
  for r in job.results:
    assert r["all_steps"][-2:] == [4, 5] and 3 not in r["all_steps"], r["all_steps"]
    r_ = r["restored"]
    assert r_["step"] == 5 and not r_["mismatches"], r_
    assert r_["data_state"] == r_["expected_data_state"], r_
  assert "vetoed" in job.logs[0], job.logs[0][-3000:]
