"""Unit tests of the save decision (retention: tests/test_retention.py)."""

from __future__ import annotations

import pytest

from emergency_ckpt.save.policies import SaveDecision, decide_save


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
