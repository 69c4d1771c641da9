"""Goodput: the manager's step timer (fake clock), the report's pure
computation (synthetic event logs), and one real single-process manager."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from emergency_ckpt.cli import main as cli_main
from emergency_ckpt.cli.goodput import goodput_summary
from emergency_ckpt.core import telemetry
from emergency_ckpt.core.goodput import Goodput, StepTimer


# ---- the step timer ------------------------------------------------------------
class _Clock:
  def __init__(self, t: float):
    self.t = t

  def __call__(self) -> float:
    return self.t


class _Events:
  def __init__(self):
    self.got: list[dict] = []

  def record(self, event: str, **fields) -> dict:
    self.got.append({"event": event, **fields})
    return self.got[-1]


def test_step_timer_with_a_restore_splits_the_time_exactly():
  clock, events = _Clock(100.0), _Events()
  timer = StepTimer(events, began=100.0, clock=clock, every_s=10.0)

  def save(step, at, took, saved):
    clock.t = at
    began = timer.save_began()
    clock.t = at + took
    timer.save_returned(step, began, saved=saved)

  clock.t = 104.0
  timer.restored(101.0, ok=True)  # 3 s of restore end the start-up at 104...
  assert events.got == []
  assert timer.snapshot().startup_s == 1.0
  save(19, 106.0, 0.5, False)  # trained 2 s; ... but for the first save() call
  assert events.got == [{"event": "startup", "startup_s": 1.5, "restore_s": 3.0, "age_s": 6.5}]
  save(20, 108.5, 0.5, True)  # 2 s; 9 s since the start: no progress event yet
  assert len(events.got) == 1
  save(21, 111.0, 0.25, True)  # 2 s; 11.25 s since the start: progress
  assert events.got[-1] == {
    "event": "progress",
    "first_step": 19,
    "last_step": 21,
    "steps": 3,
    "train_s": 6.0,
    "stall_s": 0.75,
  }
  clock.t = 113.0
  timer.restored(112.0, ok=True)  # a restore between two saves is not training
  save(22, 114.0, 0.5, False)  # 114 - 111.25 - 1
  clock.t = 120.0
  g = timer.snapshot()
  assert g == Goodput(
    wall_s=20.0, productive_s=7.75, stall_s=1.25, startup_s=1.5, restore_s=4.0, steps=4
  )
  assert g.goodput_pct == pytest.approx(38.75) and g.other_s == pytest.approx(5.5)
  assert g.as_dict()["goodput_pct"] == pytest.approx(38.75)
  with pytest.raises(dataclasses.FrozenInstanceError):
    g.stall_s = 0.0  # type: ignore[misc]
  clock.t = 121.0
  timer.close()
  timer.close()  # once
  assert events.got[2:] == [
    {
      "event": "progress",
      "first_step": 22,
      "last_step": 22,
      "steps": 1,
      "train_s": 1.75,
      "stall_s": 0.5,
      "closed": True,
    }
  ]


def test_step_timer_without_a_restore_the_first_save_ends_the_start_up():
  clock, events = _Clock(0.0), _Events()
  timer = StepTimer(events, began=0.0, clock=clock)
  clock.t = 3.0
  timer.restored(2.0, ok=False)  # nothing restorable: the start-up goes on
  assert events.got == []
  clock.t = 7.0
  assert timer.save_began() == 7.0
  assert events.got == []  # the start-up ends as this save() returns (it waits for the set-up)
  clock.t = 7.5
  assert timer.snapshot().startup_s == 6.5
  timer.save_returned(0, 7.0, saved=True)  # adds no step and no stall
  assert events.got == [{"event": "startup", "startup_s": 6.5, "restore_s": 1.0, "age_s": 7.5}]
  clock.t = 9.0
  timer.save_returned(1, 8.5, saved=False)
  g = timer.snapshot()
  assert (g.steps, g.productive_s, g.stall_s, g.startup_s, g.restore_s) == (1, 1.0, 0.5, 6.5, 1.0)
  assert g.wall_s == 9.0


def test_goodput_before_anything_is_all_start_up():
  clock = _Clock(5.0)
  g = StepTimer(_Events(), began=0.0, clock=clock).snapshot()
  assert (g.wall_s, g.startup_s, g.productive_s, g.goodput_pct) == (5.0, 5.0, 0.0, 0.0)
  assert StepTimer(_Events(), began=5.0, clock=clock).snapshot().goodput_pct is None


# ---- the report's computation ---------------------------------------------------
T0 = 1_700_000_000.0


def ev(t, event, process=0, **fields):
  return {"event": event, "time": T0 + t, "process": process, "slice": process, **fields}


def _progress(t, first, last, steps, train, stall, process=0, **kw):
  return ev(
    t,
    "progress",
    process,
    first_step=first,
    last_step=last,
    steps=steps,
    train_s=train,
    stall_s=stall,
    **kw,
  )


def two_incarnations() -> list[dict]:
  """Process 0 trains to step 22 at 2 s a step, its log records progress up
  to step 20, crashes at 52 s; restarts at 60 s, restores step 18 and closes
  at 83 s. Process 1 trains 80 s in one incarnation."""
  return [
    ev(0, "run_start", 0, run_id="g"),
    ev(5, "startup", 0, startup_s=4.0, restore_s=0.0),
    ev(20, "save", 0, step=10, tiers=["local"], stall_s=0.5),
    _progress(25, 1, 10, 10, 20.0, 1.0),
    _progress(45, 11, 20, 10, 20.0, 1.0),
    ev(52, "save", 0, step=22, tiers=["local"], stall_s=0.5),  # then it crashes
    ev(60, "run_start", 0, run_id="g"),
    ev(63, "restore", 0, step=18, source="local", duration_s=2.0, error=None),
    ev(64, "startup", 0, startup_s=2.0, restore_s=2.0),
    _progress(80, 19, 28, 10, 15.0, 1.0),
    _progress(83, 29, 29, 1, 1.5, 0.5, closed=True),
    ev(0, "run_start", 1, run_id="g"),
    ev(1, "startup", 1, startup_s=1.0, restore_s=0.0),
    _progress(83, 1, 40, 40, 80.0, 1.0, process=1, closed=True),
  ]


def test_goodput_per_incarnation_process_and_run():
  g = goodput_summary(two_incarnations(), T0, T0 + 83)
  first, second, other = g["incarnations"]
  # 52 s: 40 s trained, of which steps 19-20 (4 s) were redone, and 21-22
  # (4 s, after the last progress event) out of "other"
  assert (first["process"], first["began_s"], first["wall_s"]) == (0, 0.0, 52.0)
  assert (first["closed"], first["failed"], first["newest_step"]) == (False, True, 22)
  assert (first["lost_steps"], first["lost_s"]) == (4, 8.0)
  assert first["productive_s"] == pytest.approx(36.0)
  assert (first["stall_s"], first["restore_s"], first["startup_s"]) == (2.0, 0.0, 4.0)
  assert first["other_s"] == pytest.approx(2.0)
  assert first["goodput_pct"] == pytest.approx(100 * 36 / 52)
  # 23 s from the construction (60 s): 2 s restore, 2 s start-up, 16.5 s trained
  assert (second["began_s"], second["wall_s"], second["restored_step"]) == (60.0, 23.0, 18)
  assert (second["closed"], second["failed"], second["steps"]) == (True, False, 11)
  assert (second["productive_s"], second["stall_s"]) == (16.5, 1.5)
  assert (second["restore_s"], second["startup_s"], second["lost_s"]) == (2.0, 2.0, 0.0)
  assert second["other_s"] == pytest.approx(1.0)
  p0, p1 = g["per_process"]
  assert (p0["incarnations"], p0["failures"], p0["lost_steps"]) == (2, 1, 4)
  assert p0["productive_s"] == pytest.approx(52.5)
  assert p0["down_s"] == pytest.approx(8.0)  # 52 s to 60 s
  parts = ("productive_s", "stall_s", "restore_s", "startup_s", "lost_s", "other_s", "down_s")
  assert sum(p0[k] for k in parts) == pytest.approx(83.0)
  assert p1["goodput_pct"] == pytest.approx(100 * 80 / 83) and p1["failures"] == 0
  assert other["closed"] and other["other_s"] == pytest.approx(1.0)
  # the run: its worst process
  assert g["process"] == 0 and g["wall_s"] == 83.0
  assert g["goodput_pct"] == pytest.approx(100 * 52.5 / 83)
  assert (g["stall_s"], g["restore_s"], g["startup_s"], g["lost_s"]) == (3.5, 2.0, 6.0, 8.0)


def test_a_fresh_start_after_a_crash_redoes_everything_trained_before():
  """Killed before any checkpoint: the next incarnation restores nothing and
  trains from step 1 again, so the first one's 20 s of training are redone."""
  events = [
    ev(0, "run_start", 0, run_id="g"),
    ev(2, "startup", 0, startup_s=2.0, restore_s=0.0),
    _progress(22, 1, 10, 10, 20.0, 0.0),
    ev(23, "run_start", 0, run_id="g"),
    ev(25, "startup", 0, startup_s=2.0, restore_s=0.0),
    _progress(45, 1, 10, 10, 20.0, 0.0, closed=True),
  ]
  g = goodput_summary(events, T0, T0 + 45)
  first, second = g["incarnations"]
  assert (first["lost_steps"], first["lost_s"], first["productive_s"]) == (10, 20.0, 0.0)
  assert (second["lost_steps"], second["productive_s"]) == (0, 20.0)
  assert g["goodput_pct"] == pytest.approx(100 * 20 / 45)


