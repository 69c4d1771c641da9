"""The on-disk layout: names, the local walker, and the persistent root's
storage rules (persistent_layout) on a filesystem. No JAX job: folders are
built by hand."""

from __future__ import annotations

import json
import os
import time

import pytest

from emergency_ckpt.core import layout
from emergency_ckpt.local import folders
from emergency_ckpt.persistent import layout as persistent_layout
from emergency_ckpt.state.store import StateStore


# ---- names ---------------------------------------------------------------------------
@pytest.mark.parametrize(
  "text, want",
  [
    ("0", 0),
    ("7", 7),
    ("120", 120),
    ("007", None),  # not canonical: step 7 is spelled "7"
    ("00", None),
    ("", None),
    ("x", None),
    ("+1", None),
    ("-1", None),
    ("1_0", None),
    (" 1", None),
    ("1.0", None),
    ("\u00b2", None),  # "²": isdigit() but int() fails
    ("\u0663", None),  # Arabic-Indic 3: int() takes it, the layout does not
  ],
)
def test_parse_number(text, want):
  assert layout.parse_number(text) == want
  assert layout.step_of_name(text) == want
  assert layout.step_of_dir_name(f"step_{text}") == want
  assert layout.process_of_dir_name(f"process_{text}") == want


@pytest.mark.parametrize("name", ["step", "step_", "Step_1", "step-1", "steps_1", "xstep_1"])
def test_step_of_dir_name_rejects(name):
  assert layout.step_of_dir_name(name) is None


@pytest.mark.parametrize("n", [0, 1, 9, 10, 123456789])
def test_names_round_trip(n):
  assert layout.step_of_dir_name(layout.step_dir_name(n)) == n
  assert layout.process_of_dir_name(layout.process_dir_name(n)) == n
  assert layout.step_of_name(layout.step_name(n)) == n


def test_spelled_names():
  assert layout.process_dir("/r", "run", 3) == "/r/run/process_3"
  assert layout.local_step_dir("/r/run/process_3", 10) == "/r/run/process_3/step_10"
  assert layout.shards_path("/s") == "/s/shards.bin"
  assert layout.manifest_path("/s") == "/s/manifest.json"
  assert layout.state_file_name(1, 4) == "process_1-of-4.json"
  assert str(layout.tensors_dir("/p")) == "/p/tensors"
  assert str(layout.state_dir("/p")) == "/p/state"
  assert str(layout.run_file("/p")) == "/p/run.json"
  assert str(layout.tensor_step_dir("/p/tensors", 5)) == "/p/tensors/5"
  assert str(layout.state_step_dir("/p/state", 5)) == "/p/state/5"
  assert layout.tmp_step_dir_name(4).startswith(".tmp-step_4-")
  assert layout.is_spare_name(layout.spare_dir_name())
  for name in (layout.tmp_step_dir_name(4), layout.spare_dir_name(), layout.deleting_dir_name("x")):
    assert layout.is_tmp_name(name) and layout.step_of_dir_name(name) is None
  assert layout.deleting_tensor_name(5).startswith(".deleting-5-")


@pytest.mark.parametrize(
  "names, want",
  [
    (["10", "2", "tmp", "12abc", "007", ".deleting-3-ab", "4.orbax-checkpoint-tmp-1"], [2, 10]),
    ([], []),
    (["COMMIT"], []),
  ],
)
def test_steps_of_names(names, want):
  assert layout.steps_of_names(names) == want


@pytest.mark.parametrize(
  "name, partial",
  [
    ("30.orbax-checkpoint-tmp-1700000000", True),
    (".deleting-5-abcd1234", True),
    ("30", False),
    ("notes", False),
  ],
)
def test_is_partial_tensor_name(name, partial):
  assert layout.is_partial_tensor_name(name) is partial


# ---- the local walker ------------------------------------------------------------------
def _step(proc_dir, name, *, manifest=True):
  d = os.path.join(proc_dir, name)
  os.makedirs(d)
  if manifest:
    with open(os.path.join(d, "manifest.json"), "w") as f:
      f.write("{}")
  return d


