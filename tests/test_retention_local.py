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
