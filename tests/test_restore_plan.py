"""Unit tests of the pure restore planner (no JAX, no I/O)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from emergency_ckpt.restore import plan as rp
from emergency_ckpt.restore import summary as restore_summary
from emergency_ckpt.restore.plan import LOCAL, PEER, PERSISTENT, Status
from emergency_ckpt.restore.summary import Inventory


def layout(num_slices: int, per_slice: int) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(range(s * per_slice, (s + 1) * per_slice)) for s in range(num_slices))


def inventories(slices, local, *, state, persistent=None, rejected=None):
  """One Inventory per process; only the primary (process 0) lists shared tiers."""
  out = []
  for s, procs in enumerate(slices):
    for p in procs:
      out.append(
        Inventory(
          process=p,
          slice=s,
          local_steps=tuple(local.get(p, ())),
          local_rejected=(rejected or {}).get(p, {}),
          persistent_steps=(None if persistent is None else tuple(persistent)) if p == 0 else None,
          state_steps=tuple(state) if p == 0 else None,
        )
      )
  return out


def statuses(slices, cand, overrides=None):
  """Every process loads fine; processes of slices with the step read local."""
  out = {}
  for s, procs in enumerate(slices):
    for p in procs:
      out[p] = Status(local_ok=True if s in cand.local_slices else None, state_ok=True)
  out.update(overrides or {})
  return out


def everyone(slices, steps):
  return {p: tuple(steps) for procs in slices for p in procs}


S2 = layout(2, 2)  # slices (0, 1), (2, 3)
S3 = layout(3, 2)  # (0, 1), (2, 3), (4, 5)
S1 = layout(1, 3)  # one slice of three processes
S4 = layout(4, 2)

BAD_LOCAL = Status(local_ok=False, state_ok=True, error="crc mismatch")
BAD_STATE = Status(local_ok=True, state_ok=False, error="json torn")


def _without(local, process, step):
  local = dict(local)
  local[process] = tuple(s for s in local[process] if s != step)
  return local


# (id, slices, local steps per process, state steps, persistent steps, status overrides,
#  expected candidate steps, expected plan of the first candidate as (step, sources, peer))
PLAN_CASES = [
  (
    "all_intact",
    S2,
    everyone(S2, [10, 20]),
    [10, 20],
    None,
    {},
    [20, 10],
    (20, (LOCAL, LOCAL), None),
  ),
  (
    "one_slice_missing_a_process_step",
    S3,
    _without(everyone(S3, [10, 20]), 3, 20),
    [10, 20],
    None,
    {},
    [20, 10],
    (20, (LOCAL, PEER, LOCAL), 0),
  ),
  (
    "primary_slice_missing",
    S3,
    _without(everyone(S3, [10, 20]), 0, 20),
    [10, 20],
    None,
    {},
    [20, 10],
    (20, (PEER, LOCAL, LOCAL), 1),
  ),
  (
    "primary_and_middle_slice_missing",
    S3,
    _without(_without(everyone(S3, [20]), 1, 20), 2, 20),
    [20],
    None,
    {},
    [20],
    (20, (PEER, PEER, LOCAL), 2),
  ),
  (
    "all_local_missing_persistent_has_it",
    S2,
    {},
    [10, 20],
    [20],
    {},
    [20],
    (20, (PERSISTENT, PERSISTENT), None),
  ),
  (
    "local_ok_false_only_complete_slice_with_persistent",
    S2,
    _without(everyone(S2, [20]), 2, 20),
    [20],
    [20],
    {1: BAD_LOCAL},
    [20],
    (20, (PERSISTENT, PERSISTENT), None),
  ),
  (
    "local_ok_false_only_complete_slice_without_persistent",
    S2,
    _without(everyone(S2, [20]), 2, 20),
    [20],
    None,
    {1: BAD_LOCAL},
    [20],
    (20, None, None),
  ),
  (
    "local_ok_false_on_one_of_two_complete_slices",
    S2,
    everyone(S2, [20]),
    [20],
    [20],
    {0: BAD_LOCAL},
    [20],
    (20, (PEER, LOCAL), 1),
  ),
  (
    "state_ok_false_on_a_non_primary_process",
    S2,
    everyone(S2, [20]),
    [20],
    [20],
    {3: BAD_STATE},
    [20],
    (20, None, None),
  ),
  (
    "state_ok_false_on_primary_process",
    S2,
    everyone(S2, [20]),
    [20],
    [20],
    {0: BAD_STATE},
    [20],
    (20, None, None),
  ),
  (
    "one_slice",
    S1,
    everyone(S1, [3, 6]),
    [3, 6],
    None,
    {},
    [6, 3],
    (6, (LOCAL,), None),
  ),
  (
    "one_slice_one_process_missing_falls_to_persistent",
    S1,
    _without(everyone(S1, [3, 6]), 2, 6),
    [3, 6],
    [6],
    {},
    [6, 3],
    (6, (PERSISTENT,), None),
  ),
  (
    "four_slices_two_need_peer",
    S4,
    _without(_without(everyone(S4, [8]), 0, 8), 5, 8),
    [8],
    None,
    {},
    [8],
    (8, (PEER, LOCAL, PEER, LOCAL), 1),
  ),
  (
    "four_slices_all_intact",
    S4,
    everyone(S4, [4, 8]),
    [4, 8],
    [4],
    {},
    [8, 4],
    (8, (LOCAL,) * 4, None),
  ),
]


@pytest.mark.parametrize(
  "slices,local,state,persistent,overrides,want_steps,want_plan",
  [c[1:] for c in PLAN_CASES],
  ids=[c[0] for c in PLAN_CASES],
)
def test_candidates_and_decide(slices, local, state, persistent, overrides, want_steps, want_plan):
  invs = inventories(slices, local, state=state, persistent=persistent)
  cands = rp.candidates(restore_summary.summarize(invs, slices))
  assert [c.step for c in cands] == want_steps
  cand = cands[0]
  step, sources, peer = want_plan
  assert cand.step == step
  plan = rp.decide(cand, statuses(slices, cand, overrides), slices)
  if sources is None:
    assert plan is None
    return
  assert plan == rp.RestorePlan(step, sources, peer)
  # A PEER slice always has a LOCAL slice to receive from, and only then.
  assert (PEER in plan.sources) == (plan.peer_source is not None)
  if plan.peer_source is not None:
    assert plan.sources[plan.peer_source] == LOCAL
    assert plan.peer_source == min(i for i, s in enumerate(plan.sources) if s == LOCAL)


def test_candidate_fields():
  local = _without(everyone(S3, [10, 20]), 3, 20)
  invs = inventories(S3, local, state=[10, 20], persistent=[10])
  assert rp.candidates(restore_summary.summarize(invs, S3)) == [
    rp.Candidate(20, (0, 2), False),
    rp.Candidate(10, (0, 1, 2), True),
  ]


def test_step_without_commit_is_never_a_candidate():
  # Step 30 is everywhere (local and persistent) but its state has no COMMIT.
  invs = inventories(S2, everyone(S2, [10, 20, 30]), state=[10, 20], persistent=[20, 30])
  assert [c.step for c in rp.candidates(restore_summary.summarize(invs, S2))] == [20, 10]
  assert rp.candidates(restore_summary.summarize(invs, S2), step=30) == []


def test_committed_step_nowhere_else_is_not_a_candidate():
  local = _without(everyone(S2, [10, 20]), 1, 20)
  local = _without(local, 2, 20)
  invs = inventories(S2, local, state=[10, 20], persistent=[10])
  assert [c.step for c in rp.candidates(restore_summary.summarize(invs, S2))] == [10]


def test_no_state_steps_at_all():
  invs = inventories(S2, everyone(S2, [10]), state=[], persistent=[10])
  assert rp.candidates(restore_summary.summarize(invs, S2)) == []


@pytest.mark.parametrize("step,want", [(None, [30, 20, 10]), (20, [20]), (10, [10]), (15, [])])
def test_explicit_step_filter(step, want):
  invs = inventories(S2, everyone(S2, [10, 20, 30]), state=[10, 20, 30])
  assert [c.step for c in rp.candidates(restore_summary.summarize(invs, S2), step=step)] == want


def test_newest_first_regardless_of_input_order():
  local = {0: (5, 300, 40), 1: (40, 5, 300), 2: (300, 40, 5), 3: (5, 40, 300)}
  invs = inventories(S2, local, state=[40, 5, 300, 5])
  assert [c.step for c in rp.candidates(restore_summary.summarize(invs, S2))] == [300, 40, 5]
  # The shared tiers may be reported by any process, in any order.
  assert [c.step for c in rp.candidates(restore_summary.summarize(list(reversed(invs)), S2))] == [
    300,
    40,
    5,
  ]


@pytest.mark.parametrize(
  "step,want",
  [(10, (0, 1)), (20, (1,)), (30, ()), (40, ())],
)
def test_complete_slices(step, want):
  local = {0: (10,), 1: (10, 30), 2: (10, 20), 3: (10, 20, 30)}
  invs = inventories(S2, local, state=[])
  assert rp.complete_slices(step, restore_summary.summarize(invs, S2)) == want


def test_complete_slices_missing_inventory_counts_as_missing():
  invs = [inv for inv in inventories(S2, everyone(S2, [10]), state=[10]) if inv.process != 3]
  assert rp.complete_slices(10, restore_summary.summarize(invs, S2)) == (0,)


def test_describe_absence_names_everything():
  local = {0: (7,), 1: (), 2: (3, 9), 3: ()}
  rejected = {2: {5: "saved with topology X"}, 1: {4: "manifest checksum mismatch"}}
  invs = inventories(S2, local, state=[9, 3], persistent=[2], rejected=rejected)
  text = rp.describe_absence(restore_summary.summarize(invs, S2))
  assert "state steps with a COMMIT marker: [3, 9]" in text
  assert "persistent tensor steps: [2]" in text
  assert "local steps held by every process of a slice: none" in text
  assert "slice 0: step 7 on 1 of its processes" in text
  assert "slice 1: step 3 on 1 of its processes, slice 1: step 9 on 1" in text
  assert "process 2 ignored local step 5: saved with topology X" in text
  assert "process 1 ignored local step 4: manifest checksum mismatch" in text


def test_describe_absence_with_nothing():
  invs = inventories(S1, {}, state=[])
  text = rp.describe_absence(restore_summary.summarize(invs, S1))
  assert "state steps with a COMMIT marker: none" in text
  assert "persistent tensor steps: none" in text


@pytest.mark.parametrize(
  "inv",
  [
    Inventory(process=0, slice=0, local_steps=(), persistent_steps=None, state_steps=None),
    Inventory(
      process=0,
      slice=0,
      local_steps=(1, 5, 3),
      local_rejected={7: "bad", 11: "worse"},
      persistent_steps=(),
      state_steps=(1, 3),
      state_uncommitted=(5,),
    ),
    Inventory(process=5, slice=2, local_steps=(4,), local_rejected={}, persistent_steps=(4, 8)),
  ],
)
def test_inventory_json_round_trip(inv):
  wire = json.loads(json.dumps(inv.to_json()))  # int keys become strings on the wire
  back = Inventory.from_json(wire)
  assert back == inv
  assert isinstance(back.local_steps, tuple)
  assert all(isinstance(k, int) for k in back.local_rejected)
  for f in ("persistent_steps", "state_steps", "state_uncommitted"):
    assert getattr(back, f) == getattr(inv, f)
    assert type(getattr(back, f)) is type(getattr(inv, f))


def test_inventory_from_json_defaults():
  back = Inventory.from_json({"process": 1, "slice": 0, "local_steps": [2]})
  assert back == Inventory(process=1, slice=0, local_steps=(2,))


@pytest.mark.parametrize(
  "status",
  [
    Status(local_ok=None, state_ok=True),
    Status(local_ok=True, state_ok=False, error="torn"),
    Status(local_ok=False, state_ok=True, error="crc", mismatch="leaf ['w'] dtype"),
  ],
)
def test_status_json_round_trip(status):
  wire = json.loads(json.dumps(status.to_json()))
  assert Status.from_json(wire) == status
  assert set(wire) == {f.name for f in dataclasses.fields(Status)}


def test_job_summary_names_slices_as_ranges_and_caps_what_is_only_for_messages():
  slices = layout(40, 2)
  local = everyone(slices, [10, 20])
  local[5] = (10,)  # slice 2 misses step 20 on one process
  rejected = {p: {1: f"bad copy {p}"} for p in range(40)}
  invs = inventories(slices, local, state=[10, 20], persistent=[10], rejected=rejected)
  by_process = {inv.process: inv.to_json() for inv in invs}
  sums = {
    s: restore_summary.slice_summary(s, {p: by_process[p] for p in procs}, len(procs))
    for s, procs in enumerate(slices)
  }
  doc = restore_summary.job_summary(sums, len(slices))
  assert doc["held"] == {"10": [[0, 39]], "20": [[0, 1], [3, 39]]}
  assert len(doc["rejected"]) == restore_summary.REJECTED_SHOWN and doc["rejected_count"] == 40
  assert doc["partial"] == ["slice 2: step 20 on 1 of its processes"]
  job = restore_summary.JobInventory.from_json(json.loads(json.dumps(doc)))
  assert job == restore_summary.summarize(invs, slices)
  assert job.held[20] == (0, 1, *range(3, 40))
  assert [(c.step, c.in_persistent) for c in rp.candidates(job)] == [(20, False), (10, True)]
  assert "and 24 more rejected local copies" in rp.describe_absence(job)
  assert job.state_uncommitted == ()
  # the primary's uncommitted state steps reach everyone (what restore discards)
  by_process[0]["state_uncommitted"] = [30]
  sums[0] = restore_summary.slice_summary(0, {p: by_process[p] for p in slices[0]}, 2)
  job = restore_summary.JobInventory.from_json(
    json.loads(json.dumps(restore_summary.job_summary(sums, len(slices))))
  )
  assert job.state_uncommitted == (30,) and job.state_steps == (10, 20)


def test_shared_machines_ride_on_the_summary_capped_and_counted():
  """The placement check's reports (one per machine that runs processes of
  two slices, from its first process) reach everyone through the inventory
  summary: the first REJECTED_SHOWN named, all counted, none when nothing
  is shared (the summary stays as small as before)."""
  slices = layout(40, 2)
  invs = inventories(slices, everyone(slices, [10]), state=[10])
  by_process = {inv.process: inv.to_json() for inv in invs}
  plain = {
    s: restore_summary.slice_summary(s, {p: by_process[p] for p in procs}, len(procs))
    for s, procs in enumerate(slices)
  }
  assert "placement" not in restore_summary.job_summary(plain, len(slices))
  # 20 machines' first processes report (what they report is placement.py's)
  for p in range(0, 40, 2):
    inv = dataclasses.replace(invs[p], placement={"host": f"h{p // 2}", "processes": [p, p + 1]})
    by_process[p] = json.loads(json.dumps(inv.to_json()))
    assert Inventory.from_json(by_process[p]) == inv
  sums = {
    s: restore_summary.slice_summary(s, {p: by_process[p] for p in procs}, len(procs))
    for s, procs in enumerate(slices)
  }
  job = restore_summary.JobInventory.from_json(
    json.loads(json.dumps(restore_summary.job_summary(sums, len(slices))))
  )
  assert job.placement_count == 20 and len(job.placement) == restore_summary.REJECTED_SHOWN
  assert job.placement[0] == {"host": "h0", "processes": [0, 1]}
  assert job.held[10] == tuple(range(40))  # the rest of the summary is as before


def test_a_slice_with_a_silent_process_holds_nothing():
  invs = [inv for inv in inventories(S2, everyone(S2, [10]), state=[10]) if inv.process != 3]
  by_process = {inv.process: inv.to_json() for inv in invs}
  assert restore_summary.slice_summary(1, {2: by_process[2]}, expected=2)["held"] == []


def test_decide_on_failures_only_equals_decide_on_every_status():
  cand = rp.Candidate(10, (0, 1, 2), True)
  full = statuses(S3, cand, {3: BAD_LOCAL})
  failures = {p: st for p, st in full.items() if not st.is_ok}
  assert list(failures) == [3]
  assert rp.decide(cand, failures, S3) == rp.decide(cand, full, S3)
  assert rp.decide(cand, failures, S3).sources == (LOCAL, PEER, LOCAL)
  assert rp.decide(cand, {0: BAD_STATE}, S3) is None
