"""Fault matrix, part 4: bad input at the API (one process, in the test
process), the ownership check with a fake stat, failpoint typos, and a scan
for pickle anywhere in the library."""

from __future__ import annotations

import ast
import dataclasses
import os
import stat

import numpy as np
import pytest

import emergency_ckpt as ec
from emergency_ckpt.core import failpoints
from emergency_ckpt.local import owner as local_owner
from tests.fault_matrix import excerpt
from tests.helpers import abstract as _abstract
from tests.single_slice import state as _state

PACKAGE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "emergency_ckpt"
)


def _raises(kind, fn, *needles, n: int = 160) -> tuple[bool, str]:
  """(ok, observed): fn() raised `kind` whose message contains every needle."""
  try:
    fn()
  except Exception as e:  # noqa: BLE001 - judged below
    ok = isinstance(e, kind) and all(n in str(e) for n in needles)
    text = excerpt(str(e), needles[0] if needles else None, n=n)
    return ok, f"{type(e).__name__}: {text}"
  return False, f"no error (wanted {kind.__name__})"


def _check_all(fault_matrix, scenario: str, cases: list[tuple[bool, str]]) -> None:
  ok = all(c[0] for c in cases)
  short = [c[1] if len(c[1]) <= 110 else c[1][:107] + "..." for c in cases]
  fault_matrix.check(scenario, " / ".join(short), ok)


def test_data_state_errors_name_the_key(options, mesh, fault_matrix):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    s = _state(mesh, 2.0)
    cases = [
      _raises(ec.DataStateError, lambda: mngr.save(2, s, {"rng": np.uint32(7)}), "['rng']"),
      _raises(
        ec.DataStateError, lambda: mngr.save(2, s, {"it": {"seen": {1, 2}}}), "['it']['seen']"
      ),
      _raises(ec.DataStateError, lambda: mngr.save(2, s, {"pos": [1, float("nan")]}), "['pos'][1]"),
      _raises(ec.DataStateError, lambda: mngr.save(2, s, {"raw": b"\x00"}), "['raw']"),
      _raises(ec.DataStateError, lambda: mngr.save(2, s, {"k": {3: "x"}}), "[3]"),
    ]
    assert mngr.all_steps() == []  # nothing was saved by the failed calls
    _check_all(fault_matrix, "api.data_state_not_json", cases)
    case = _raises(ec.DataStateError, lambda: mngr.save(2, s, [1, 2]), "list")
    fault_matrix.check("api.data_state_not_dict", case[1], case[0])


def test_step_errors(options, mesh, fault_matrix):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    s = _state(mesh, 4.0)
    ok, text = _raises(ec.StepError, lambda: mngr.save(-1, s), "-1")
    fault_matrix.check("api.step_negative", text, ok)
    cases = [
      _raises(ec.StepError, lambda: mngr.save(2.0, s), "2.0"),
      _raises(ec.StepError, lambda: mngr.save(True, s), "True"),
    ]
    _check_all(fault_matrix, "api.step_not_int", cases)
    assert mngr.save(4, s, {"pos": 4})
    ok, text = _raises(ec.StepError, lambda: mngr.save(3, s), "step=3", "step 4")
    fault_matrix.check("api.step_not_monotonic", text, ok)
    ok, text = _raises(ec.StepAlreadyExistsError, lambda: mngr.save(4, s), "step=4")
    fault_matrix.check("api.step_exists", text, ok)
    mngr.wait_until_finished()
    assert mngr.restore(_abstract(mesh)).data_state == {"pos": 4}  # the first save intact


def test_replica_axis_errors(options, mesh, fault_matrix):
  ok, text = _raises(
    ec.TopologyError,
    lambda: ec.CheckpointManager(dataclasses.replace(options, replica_axis="slices"), mesh=mesh),
    "'slices'",
    "replica",
    "data",
  )
  fault_matrix.check("api.replica_axis_name", text, ok)
  ok, text = _raises(
    ec.TopologyError,
    lambda: ec.CheckpointManager(dataclasses.replace(options, replica_axis=5), mesh=mesh),
    "replica_axis=5",
  )
  fault_matrix.check("api.replica_axis_index", text, ok)


