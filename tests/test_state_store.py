"""Unit tests of the JSON-per-process state store on a local directory."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from etils import epath

from emergency_ckpt.core.layout import COMMIT_FILE as COMMIT
from emergency_ckpt.core.layout import state_file_name as file_name
from emergency_ckpt.core.storage import write_bytes
from emergency_ckpt.errors import CorruptCheckpointError, DataStateError
from emergency_ckpt.state.data_state import validate_data_state
from emergency_ckpt.state.store import StateStore

N = 3


def stores(root, n=N):
  return [StateStore(root, process_index=i, process_count=n) for i in range(n)]


def payload(process: int, step: int) -> dict:
  return {
    "iterator": {"epoch": step // 10, "position": step * 7 + process, "seed": 1234567890123},
    "lr": 0.1 / (process + 1),
    "tags": ["a", "b", None, True, -0.0],
    "name": f"p{process}-\u00e9",
  }


def save_step(root, step, *, commit=True, skip=()):
  ss = stores(root)
  for s in ss:
    if s._me not in skip:
      s.write(step, payload(s._me, step))
  if commit:
    assert ss[0].commit(step, timeout_s=1.0)
  return ss


def test_write_commit_read_round_trip(tmp_path):
  ss = save_step(tmp_path, 10)
  save_step(tmp_path, 20)
  for s in ss:
    for step in (10, 20):
      got = s.read(step)
      assert got == payload(s._me, step)
      assert json.dumps(got, sort_keys=True) == json.dumps(payload(s._me, step), sort_keys=True)
  # Any process can read another's file explicitly.
  assert ss[0].read(20, process=2) == payload(2, 20)
  assert ss[0].committed_steps() == [10, 20]
  assert ss[2].is_committed(10)
  names = sorted(os.listdir(tmp_path / "10"))
  assert names == sorted([COMMIT] + [file_name(p, N) for p in range(N)])


def test_none_data_state_round_trips(tmp_path):
  ss = stores(tmp_path)
  for s in ss:
    s.write(5, None)
  assert ss[0].commit(5, timeout_s=1.0)
  assert [s.read(5) for s in ss] == [None, None, None]


def test_committed_steps_excludes_missing_commit(tmp_path):
  ss = save_step(tmp_path, 10)
  save_step(tmp_path, 20, commit=False)
  assert ss[0].committed_steps() == [10]
  assert not ss[0].is_committed(20)
  assert ss[0].listed_steps() == [10, 20]


def test_json_deleted_after_commit_is_never_loaded(tmp_path):
  """COMMIT alone makes a step committed (no listing of its folder, issue
  15); a file deleted after COMMIT is caught where it is read: its process's
  read() raises, so restore rejects the step (restorer._try_load -> state_ok
  False -> restore_plan rejects it on every process; proven end to end by
  test_faults_damage's state.json_missing and test_multiprocess_core's
  e_json_missing). The offline check (fully_committed, the CLI) excludes it."""
  ss = save_step(tmp_path, 10)
  save_step(tmp_path, 20)
  os.remove(tmp_path / "20" / file_name(1, N))
  assert ss[0].committed_steps() == [10, 20]
  assert ss[0].is_committed(20) and ss[0].is_committed(10)
  assert not ss[0].fully_committed(20) and ss[0].fully_committed(10)
  assert list(ss[0].fully_committed_records()) == [10]
  with pytest.raises(CorruptCheckpointError, match="missing"):
    ss[1].read(20)
  assert ss[0].read(20) == payload(0, 20) and ss[1].read(10) == payload(1, 10)


@pytest.mark.parametrize(
  "marker",
  [
    b"",
    b"{not json",
    b"[]",
    json.dumps({"format": "other/1", "step": 20}).encode(),
    json.dumps({"format": "emergency_ckpt.state/1", "step": 20}).encode(),
    json.dumps({"format": "emergency_ckpt.state/1", "step": 20, "process_count": "3"}).encode(),
  ],
  ids=["empty", "garbage", "not_a_dict", "wrong_format", "no_count", "count_not_int"],
)
def test_committed_steps_excludes_bad_marker(tmp_path, marker):
  ss = save_step(tmp_path, 20)
  (tmp_path / "20" / COMMIT).write_bytes(marker)
  assert ss[0].committed_steps() == []


def test_commit_copied_from_another_step_does_not_count(tmp_path):
  ss = save_step(tmp_path, 10)
  save_step(tmp_path, 20, commit=False)
  (tmp_path / "20" / COMMIT).write_bytes((tmp_path / "10" / COMMIT).read_bytes())
  assert ss[0].committed_steps() == [10]


def test_listed_steps_ignores_other_names(tmp_path):
  ss = save_step(tmp_path, 3)
  for name in ("tmp", "12abc", "007", "+4", "\u00b2", "\u0663"):  # "²", Arabic-Indic 3
    (tmp_path / name).mkdir()
  assert ss[0].listed_steps() == [3]
  assert ss[0].committed_steps() == [3]
  assert StateStore(tmp_path / "absent", process_index=0, process_count=1).committed_steps() == []


def _file(root, step, process):
  return root / str(step) / file_name(process, N)


def test_read_truncated_file(tmp_path):
  ss = save_step(tmp_path, 10)
  path = _file(tmp_path, 10, 1)
  raw = path.read_bytes()
  path.write_bytes(raw[: len(raw) // 2])
  with pytest.raises(CorruptCheckpointError, match="unreadable"):
    ss[1].read(10)
  assert ss[0].read(10) == payload(0, 10)  # others unaffected


@pytest.mark.parametrize(
  "edit",
  [
    lambda doc: doc["data_state"]["iterator"].update(position=999),
    lambda doc: doc["data_state"].update(extra=1),
    lambda doc: doc.update(crc32=doc["crc32"] ^ 1),
    lambda doc: doc.update(step=11),  # a file copied from another step
    lambda doc: doc.update(format="other/1"),
  ],
  ids=["value", "added_key", "crc", "step", "format"],
)
def test_read_edited_file_fails_checksum(tmp_path, edit):
  ss = save_step(tmp_path, 10)
  path = _file(tmp_path, 10, 2)
  doc = json.loads(path.read_bytes())
  edit(doc)
  path.write_bytes(json.dumps(doc).encode())
  with pytest.raises(CorruptCheckpointError, match="checksum"):
    ss[2].read(10)


@pytest.mark.parametrize(
  "text",
  ['{"format": "emergency_ckpt.state/1", "step": 10}', "[1, 2]", "\xff\xfe"],
  ids=["no_keys", "not_object", "not_utf8"],
)
def test_read_malformed_file(tmp_path, text):
  ss = save_step(tmp_path, 10)
  _file(tmp_path, 10, 0).write_bytes(text.encode("latin-1"))
  with pytest.raises(CorruptCheckpointError):
    ss[0].read(10)


def test_read_missing_file(tmp_path):
  ss = save_step(tmp_path, 10)
  os.remove(_file(tmp_path, 10, 1))
  with pytest.raises(CorruptCheckpointError, match="missing"):
    ss[1].read(10)
  with pytest.raises(CorruptCheckpointError, match="missing"):
    ss[0].read(99)


@pytest.mark.parametrize(
  "data_state,where",
  [
    ({"seen": {1, 2}}, "data_state['seen'] (a set)"),
    ({"n": np.int64(3)}, "data_state['n'] (a int64)"),
    ({"x": np.float32(1.5)}, "data_state['x'] (a float32)"),
    ({"ok": np.bool_(True)}, "data_state['ok']"),
    ({"raw": b"\x00\x01"}, "data_state['raw'] (a bytes)"),
    ({"loss": float("nan")}, "data_state['loss'] (non-finite float nan)"),
    ({"loss": float("-inf")}, "data_state['loss'] (non-finite float -inf)"),
    ({1: "one"}, "data_state[1] (key is int, must be str)"),
    ({"outer": {(1, 2): "t"}}, "data_state['outer'][(1, 2)] (key is tuple"),
    ({"a": [1, "x", {"b": [0, {3}]}]}, "data_state['a'][2]['b'][1] (a set)"),
    ({"a": [1.0, float("inf")]}, "data_state['a'][1]"),
    ({"arr": np.zeros(2)}, "data_state['arr'] (a ndarray)"),
  ],
)
def test_validate_data_state_names_bad_key(data_state, where):
  with pytest.raises(DataStateError) as info:
    validate_data_state(data_state)
  assert where in str(info.value)
  assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("data_state", [[1, 2], "state", 3, (1,)])
def test_validate_data_state_rejects_non_dict(data_state):
  with pytest.raises(DataStateError, match="must be a dict"):
    validate_data_state(data_state)


@pytest.mark.parametrize(
  "data_state",
  [None, {}, {"a": 1, "b": [1.5, "x", None, True, {"c": []}], "big": 2**70, "neg": -0.0}],
)
def test_validate_data_state_accepts_json(data_state):
  validate_data_state(data_state)


def test_commit_times_out_when_a_file_is_missing(tmp_path):
  ss = save_step(tmp_path, 10, commit=False, skip=(2,))
  t0 = time.monotonic()
  assert ss[0].commit(10, timeout_s=0.3) is False
  elapsed = time.monotonic() - t0
  assert 0.3 <= elapsed < 3.0
  assert not (tmp_path / "10" / COMMIT).exists()
  assert ss[0].committed_steps() == []
  assert ss[0].missing(10) == [2]
  ss[2].write(10, payload(2, 10))
  assert ss[0].commit(10, timeout_s=0.3) is True
  assert ss[0].committed_steps() == [10]


def test_commit_waits_for_a_late_writer(tmp_path):
  import threading

  ss = save_step(tmp_path, 10, commit=False, skip=(1,))
  timer = threading.Timer(0.2, lambda: ss[1].write(10, payload(1, 10)))
  timer.start()
  try:
    assert ss[0].commit(10, timeout_s=5.0, poll_s=0.02) is True
  finally:
    timer.join()
  assert ss[0].committed_steps() == [10]


def test_commit_lists_once_when_the_written_hint_says_every_file_is_there(tmp_path, monkeypatch):
  """With the coordination service's counter as a hint (issue 15), the
  primary waits on it, then lists the step's folder once; a hint that lies
  (says ready too early) costs polling, never a wrong COMMIT."""
  import threading

  from emergency_ckpt.core import storage

  listings = []
  real = storage.list_names
  monkeypatch.setattr(storage, "list_names", lambda path: listings.append(path) or real(path))
  ss = save_step(tmp_path, 10, commit=False, skip=(1,))
  late = threading.Timer(0.2, lambda: ss[1].write(10, payload(1, 10)))
  hinted = []

  def written(timeout_s):
    late.start()
    late.join()  # the counter reaches its target once the last file is written
    hinted.append(timeout_s)
    return True

  assert ss[0].commit(10, timeout_s=5.0, written=written) is True
  assert hinted == [5.0] and len(listings) == 1
  assert ss[0].committed_steps() == [10]
  listings.clear()
  ss = save_step(tmp_path, 20, commit=False, skip=(2,))
  threading.Timer(0.2, lambda: ss[2].write(20, payload(2, 20))).start()
  assert ss[0].commit(20, timeout_s=5.0, poll_s=0.02, written=lambda t: True) is True
  assert len(listings) > 1  # the lie was caught by the listing
  assert ss[0].missing(20) == []


def test_delete_removes_step(tmp_path):
  ss = save_step(tmp_path, 10)
  save_step(tmp_path, 20)
  ss[0].delete(10)
  assert not (tmp_path / "10").exists()
  assert ss[0].committed_steps() == [20]
  assert ss[0].listed_steps() == [20]
  ss[0].delete(10)  # deleting again is a no-op
  ss[0].delete(12345)
  with pytest.raises(CorruptCheckpointError):
    ss[0].read(10)


def test_write_bytes_leaves_no_temp_files(tmp_path):
  path = epath.Path(tmp_path) / "blob"
  write_bytes(path, b"first")
  write_bytes(path, b"second, longer")
  assert path.read_bytes() == b"second, longer"
  assert os.listdir(tmp_path) == ["blob"]
  save_step(tmp_path / "store", 7)
  leftovers = [n for n in os.listdir(tmp_path / "store" / "7") if ".tmp" in n]
  assert leftovers == []


def test_record_is_the_commit_record_and_committed_records_agree(tmp_path):
  ss = stores(tmp_path)
  for s in ss:
    s.write(10, payload(s._me, 10))
  assert ss[0].commit(10, timeout_s=1.0, metrics={"loss": 0.5}, info={"bytes": 7})
  save_step(tmp_path, 20, commit=False)
  record = ss[0].record(10)
  assert record["metrics"] == {"loss": 0.5} and record["info"] == {"bytes": 7}
  assert record["process_count"] == N and record["files"] == [file_name(p, N) for p in range(N)]
  assert ss[0].record(20) is None and ss[0].record(99) is None
  assert ss[0].committed_records() == {10: record}
  assert ss[0].saved_process_count(10) == N and ss[0].saved_process_count(20) is None


def test_has_commit_reads_the_marker_without_listing(tmp_path, monkeypatch):
  """Local retention asks after every save on every process: one small read,
  never a listing of the step's folder (one file per process)."""
  from emergency_ckpt.core import storage

  ss = save_step(tmp_path, 10)
  save_step(tmp_path, 20, commit=False)
  listings = []
  real = storage.list_names
  monkeypatch.setattr(storage, "list_names", lambda path: listings.append(path) or real(path))
  assert ss[0].has_commit(10) and not ss[0].has_commit(20) and not ss[0].has_commit(30)
  assert listings == []


