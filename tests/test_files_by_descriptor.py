"""Files by descriptor (issue 37, item 4): a symlink swapped in between a
deletion's plan and its act never redirects it outside the local root; every
ancestor of the ramdisk root is checked; the default ramdisk root is each
user's own and a squatted one is refused; an all-interfaces peer.host is
refused unless allowed.
"""

from __future__ import annotations

import os
import shutil
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt import options as options_lib
from emergency_ckpt.errors import InvalidOptionsError, UnsafeDirectoryError
from emergency_ckpt.local import folders
from emergency_ckpt.local import owner as local_owner
from emergency_ckpt.options import LocalTierOptions, PeerOptions


def _step(parent: str, step: int) -> str:
  d = os.path.join(parent, f"step_{step}")
  os.makedirs(d)
  with open(os.path.join(d, "manifest.json"), "w") as f:
    f.write("{}")
  return d


def _tree(tmp_path):
  """<root>/run/process_0/step_5 (planned for deletion) and a victim folder
  outside the root with the same layout."""
  root, victim = str(tmp_path / "root"), str(tmp_path / "victim")
  planned = _step(os.path.join(root, "run", "process_0"), 5)
  precious = _step(os.path.join(victim, "process_0"), 5)
  return root, victim, planned, precious


@pytest.mark.parametrize("swapped", ["run", "process"])
def test_a_symlink_swapped_in_after_the_plan_is_refused(tmp_path, swapped, caplog):
  root, victim, planned, precious = _tree(tmp_path)
  run = os.path.join(root, "run")
  if swapped == "run":  # <root>/run -> victim (victim/process_0/step_5)
    os.rename(run, run + ".moved")
    os.symlink(victim, run)
  else:  # <root>/run/process_0 -> victim/process_0
    os.rename(os.path.join(run, "process_0"), os.path.join(run, "moved"))
    os.symlink(os.path.join(victim, "process_0"), os.path.join(run, "process_0"))
  with pytest.raises(UnsafeDirectoryError, match="symlink"):
    folders.delete_local_step_dir(planned)
  assert os.listdir(precious) == ["manifest.json"]
  assert "refused to follow" in caplog.text


def test_a_step_that_is_itself_a_symlink_goes_not_its_target(tmp_path):
  root, _, planned, precious = _tree(tmp_path)
  os.rename(planned, planned + ".moved")
  os.symlink(precious, planned)
  folders.delete_local_step_dir(planned)
  assert not os.path.lexists(planned)
  assert os.listdir(precious) == ["manifest.json"]


def test_partner_and_xor_steps_are_deleted_through_their_parents(tmp_path):
  proc = os.path.join(str(tmp_path), "root", "run", "process_0")
  for parent in (os.path.join(proc, "partner", "process_1"), os.path.join(proc, "xor")):
    d = _step(parent, 3)
    folders.delete_local_step_dir(d)
    assert not os.path.lexists(d) and os.listdir(parent) == []


def test_a_symlink_racing_the_deletion_never_redirects_it(tmp_path):
  """A thread swaps <root>/run for a link to the victim and back, as fast as
  it can, while steps are planned and deleted: whatever wins each race,
  nothing outside the root is ever deleted."""
  root, victim, _, precious = _tree(tmp_path)
  run = os.path.join(root, "run")
  moved = run + ".real"
  stop = threading.Event()

  def race():
    while not stop.is_set():
      try:
        os.rename(run, moved)
        os.symlink(victim, run)
        os.unlink(run)
        os.rename(moved, run)
      except OSError:
        pass

  t = threading.Thread(target=race)
  t.start()
  deleted = refused = 0
  try:
    for i in range(300):
      for real in (run, moved):  # wherever the real folder is now, a step to delete
        if not os.path.islink(real):
          try:
            _step(os.path.join(real, "process_0"), 5)
          except OSError:
            pass
      try:
        folders.delete_local_step_dir(os.path.join(run, "process_0", "step_5"))
        deleted += 1
      except OSError:
        refused += 1
      assert os.listdir(precious) == ["manifest.json"], f"iteration {i}"
  finally:
    stop.set()
    t.join()
  assert os.listdir(precious) == ["manifest.json"]
  assert deleted + refused > 0


