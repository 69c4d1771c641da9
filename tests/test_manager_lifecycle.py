"""Retention, best_step, delete, metadata and data_state objects, in one
process (a 1-slice job) on real files; the multi-process GCS version is in
tests/test_gcs_retention.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import emergency_ckpt as ec
from tests.helpers import abstract as _abstract
from tests.single_slice import state as _state


def _options(shm_dir, **kw) -> ec.CheckpointManagerOptions:
  local = {"save_interval_steps": 1, "max_to_keep": 2} | kw.pop("local", {})
  persistent = {"save_interval_steps": 2, "max_to_keep": 2} | kw.pop("persistent", {})
  return ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=os.path.join(shm_dir, "local"), **local),
    persistent=ec.PersistentTierOptions(
      directory=os.path.join(shm_dir, "persistent"), **persistent
    ),
    run_id="lifecycle",
    **kw,
  )


def _persistent_steps(shm_dir) -> list[int]:
  root = os.path.join(shm_dir, "persistent", "tensors")
  return sorted(int(n) for n in os.listdir(root) if n.isdigit())


def _local_steps(mngr) -> list[int]:
  return sorted(int(n[5:]) for n in os.listdir(mngr.local_directory) if n.startswith("step_"))


LOSSES = {2: 5.0, 4: 1.0, 6: 3.0, 8: 0.5, 10: 4.0, 12: 6.0, 14: 7.0, 16: 2.0}


def test_persistent_retention_latest_period_and_best(shm_dir, mesh):
  opts = _options(
    shm_dir,
    persistent={"max_to_keep": 2, "keep_period": 6, "keep_best": 2},
    best_metric="loss",
    best_mode="min",
  )
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    for step in range(1, 17):
      mngr.save(step, _state(mesh, step), metrics={"loss": LOSSES.get(step, 100.0 + step)})
      mngr.wait_until_finished()  # each upload finalized: retention runs on each
    # latest 2: 14, 16; every 6th: 6, 12; best 2 by min loss: 8 (0.5), 4 (1.0).
    assert _persistent_steps(shm_dir) == [4, 6, 8, 12, 14, 16]
    assert mngr.best_step() == 8  # among restorable steps (local 15, 16 and persistent ones)
    md = mngr.metadata(8)
    assert md.persistent and md.state_committed and md.restorable
    assert md.local_slices == ()  # local tier: max_to_keep 2, no best rule
    assert md.metrics == {"loss": 0.5}
    assert md.topology["process_count"] == 1 and md.topology["slice_processes"] == [[0]]
    assert md.persistent_bytes > 0 and md.saved_at > 0


def test_local_retention_keep_best_and_period(shm_dir, mesh):
  opts = _options(
    shm_dir,
    local={"max_to_keep": 1, "keep_period": 5, "keep_best": 1},
    persistent={"save_interval_steps": 100},
    best_metric="acc",
    best_mode="max",
  )
  accs = {3: 0.9, 7: 0.95, 8: 0.1}
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    for step in range(1, 10):
      mngr.save(step, _state(mesh, step), metrics={"acc": accs.get(step, 0.0)})
      mngr.wait_until_finished()
    # newest 9; every 5th: 5; best 1 by max acc: 7. Local retention runs
    # when a write lands, racing that step's state commit: if the commit has
    # not landed yet it also keeps 8 (the newest committed step then), until
    # the next save. Nothing else may survive, and none of 5, 7, 9 may go.
    got = set(_local_steps(mngr))
    assert {5, 7, 9} <= got <= {5, 7, 8, 9}, got
    mngr.save(10, _state(mesh, 10), metrics={"acc": 0.0})
    mngr.wait_until_finished()
    got = set(_local_steps(mngr))
    assert {5, 7, 10} <= got <= {5, 7, 9, 10}, got
    assert mngr.best_step() == 7
    r = mngr.restore(_abstract(mesh), step=mngr.best_step())
    assert r.step == 7 and r.source == "local"


def test_delete_refuses_only_restorable_step(shm_dir, mesh):
  with ec.CheckpointManager(_options(shm_dir), mesh=mesh) as mngr:
    mngr.save(2, _state(mesh, 2.0), data_state={"pos": 2})  # both tiers
    mngr.wait_until_finished()
    with pytest.raises(ec.ProtectedStepError, match="only restorable"):
      mngr.delete(2)
    assert mngr.all_steps() == [2]  # nothing was deleted
    mngr.save(3, _state(mesh, 3.0))
    mngr.delete(2)  # now allowed: 3 is restorable
    assert mngr.all_steps() == [3]
    assert _persistent_steps(shm_dir) == []
    assert 2 not in _local_steps(mngr)
    assert not os.path.exists(os.path.join(shm_dir, "persistent", "state", "2"))
    with pytest.raises(ec.ProtectedStepError):
      mngr.delete(3)
    mngr.delete(3, force=True)
    assert mngr.all_steps() == []
    with pytest.raises(ec.NoRestorableCheckpointError):
      mngr.restore(_abstract(mesh))


def test_metadata_names_tiers_and_unknown_step(shm_dir, mesh):
  with ec.CheckpointManager(_options(shm_dir), mesh=mesh) as mngr:
    mngr.save(1, _state(mesh, 1.0))  # local only
    mngr.save(2, _state(mesh, 2.0))  # both
    mngr.wait_until_finished()
    m1, m2 = mngr.metadata(1), mngr.metadata(2)
    assert (m1.local_slices, m1.persistent, m1.restorable) == ((0,), False, True)
    assert (m2.local_slices, m2.persistent, m2.restorable) == ((0,), True, True)
    assert m1.local_bytes >= 4 * 2 * 4 and m1.persistent_bytes is None
    assert m2.topology == m1.topology and m2.saved_at >= m1.saved_at
    with pytest.raises(ec.StepError, match="step 7 is in no tier"):
      mngr.metadata(7)


class _BytesIterator:
  """Like grain's DataLoader iterator: get_state() returns bytes."""

  def __init__(self):
    self.pos = 0

  def get_state(self) -> bytes:
    return json.dumps({"pos": self.pos}).encode() + b"\x00\xff"

  def set_state(self, state: bytes) -> None:
    assert state.endswith(b"\x00\xff"), state
    self.pos = json.loads(state[:-2])["pos"]


