"""What the local tier leaves on a ramdisk across restarts: the leftovers of
folders it adopts after a host shuffle, and torn step folders (the soak's
'orphans' and 'torn' findings, tests/test_fault_soak.py). Real tmpfs
folders, one process, 2 CPU devices."""

from __future__ import annotations

import fcntl
import os
import shutil

import pytest

from emergency_ckpt.local import folders
from tests.test_local_tier import make_tier, mesh, save, state, topo  # noqa: F401 - fixtures

RUN = "r"  # tests.test_local_tier's run id


def _run_dir(tier) -> str:
  return os.path.dirname(tier.directory)


def _spare(folder: str, file: str = "shards.bin", name: str = ".tmp-spare-0123456789ab") -> str:
  path = os.path.join(folder, name)
  os.makedirs(path)
  with open(os.path.join(path, file), "wb") as f:
    f.write(b"\0" * 4096)
  return path


def _parity(xor: str, step: int, *, marked: bool = True) -> str:
  path = os.path.join(xor, f"step_{step}")
  os.makedirs(path)
  with open(os.path.join(path, "parity.bin"), "wb") as f:
    f.write(b"\1" * 512)
  if marked:
    with open(os.path.join(path, "group.json"), "w") as f:
      f.write("{}")
  return path


def _tree(folder: str) -> list[str]:
  """Every file and folder under `folder`, relative, sorted."""
  out = []
  for here, dirs, files in os.walk(folder):
    out += [os.path.relpath(os.path.join(here, n), folder) for n in dirs + files]
  return sorted(out)


def _killed_job_folder(shm_dir, topo, state, index: int = 3) -> str:  # noqa: F811
  """What a killed job's process left in its folder on this host, which a
  restarted process finds after the hosts were shuffled: steps 1, 3, 4, 5
  (step 2 torn: no manifest), a save in progress and a spare; partner/
  process_2: a partner copy of step 4, a torn one of step 5 and a spare;
  xor/: parity blocks of steps 3, 4, 5, a torn one of step 6 and a spare."""
  old = make_tier(shm_dir, topo)
  for step in range(1, 6):
    save(old, step, state)
  old.close()
  dead = os.path.join(_run_dir(old), f"process_{index}")
  os.rename(old.directory, dead)
  os.remove(os.path.join(dead, "step_2", "manifest.json"))
  shutil.copytree(os.path.join(dead, "step_5"), os.path.join(dead, ".tmp-step_6-0badf00d"))
  _spare(dead)
  partner = os.path.join(dead, "partner", "process_2")
  os.makedirs(partner)
  shutil.copytree(os.path.join(dead, "step_4"), os.path.join(partner, "step_4"))
  shutil.copytree(os.path.join(dead, "step_4"), os.path.join(partner, "step_5"))
  os.remove(os.path.join(partner, "step_5", "manifest.json"))
  _spare(partner)
  xor = os.path.join(dead, "xor")
  for step in (3, 4, 5):
    _parity(xor, step)
  _parity(xor, 6, marked=False)
  _spare(xor, "parity.bin")
  return dead