def test_impossible_options(fault_matrix):
  local = dict(directory="/dev/shm/x")
  persistent = ec.PersistentTierOptions(directory="/tmp/p")
  good_local = ec.LocalTierOptions(**local)

  def manager(**kw):
    return lambda: ec.CheckpointManagerOptions(local=good_local, persistent=persistent, **kw)

  cases = [
    _raises(
      ec.InvalidOptionsError,
      lambda: ec.LocalTierOptions(**local, save_interval_steps=0),
      "local.save_interval_steps",
    ),
    _raises(
      ec.InvalidOptionsError,
      lambda: ec.PersistentTierOptions(directory="/tmp/p", save_interval_steps=0),
      "persistent.save_interval_steps",
    ),
    _raises(
      ec.InvalidOptionsError,
      lambda: ec.LocalTierOptions(**local, max_to_keep=0),
      "local.max_to_keep",
    ),
    _raises(
      ec.InvalidOptionsError,
      lambda: ec.PersistentTierOptions(directory="/tmp/p", max_to_keep=-1),
      "persistent.max_to_keep",
    ),
    _raises(ec.InvalidOptionsError, manager(collective_timeout_s=0), "collective_timeout_s"),
    _raises(ec.InvalidOptionsError, manager(state_commit_timeout_s=-5), "state_commit_timeout_s"),
    _raises(
      ec.InvalidOptionsError,
      lambda: ec.LocalTierOptions(directory="gs://bucket/x"),
      "local.directory",
    ),
    _raises(ec.InvalidOptionsError, manager(run_id="../escape"), "run_id"),
  ]
  _check_all(fault_matrix, "api.impossible_options", cases)


def test_restore_errors(options, mesh, fault_matrix):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    ok, text = _raises(
      ec.NoRestorableCheckpointError,
      lambda: mngr.restore(_abstract(mesh)),
      options.persistent.directory,
      "local",
    )
    ok = ok and issubclass(ec.NoRestorableCheckpointError, FileNotFoundError)
    fault_matrix.check("api.nothing_to_restore", text, ok)
    mngr.save(2, _state(mesh, 2.0), force=True)
    mngr.wait_until_finished()
    ok, text = _raises(
      ec.StepNotRestorableError, lambda: mngr.restore(_abstract(mesh), step=3), "step 3"
    )
    fault_matrix.check("api.restore_unrestorable_step", text, ok)


def test_abstract_leaf_without_sharding(options, mesh, fault_matrix):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr.save(2, _state(mesh, 2.0), force=True)
    mngr.wait_until_finished()
    bad = {"w": np.zeros((4, 2), np.float32)}
    ok, text = _raises(ec.StateMismatchError, lambda: mngr.restore(bad), "['w']")
    fault_matrix.check("api.abstract_not_sharded", text, ok)


def test_closed_manager(options, mesh, fault_matrix):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    pass
  cases = [
    _raises(ec.EmergencyCheckpointError, lambda: mngr.save(4, _state(mesh, 4.0)), "closed"),
    _raises(ec.EmergencyCheckpointError, lambda: mngr.restore(_abstract(mesh)), "closed"),
  ]
  _check_all(fault_matrix, "api.closed_manager", cases)


def test_foreign_owner_refused_with_fake_stat(shm_dir, monkeypatch, fault_matrix):
  """chown needs root: make lstat report another owner instead."""
  path = os.path.join(shm_dir, "theirs")
  os.mkdir(path, 0o700)
  real_lstat = os.lstat

  def fake_lstat(p, *a, **kw):
    st = real_lstat(p, *a, **kw)
    if os.path.abspath(p) != path:
      return st
    fields = list(st)
    fields[stat.ST_UID] = os.geteuid() + 4242
    return os.stat_result(fields)

  monkeypatch.setattr(local_owner.os, "lstat", fake_lstat)
  ok, text = _raises(
    ec.UnsafeDirectoryError,
    lambda: local_owner.secure_makedirs(path),
    f"uid {os.geteuid() + 4242}",
    path,
  )
  fault_matrix.check("dir.foreign_owner_fake_stat", text, ok)


