"""The per-tier health bookkeeping behind CheckpointManager.health() (pure logic)."""

from __future__ import annotations

import json
import threading

from emergency_ckpt.core.health import SKIPS_KEPT, HealthTracker


class Clock:
  def __init__(self):
    self.t = 100.0

  def __call__(self) -> float:
    return self.t


def test_a_fresh_tracker_is_healthy_and_empty():
  h = HealthTracker(["local", "persistent"]).snapshot()
  assert set(h) == {"local", "persistent"} and h.ok and h.problems() == []
  assert h["persistent"].newest_durable_step is None and h["persistent"].in_flight == ()
  assert h["persistent"].oldest_in_flight_s is None


def test_in_flight_age_names_the_oldest_operation():
  clock = Clock()
  tr = HealthTracker(["persistent"], clock=clock)
  tr.begin("persistent", 3, "upload")
  clock.t += 5
  tr.begin("persistent", 6, "upload")
  clock.t += 2.5
  p = tr.snapshot()["persistent"]
  assert p.in_flight == ("upload of step 3", "upload of step 6")
  assert p.oldest_in_flight_s == 7.5
  assert tr.in_flight("persistent") == ((3, "upload"), 7.5)
  tr.end("persistent", 3)
  assert tr.snapshot()["persistent"].oldest_in_flight_s == 2.5
  assert tr.snapshot()["persistent"].newest_durable_step == 3


def test_failures_count_until_a_success_and_keep_the_last_error():
  tr = HealthTracker(["local"])
  for step in (1, 2):
    tr.begin("local", step, "write")
    tr.end("local", step, error=f"ENOSPC at step {step}")
  h = tr.snapshot()
  assert not h.ok and h["local"].consecutive_failures == 2
  assert h["local"].last_error == "ENOSPC at step 2"
  assert h.problems() == ["local: 2 failure(s) in a row, last: ENOSPC at step 2"]
  tr.end("local", 3)
  h = tr.snapshot()
  assert h.ok and h["local"].consecutive_failures == 0 and h["local"].newest_durable_step == 3
  assert h["local"].last_error == "ENOSPC at step 2"  # the history stays readable


def test_newest_durable_never_goes_back():
  tr = HealthTracker(["persistent"])
  tr.end("persistent", 9)
  tr.end("persistent", 6)  # a slower, older upload ending late
  assert tr.snapshot()["persistent"].newest_durable_step == 9


def test_skips_are_counted_all_and_kept_newest():
  tr = HealthTracker(["persistent"])
  for step in range(SKIPS_KEPT + 5):
    tr.skip("persistent", step)
  p = tr.snapshot()["persistent"]
  assert p.skipped_total == SKIPS_KEPT + 5
  assert p.skipped_steps == tuple(range(5, SKIPS_KEPT + 5))
  assert p.ok  # skipping is degraded service, not a failure


def test_a_tier_first_named_later_is_tracked_and_the_snapshot_is_json():
  tr = HealthTracker(["local"])
  tr.end("xor", 4, error="member 2 gone")
  doc = json.loads(json.dumps(tr.snapshot().as_dict()))
  assert doc["xor"]["consecutive_failures"] == 1 and doc["xor"]["ok"] is False
  assert doc["local"]["ok"] is True


def test_concurrent_updates_lose_nothing():
  tr = HealthTracker(["local"])

  def work(base: int) -> None:
    for i in range(500):
      tr.begin("local", base + i, "write")
      tr.end("local", base + i)
      tr.skip("local", base + i)

  threads = [threading.Thread(target=work, args=(k * 1000,)) for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  h = tr.snapshot()["local"]
  assert h.skipped_total == 2000 and h.in_flight == () and h.newest_durable_step == 3499


def test_report_logs_problems_once_per_change(caplog):
  tr = HealthTracker(["persistent"])
  with caplog.at_level("WARNING", logger="emergency_ckpt"):
    assert tr.report("[p0]").ok
    tr.skip("persistent", 6)
    tr.report("[p0]")
    tr.report("[p0]")  # the same problems: no second warning
    tr.skip("persistent", 9)
    h = tr.report("[p0]")
  warnings = [r.getMessage() for r in caplog.records]
  assert len(warnings) == 2, warnings
  assert "[p0] checkpointing is degraded" in warnings[0] and "newest [6]" in warnings[0]
  assert "newest [6, 9]" in warnings[1]
  assert h["persistent"].skipped_total == 2


def test_a_tier_that_went_down_is_a_failure_counted_once_until_it_works():
  tr = HealthTracker(["partner"])
  tr.down("partner", "the partner receiver stopped: EMFILE")
  tr.down("partner", "the partner receiver stopped: EMFILE")  # asked again: the same failure
  p = tr.snapshot()["partner"]
  assert (p.consecutive_failures, p.ok) == (1, False) and "EMFILE" in p.last_error
  tr.end("partner", 7)
  assert tr.snapshot()["partner"].ok