def test_train_step_durations_price_the_redone_steps():
  events = two_incarnations()[:11]
  events += [
    ev(50 + i / 10, "train_step", 0, step=s, duration_s=1.5) for i, s in enumerate(range(17, 23))
  ]
  first = goodput_summary(events, T0, T0 + 83)["incarnations"][0]
  # steps 19-22 at 1.5 s; 19-20 were in the progress events' train_s
  assert (first["lost_steps"], first["lost_s"]) == (4, 6.0)
  assert first["productive_s"] == pytest.approx(37.0)
  assert first["other_s"] == pytest.approx(6.0 - 3.0)


def test_a_crash_during_start_up_is_start_up_and_old_logs_have_no_goodput():
  events = [
    ev(0, "run_start", 0),
    ev(1, "startup", 0, startup_s=1.0, restore_s=0.0),
    _progress(11, 1, 10, 10, 9.0, 0.5, closed=True),
    ev(20, "run_start", 0),
    ev(30, "restore", 0, step=None, source=None, duration_s=4.0, error="hung"),
  ]
  g = goodput_summary(events, T0, T0 + 30)
  crashed = g["incarnations"][1]
  assert (crashed["failed"], crashed["restore_s"], crashed["startup_s"]) == (True, 4.0, 6.0)
  assert g["down_s"] == pytest.approx(9.0) and g["goodput_pct"] == pytest.approx(30.0)
  old = [e for e in events if e["event"] in ("run_start", "restore")]
  g = goodput_summary(old, T0, T0 + 30)
  assert g["goodput_pct"] is None and g["process"] is None
  assert [i["failed"] for i in g["incarnations"]] == [True, False]  # a restart followed the first