def test_shared_sticky_root_is_accepted(shm_dir, mesh, fault_matrix):
  """local.directory may be a shared sticky folder like /dev/shm itself (mode
  1777): the run and process folders below it are ours and 0700."""
  root = os.path.join(shm_dir, "shm")
  os.mkdir(root)
  os.chmod(root, 0o1777)
  options = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=root, save_interval_steps=1),
    persistent=ec.PersistentTierOptions(directory=os.path.join(shm_dir, "p")),
    run_id="shared",
  )
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr.save(1, _state(mesh, 1.0))
    mngr.wait_until_finished()
    restored = mngr.restore(_abstract(mesh)).step
    modes = [
      oct(stat.S_IMODE(os.stat(p).st_mode))
      for p in (root, os.path.dirname(mngr.local_directory), mngr.local_directory)
    ]
  link = os.path.join(shm_dir, "link")
  os.symlink(root, link)
  refused_link, text_link = _raises(
    ec.UnsafeDirectoryError, lambda: local_owner.secure_makedirs(link, shared_ok=True), "symlink"
  )
  plain = os.path.join(shm_dir, "open")
  os.mkdir(plain)
  os.chmod(plain, 0o777)  # world-writable without the sticky bit
  refused_open, text_open = _raises(
    ec.UnsafeDirectoryError, lambda: local_owner.secure_makedirs(plain, shared_ok=True), "0o777"
  )
  theirs = os.path.join(shm_dir, "theirs")  # sticky, but another user's: they could swap ours
  os.mkdir(theirs)
  os.chmod(theirs, 0o1777)
  real_lstat = os.lstat

  def fake_lstat(p, *a, **kw):
    st = real_lstat(p, *a, **kw)
    if os.path.abspath(p) != theirs:
      return st
    fields = list(st)
    fields[stat.ST_UID] = 4242
    return os.stat_result(fields)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(local_owner.os, "lstat", fake_lstat)
    refused_theirs, text_theirs = _raises(
      ec.UnsafeDirectoryError, lambda: local_owner.secure_makedirs(theirs, shared_ok=True), "4242"
    )
  ok = restored == 1 and modes[1:] == ["0o700", "0o700"]
  ok = ok and refused_link and refused_open and refused_theirs
  fault_matrix.check(
    "dir.shared_root",
    f"root mode {modes[0]} accepted, run/process folders {modes[1:]}, step {restored} saved"
    f" and restored; a symlink to it: {text_link[:90]}...; mode 0777 without +t:"
    f" {text_open[:90]}...; a sticky folder of uid 4242: {text_theirs[:90]}...",
    ok,
  )


def test_failpoint_typo_is_an_error(fault_matrix):
  cases = [
    _raises(ValueError, lambda: failpoints.parse("local.mid_write3"), "local.mid_write3"),
    _raises(ValueError, lambda: failpoints.parse("local.mid_write@x"), "name@step"),
    _raises(ValueError, lambda: failpoints.parse("local.mid_write@3:explode"), "explode"),
  ]
  parsed = failpoints.parse(" local.mid_write@3, state.before_commit@4:stop ")
  ok = parsed == {("local.mid_write", 3): "kill", ("state.before_commit", 4): "stop"}
  cases.append((ok, f"valid spec parsed to {parsed}"))
  _check_all(fault_matrix, "api.bad_failpoint_spec", cases)


_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve", "joblib"}


