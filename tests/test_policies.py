"""Unit tests of save decisions and retention."""

from __future__ import annotations

import pytest

from emergency_ckpt.policies import SaveDecision, decide_save, keep_latest


@pytest.mark.parametrize(
  "step,local_interval,persistent_interval,want",
  [
    (0, 10, 100, (True, True)),
    (10, 10, 100, (True, False)),
    (5, 10, 100, (False, False)),
    (100, 10, 100, (True, True)),
    (200, 10, 100, (True, True)),
    (150, 10, 100, (True, False)),
    (7, 1, 100, (True, False)),
    (6, 4, 3, (False, True)),
    (12, 4, 3, (True, True)),
    (13, 4, 3, (False, False)),
    (99, 10, 100, (False, False)),
  ],
)
def test_decide_save_intervals(step, local_interval, persistent_interval, want):
  d = decide_save(step, local_interval=local_interval, persistent_interval=persistent_interval)
  assert d == SaveDecision(*want)
  assert d.any == any(want)


@pytest.mark.parametrize("step", [0, 1, 5, 99, 101])
def test_decide_save_force_saves_both_tiers(step):
  d = decide_save(step, local_interval=10, persistent_interval=100, force=True)
  assert d == SaveDecision(True, True)
  assert d.any


def test_decide_save_none_is_not_any():
  assert not decide_save(3, local_interval=2, persistent_interval=5).any


def test_decide_save_keywords_only():
  with pytest.raises(TypeError):
    decide_save(10, 10, 100)  # type: ignore[misc]


@pytest.mark.parametrize(
  "steps,max_to_keep,protected,want",
  [
    ([1, 2, 3, 4, 5], 2, (), {4, 5}),
    ([5, 1, 4, 2, 3], 3, (), {3, 4, 5}),
    ([1, 2, 3], 1, (), {3}),
    ([1, 2, 3], 10, (), {1, 2, 3}),
    ([1, 2, 3], None, (), {1, 2, 3}),
    ([], 2, (), set()),
    ([], None, (7,), set()),
    ([3, 3, 2, 2, 1], 2, (), {2, 3}),  # duplicates count once
    ([10, 20, 30, 40], 2, (10,), {10, 30, 40}),  # protected kept beyond max_to_keep
    ([10, 20, 30, 40], 2, (40,), {30, 40}),  # protected already among the newest
    ([10, 20, 30, 40], 1, (10, 20), {10, 20, 40}),
    ([10, 20, 30], 2, (99,), {20, 30}),  # protected not in steps is ignored
    ([10, 20, 30], None, (5, 10), {10, 20, 30}),
    ([10, 20, 30], 1, [15, 20], {20, 30}),
  ],
)
def test_keep_latest(steps, max_to_keep, protected, want):
  assert keep_latest(steps, max_to_keep, protected) == want


def test_keep_latest_accepts_iterators():
  assert keep_latest(iter([4, 8, 6]), 2, iter([4])) == {4, 6, 8}
  assert keep_latest((s for s in [4, 8, 6]), 2) == {6, 8}
