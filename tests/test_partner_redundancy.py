"""Issue 18, partner redundancy (local.redundancy = "partner"): each
process's local step also lives in its partner's ramdisk (the next process
of its slice on another machine), so a lost host is rebuilt without a peer
slice and without the persistent tier.

Saved once per module: 1 slice x 4 processes (each a machine of its own:
host_<i>), steps 1-5, local every step (3 kept), persistent every 3rd
(step 3). Each test restarts on a copy of those folders after wiping
hosts. Real jax.distributed jobs, real files on /dev/shm, bit-exact checks.
"""

from __future__ import annotations

import os
import shutil

import pytest

from emergency_ckpt import local_format
from emergency_ckpt.testing.launcher import run_job
from tests.conftest import _fresh_shm_dir


def _save(root: str, processes: int, slices: int) -> dict:
  args = {
    "slices": slices,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "persistent"),
    "steps": [1, 2, 3, 4, 5],
    "persistent_interval": 3,
    "local_keep": 3,
    "redundancy": "partner",
    "sim_hosts": True,
  }
  run_job("tests.scenarios:save_steps", processes, args, timeout_s=240).check()
  return args


@pytest.fixture(scope="module")
def one_slice():
  for root in _fresh_shm_dir("ectest-partner-"):
    yield _save(root, 4, 1)


def _copy(saved: dict, dest: str) -> dict:
  args = dict(saved)
  for key in ("local_root", "persistent"):
    args[key] = os.path.join(dest, os.path.basename(saved[key]))
    shutil.copytree(saved[key], args[key], symlinks=True)
  return args


def _wipe(args: dict, *hosts: int) -> None:
  for host in hosts:
    shutil.rmtree(os.path.join(args["local_root"], f"host_{host}"))


def _partner_dir(args: dict, host: int, sender: int) -> str:
  return os.path.join(
    args["local_root"],
    f"host_{host}",
    "test-run",
    f"process_{host}",
    "partner",
    f"process_{sender}",
  )


def _restart(args: dict, processes: int, slices: int) -> dict[int, dict]:
  args = dict(args, slices=slices, then_save=[6, 7, 8])
  results = run_job(
    "tests.elastic_scenarios:restore_then_save", processes, args, timeout_s=240
  ).check()
  return {r["process"]: r for r in results}


def test_every_step_lives_in_the_partners_ramdisk_too(one_slice, shm_dir):
  args = _copy(one_slice, shm_dir)
  for p in range(4):
    partner = (p + 1) % 4
    held = sorted(os.listdir(_partner_dir(args, partner, p)))
    assert held == ["step_2", "step_3", "step_4", "step_5"], (p, held)  # max_to_keep + 1
    for step in (2, 3, 4, 5):
      where = os.path.join(_partner_dir(args, partner, p), f"step_{step}")
      body, problems = local_format.verify_step_dir(where)
      assert problems == [] and body["process_index"] == p, (where, problems)


def test_a_lost_host_is_rebuilt_from_its_partner(one_slice, shm_dir):
  args = _copy(one_slice, shm_dir)
  _wipe(args, 1)
  got = _restart(args, 4, 1)
  assert {p: r["source"] for p, r in got.items()} == {
    0: "local",
    1: "partner",
    2: "local",
    3: "local",
  }
  for r in got.values():
    assert (r["step"], r["bad"]) == (5, []), r
    assert r["data_state"] == {
      "pos": 5000 + r["process"],
      "seed": [r["process"], 5],
      "tag": f"p{r['process']}-s5",
    }
    assert r["all_steps"][-3:] == [6, 7, 8], r


def test_losing_a_host_and_its_partner_falls_back_to_persistent(one_slice, shm_dir):
  args = _copy(one_slice, shm_dir)
  _wipe(args, 1, 2)  # process 1 and its partner (process 2)
  got = _restart(args, 4, 1)
  for r in got.values():
    assert (r["step"], r["source"], r["bad"]) == (3, "persistent", []), r


def test_a_damaged_partner_copy_is_skipped(one_slice, shm_dir):
  args = _copy(one_slice, shm_dir)
  _wipe(args, 1)
  where = os.path.join(_partner_dir(args, 2, 1), "step_5")
  body = local_format.read_manifest(where)
  at = body["leaves"][-1]["shards"][0]["offset"] + 3
  with open(os.path.join(where, local_format.SHARDS), "r+b") as f:
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0x01]))
  got = _restart(args, 4, 1)
  for p, r in got.items():
    # step 5's only copy of process 1 is damaged: step 4, rebuilt from the partner
    assert (r["step"], r["bad"]) == (4, []), r
    assert r["source"] == ("partner" if p == 1 else "local"), r


def test_the_same_position_lost_in_every_slice_is_rebuilt_from_partners(shm_dir):
  args = _save(shm_dir, 4, 2)  # 2 slices x 2 processes; partners: 0<->1, 2<->3
  _wipe(args, 1, 3)  # slice position 1 of both slices: no peer slice holds it
  got = _restart(args, 4, 2)
  for p, r in got.items():
    assert (r["step"], r["bad"]) == (5, []), r
    assert r["source"] == ("partner" if p in (1, 3) else "local"), r