# ---- the ramdisk root's ancestors ----------------------------------------------------
def test_an_ancestor_writable_by_others_is_refused(tmp_path):
  open_dir = tmp_path / "open"
  open_dir.mkdir()
  os.chmod(open_dir, 0o777)
  with pytest.raises(UnsafeDirectoryError, match="chmod go-w"):
    local_owner.secure_makedirs(str(open_dir / "ramdisk" / "run"))
  assert not (open_dir / "ramdisk").exists()  # refused before anything was made


def test_a_sticky_ancestor_is_accepted(tmp_path):
  sticky = tmp_path / "sticky"
  sticky.mkdir()
  os.chmod(sticky, 0o1777)
  local_owner.secure_makedirs(str(sticky / "ramdisk"))
  assert (sticky / "ramdisk").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_an_ancestor_of_another_user_is_refused(tmp_path):
  theirs = tmp_path / "theirs"
  theirs.mkdir()
  os.chown(theirs, 4242, 4242)
  with pytest.raises(UnsafeDirectoryError, match="uid 4242"):
    local_owner.secure_makedirs(str(theirs / "ramdisk"))


def test_the_real_shm_root_passes():
  local_owner.check_ancestors("/dev/shm/emergency_ckpt_probe/run")


# ---- the default ramdisk root: each user's own ----------------------------------------
def test_the_default_root_is_each_users_own(monkeypatch):
  mine = LocalTierOptions().root
  assert mine == f"/dev/shm/emergency_ckpt-{os.getuid()}"
  monkeypatch.setattr(options_lib.os, "getuid", lambda: 4242)
  assert LocalTierOptions().root == "/dev/shm/emergency_ckpt-4242" != mine
  assert LocalTierOptions(directory="/dev/shm/x").root == "/dev/shm/x"


def test_a_manager_without_a_directory_saves_and_restores_in_the_users_root(tmp_path, mesh):
  run_id = f"default-root-{os.getpid()}"
  where = os.path.join(LocalTierOptions().root, run_id)
  options = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(save_interval_steps=1),
    persistent=ec.PersistentTierOptions(directory=str(tmp_path / "p"), save_interval_steps=100),
    run_id=run_id,
  )
  sharding = NamedSharding(mesh, P())
  state = {"w": jax.device_put(np.arange(8, dtype=np.float32), sharding)}
  try:
    with ec.CheckpointManager(options, mesh=mesh) as mngr:
      mngr.save(1, state)
    assert os.path.isdir(os.path.join(where, "process_0", "step_1"))
    assert os.stat(LocalTierOptions().root).st_mode & 0o777 == 0o700
    with ec.CheckpointManager(options, mesh=mesh) as mngr:
      got = mngr.restore({"w": jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding)})
    assert got.step == 1 and got.source == "local"
    np.testing.assert_array_equal(np.asarray(got.state["w"]), np.arange(8, dtype=np.float32))
  finally:
    shutil.rmtree(where, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_default_root_squatted_by_another_user_is_refused(monkeypatch):
  monkeypatch.setattr(options_lib.os, "getuid", lambda: 4343)  # a user with no folder yet
  root = LocalTierOptions().root
  os.makedirs(root, mode=0o1777)
  try:
    os.chmod(root, 0o1777)  # sticky and open, as a squatter would leave it
    os.chown(root, 4242, 4242)
    with pytest.raises(UnsafeDirectoryError, match="uid 4242"):
      local_owner.secure_makedirs(root, shared_ok=True)
  finally:
    os.rmdir(root)


# ---- peer.host -----------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", " 0.0.0.0 ", "*"])
def test_all_interfaces_peer_host_is_refused(host):
  with pytest.raises(InvalidOptionsError, match="allow_all_interfaces"):
    PeerOptions(host=host)
  assert PeerOptions(host=host, allow_all_interfaces=True).host == host


@pytest.mark.parametrize("host", [None, "10.0.0.7", "::1", "host-1.example"])
def test_a_named_peer_host_is_accepted(host):
  assert PeerOptions(host=host).host == host


def test_allow_all_interfaces_must_be_a_bool():
  with pytest.raises(InvalidOptionsError, match="allow_all_interfaces"):
    PeerOptions(host="0.0.0.0", allow_all_interfaces="yes")
