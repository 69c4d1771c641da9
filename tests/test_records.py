"""Per-step memory stays bounded, and the background runtime's error contract."""

from __future__ import annotations

import concurrent.futures
import os
import threading

import pytest

import emergency_ckpt as ec
from emergency_ckpt.core.records import DEFAULT_CAP, StepRecords
from emergency_ckpt.runtime.background import Background
from tests.single_slice import state as _state


def test_step_records_keep_the_newest_steps_only():
  records = StepRecords(cap=4)
  for step in range(100):
    records.metrics.put(step, {"loss": float(step)})
    records.info.put(step, {"bytes": step})
    records.started.put(step, float(step))
    records.persistent_final.put(step, True)
  assert records.sizes() == {"metrics": 4, "info": 4, "started": 4, "persistent_final": 4}
  assert records.metrics.get(99) == {"loss": 99.0}
  assert records.metrics.get(95) is None and 95 not in records.persistent_final
  records.forget(99)
  assert records.metrics.get(99) is None and records.sizes()["info"] == 3


def test_a_long_run_holds_bounded_per_step_memory(shm_dir, mesh):
  """A manager saving many steps (metrics, both tiers, best-metric ranking)
  keeps at most DEFAULT_CAP steps in each per-step map; ranking still sees
  dropped steps through their COMMIT records."""
  steps = DEFAULT_CAP * 2 + 10
  options = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(
      directory=os.path.join(shm_dir, "local"), save_interval_steps=1, max_to_keep=1
    ),
    persistent=ec.PersistentTierOptions(
      directory=os.path.join(shm_dir, "persistent"),
      save_interval_steps=steps,
      max_to_keep=1,
      keep_best=1,
    ),
    best_metric="loss",
    run_id="bounded",
  )
  state = _state(mesh, 1.0)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    for step in range(1, steps + 1):
      # the best (lowest) loss is step 1's, long dropped from memory
      mngr.save(step, state, metrics={"loss": 0.0 if step == 1 else float(step)})
    mngr.wait_until_finished()
    sizes = mngr._records.sizes()
    assert max(sizes.values()) <= DEFAULT_CAP, sizes
    assert 1 not in mngr._records.metrics._items
    assert mngr.best_step() == steps  # restorable: the newest; step 1 was retired
    assert mngr.all_steps() == [steps]


def test_background_raises_a_failure_once_and_stays_failed():
  bg = Background("[test]")
  gate = threading.Event()

  def boom():
    gate.wait(5)
    raise ValueError("disk on fire")

  bg.submit("a", boom)
  bg.submit("b", lambda: None)
  gate.set()
  with pytest.raises(ValueError, match="disk on fire"):
    bg.wait()
  assert bg.failed
  bg.wait()  # raised once: not again
  bg.drain()
  bg.close()


def test_background_lanes_run_in_order_and_close_waits():
  bg = Background()
  seen = []
  for i in range(20):
    bg.submit("lane", seen.append, i)
  bg.flush("lane")
  assert seen == list(range(20))
  bg.submit("lane", seen.append, 20)
  bg.close()
  assert seen[-1] == 20
  bg.try_submit("lane", seen.append, 21)  # closing: ignored, no error
  assert seen[-1] == 20


def test_waiting_on_a_lane_waits_for_its_last_task_without_a_task_of_its_own():
  """Lane.wait_queued (behind LocalTier.wait, StagingArea.wait_prepared and
  Background.flush) waits for the lane's last task: an idle lane returns
  at once without starting its thread, a failed task is not raised there
  (its owner raises it), and a queue of tasks is waited out in full."""
  import threading  # noqa: PLC0415

  bg = Background()
  lane = bg.lane("idle")
  lane.wait_queued()
  assert lane._thread is None  # noqa: SLF001 - no thread started for nothing

  busy = bg.lane("busy")
  gate, seen = threading.Event(), []
  busy.submit(gate.wait)
  for i in range(5):
    busy.submit(seen.append, i)
  waiter = threading.Thread(target=busy.wait_queued)
  waiter.start()
  waiter.join(0.2)
  assert waiter.is_alive() and seen == []  # still behind the gate
  gate.set()
  waiter.join(10)
  assert not waiter.is_alive() and seen == list(range(5))

  busy.submit(lambda: 1 / 0)
  busy.wait_queued()  # the failure is its submitter's to raise
  bg.close()


def test_background_raises_only_the_kinds_asked_for_and_keeps_the_rest():
  from emergency_ckpt.errors import CALLER_ERRORS, StateMismatchError, StorageError  # noqa: PLC0415

  bg = Background("[test]")

  def fail(e):
    raise e

  sick = bg.submit("a", fail, StorageError("bucket hung"))
  wrong = bg.submit("a", fail, StateMismatchError("leaf w changed shape"))
  concurrent.futures.wait([sick, wrong])
  bg.raise_errors(only=(KeyError,))  # none of that kind: nothing raised
  with pytest.raises(StateMismatchError):
    bg.raise_errors(only=CALLER_ERRORS)
  bg.raise_errors(only=CALLER_ERRORS)  # raised once
  with pytest.raises(StorageError):  # the sick tier's error stays for wait_until_finished()
    bg.raise_errors()
  bg.close()
