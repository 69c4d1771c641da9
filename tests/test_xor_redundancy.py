"""Issue 18, XOR parity (local.redundancy = "xor"): the processes of a slice
form groups on distinct machines; each member keeps an XOR parity block of
the others' steps (1/(k-1) of a step), and any one member lost per group is
rebuilt from the other k-1, bit-exactly, without a peer slice or the
persistent tier.

Saved once per module: 1 slice x 4 processes (each a machine of its own:
host_<i>; one group of 4), steps 1-5, local every step (3 kept),
persistent every 3rd (step 3). Each test restarts on a copy of those
folders after wiping hosts. Real jax.distributed jobs, real files on
/dev/shm, bit-exact checks.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from emergency_ckpt.core import parity as xor_parity
from emergency_ckpt.local import blocks as local_blocks
from tests import restart_helpers as rh
from tests.conftest import _fresh_shm_dir


def _save(root: str, processes: int, slices: int, **extra) -> dict:
  return rh.save_run(root, processes, slices, redundancy="xor", sim_hosts=True, **extra)


@pytest.fixture(scope="module")
def one_slice():
  # sent beside the local write (the default on a training host's many cores;
  # the 2-slice test below sends after it)
  for root in _fresh_shm_dir("ectest-xor-"):
    # one save at a time: a save that finds local.max_to_keep newer steps
    # queued behind an unsent one skips that one (save/protection.py); here
    # every step's copy is checked
    yield _save(root, 4, 1, redundancy_overlap=True, wait_each=True)


def test_each_member_keeps_the_xor_of_the_others_chunks(one_slice, shm_dir):
  assert one_slice["overlap"] == [True]  # every process sent beside its write
  args = rh.copy_run(one_slice, shm_dir)
  data = []
  for p in range(4):
    with open(os.path.join(rh.process_dir(args, p), "step_5", "shards.bin"), "rb") as f:
      data.append(f.read())
  for j in range(4):
    folder = os.path.join(rh.process_dir(args, j), "xor")
    names = sorted(os.listdir(folder))
    steps = [n for n in names if n.startswith("step_")]
    assert steps == ["step_2", "step_3", "step_4", "step_5"]  # keep + 1
    # and step 1's block, the spare the next step's chunks are written into
    (spare,) = [n for n in names if n not in steps]
    assert spare.startswith(".tmp-spare-")
    spare_bytes = os.path.getsize(os.path.join(folder, spare, local_blocks.PARITY_FILE))
    body = local_blocks.read_group(os.path.join(folder, "step_5"))
    assert (body["group"], body["member"]) == ([0, 1, 2, 3], j)
    with open(os.path.join(folder, "step_5", local_blocks.PARITY_FILE), "rb") as f:
      block = np.frombuffer(f.read(), np.uint8)
    assert block.tobytes() == xor_parity.parity(j, data).tobytes()
    assert spare_bytes == len(block)  # every step of this run has one size
    # 1/(k-1) of a step, not a copy
    assert len(block) <= -(-max(len(d) for d in data) // 3)


def test_a_lost_host_is_rebuilt_from_its_group(one_slice, shm_dir, fault_matrix):
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1)
  got = rh.restart(args, 4, 1)
  fault_matrix.check(
    "redundancy.xor_host_lost",
    rh.describe(got),
    rh.outcome(got) == {p: (5, "parity" if p == 1 else "local", []) for p in range(4)},
  )
  for r in got.values():
    assert (r["step"], r["bad"]) == (5, []), r
    p = r["process"]
    assert r["data_state"] == {"pos": 5000 + p, "seed": [p, 5], "tag": f"p{p}-s5"}, r
    assert r["all_steps"][-3:] == [6, 7, 8], r


def test_two_hosts_of_a_group_lost_fall_back_to_persistent(one_slice, shm_dir, fault_matrix):
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1, 2)
  got = rh.restart(args, 4, 1)
  fault_matrix.check(
    "redundancy.xor_two_lost",
    rh.describe(got),
    len(got) == 4
    and all((r["step"], r["source"], r["bad"]) == (3, "persistent", []) for r in got.values()),
  )


def test_a_damaged_parity_block_is_skipped(one_slice, shm_dir, fault_matrix):
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1)
  path = os.path.join(rh.process_dir(args, 2), "xor", "step_5", local_blocks.PARITY_FILE)
  with open(path, "r+b") as f:  # member 2's block holds a chunk of member 1's step 5
    f.seek(7)
    byte = f.read(1)
    f.seek(7)
    f.write(bytes([byte[0] ^ 0x04]))
  got = rh.restart(args, 4, 1)
  # step 5 skipped, step 4 rebuilt
  fault_matrix.check(
    "redundancy.xor_parity_damaged",
    rh.describe(got),
    rh.outcome(got) == {p: (4, "parity" if p == 1 else "local", []) for p in range(4)},
  )


def test_a_torn_group_file_is_not_used(one_slice, shm_dir, fault_matrix):
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1)
  path = os.path.join(rh.process_dir(args, 3), "xor", "step_5", local_blocks.GROUP_FILE)
  with open(path) as f:
    doc = json.load(f)
  doc["body"]["sizes"]["0"] += 1  # edited: its checksum no longer matches
  with open(path, "w") as f:
    json.dump(doc, f)
  got = rh.restart(args, 4, 1)
  fault_matrix.check(
    "redundancy.xor_group_file_edited",
    rh.describe(got),
    rh.outcome(got) == {p: (4, "parity" if p == 1 else "local", []) for p in range(4)},
  )


def test_the_same_position_lost_in_every_slice_is_rebuilt(shm_dir):
  args = _save(shm_dir, 4, 2, redundancy_overlap=False)  # 2 slices x 2 processes: groups of 2
  assert args["overlap"] == [False]  # sent after the local write
  rh.wipe_hosts(args, 1, 3)
  got = rh.restart(args, 4, 2)
  for p, r in got.items():
    why = f"process {p}: step {r['step']} from {r['source']}; warnings: {r['warnings']}"
    assert (r["step"], r["bad"]) == (5, []), why
    assert r["source"] == ("parity" if p in (1, 3) else "local"), why


def test_the_restarted_process_rebuilds_its_own_shards(one_slice, shm_dir):
  """Same process count: the process that took the lost member's place
  rebuilds it (pulling every piece from the survivors at once), no
  survivor rebuilds and forwards it; with hosts shuffled it reads the
  pieces its new host holds in place."""
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1)
  got = rh.restart(args, 4, 1)
  assert {p: r["rebuilt"] for p, r in got.items()} == {0: [], 1: [1], 2: [], 3: []}, got
  # host 1 lost, and host 2's machine now runs process 1 (host 2 comes back empty)
  args = rh.copy_run(one_slice, os.path.join(shm_dir, "shuffled"))
  rh.wipe_hosts(args, 1)
  os.rename(os.path.join(args["local_root"], "host_2"), os.path.join(args["local_root"], "host_1"))
  got = rh.restart(args, 4, 1)
  for r in got.values():
    assert (r["step"], r["bad"]) == (5, []), r
  assert {p: r["rebuilt"] for p, r in got.items()} == {0: [], 1: [1], 2: [], 3: []}, got
  assert got[1]["source"] == "parity", got[1]


def test_onto_more_slices_a_survivor_rebuilds_and_serves_the_lost_member(one_slice, shm_dir):
  """Another process count (1 slice x 4 saved, 2 slices x 4 restored): the
  first survivor of the group rebuilds the lost member and serves it to
  both processes that need its shards."""
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1)
  got = rh.restart(args, 8, 2)
  for r in got.values():
    assert (r["step"], r["bad"]) == (5, []), r
  assert {p: r["rebuilt"] for p, r in got.items()} == {p: [1] if p == 0 else [] for p in range(8)}