class _DictIterator:
  def __init__(self):
    self.pos = 0

  def get_state(self) -> dict:
    return {"pos": self.pos}

  def set_state(self, state: dict) -> None:
    self.pos = state["pos"]


@pytest.mark.parametrize("cls", [_BytesIterator, _DictIterator])
def test_data_state_object_round_trip(shm_dir, mesh, cls):
  with ec.CheckpointManager(_options(shm_dir), mesh=mesh) as mngr:
    it = cls()
    it.pos = 41
    mngr.save(2, _state(mesh, 2.0), data_state=it)
    it.pos = 99
    mngr.wait_until_finished()
    fresh = cls()
    r = mngr.restore(_abstract(mesh), data_state=fresh)
    assert fresh.pos == 41
    assert r.data_state == it.__class__().get_state().__class__(r.data_state)  # same type
    with pytest.raises(ec.DataStateError, match="set_state"):
      mngr.restore(_abstract(mesh), data_state={"not": "an iterator"})


def test_bad_data_state_object_and_metrics(shm_dir, mesh):
  class NoState:
    pass

  class BadState:
    def get_state(self):
      return {"rng": np.uint32(3)}

  with ec.CheckpointManager(_options(shm_dir), mesh=mesh) as mngr:
    with pytest.raises(ec.DataStateError, match="get_state"):
      mngr.save(1, _state(mesh, 1.0), data_state=NoState())
    with pytest.raises(ec.DataStateError, match=r"BadState.get_state\(\)\['rng'\]"):
      mngr.save(1, _state(mesh, 1.0), data_state=BadState())
    with pytest.raises(ec.MetricsError, match="finite"):
      mngr.save(1, _state(mesh, 1.0), metrics={"loss": float("nan")})
    with pytest.raises(ec.MetricsError, match="dict"):
      mngr.save(1, _state(mesh, 1.0), metrics=[1.0])
    mngr.save(1, _state(mesh, 1.0), metrics={"loss": np.float32(2.5)})  # numpy scalars ok
    with pytest.raises(ec.InvalidOptionsError, match="best_metric"):
      mngr.best_step()
    assert mngr.reached_preemption(1) is False  # no preemption service in one process


def test_keep_best_needs_best_metric(shm_dir):
  with pytest.raises(ec.InvalidOptionsError, match="persistent.keep_best=2 needs best_metric"):
    _options(shm_dir, persistent={"keep_best": 2})
  with pytest.raises(ec.InvalidOptionsError, match="best_mode"):
    _options(shm_dir, best_metric="loss", best_mode="lowest")
  with pytest.raises(ec.InvalidOptionsError, match="local.keep_period"):
    _options(shm_dir, local={"keep_period": 0})


def test_event_log_records_saves_and_restores(shm_dir, mesh):
  from emergency_ckpt.core.telemetry import read_events  # noqa: PLC0415

  log = os.path.join(shm_dir, "events", "p{process}.jsonl")
  with ec.CheckpointManager(_options(shm_dir, event_log=log), mesh=mesh) as mngr:
    mngr.save(1, _state(mesh, 1.0))
    mngr.save(2, _state(mesh, 2.0))
    mngr.wait_until_finished()
    got = mngr.restore(_abstract(mesh))
  events = read_events(os.path.join(shm_dir, "events", "p0.jsonl"))
  kinds = [(e["event"], e.get("step"), e.get("tier")) for e in events]
  assert kinds[0][0] == "run_start"
  saves = [e for e in events if e["event"] == "save"]
  assert [(e["step"], e["tiers"]) for e in saves] == [(1, ["local"]), (2, ["local", "persistent"])]
  assert all(32 <= e["bytes"] <= 128 for e in saves)  # staged bytes: 32 + alignment
  assert all(e["stall_s"] >= 0 and e["process"] == 0 and e["slice"] == 0 for e in saves)
  durable = {(e["step"], e["tier"]) for e in events if e["event"] == "save_durable"}
  assert durable == {(1, "local"), (1, "state"), (2, "local"), (2, "state"), (2, "persistent")}
  (restore,) = [e for e in events if e["event"] == "restore"]
  assert (restore["step"], restore["source"], restore["bytes"], restore["error"]) == (
    2,
    "local",
    32,
    None,
  )
  # where its time went: each phase it ran, in order, adding up to its duration
  phases = restore["phases"]
  assert list(phases) == ["wait_saves", "inventory", "read", "agree", "place"], phases
  assert all(v >= 0 for v in phases.values())
  assert sum(phases.values()) <= restore["duration_s"] + 1e-5, (phases, restore["duration_s"])
  assert got.phases == phases  # the same figures on the result
