"""State retention of the persistent steps whose upload may be in flight
(plans.state_plan's `uploading` and `persistent_interval`), and the
retainer's choice between them (Retainer._uploading). Pure logic; no files."""

from __future__ import annotations

import dataclasses

import pytest

from emergency_ckpt.retention.plans import LOCAL_LAG_STEPS, state_plan
from emergency_ckpt.retention.retainer import Retainer
from emergency_ckpt.retention.rules import Rules
from tests.test_retention import check_plan

STEPS = range(1, 31)  # every step saved locally and committed


def keep(*, persistent=(), interval=None, uploading=(), listed=STEPS, committed=STEPS):
  """state_plan's keep as the manager calls it (local max_to_keep 2)."""
  plan = state_plan(
    listed,
    committed,
    Rules(max_to_keep=2),
    persistent=persistent,
    persistent_interval=interval,
    uploading=uploading,
    extra_newest=LOCAL_LAG_STEPS,
  )
  check_plan(plan, listed)
  return plan


NEWEST = {27, 28, 29, 30}  # the local rules: 2 + LOCAL_LAG_STEPS committed steps


@pytest.mark.parametrize(
  "kwargs, want",
  [
    # nothing persistent known: the local rules alone
    ({}, NEWEST),
    # the steps the cadence sent to the persistent tier, none finalized yet
    ({"uploading": [1, 13]}, {1, 13} | NEWEST),
    # 1 finalized: 13's upload may still run, 1 stays as a persistent step
    ({"persistent": [1], "uploading": [1, 13]}, {1, 13} | NEWEST),
    # 13 finalized: nothing older may still upload
    ({"persistent": [13], "uploading": [1, 13]}, {13} | NEWEST),
    # the interval-1 fallback keeps every step newer than the newest finalized one
    ({"persistent": [13], "interval": 1}, set(range(13, 31))),
    # a fixed interval and a forced step beside it
    ({"interval": 10, "uploading": [7]}, {7, 10, 20} | NEWEST),
    ({"persistent": [10], "interval": 10, "uploading": [7]}, {10, 20} | NEWEST),
  ],
)
def test_state_plan_keeps_exactly_the_uploading_steps(kwargs, want):
  assert keep(**kwargs).keep == want


def test_uploading_state_is_kept_even_uncommitted():
  # 5's COMMIT failed; it was sent to the persistent tier: its upload may still need it
  committed = [s for s in STEPS if s != 5]
  plan = keep(uploading=[5], committed=committed)
  assert plan.keep == {5} | NEWEST
  assert "upload may be in flight" in plan.reasons[5]
  assert keep(committed=committed).keep == NEWEST


class _Options:
  def __init__(self, **persistent):
    base = {"save_interval_steps": 100, "save_interval_s": None}
    self.persistent = dataclasses.make_dataclass("P", list(base))(**{**base, **persistent})


def _uploading(options, follow=None, newest=None):
  r = Retainer.__new__(Retainer)  # the choice only: no tiers
  r._options, r._uploads = options, None
  if follow is not None:
    r.follow_uploads(follow)
  return r._uploading(newest)


def test_the_retainer_protects_the_followed_steps_or_the_fixed_interval():
  asked = []

  def steps(newer_than):
    asked.append(newer_than)
    return [40, 60]

  assert _uploading(_Options()) == (100, ())
  assert _uploading(_Options(), steps, newest=20) == (100, [40, 60])  # forced steps too
  assert _uploading(_Options(save_interval_steps="auto"), steps, newest=20) == (None, [40, 60])
  assert _uploading(_Options(save_interval_s=60.0), steps) == (None, [40, 60])
  assert asked == [20, 20, None]
  # a chosen interval nobody names the steps of: every step (the safe side)
  assert _uploading(_Options(save_interval_steps="auto")) == (1, ())
  assert _uploading(_Options(save_interval_s=60.0)) == (1, ())