@pytest.fixture
def local_root(tmp_path):
  """run-a/process_0: steps 10 and 20, plus every kind of stray; run-a/process_1:
  step 10; stray process folders, files and links beside them."""
  root = str(tmp_path / "local")
  p0 = os.path.join(root, "run-a", "process_0")
  p1 = os.path.join(root, "run-a", "process_1")
  _step(p0, "step_10")
  _step(p0, "step_20")
  _step(p0, "step_x")  # stray name, even with a manifest
  _step(p0, "step_007")  # not canonical
  _step(p0, "step_30", manifest=False)  # no marker: not a step
  os.makedirs(os.path.join(p0, ".tmp-step_40-abcd1234"))
  os.makedirs(os.path.join(p0, ".tmp-spare-0123456789ab"))
  with open(os.path.join(p0, "step_50"), "w") as f:  # a file, not a folder
    f.write("x")
  _step(p1, "step_10")
  for stray in ("process_y", "process_01", "process_"):
    _step(os.path.join(root, "run-a", stray), "step_10")
  with open(os.path.join(root, "run-a", "notes.txt"), "w") as f:
    f.write("x")
  with open(os.path.join(root, "file-at-root"), "w") as f:
    f.write("x")
  os.symlink(os.path.join(root, "run-a"), os.path.join(root, "link-run"))
  os.makedirs(os.path.join(root, "run-b"))
  os.symlink(p1, os.path.join(root, "run-b", "process_1"))  # a planted link
  return root


def test_walk_local_lists_steps_and_ignores_strays(local_root):
  listing = folders.walk_local(local_root)
  assert [(p.run_id, p.process_index) for p in listing.processes] == [("run-a", 0), ("run-a", 1)]
  p0, p1 = listing.processes
  assert sorted(p0.steps) == [10, 20] and sorted(p1.steps) == [10]
  assert p0.steps[10] == os.path.join(local_root, "run-a", "process_0", "step_10")
  assert sorted(p0.unmarked) == [30]
  assert sorted(os.path.basename(t) for t in p0.tmp) == [
    ".tmp-spare-0123456789ab",
    ".tmp-step_40-abcd1234",
  ]
  assert sorted(os.path.basename(s) for s in p0.strays) == ["step_007", "step_50", "step_x"]
  strays = {os.path.relpath(s, local_root) for s in listing.strays}
  assert strays == {
    "run-a/process_y",
    "run-a/process_01",
    "run-a/process_",
    "run-a/notes.txt",
    "file-at-root",
    "link-run",
    "run-b/process_1",
  }


def test_list_local_steps_agrees_with_the_walker(local_root):
  for proc in folders.walk_local(local_root).processes:
    assert folders.list_local_steps(proc.path) == sorted(proc.steps)
  assert folders.list_local_steps(os.path.join(local_root, "absent")) == []


@pytest.mark.parametrize("root", ["absent", "a-file"])
def test_walk_local_of_nothing(tmp_path, root):
  (tmp_path / "a-file").write_text("x")
  listing = folders.walk_local(str(tmp_path / root))
  assert listing.processes == () and listing.strays == ()


def test_delete_local_step_dir(tmp_path):
  proc = str(tmp_path / "run" / "process_0")
  d = _step(proc, "step_10")
  folders.delete_local_step_dir(d)
  assert os.listdir(proc) == []
  folders.delete_local_step_dir(d)  # absent: no-op
  target = _step(str(tmp_path / "elsewhere"), "step_20")
  link = os.path.join(proc, "step_30")
  os.symlink(target, link)
  folders.delete_local_step_dir(link)  # the link goes, never its target
  assert os.listdir(proc) == [] and os.path.isdir(target)


def test_rename_out_of_namespace(tmp_path):
  proc = str(tmp_path / "run" / "process_0")
  d = _step(proc, "step_10")
  doomed = folders.rename_out_of_namespace(d)
  assert os.path.basename(doomed).startswith(".tmp-delete-step_10-")
  assert folders.list_local_steps(proc) == []
  (listed,) = folders.walk_local(str(tmp_path)).processes
  assert listed.steps == {} and listed.tmp == (doomed,)
  folders.remove_renamed(doomed)
  assert os.listdir(proc) == []
  assert folders.rename_out_of_namespace(d) is None


# ---- the persistent root on a filesystem -------------------------------------------------
def _tensor_step(root, name):
  d = os.path.join(root, "tensors", name, "default")
  os.makedirs(d)
  with open(os.path.join(d, "data"), "wb") as f:
    f.write(b"x" * 100)


def _state_step(root, step, *, commit=True, metrics=None):
  stores = [
    StateStore(os.path.join(root, "state"), process_index=i, process_count=2) for i in (0, 1)
  ]
  for s in stores:
    s.write(step, {"i": step})
  if commit:
    assert stores[0].commit(step, timeout_s=1.0, metrics=metrics)


