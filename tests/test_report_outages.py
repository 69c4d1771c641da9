"""`emergency-ckpt report`'s outages, from synthetic event logs (pure logic)."""

from __future__ import annotations

import json

from emergency_ckpt.cli import main as cli_main
from emergency_ckpt.cli.outages import find_outages


def _save(t, step, tiers=("local", "persistent"), process=0):
  return {"event": "save", "time": t, "step": step, "tiers": list(tiers), "process": process}


def _durable(t, step, tier="persistent", error=None, process=0):
  return {
    "event": "save_durable",
    "time": t,
    "step": step,
    "tier": tier,
    "error": error,
    "process": process,
  }


def _skipped(t, step, tier="persistent", process=0):
  return {"event": "save_skipped", "time": t, "step": step, "tier": tier, "process": process}


def _run_with_outage():
  """Persistent saves every 3rd step (no local events: a separate tier)."""
  p = ("persistent",)
  return [
    _save(100.0, 3, p),
    _durable(101.0, 3),
    _save(103.0, 6, p),  # its upload hangs
    _save(106.0, 9, p),
    _skipped(106.0, 9),
    _save(109.0, 12, p),
    _skipped(109.0, 12),
    _save(112.0, 15, p),  # the bucket is back: 6 fails at last, 15 goes
    _durable(113.0, 6, error="StorageError: timed out"),
    _durable(116.0, 15),
    _save(118.0, 18, p),
    _durable(119.0, 18),
  ]


def test_an_outage_is_found_with_its_skips_and_its_catch_up():
  (o,) = find_outages(_run_with_outage(), 100.0)
  assert o["tier"] == "persistent"
  assert o["steps"] == [6, 9, 12]
  assert (o["skipped"], o["failed"]) == (2, 1)
  assert o["began_s"] == 3.0 and o["ended_s"] == 16.0 and o["duration_s"] == 13.0
  assert o["caught_up_step"] == 15 and o["catch_up_s"] == 4.0


def test_a_healthy_run_has_no_outage_and_slow_steps_are_not_one():
  events = [_save(0.0, 3, ("persistent",)), _save(1.0, 6, ("persistent",))]
  events += [_durable(5.0, 3), _durable(6.0, 6)]
  assert find_outages(events, 0.0) == []


def test_an_outage_still_going_at_the_end_says_so():
  p = ("persistent",)
  events = [_save(0.0, 3, p), _durable(1.0, 3), _save(3.0, 6, p), _save(6.0, 9, p)]
  events.append(_skipped(6.0, 9))
  (o,) = find_outages(events, 0.0)
  assert o["steps"] == [6, 9] and o["ended_s"] is None and o["duration_s"] is None
  assert o["caught_up_step"] is None


def test_every_process_counts_once_and_tiers_are_apart():
  events = []
  for p in (0, 1):  # two processes of the primary slice: the same skips, the same steps
    events += [dict(e, process=p) for e in _run_with_outage()]
  events.append(_durable(104.0, 7, tier="local", error="OSError: No space left on device"))
  events.append(_save(104.0, 7, tiers=("local",)))
  events.append(_durable(105.0, 8, tier="local"))
  events.append(_save(104.5, 8, tiers=("local",)))
  outages = find_outages(events, 100.0)
  assert [(o["tier"], o["steps"], o["skipped"]) for o in outages] == [
    ("persistent", [6, 9, 12], 2),
    ("local", [7], 0),
  ]


def test_the_report_command_shows_outages(tmp_path, capsys):
  log = tmp_path / "events_0.jsonl"
  log.write_text("".join(json.dumps(e) + "\n" for e in _run_with_outage()))
  assert cli_main(["report", str(log)]) == 0
  text = capsys.readouterr().out
  assert "outages (1)" in text and "step 15" in text
  assert cli_main(["report", "--json", str(log)]) == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["outages"][0]["skipped"] == 2
