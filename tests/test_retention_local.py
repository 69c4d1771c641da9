"""Local retention never drops the newest committed step or anything newer."""

import pytest

from emergency_ckpt.policies import keep_local


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
  from emergency_ckpt.policies import keep_state

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