def test_an_adopted_folder_is_cleaned_at_start_and_emptied_by_retention(shm_dir, topo, state):  # noqa: F811
  """Hosts shuffled: a restarted process finds a killed process's folder.
  At start its spares, saves in progress and torn step folders go (in its
  partner and XOR folders too), its steps and parity blocks stay for the
  restore; once retention drops the adopted steps, their parity blocks and
  partner copies go, and the emptied folder with them (once this machine's
  live processes are known)."""
  dead = _killed_job_folder(shm_dir, topo, state)
  tier = make_tier(shm_dir, topo)
  try:
    data = [f"step_{s}" for s in (1, 3, 4, 5)] + ["partner/process_2/step_4"]
    parity = [f"xor/step_{s}" for s in (3, 4, 5)]
    expected = [".owner", "partner", "partner/process_2", "xor", *data, *parity]
    expected += [f"{d}/{f}" for d in data for f in ("manifest.json", "shards.bin")]
    expected += [f"{d}/{f}" for d in parity for f in ("group.json", "parity.bin")]
    assert _tree(dead) == sorted(expected)  # what a restore may read stays
    assert tier.usable_steps() == ([1, 3, 4, 5], {})
    assert tier.held_steps() == [1, 3, 4, 5]
    for step in (6, 7, 8, 9):
      save(tier, step, state)
    assert tier.apply_retention({4, 5, 6, 7, 8, 9}) == [1, 3]
    # steps 4, 5 kept: their parity blocks and copies stay; older ones go
    assert sorted(os.listdir(dead)) == [".owner", "partner", "step_4", "step_5", "xor"]
    assert sorted(os.listdir(os.path.join(dead, "xor"))) == ["step_4", "step_5"]
    assert tier.apply_retention({8, 9}) == [4, 5, 6, 7]
    assert os.listdir(dead) == [".owner"]  # this machine's processes unknown: it stays
    tier.set_colocated({0})
    assert tier.apply_retention({8, 9}) == []
    assert not os.path.exists(dead)
    assert sorted(os.listdir(_run_dir(tier))) == ["process_0"]
    assert tier.held_steps() == [8, 9] and tier.parity() == {} and tier.copies().keys() <= {8, 9}
  finally:
    tier.close()


def test_retention_keeps_parity_blocks_the_newest_restorable_step_may_need(shm_dir, topo, state):  # noqa: F811
  """A parity block in an adopted folder stays while retention deletes
  nothing (no step held is committed: the newest restorable step may be
  one rebuilt from that block), and so does one as new as the steps kept
  (or newer) or one of a kept step."""
  dead = _killed_job_folder(shm_dir, topo, state)
  xor = os.path.join(dead, "xor")
  for step in (2, 7, 12):
    _parity(xor, step)
  tier = make_tier(shm_dir, topo)
  try:
    tier.set_colocated({0})
    tier.usable_steps()
    for step in (6, 7, 8):
      save(tier, step, state)
    everything = set(tier.held_steps())
    assert tier.apply_retention(everything) == []  # nothing committed: nothing goes
    assert sorted(os.listdir(xor)) == [f"step_{s}" for s in (12, 2, 3, 4, 5, 7)]
    assert tier.apply_retention({3, 6, 7, 8}) == [1, 4, 5]
    assert sorted(os.listdir(xor)) == ["step_12", "step_3", "step_7"]
    assert sorted(os.listdir(dead)) == [".owner", "step_3", "xor"]
  finally:
    tier.close()


def test_a_live_folder_is_never_cleaned(shm_dir, topo, state):  # noqa: F811
  """A folder whose .owner a live process holds (or of a process of this
  job on this machine) keeps its spares, saves in progress and torn step
  folders, at start and through retention."""
  dead = _killed_job_folder(shm_dir, topo, state)
  before = _tree(dead)
  fd = os.open(os.path.join(dead, ".owner"), os.O_RDWR)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live manager holds it
    tier = make_tier(shm_dir, topo)
    try:
      assert tier.usable_steps() == ([], {})
      for step in (6, 7, 8):
        save(tier, step, state)
      tier.set_colocated({0})
      assert tier.apply_retention({8}) == [6, 7]
      assert _tree(dead) == before
      os.close(fd)
      fd = None
      tier.set_colocated({0, 3})  # process 3 of this job runs on this machine
      assert tier.apply_retention({8}) == []
      assert _tree(dead) == before
    finally:
      tier.close()
  finally:
    if fd is not None:
      os.close(fd)