def test_list_steps_filesystem(tmp_path):
  root = str(tmp_path)
  for name in ("7", "12", "007", "30.orbax-checkpoint-tmp-1", ".deleting-5-ab", "notes"):
    _tensor_step(root, name)
  with open(os.path.join(root, "tensors", "40"), "w") as f:
    f.write("a file, not a step")
  tensors = layout.tensors_dir(root)
  assert persistent_layout.list_steps(tensors) == [7, 12]
  assert persistent_layout.list_steps(tmp_path / "absent") == []
  assert persistent_layout.is_finalized(layout.tensor_step_dir(tensors, 7))
  assert not persistent_layout.is_finalized(layout.tensor_step_dir(tensors, 8))
  assert persistent_layout.wait_finalized(tensors, 7, timeout_s=0.1)
  assert not persistent_layout.wait_finalized(tensors, 8, timeout_s=0.05)
  # its upload failed without finalizing it: no wait for the timeout
  t0 = time.monotonic()
  assert not persistent_layout.wait_finalized(tensors, 8, timeout_s=60, failed=lambda: True)
  assert time.monotonic() - t0 < 30
  assert persistent_layout.wait_finalized(tensors, 7, timeout_s=60, failed=lambda: True)


def test_delete_step_bytes_cleanup(tmp_path):
  root = str(tmp_path)
  for name in ("7", "12", "30.orbax-checkpoint-tmp-1", ".deleting-5-ab"):
    _tensor_step(root, name)
  tensors = layout.tensors_dir(root)
  assert persistent_layout.step_bytes(tensors, 7) == 100
  assert persistent_layout.step_bytes(tensors, 8) is None
  persistent_layout.delete_step(tensors, 7)
  persistent_layout.delete_step(tensors, 7)  # absent: no-op
  assert persistent_layout.list_steps(tensors) == [12]
  removed = persistent_layout.cleanup_unfinalized(tensors)
  assert sorted(removed) == [".deleting-5-ab", "30.orbax-checkpoint-tmp-1"]
  assert sorted(os.listdir(tensors)) == ["12"]


def test_scan_reads_a_whole_root(tmp_path):
  root = str(tmp_path / "pers")
  assert not persistent_layout.looks_persistent(root)
  for name in ("10", "20", "30"):
    _tensor_step(root, name)
  _state_step(root, 10, metrics={"loss": 0.5})
  _state_step(root, 20)
  _state_step(root, 25, commit=False)
  os.makedirs(os.path.join(root, "state", "junk"))
  assert persistent_layout.looks_persistent(root)
  listing = persistent_layout.scan(root)
  assert listing.tensor_steps == (10, 20, 30)
  assert listing.state_steps == (10, 20, 25)
  assert listing.committed == {10, 20}
  assert listing.metrics == {10: {"loss": 0.5}, 20: {}}
  assert listing.run is None and listing.run_id is None and listing.persistent_interval is None
  with open(os.path.join(root, "run.json"), "w") as f:
    json.dump({"run_id": "r", "persistent_save_interval_steps": 10}, f)
  listing = persistent_layout.scan(root)
  assert listing.run_id == "r" and listing.persistent_interval == 10
  assert listing.state_store().committed_steps() == [10, 20]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_read_run_info_tolerates_garbage(tmp_path, text):
  (tmp_path / "run.json").write_text(text)
  assert persistent_layout.read_run_info(tmp_path) is None
  assert persistent_layout.looks_persistent(tmp_path)


def test_gcs_listing_follows_orbaxs_commit_file_rule(gcs_bucket):
  """On GCS a tensor step is final once its commit file exists: the listing
  (no Orbax) agrees with Orbax's checkpoint_steps, and deletion and cleanup
  keep to the same rule."""
  from emergency_ckpt.core import storage  # noqa: PLC0415

  tensors = layout.tensors_dir(f"{gcs_bucket}/run")
  for name in ("10", "30", "007", "40"):
    storage.write_bytes(tensors / name / layout.GCS_COMMIT_FILE, b"ok")
  for name in ("10", "20", "30", "007", "40"):
    storage.write_bytes(tensors / name / "default" / "data", b"x" * 10)
  assert persistent_layout.list_steps(tensors) == [10, 30, 40]
  from emergency_ckpt.persistent.orbax_loader import orbax as _ocp  # noqa: PLC0415 - the reference rule

  assert sorted(_ocp().path.step.checkpoint_steps(tensors)) == [7, 10, 30, 40]  # "007" is 7 there
  assert persistent_layout.step_bytes(tensors, 10) == 12
  persistent_layout.delete_step(tensors, 40)
  assert persistent_layout.list_steps(tensors) == [10, 30]
  assert persistent_layout.cleanup_unfinalized(tensors) == ["20"]
  assert persistent_layout.list_steps(tensors) == [10, 30]
  assert persistent_layout.wait_finalized(tensors, 30, timeout_s=1.0)
  assert not persistent_layout.wait_finalized(tensors, 20, timeout_s=0.05)
  assert persistent_layout.list_steps(layout.tensors_dir(f"{gcs_bucket}/absent")) == []