def test_report_shows_the_goodput(tmp_path, capsys):
  path = tmp_path / "events.jsonl"
  path.write_text("".join(json.dumps(e) + "\n" for e in two_incarnations()))
  assert cli_main(["report", str(path), "--json"]) == 0
  s = json.loads(capsys.readouterr().out)
  assert s["goodput"]["goodput_pct"] == pytest.approx(100 * 52.5 / 83)
  assert len(s["goodput"]["incarnations"]) == 3
  (restore,) = s["restores"]  # no train_step events: redone work from the progress events
  assert (restore["newest_trained"], restore["redone_steps"], restore["redone_s"]) == (22, 4, 8.0)
  assert cli_main(["report", str(path)]) == 0
  out = capsys.readouterr().out
  assert "goodput              63.25 % (process 0: 52.5 s productive of 83.0 s wall time)" in out
  assert (
    "time lost            save stalls 3.5 s (4.2 %), restores 2.0 s (2.4 %),"
    " start-up 6.0 s (7.2 %), redone work 8.0 s (9.6 %, 4 steps), down 8.0 s (9.6 %),"
    " other 3.0 s (3.6 %)"
  ) in out
  assert "no close: FAILED" in out


def test_report_png_marks_failures(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  path = tmp_path / "events.jsonl"
  path.write_text("".join(json.dumps(e) + "\n" for e in two_incarnations()))
  assert cli_main(["report", str(path), "--png", str(tmp_path / "t.png")]) == 0
  assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- a real manager ------------------------------------------------------------
def test_manager_records_progress_and_startup_and_report_counts_them(
  options, mesh, tmp_path, capsys
):
  import emergency_ckpt as ec  # noqa: PLC0415
  from tests.helpers import abstract  # noqa: PLC0415
  from tests.single_slice import state  # noqa: PLC0415

  log = tmp_path / "events_{process}.jsonl"
  opts = dataclasses.replace(
    options,
    event_log=str(log),
    persistent=dataclasses.replace(options.persistent, save_interval_steps=1000),
  )
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    assert mngr.latest_step() is None
    for step in range(20):  # local saves at even steps
      time.sleep(0.01)  # "training"
      mngr.save(step, state(mesh, float(step)))
    g = mngr.goodput()
    assert isinstance(g, ec.Goodput) and g.steps == 19  # step 0's save ended the start-up
    assert g.productive_s >= 19 * 0.01 and g.restore_s == 0.0 and g.startup_s > 0
    assert g.wall_s >= g.productive_s + g.stall_s + g.startup_s
  path = tmp_path / "events_0.jsonl"
  events = telemetry.read_events(path)
  (startup,) = [e for e in events if e["event"] == "startup"]
  assert startup["restore_s"] == 0.0
  # recorded as step 0's save() returned: the construction began before run_start
  (run_start,) = [e for e in events if e["event"] == "run_start"]
  assert startup["time"] - startup["startup_s"] <= run_start["time"] + 1e-3
  assert startup["startup_s"] == pytest.approx(g.startup_s, abs=1e-5)
  progress = [e for e in events if e["event"] == "progress"]
  assert progress[-1]["closed"] is True and all("closed" not in e for e in progress[:-1])
  assert sum(e["steps"] for e in progress) == 19
  assert (progress[0]["first_step"], progress[-1]["last_step"]) == (1, 19)
  assert sum(e["train_s"] for e in progress) == pytest.approx(g.productive_s, abs=1e-5)
  assert sum(e["stall_s"] for e in progress) == pytest.approx(g.stall_s, abs=1e-5)

  # a second incarnation restores step 18: step 19 is redone
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    assert mngr.restore(abstract(mesh)).step == 18
    mngr.save(19, state(mesh, 19.0))
    g2 = mngr.goodput()
    assert g2.restore_s > 0 and g2.steps == 1
  events = telemetry.read_events(path)
  startups = [e for e in events if e["event"] == "startup"]
  assert len(startups) == 2 and startups[1]["restore_s"] == pytest.approx(g2.restore_s, abs=1e-5)
  # recorded as step 19's save() returned: its start-up is the restore's, plus that call
  assert startups[1]["startup_s"] == pytest.approx(g2.startup_s, abs=1e-5)
  run_starts = [e for e in events if e["event"] == "run_start"]
  assert startups[1]["time"] - startups[1]["age_s"] <= run_starts[1]["time"] + 1e-3

  assert cli_main(["report", str(path), "--json"]) == 0
  s = json.loads(capsys.readouterr().out)["goodput"]
  first, second = s["incarnations"]
  assert (first["closed"], first["failed"], first["steps"], first["lost_steps"]) == (
    True,
    False,
    19,
    1,
  )
  train = sum(e["train_s"] for e in progress)
  assert first["lost_s"] == pytest.approx(train / 19)
  assert first["productive_s"] == pytest.approx(train - train / 19)
  assert (second["restored_step"], second["steps"], second["closed"]) == (18, 1, True)
  assert s["lost_steps"] == 1 and 0 < s["goodput_pct"] < 100
  assert cli_main(["report", str(path)]) == 0
  out = capsys.readouterr().out
  assert f"goodput              {s['goodput_pct']:.2f} % (process 0:" in out
  assert "%, 1 steps)" in out and "goodput per incarnation" in out