def test_torn_step_folders_go_at_start_and_by_retention(shm_dir, topo, state):  # noqa: F811
  """A step folder without its marker (manifest.json; group.json in xor/)
  is never a step: it goes when the tier starts, in its own folder and its
  partner and XOR folders, and when retention runs."""
  tier = make_tier(shm_dir, topo)
  for step in (1, 2):
    save(tier, step, state)
  own = tier.directory
  partner = os.path.join(own, "partner", "process_1")
  os.makedirs(partner)
  for step in (1, 2):
    shutil.copytree(tier.step_dir(step), os.path.join(partner, f"step_{step}"))
  os.remove(os.path.join(partner, "step_2", "manifest.json"))
  xor = os.path.join(own, "xor")
  _parity(xor, 1)
  _parity(xor, 2, marked=False)
  os.remove(os.path.join(tier.step_dir(1), "manifest.json"))
  os.makedirs(tier.step_dir(7))  # empty
  tier.close()
  tier = make_tier(shm_dir, topo)
  try:
    assert sorted(os.listdir(own)) == [".owner", "partner", "step_2", "xor"]
    assert os.listdir(partner) == ["step_1"] and os.listdir(xor) == ["step_1"]
    for step in (3, 4):
      save(tier, step, state)
    os.remove(os.path.join(tier.step_dir(3), "manifest.json"))  # damaged while running
    os.remove(os.path.join(partner, "step_1", "manifest.json"))
    os.remove(os.path.join(xor, "step_1", "group.json"))
    assert tier.steps() == [2, 4]
    assert tier.apply_retention({4}) == [2]
    left = sorted(n for n in os.listdir(own) if not n.startswith(".tmp-spare-"))
    assert left == [".owner", "partner", "step_4", "xor"]  # step 2's file kept as a spare
    assert os.listdir(partner) == [] and os.listdir(xor) == []
  finally:
    tier.close()


def test_a_step_committed_while_a_torn_folder_is_removed_is_put_back(shm_dir, monkeypatch):
  """drop_unmarked renames a torn folder away before removing it: if a step
  was renamed into place under that name meanwhile, it is put back."""
  folder = os.path.join(shm_dir, "p")
  torn = os.path.join(folder, "step_5")
  os.makedirs(torn)
  real = folders.rename_out_of_namespace

  def racing(path):
    shutil.rmtree(path)  # the torn folder replaced by a committed step
    os.makedirs(path)
    with open(os.path.join(path, "manifest.json"), "w") as f:
      f.write("{}")
    return real(path)

  monkeypatch.setattr(folders, "rename_out_of_namespace", racing)
  assert folders.drop_unmarked(folder, "manifest.json") == []
  assert os.listdir(folder) == ["step_5"]
  assert os.listdir(torn) == ["manifest.json"]


@pytest.mark.parametrize("kind", ["link", "file"])
def test_drop_unmarked_leaves_links_and_files_alone(shm_dir, kind):
  folder = os.path.join(shm_dir, "p")
  os.makedirs(os.path.join(shm_dir, "target"))
  os.makedirs(folder)
  path = os.path.join(folder, "step_3")
  if kind == "link":
    os.symlink(os.path.join(shm_dir, "target"), path)
  else:
    open(path, "w").close()
  assert folders.drop_unmarked(folder, "manifest.json") == []
  assert os.path.lexists(path) and os.path.isdir(os.path.join(shm_dir, "target"))


def test_after_a_restore_newer_leftovers_of_dead_folders_go_damaged_ones_too(
  shm_dir,
  topo,  # noqa: F811
  state,  # noqa: F811
):
  """The soak's 'orphans' finding: a dead folder's step newer than the
  restored one, with a damaged manifest, is no copy (discovery skips it),
  so retention never listed it; after the restore it goes, with every newer
  step folder there (data, partner copy, parity block), the restorable ones
  and older ones kept."""
  dead = _killed_job_folder(shm_dir, topo, state)
  manifest = os.path.join(dead, "step_5", "manifest.json")
  with open(manifest, "r+b") as f:  # a flipped byte: the copy is damaged
    f.seek(40)
    byte = f.read(1)
    f.seek(40)
    f.write(bytes([byte[0] ^ 0x10]))
  tier = make_tier(shm_dir, topo)
  try:
    assert tier.usable_steps()[0] == [1, 3, 4]  # step 5 damaged: no copy, never retained
    tier.drop_newer_leftovers(3, keep={4})
    assert sorted(n for n in os.listdir(dead) if n.startswith("step_")) == [
      "step_1",
      "step_3",
      "step_4",
    ]
    partner = os.listdir(os.path.join(dead, "partner", "process_2"))
    assert sorted(n for n in partner if n.startswith("step_")) == ["step_4"]
    assert sorted(os.listdir(os.path.join(dead, "xor"))) == ["step_3", "step_4"]
    assert tier.held_steps() == [1, 3, 4]
  finally:
    tier.close()
