"""Local retention never drops the newest committed step or anything newer."""

import os

import pytest

from emergency_ckpt.demo.launcher import run_job
from emergency_ckpt.retention import plans
from emergency_ckpt.retention.rules import Rules


def keep_local(steps, k, committed):
  """plans.local_plan's keep, given the newest committed step."""
  plan = plans.local_plan(
    steps,
    Rules(max_to_keep=k),
    is_committed=lambda s: committed is not None and s <= committed,
  )
  return set(plan.keep)


def keep_state(listed, committed, persistent, *, local_keep, persistent_interval):
  """plans.state_plan's keep, as the manager calls it."""
  plan = plans.state_plan(
    listed,
    committed,
    Rules(max_to_keep=local_keep),
    persistent=persistent,
    persistent_interval=persistent_interval,
    extra_newest=plans.LOCAL_LAG_STEPS,
  )
  return set(plan.keep)


@pytest.mark.parametrize(
  "steps, k, committed, want",
  [
    ([1, 2, 3], 2, 3, {2, 3}),
    ([1, 2, 3], 2, 1, {1, 2, 3}),  # 2 and 3 not committed yet: keep 1 too
    ([1, 2, 3], 2, None, {1, 2, 3}),  # nothing known committed: delete nothing
    ([1, 2, 3, 4, 5], 1, 3, {3, 4, 5}),
    ([5], 1, 5, {5}),
    ([], 2, None, set()),
  ],
)
def test_keep_local(steps, k, committed, want):
  assert keep_local(steps, k, committed) == want


def test_keep_state_keeps_persistent_recent_and_in_flight():
  listed = list(range(5, 45, 5))  # 5..40
  keep = keep_state(
    listed,
    committed=[5, 10, 15, 20, 25, 30, 35],
    persistent=[20],
    local_keep=2,
    persistent_interval=20,
  )
  # 20: persistent; 25..35: newest 4 committed; 40: commit in flight (and an upload).
  assert keep == {20, 25, 30, 35, 40}
  assert keep_state(
    [5, 10], committed=[], persistent=[], local_keep=1, persistent_interval=100
  ) == {5, 10}
  # A persistent-interval step whose upload has not finished is kept.
  assert 20 in keep_state(
    listed, committed=listed, persistent=[], local_keep=1, persistent_interval=20
  )


def test_every_process_drops_the_older_step_once_the_newer_one_commits(shm_dir):
  """max_to_keep=1 on 2 slices of 1 process: after the third save each
  ramdisk holds step 3 alone. Before commits woke retention up, both
  processes kept steps 2 and 3 until their next write (step 3 committed
  only after their own write's retention had run)."""
  args = {
    "slices": 2,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
  }
  results = run_job(
    "tests.retention_scenarios:local_retention_after_commit", 2, args, timeout_s=120
  ).check()
  for r in results:
    assert r["local_steps"] == [3], results
    assert r["all_steps"][-1] == 3, results


def test_a_clean_close_leaves_the_ramdisk_as_retention_says(shm_dir):
  """max_to_keep=1 on 2 slices of 1 process, three saves and close() at
  once, the primary's commit of step 3 held back 1.5 s: process 1's last
  pass ran before that commit, and nothing ran one after it, so it closed
  holding steps 2 and 3 (the soak's "after the job" retention finding).
  close() now waits (at most 5 s) for the newest step's commit and runs one
  last pass: every ramdisk holds step 3 alone."""
  args = {
    "slices": 2,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
  }
  results = run_job(
    "tests.retention_scenarios:local_retention_at_close",
    2,
    args,
    env={0: {"EC_FAILPOINTS": "state.before_commit@3:sleep1.5"}},
    timeout_s=120,
  ).check()
  for r in results:
    assert r["local_steps"] == [3], results
