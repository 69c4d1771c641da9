"""Issue 16, part 2: ramdisk copies restored onto another mesh (resharded).

Saved once per module: 2 slices x 2 processes x 2 CPU devices, steps 1-5,
local every step (3 kept), persistent every 3rd (step 3); each process on
a host of its own (host_<i> folders). Each test restarts on a copy of those
folders as processes x 1 device, so every process needs other shards than
any saved process held: it assembles them from the saved shards that
overlap them, from its own host's copy or from the holder's, bit-exactly.
Real jax.distributed jobs, real files on /dev/shm.
"""

from __future__ import annotations

import os

import pytest

from emergency_ckpt.local import format as local_format
from tests import restart_helpers as rh
from tests import scenarios as sc
from tests.conftest import _fresh_shm_dir


@pytest.fixture(scope="module")
def saved():
  """The saved run's folders, on /dev/shm (each test restarts on a copy)."""
  for root in _fresh_shm_dir("ectest-reshard-"):
    yield rh.save_run(root, 4, 2)


def _restart(args: dict, processes: int, slices: int) -> dict[int, dict]:
  return rh.restart(args, processes, slices, devices_per_process=1)


def test_two_by_two_restored_as_two_slices_of_four_single_device_processes(saved, shm_dir):
  args = rh.copy_run(saved, shm_dir)
  got = _restart(args, 8, 2)
  # New process p needs columns [4p, 4p+4) of its slice's data axis. Saved
  # process 0 held columns 0-8 and process 3 (slice 1) columns 8-16, on
  # hosts 0 and 3: processes 0 and 3 find every byte on their own host.
  want = {p: "local" if p in (0, 3) else "peer" for p in range(8)}
  assert {p: r["source"] for p, r in got.items()} == want, got
  for p, r in got.items():
    assert (r["step"], r["bad"]) == (5, []), r
    assert r["data_state"] is None, r  # saved by 4 processes (see data_state_remap)
    assert r["all_steps"][-3:] == [6, 7, 8], r
    # the run goes on under the new topology; the old copies are retired
    assert r["host_folders"][f"process_{p}"] == ["step_6", "step_7", "step_8"], r


def test_two_slices_restored_as_one_slice_of_four_single_device_processes(saved, shm_dir):
  args = rh.copy_run(saved, shm_dir)
  got = _restart(args, 4, 1)
  assert {p: r["source"] for p, r in got.items()} == {0: "local", 1: "peer", 2: "peer", 3: "local"}
  for r in got.values():
    assert (r["step"], r["bad"]) == (5, []), r


def test_a_damaged_copy_is_skipped_for_the_other_saved_slice(saved, shm_dir, fault_matrix):
  args = rh.copy_run(saved, shm_dir)
  where = os.path.join(rh.process_dir(args, 0), "step_5")
  body = local_format.read_manifest(where)
  w = next(leaf for leaf in body["leaves"] if leaf["path"] == "['w']")
  at = w["shards"][0]["offset"] + 5
  with open(os.path.join(where, local_format.SHARDS), "r+b") as f:  # one bit of saved process 0's
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0x10]))
  got = _restart(args, 8, 2)
  # saved slice 1 (hosts 2-3) serves everyone now
  want = {p: (5, "local" if p == 3 else "peer", []) for p in got}
  seen = {p: (r["step"], r["source"], r["bad"]) for p, r in got.items()}
  fault_matrix.check(
    "reshard.damaged_copy",
    f"step 5 restored on {len(got)}/8 processes (sources {[v[1] for _, v in sorted(seen.items())]}),"
    f" bit mismatches: {sum(len(r['bad']) for r in got.values())}",
    seen == want,
  )


def test_a_piece_held_by_no_ramdisk_restores_from_persistent(saved, shm_dir, fault_matrix):
  args = rh.copy_run(saved, shm_dir)
  rh.wipe_hosts(args, 1, 3)  # slice position 1 of both saved slices is gone
  got = _restart(args, 8, 2)
  seen = {(r["step"], r["source"], len(r["bad"])) for r in got.values()}
  fault_matrix.check(
    "reshard.piece_lost",
    f"restored {sorted(seen)} (step, source, bit mismatches) on {len(got)}/8 processes",
    seen == {(3, "persistent", 0)} and len(got) == 8,
  )


def test_expected_values_differ_by_step():
  """The bit checks above would notice a step mix-up."""
  assert (sc.bits(sc.expected(5)["w"]) != sc.bits(sc.expected(3)["w"])).any()
