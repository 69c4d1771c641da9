"""The demo's run (./scripts/demo: 2 slices x 2 processes, a stop at step 33,
a restart from step 30) through `emergency-ckpt report`: the goodput
breakdown of every process incarnation, in seconds and shares of the wall
time. One real run (three 4-process CPU jobs)."""

from __future__ import annotations

import json
import os

import pytest

from emergency_ckpt.cli import main as cli_main
from emergency_ckpt.cli.goodput import PARTS
from emergency_ckpt.demo.main import run


@pytest.fixture(scope="module")
def events(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("demo"))
  assert run(root) == 0
  return os.path.join(root, "events")


def test_the_demo_report_splits_each_incarnation_s_time(events, capsys):
  assert cli_main(["report", events, "--json"]) == 0
  g = json.loads(capsys.readouterr().out)["goodput"]
  incs = g["incarnations"]
  assert len(incs) == 8 and all(i["closed"] and not i["failed"] for i in incs)
  first = [i for i in incs if i["index"] == 0]
  second = [i for i in incs if i["index"] == 1]
  assert [i["lost_steps"] for i in first] == [3] * 4  # 31..33, redone after the restore of 30
  assert [(i["restored_step"], i["steps"]) for i in second] == [(30, 10)] * 4
  assert all(i["steps"] == 32 for i in first)  # step 1's save() call ended the start-up
  for i in incs:
    assert sum(i[k] for k in PARTS) == pytest.approx(i["wall_s"], abs=0.01), i
    assert i["startup_s"] > 0 and i["productive_s"] > 0, i
    # the manager's set-up (Orbax) ends in the first save() call: start-up, not a
    # save stall (the demo's saves stall milliseconds)
    assert i["stall_s"] < 0.5, i
  assert g["lost_steps"] == 3 and 0 < g["goodput_pct"] < 100
  assert cli_main(["report", events]) == 0
  out = capsys.readouterr().out
  (lost,) = [line for line in out.splitlines() if line.startswith("time lost")]
  for part in ("save stalls", "restores", "start-up", "redone work", "down", "other"):
    assert f"{part} " in lost and " %" in lost.split(f"{part} ")[1].split(",")[0], lost
  assert "3 steps" in lost
