"""Unit tests of the JSON-lines event log (emergency_ckpt.core.telemetry)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import numpy as np
import pytest

from emergency_ckpt.core.telemetry import EventLog, format_event, read_events


def lines(path) -> list[dict]:
  with open(path) as f:
    text = f.read()
  assert text.endswith("\n")
  return [json.loads(line) for line in text.splitlines()]


def test_record_appends_one_json_line(tmp_path):
  path = tmp_path / "logs" / "events_0.jsonl"  # the folder is created
  t0 = time.time()
  with EventLog(path, process=3, slice=1) as log:
    rec = log.record("save", step=30, tiers=["local", "persistent"], bytes=4096, stall_s=0.012)
    got = lines(path)  # on the file as soon as record() returns
    assert got == [rec]
    log.record("restore", step=30, source="peer", duration_s=1.5, bytes=1, error=None, tried=[40])
  assert rec["event"] == "save" and rec["process"] == 3 and rec["slice"] == 1
  assert t0 <= rec["time"] <= time.time()
  assert list(rec)[:4] == ["event", "time", "process", "slice"]
  assert rec["tiers"] == ["local", "persistent"] and rec["stall_s"] == 0.012
  got = lines(path)
  assert [e["event"] for e in got] == ["save", "restore"]
  assert got[1]["error"] is None and got[1]["tried"] == [40]
  # A restarted process appends to the same file.
  with EventLog(path, process=3, slice=1) as log:
    log.record("run_start", run_id="r1", topology={"process_count": 4})
  assert [e["event"] for e in lines(path)] == ["save", "restore", "run_start"]


def test_values_json_cannot_hold_are_converted(tmp_path):
  path = tmp_path / "e.jsonl"
  with EventLog(path, process=0, slice=0) as log:
    log.record("save", step=np.int64(7), stall_s=np.float32(0.5), shape=np.arange(3), tag={1})
    cyclic = []
    cyclic.append(cyclic)
    log.record("odd", value=cyclic)  # kept, as a repr, not raised
  got = lines(path)
  assert got[0]["step"] == 7 and got[0]["stall_s"] == 0.5 and got[0]["shape"] == [0, 1, 2]
  assert got[0]["tag"] == [1]
  assert got[1]["event"] == "odd" and got[1]["process"] == 0 and isinstance(got[1]["value"], str)


def test_reserved_field_names_are_refused(tmp_path):
  log = EventLog(None, process=0, slice=0)
  with pytest.raises(ValueError, match="reserved"):
    log.record("save", time=1.0)
  with pytest.raises(ValueError, match="reserved"):
    log.record("save", process=1)


def test_thread_safe_appends(tmp_path):
  path = tmp_path / "e.jsonl"
  log = EventLog(path, process=0, slice=0)
  threads, per_thread = 8, 200
  payload = "x" * 3000  # records longer than a pipe buffer still stay whole

  def work(k):
    for i in range(per_thread):
      log.record("train_step", thread=k, step=i, pad=payload)

  ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
  for t in ts:
    t.start()
  for t in ts:
    t.join()
  log.close()
  got = lines(path)
  assert len(got) == threads * per_thread
  for k in range(threads):
    assert sorted(e["step"] for e in got if e["thread"] == k) == list(range(per_thread))


def test_logs_a_readable_line_with_the_prefix(caplog):
  log = EventLog(None, process=2, slice=1)  # no file: logging only
  with caplog.at_level(logging.INFO, logger="emergency_ckpt"):
    log.record("save", step=30, tiers=["local", "persistent"], bytes=4096, stall_s=0.0123456)
    log.record("save_durable", step=30, tier="persistent", durable_s=2.5, error="bucket gone")
    log.record("restore", step=20, source="peer", error=None)
  recs = [r for r in caplog.records if r.name == "emergency_ckpt"]
  assert [r.levelno for r in recs] == [logging.INFO, logging.WARNING, logging.INFO]
  msgs = [r.getMessage() for r in recs]
  assert msgs[0] == (
    "[process=2][slice=1] save step=30 tiers=local,persistent bytes=4096 stall_s=0.01235"
  )
  assert msgs[1].startswith("[process=2][slice=1] save_durable step=30 tier=persistent")
  assert msgs[1].endswith("error='bucket gone'")
  assert msgs[2] == "[process=2][slice=1] restore step=20 source=peer"  # None left out


def test_format_event_of_a_read_record():
  rec = {"event": "save_failed", "time": 1.0, "process": 0, "slice": 0, "step": 5, "error": "x"}
  assert format_event(rec) == "[process=0][slice=0] save_failed step=5 error=x"


def test_unwritable_path_never_raises_and_warns_once(tmp_path, caplog):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with caplog.at_level(logging.INFO, logger="emergency_ckpt"):
    log = EventLog(blocker / "sub" / "e.jsonl", process=0, slice=0)  # parent is a file
    rec = log.record("save", step=1)
    log.record("save", step=2)
  assert rec["step"] == 1
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "not writable" in warnings[0].getMessage()


def test_write_failure_after_open_never_raises(tmp_path, caplog):
  log = EventLog(tmp_path / "e.jsonl", process=0, slice=0)
  os.close(log._fd)  # the file descriptor goes bad under the log
  with caplog.at_level(logging.WARNING, logger="emergency_ckpt"):
    log.record("save", step=1)
    log.record("save", step=2)
  assert sum("not writable" in r.getMessage() for r in caplog.records) == 1
  log._fd = None


def test_read_events_tolerates_a_torn_last_line(tmp_path, caplog):
  path = tmp_path / "e.jsonl"
  with EventLog(path, process=0, slice=0) as log:
    log.record("save", step=10)
    log.record("save", step=20)
  with open(path, "a") as f:
    f.write('{"event": "save", "time": 12')  # a crash in the middle of a write
  with caplog.at_level(logging.WARNING, logger="emergency_ckpt"):
    got = read_events(path)
  assert [e["step"] for e in got] == [10, 20]
  assert not caplog.records  # a torn last line is expected, not warned about

  # The restarted process appends right after the torn piece.
  with EventLog(path, process=0, slice=0) as log:
    log.record("run_start", run_id="r")
  with open(path, "a") as f:
    f.write("not json\n")
  with EventLog(path, process=0, slice=0) as log:
    log.record("save", step=30)
  with caplog.at_level(logging.WARNING, logger="emergency_ckpt"):
    got = read_events(path)
  assert [e["event"] for e in got] == ["save", "save", "run_start", "save"]
  assert sum("skipped 1 unreadable" in r.getMessage() for r in caplog.records) == 1


def test_read_events_merges_files_by_time(tmp_path):
  a, b = tmp_path / "logs" / "p0.jsonl", tmp_path / "logs" / "p1.jsonl"
  a.parent.mkdir()
  a.write_text(
    "".join(json.dumps({"event": "e", "time": t, "process": 0}) + "\n" for t in (1, 3, 5))
  )
  b.write_text("".join(json.dumps({"event": "e", "time": t, "process": 1}) + "\n" for t in (2, 4)))
  (tmp_path / "logs" / "notes.txt").write_text("ignored")
  assert [e["time"] for e in read_events([a, b])] == [1, 2, 3, 4, 5]
  assert [e["process"] for e in read_events(tmp_path / "logs")] == [0, 1, 0, 1, 0]
  with pytest.raises(OSError):
    read_events(tmp_path / "missing.jsonl")
