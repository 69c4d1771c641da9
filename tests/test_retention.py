"""Unit tests of retention.py: the one retention plan of the manager and gc.
Pure functions of listings; no files."""

from __future__ import annotations

import math
import random

import pytest

from emergency_ckpt.errors import InvalidOptionsError
from emergency_ckpt.retention import rules as retention
from emergency_ckpt.retention.plans import local_plan, persistent_plan, state_plan
from emergency_ckpt.retention.rules import (
  Rules,
  best_steps,
  explain,
  keep_latest,
  retain,
)


def check_plan(plan: retention.Plan, steps) -> None:
  """Every listed step is either kept or deleted, with a reason."""
  steps = set(steps)
  assert plan.keep | set(plan.delete) == steps
  assert not plan.keep & set(plan.delete)
  assert list(plan.delete) == sorted(plan.delete)
  assert set(plan.reasons) == steps and all(plan.reasons.values())


# ---- rules ----------------------------------------------------------------------------
@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"max_to_keep": -1}, "max_to_keep"),
    ({"max_to_keep": 1.5}, "max_to_keep"),
    ({"max_to_keep": True}, "max_to_keep"),
    ({"max_to_keep": 1, "keep_period": 0}, "keep_period"),
    ({"max_to_keep": 1, "keep_best": -1}, "keep_best"),
    ({"max_to_keep": 1, "best_mode": "median"}, "best_mode"),
  ],
)
def test_rules_reject_impossible_values(kwargs, field):
  with pytest.raises(InvalidOptionsError, match=field):
    Rules(**kwargs)


@pytest.mark.parametrize(
  "kwargs",
  [
    {"max_to_keep": None},
    {"max_to_keep": 0},
    {"max_to_keep": 3, "keep_period": 1, "keep_best": 0, "best_metric": "l", "best_mode": "max"},
  ],
)
def test_rules_accept(kwargs):
  Rules(**kwargs)


def test_rules_are_keyword_only_and_frozen():
  with pytest.raises(TypeError):
    Rules(2)  # type: ignore[misc]
  with pytest.raises(AttributeError):
    Rules(max_to_keep=2).max_to_keep = 3  # type: ignore[misc]


