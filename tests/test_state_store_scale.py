"""The state store at thousands of processes (issue 15): committed_steps()
reads one COMMIT per step and lists no step folder; the offline tools still
check every file; the commit benchmark stage runs at a tiny size. No timing
assertions.

A JSON deleted (or torn, or edited) after COMMIT is never loaded at restore:
tests/test_state_store.py::test_json_deleted_after_commit_is_never_loaded
(the reading process's read() raises), and end to end in real jobs
tests/test_faults_damage.py::test_damaged_checkpoint_restores[state.json_missing]
(and [state.json_torn], [state.json_edited]) and
tests/test_multiprocess_core.py::test_save_restart_restore (variant
e_json_missing): the older step is restored.
"""

from __future__ import annotations

import json
import os

import pytest

from emergency_ckpt.core import layout, storage
from emergency_ckpt.errors import StorageError
from emergency_ckpt.persistent import layout as persistent_layout
from emergency_ckpt.state.store import StateStore

N = 4


def _save(root, step, *, commit=True, skip=()):
  stores = [StateStore(root, process_index=i, process_count=N) for i in range(N)]
  for s in stores:
    if s._me not in skip:
      s.write(step, {"position": step * N + s._me})
  if commit:
    assert stores[0].commit(step, timeout_s=1.0)
  return stores


@pytest.fixture
def listings(monkeypatch):
  """Every folder storage.list_names lists, in order."""
  seen: list[str] = []
  real = storage.list_names
  monkeypatch.setattr(
    storage, "list_names", lambda path, **kw: seen.append(str(path)) or real(path, **kw)
  )
  return seen


def test_committed_steps_lists_the_root_once_and_no_step_folder(tmp_path, listings):
  for step in range(1, 41):
    _save(tmp_path, step, commit=step != 7)
  _save(tmp_path, 41, commit=False, skip=(2,))
  listings.clear()
  store = StateStore(tmp_path, process_index=0, process_count=N)
  assert store.committed_steps() == [s for s in range(1, 41) if s != 7]
  assert listings == [str(tmp_path)]
  listings.clear()
  records = store.committed_records([5, 7, 41, 99])  # the caller's own listing: none here
  assert list(records) == [5] and records[5]["process_count"] == N
  assert listings == []
  assert store.is_committed(5) and not store.is_committed(7) and listings == []


def test_fully_committed_lists_each_step_once(tmp_path, listings):
  for step in (1, 2, 3):
    _save(tmp_path, step)
  os.remove(tmp_path / "2" / layout.state_file_name(3, N))
  listings.clear()
  store = StateStore(tmp_path, process_index=0, process_count=N)
  assert list(store.fully_committed_records()) == [1, 3]
  assert sorted(listings) == sorted([str(tmp_path)] + [str(tmp_path / str(s)) for s in (1, 2, 3)])
  assert store.committed_steps() == [1, 2, 3]  # COMMIT alone: a job verifies where it reads


def test_cli_scan_still_checks_every_file(tmp_path):
  """`emergency-ckpt verify`/`inspect`/`gc` read persistent_layout.scan: a
  step whose JSON went missing after COMMIT is reported uncommitted there."""
  root = tmp_path / "pers"
  os.makedirs(root)
  (root / "run.json").write_text(json.dumps({"run_id": "r"}))
  state = layout.state_dir(root)
  for step in (10, 20):
    _save(state, step)
  os.remove(os.path.join(os.fspath(state), "20", layout.state_file_name(1, N)))
  listing = persistent_layout.scan(root)
  assert listing.state_steps == (10, 20) and listing.committed == {10}
  from emergency_ckpt.cli.inspect import collect  # noqa: PLC0415

  rows = {r["step"]: r["state"] for r in collect([str(root)], check=True)}
  assert rows == {10: "committed", 20: "uncommitted"}


def test_an_unreachable_bucket_is_not_uncommitted(tmp_path, monkeypatch):
  """A read that fails (StorageError) from one of the concurrent COMMIT reads
  propagates: never a shorter list of committed steps."""
  for step in range(1, 6):
    _save(tmp_path, step)
  real = storage.read_bytes

  def read(path, **kw):
    if "/3/" in os.fspath(path):
      raise StorageError("bucket unreachable")
    return real(path, **kw)

  monkeypatch.setattr(storage, "read_bytes", read)
  with pytest.raises(StorageError, match="unreachable"):
    StateStore(tmp_path, process_index=0, process_count=N).committed_steps()


def test_measure_commit_at_a_tiny_size(gcs_server):
  from benchmarks.scale_commit import measure_commit  # noqa: PLC0415

  before = os.environ.get("STORAGE_EMULATOR_HOST")
  k, steps = 8, 3
  got = measure_commit(k, steps=steps, server_url=gcs_server.url)
  assert os.environ.get("STORAGE_EMULATOR_HOST") == before
  json.dumps(got)
  assert got["ok"] and got["k"] == k and got["steps"] == steps
  assert got["objects_written"] == k + 1 and got["uploads"] == k + 1
  assert got["commit_listings"] == 1
  assert got["commit_listing_pages"] == got["listing_pages_expected"] == 1
  assert got["commit_requests"] == {"upload": 1, "listing": 1, "read": 0, "metadata": 0, "other": 0}
  cs = got["committed_steps"]
  assert cs["found"] == steps
  assert cs["requests"] == {"upload": 0, "listing": 1, "read": steps, "metadata": 0, "other": 0}
  assert cs["old_listing_pages"] == 1 + steps
  for key in ("write_s", "last_write_to_commit_s", "commit_hint_s", "commit_list_s"):
    assert got[key] >= 0
  assert cs["seconds"] >= 0
