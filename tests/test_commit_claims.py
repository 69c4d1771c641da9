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
import threading

from emergency_ckpt.core import failpoints
from emergency_ckpt.demo.launcher import run_job
from emergency_ckpt.local import folders
from emergency_ckpt.retention import plans
from emergency_ckpt.retention.claims import CommitClaims
from emergency_ckpt.retention.rules import Rules


def test_a_claimed_step_is_kept_and_a_dropped_step_is_vetoed():
  claims = CommitClaims()
  assert claims.claim(3) is None
  # retention would delete 3 and 4: 3 is claimed (kept), 4 is marked dropped
  assert claims.drop([3, 4], newest_committed=2) == {3}
  refused = claims.claim(4)
  assert refused is not None and "deleted its copy" in refused
  # a committed step below the newest committed is no drop to remember
  claims.drop([1], newest_committed=2)
  assert claims.claim(5) is None
  claims.release(5)  # its state write failed
  assert claims.claimed() == frozenset({3})


def test_settle_forgets_claims_and_drops_at_or_below_the_newest_commit():
  claims = CommitClaims()
  for s in (3, 4, 5):
    assert claims.claim(s) is None
  claims.drop([6], newest_committed=2)
  claims.settle(4)
  assert claims.claimed() == frozenset({5})
  assert "deleted" in claims.claim(6)
  claims.settle(6)
  assert claims.claim(7) is None


def _race_once(claims: CommitClaims) -> dict:
  results: dict[str, object] = {}
  go = threading.Barrier(2)

  def claim():
    go.wait()
    results["claim"] = claims.claim(7)

  def drop():
    go.wait()
    results["kept"] = claims.drop([7], newest_committed=None)

  threads = [threading.Thread(target=claim), threading.Thread(target=drop)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return results


def test_claim_and_drop_race_never_both_win():
  """Many threads: every step ends either claimed (and not dropped) or
  dropped (and its claim refused), never both."""
  for _ in range(200):
    results = _race_once(CommitClaims())
    claimed = results["claim"] is None
    kept = results["kept"] == {7}
    assert claimed == kept, results


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


def test_a_lagging_commit_never_commits_a_step_retention_deleted(module_shm_dir):
  """1 slice x 2 processes, local max_to_keep 1, a step saved every 0.3 s:
  the primary's commit of step 3 waits 8 s, and the primary dies right
  after it commits. Meanwhile each process claimed every step it wrote the
  state of (their COMMITs may come at any moment), so local retention
  kept them all, 3 included; the restart restores
  step 3 from the ramdisks. Before the claims, retention deleted 3 during
  the lag, it committed anyway, and the restart found its newest committed
  step on no ramdisk (the soak's "regressed" finding)."""
  root = os.path.join(module_shm_dir, "commit_lag")
  args = {
    "slices": 1,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "persistent"),
    "persistent_interval": 1000,
    "local_keep": 1,
    "state_commit_timeout_s": 60,
    "collective_timeout_s": 20,
    "steps": list(range(1, 15)),
    "pace_s": 0.3,
    "phase": "save",
  }
  os.makedirs(root, exist_ok=True)
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