# ---- building blocks ------------------------------------------------------------------
@pytest.mark.parametrize(
  "steps,max_to_keep,protected,want",
  [
    ([1, 2, 3, 4, 5], 2, (), {4, 5}),
    ([5, 1, 4, 2, 3], 3, (), {3, 4, 5}),
    ([1, 2, 3], 1, (), {3}),
    ([1, 2, 3], 10, (), {1, 2, 3}),
    ([1, 2, 3], None, (), {1, 2, 3}),
    ([1, 2, 3], 0, (), set()),
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


LOSSES = {1: {"l": 0.5}, 2: {"l": 0.2}, 3: {"l": 0.2}, 4: {"l": 0.9}}


@pytest.mark.parametrize(
  "metrics, mode, n, want",
  [
    (LOSSES, "min", None, [3, 2, 1, 4]),  # a tie ranks the newer step first
    (LOSSES, "max", None, [4, 1, 3, 2]),
    (LOSSES, "min", 2, [3, 2]),
    (LOSSES, "min", 0, []),
    ({1: {"l": math.nan}, 2: {"l": math.inf}, 3: {"l": True}, 4: {"l": "0.1"}}, "min", None, []),
    ({1: {}, 2: {"other": 0.0}, 3: {"l": 1}, 4: None}, "min", None, [3]),
    ({}, "max", 3, []),
  ],
)
def test_best_steps(metrics, mode, n, want):
  assert best_steps(metrics, "l", mode, n) == want


@pytest.mark.parametrize(
  "rules, protected, want",
  [
    (Rules(max_to_keep=2), (), {90, 100}),
    (Rules(max_to_keep=2, keep_period=50), (), {50, 90, 100}),
    (Rules(max_to_keep=1, keep_best=2, best_metric="l"), (), {20, 70, 100}),
    (Rules(max_to_keep=1, keep_best=2, best_metric="l", best_mode="max"), (), {10, 30, 100}),
    (Rules(max_to_keep=1, keep_best=2), (), {100}),  # no metric: keep_best is off
    (Rules(max_to_keep=0), (40,), {40}),
    (Rules(max_to_keep=None), (), set(range(10, 110, 10))),
  ],
)
def test_retain(rules, protected, want):
  losses = {10: 0.9, 20: 0.1, 30: 0.8, 40: 0.7, 50: 0.6, 60: 0.5, 70: 0.2, 80: 0.4, 90: 0.3}
  metrics = {s: {"l": v} for s, v in losses.items()}  # 100 has none: never "best"
  assert retain(range(10, 110, 10), rules, metrics=metrics, protected=protected) == want


def test_explain_reasons():
  plan = explain(range(5, 55, 5), Rules(max_to_keep=1, keep_period=20), protected={5: "pinned"})
  check_plan(plan, range(5, 55, 5))
  assert plan.keep == {5, 20, 40, 50}
  assert plan.reasons[35] == "not among the newest 1, not a multiple of 20"
  assert plan.reasons[40] == "multiple of 20"
  assert plan.reasons[50] == "newest 1"
  assert plan.reasons[5].startswith("pinned")
  metrics = {10: {"l": 0.1}, 20: {"l": 0.5}}
  plan = explain([10, 20, 30], Rules(max_to_keep=0, keep_best=1, best_metric="l"), metrics=metrics)
  assert plan.keep == {10} and plan.delete == (20, 30)
  assert plan.reasons[10] == "best 1 by l=0.1 (#1)"
  assert plan.reasons[20] == "not among the newest 0, not among the best 1 (l=0.5)"
  assert plan.reasons[30].endswith("(no l)")
  assert explain([1], Rules(max_to_keep=None)).reasons[1] == "every step (no max_to_keep)"


# ---- local tier -------------------------------------------------------------------------
@pytest.mark.parametrize(
  "steps, k, committed, want",
  [
    ([1, 2, 3], 2, {3}, {2, 3}),
    ([1, 2, 3], 2, {1}, {1, 2, 3}),  # 2 and 3 not committed yet: keep 1 too
    ([1, 2, 3], 2, set(), {1, 2, 3}),  # nothing committed: delete nothing
    ([1, 2, 3, 4, 5], 1, {1, 2, 3}, {3, 4, 5}),
    ([5], 1, {5}, {5}),
    ([], 2, set(), set()),
    # the newest commit is elsewhere (another host's steps), none held: the
    # newest max_to_keep + 1 uncommitted steps stay (their commits may be in flight)
    ([1, 2, 3], 1, {10}, {2, 3}),
    # a state store that cannot commit (a sick bucket) never fills the
    # ramdisk: the newest committed step and max_to_keep + 1 newer ones stay
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2, {1}, {1, 8, 9, 10}),
    ([1, 2, 3, 4, 5, 6], 2, set(), {4, 5, 6}),
    # held 2 committed, 3 and 4 not although 10 is: 3 and 4 stay (gc used to drop 3)
    ([1, 2, 3, 4], 1, {2, 10}, {2, 3, 4}),
    # no state store known (gc without one): the newest step stands in
    ([1, 2, 3], 0, None, {3}),
    ([1, 2, 3], 2, None, {2, 3}),
    ([], 2, None, set()),
  ],
)
def test_local_plan(steps, k, committed, want):
  is_committed = None if committed is None else committed.__contains__
  plan = local_plan(steps, Rules(max_to_keep=k), is_committed=is_committed)
  check_plan(plan, steps)
  assert plan.keep == want


def test_local_plan_asks_newest_first_and_stops():
  asked = []

  def is_committed(step):
    asked.append(step)
    return step <= 7

  plan = local_plan([9, 3, 8, 7, 5], Rules(max_to_keep=1), is_committed=is_committed)
  assert asked == [9, 8, 7]
  assert plan.keep == {7, 8, 9} and plan.delete == (3, 5)
  assert "newest restorable here" in plan.reasons[7]
  assert "commit may be in flight" in plan.reasons[9]


def test_local_plan_keep_best_counts_only_given_metrics():
  metrics = {1: {"l": 0.1}, 2: {"l": 0.9}}  # 3 has none (not committed: never "best")
  plan = local_plan(
    [1, 2, 3, 4],
    Rules(max_to_keep=0, keep_best=1, best_metric="l"),
    is_committed={1, 2, 4}.__contains__,
    metrics=metrics,
  )
  assert plan.keep == {1, 4}


# ---- persistent tier -----------------------------------------------------------------------
@pytest.mark.parametrize(
  "steps, committed, rules, want",
  [
    # newer than the newest restorable: at most max_to_keep + 1 kept
    ([10, 20, 30, 40, 50], {10, 20, 30}, Rules(max_to_keep=0), {30, 50}),
    (range(10, 80, 10), {10}, Rules(max_to_keep=2), {10, 50, 60, 70}),
    (range(10, 80, 10), {10}, Rules(max_to_keep=None), set(range(10, 80, 10))),
    ([10, 20, 30], {10, 20, 30}, Rules(max_to_keep=1), {30}),
    ([10, 20, 30], {5, 40}, Rules(max_to_keep=0), {10, 20, 30}),  # none restorable
    ([10, 20, 30], set(), Rules(max_to_keep=0), {10, 20, 30}),
    ([], {10}, Rules(max_to_keep=0), set()),
    ([10, 20, 30, 40], {10, 20, 30, 40}, Rules(max_to_keep=1, keep_period=20), {20, 40}),
    (
      [10, 20, 30, 40],
      {10, 20, 30, 40},
      Rules(max_to_keep=1, keep_best=1, best_metric="l"),
      {20, 40},
    ),
  ],
)
def test_persistent_plan(steps, committed, rules, want):
  metrics = {s: {"l": 0.1 if s == 20 else 1.0} for s in committed}
  plan = persistent_plan(steps, rules, committed=committed, metrics=metrics, capped=True)
  check_plan(plan, steps)
  assert plan.keep == want


def test_persistent_plan_uncapped_keeps_every_newer_step():
  """gc's plan: beside a running job it cannot tell a commit backlog from
  a stopped one, so every step newer than the newest restorable one stays."""
  plan = persistent_plan(range(10, 80, 10), Rules(max_to_keep=2), committed={10})
  assert plan.keep == set(range(10, 80, 10))


def test_persistent_plan_reasons():
  plan = persistent_plan([10, 20, 30], Rules(max_to_keep=0), committed={10, 20})
  assert "newest restorable" in plan.reasons[20]
  assert "may be in flight" in plan.reasons[30]
  assert plan.reasons[10] == "not among the newest 0"


# ---- state store ----------------------------------------------------------------------------
@pytest.mark.parametrize(
  "listed, committed, kwargs, rules, want",
  [
    # the manager: 20 persistent; newest 2+2 committed; 40 in flight (and an upload)
    (
      range(5, 45, 5),
      range(5, 40, 5),
      {"persistent": [20], "persistent_interval": 20, "extra_newest": 2},
      Rules(max_to_keep=2),
      {20, 25, 30, 35, 40},
    ),
    # nothing committed: everything stays
    ([5, 10], [], {"persistent_interval": 100}, Rules(max_to_keep=1), {5, 10}),
    # a persistent-interval step newer than the newest persistent one stays
    (range(5, 45, 5), range(5, 45, 5), {"persistent_interval": 20}, Rules(max_to_keep=1), {20, 40}),
    (
      range(5, 45, 5),
      range(5, 45, 5),
      {"persistent": [20], "persistent_interval": 20},
      Rules(max_to_keep=1),
      {20, 40},
    ),
    (
      range(5, 45, 5),
      range(5, 45, 5),
      {"persistent": [40], "persistent_interval": 20},
      Rules(max_to_keep=1),
      {40},
    ),
    # gc: 12 an abandoned commit, 50 in flight; 40 persistent, 45 a kept local step
    (
      [*range(5, 55, 5), 12],
      range(5, 50, 5),
      {"persistent": [40], "local_kept": [45]},
      Rules(max_to_keep=1, keep_period=30),
      {30, 40, 45, 50},
    ),
    # gc: a kept local step's state stays whatever the rules say
    (
      range(5, 50, 5),
      range(5, 50, 5),
      {"local_kept": [25, 45]},
      Rules(max_to_keep=0),
      {25, 45},
    ),
    # the local rules with every step kept: every committed step stays
    ([5, 8, 10], [5, 10], {}, Rules(max_to_keep=None), {5, 10}),
  ],
)
def test_state_plan(listed, committed, kwargs, rules, want):
  plan = state_plan(listed, committed, rules, **kwargs)
  check_plan(plan, listed)
  assert plan.keep == want


def test_state_plan_reasons():
  plan = state_plan(
    [10, 12, 20, 30, 40, 50],
    [10, 20, 30, 40],
    Rules(max_to_keep=1),
    persistent=[20],
    local_kept=[30],
    persistent_interval=50,
  )
  assert plan.keep == {20, 30, 40, 50}
  assert plan.reasons[12].startswith("uncommitted")
  assert "state of a kept persistent step" in plan.reasons[20]
  assert "state of a kept local step" in plan.reasons[30]
  assert "may be in flight" in plan.reasons[50]
  plan = state_plan(
    [10, 20, 30], [10, 20, 30], Rules(max_to_keep=0), persistent=[5], persistent_interval=20
  )
  assert plan.keep == {20, 30} and plan.delete == (10,)
  assert "upload may be in flight" in plan.reasons[20]
  assert "newest commit" in plan.reasons[30]


# ---- invariants over random listings ------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_plans_never_delete_the_newest_restorable_step_or_newer(seed):
  rng = random.Random(seed)
  steps = sorted(rng.sample(range(1, 60), rng.randint(0, 12)))
  committed = {s for s in steps if rng.random() < 0.6} | set(rng.sample(range(1, 60), 3))
  metrics = {s: {"l": rng.random()} for s in committed}
  rules = Rules(
    max_to_keep=rng.choice([None, 0, 1, 2, 3]),
    keep_period=rng.choice([None, 2, 5]),
    keep_best=rng.choice([None, 0, 1, 2]),
    best_metric=rng.choice([None, "l"]),
    best_mode=rng.choice(["min", "max"]),
  )
  local = local_plan(steps, rules, is_committed=committed.__contains__, metrics=metrics)
  check_plan(local, steps)
  held = [s for s in steps if s in committed]
  assert {s for s in steps if held and s >= held[-1]} <= local.keep
  if not held:
    assert local.keep == set(steps)
  pers = persistent_plan(steps, rules, committed=committed, metrics=metrics)
  check_plan(pers, steps)
  assert {s for s in steps if held and s >= held[-1]} <= pers.keep
  listed = sorted(set(steps) | set(rng.sample(range(1, 60), 4)))
  state = state_plan(
    listed, committed, rules, persistent=pers.keep, local_kept=local.keep, metrics=metrics
  )
  check_plan(state, listed)
  assert set(listed) & (pers.keep | local.keep) <= state.keep  # a kept copy keeps its state
  newest_commit = max(set(listed) & committed, default=None)
  assert {s for s in listed if newest_commit is None or s >= newest_commit} <= state.keep