def _pickle_uses(path: str) -> list[str]:
  with open(path) as f:
    source = f.read()
  tree = ast.parse(source, path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name.split(".")[0] for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      names = [(node.module or "").split(".")[0]]
    else:
      names = []
    found += [
      f"{os.path.basename(path)}:{node.lineno} imports {n}" for n in names if n in _PICKLE_MODULES
    ]
    if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
      if not (isinstance(node.value, ast.Constant) and node.value.value is False):
        found.append(f"{os.path.basename(path)}:{node.value.lineno} allow_pickle")
    if isinstance(node, ast.Attribute) and "pickle" in node.attr.lower():
      found.append(f"{os.path.basename(path)}:{node.lineno} uses .{node.attr}")
    if isinstance(node, ast.Name) and "pickle" in node.id.lower():
      found.append(f"{os.path.basename(path)}:{node.lineno} uses {node.id}")
  return found


def test_no_pickle_in_the_library(fault_matrix):
  files = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
  found = [hit for f in files for hit in _pickle_uses(os.path.join(PACKAGE, f))]
  fault_matrix.check(
    "code.no_pickle",
    f"{len(files)} modules scanned (AST: imports, allow_pickle=, *pickle* names): "
    + (", ".join(found) if found else "none found"),
    not found,
  )


def test_pickle_scan_catches_uses(tmp_path):
  """The scanner itself: each pattern is found."""
  bad = tmp_path / "bad.py"
  bad.write_text(
    "import pickle\nfrom cloudpickle import dumps\nimport numpy as np\n"
    "np.load('x', allow_pickle=True)\nimport orbax.checkpoint as ocp\nocp.PickleHandler\n"
  )
  hits = _pickle_uses(str(bad))
  assert len(hits) == 4, hits


# ---- the launcher ------------------------------------------------------------------------


def test_launcher_process0_exits_after_its_siblings(tmp_path):
  """Process 0 hosts the coordination service: if it exited first, process 1
  would abort (SIGABRT) before writing its result (EC_LAUNCHER_EXIT_WAIT_S=0
  shows it). Process 0 now waits for the others' results."""
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415

  job = run_job(
    "tests.fault_scenarios:sleep_then_return",
    2,
    {"sleep_s": [0, 3]},
    timeout_s=120,
    out_dir=str(tmp_path),
  )
  assert job.returncodes == [0, 0], job.logs[1][-2000:]
  assert job.results == [0, 1]
  assert all(isinstance(p, int) for p in job.pids)


def test_launcher_every_process_exits_after_its_siblings(tmp_path):
  """A process that exits at once closes its Gloo sockets under a sibling still
  reading the last collective (seen in CI: 'Gloo all-reduce failed: Connection
  closed by peer'). Process 1 returns at once; 2 s later it is still alive."""
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415

  job = run_job(
    "tests.fault_scenarios:sibling_alive_after",
    2,
    {"sleep_s": 2},
    timeout_s=120,
    out_dir=str(tmp_path),
  )
  assert job.check() == [True, None]


def test_launcher_sees_dead_and_zombie_siblings(tmp_path):
  import subprocess  # noqa: PLC0415
  import time  # noqa: PLC0415

  from emergency_ckpt.demo import job_process  # noqa: PLC0415

  child = subprocess.Popen(["true"])
  deadline = time.monotonic() + 10
  while not job_process.process_gone(child.pid):  # a zombie until reaped
    assert time.monotonic() < deadline
    time.sleep(0.01)
  (tmp_path / "pid_1").write_text(str(child.pid))
  (tmp_path / "pid_2").write_text(str(os.getpid()))  # alive
  (tmp_path / "result_3.json").write_text("{}")  # finished
  t0 = time.monotonic()
  left = job_process.wait_for_siblings(str(tmp_path), 0, 4, timeout_s=0.5)
  assert left == [2] and time.monotonic() - t0 >= 0.5
  # Process 0 leaves last: a sibling that wrote its result but still runs
  # would abort once the coordination service it hosts is gone.
  (tmp_path / "pid_3").write_text(str(os.getpid()))
  left = job_process.wait_for_siblings(str(tmp_path), 0, 4, timeout_s=0.2, until_gone=True)
  assert left == [2, 3]
  child.wait()
  assert job_process.process_gone(child.pid)  # reaped