def test_commit_records_are_read_once_and_forgotten_when_deleted(tmp_path, monkeypatch):
  """Retention asks for the committed steps after every save: a COMMIT never
  changes until its step is deleted, so each is read once; a step deleted
  (here, or by another tool) is forgotten at the next listing."""
  for step in (1, 2, 3):
    save_step(tmp_path, step)
  primary = StateStore(tmp_path, process_index=0, process_count=N)
  reads = []
  real = primary.record
  monkeypatch.setattr(primary, "record", lambda step: reads.append(step) or real(step))
  assert primary.committed_steps() == [1, 2, 3] and sorted(reads) == [1, 2, 3]
  save_step(tmp_path, 4)
  assert primary.committed_steps() == [1, 2, 3, 4] and sorted(reads) == [1, 2, 3, 4]
  primary.delete(1)
  StateStore(tmp_path, process_index=0, process_count=N).delete(2)  # another tool
  assert primary.committed_steps() == [3, 4] and len(reads) == 4
  save_step(tmp_path, 2)  # saved again after a restore to step 1: read anew
  assert primary.committed_steps() == [2, 3, 4] and len(reads) == 5


def test_saved_data_states_read_each_file_when_first_accessed(tmp_path, monkeypatch):
  from emergency_ckpt.errors import CorruptCheckpointError  # noqa: PLC0415
  from emergency_ckpt.state.data_state import SavedDataStates  # noqa: PLC0415
  from emergency_ckpt.state.store import StateStore  # noqa: PLC0415

  for p in range(3):
    StateStore(str(tmp_path), process_index=p, process_count=3).write(5, {"pos": 10 + p})
  store = StateStore(str(tmp_path), process_index=0, process_count=4)  # a new count
  reads = []
  original = store.read
  monkeypatch.setattr(
    store, "read", lambda *a, **k: reads.append(k["process"]) or original(*a, **k)
  )
  states = SavedDataStates(store, 5, 3)
  assert len(states) == 3 and list(states) == [0, 1, 2] and reads == []
  assert states[2] == {"pos": 12} and states[2] == {"pos": 12} and reads == [2]  # once
  assert 3 not in states and "x" not in states
  path = tmp_path / "5" / "process_1-of-3.json"
  path.write_bytes(path.read_bytes()[:-5])  # torn
  with pytest.raises(CorruptCheckpointError, match="process_1-of-3"):
    states[1]
