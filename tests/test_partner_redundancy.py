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

import pytest

from emergency_ckpt.demo.launcher import run_job
from emergency_ckpt.local import format as local_format
from tests import restart_helpers as rh
from tests.conftest import _fresh_shm_dir


def _save(root: str, processes: int, slices: int, **extra) -> dict:
  return rh.save_run(root, processes, slices, redundancy="partner", sim_hosts=True, **extra)


@pytest.fixture(scope="module")
def one_slice():
  # sent beside the local write (the default on a training host's many cores;
  # the 2-slice test below sends after it)
  for root in _fresh_shm_dir("ectest-partner-"):
    # one save at a time: a save that finds local.max_to_keep newer steps
    # queued behind an unsent one skips that one (save/protection.py); here
    # every step's copy is checked
    yield _save(root, 4, 1, redundancy_overlap=True, wait_each=True)


def _partner_dir(args: dict, host: int, sender: int) -> str:
  return os.path.join(rh.process_dir(args, host), "partner", f"process_{sender}")


def test_every_step_lives_in_the_partners_ramdisk_too(one_slice, shm_dir):
  assert one_slice["overlap"] == [True]  # every process sent beside its write
  args = rh.copy_run(one_slice, shm_dir)
  for p in range(4):
    partner = (p + 1) % 4
    names = sorted(os.listdir(_partner_dir(args, partner, p)))
    held = [n for n in names if not n.startswith(".tmp-")]
    assert held == ["step_2", "step_3", "step_4", "step_5"], (p, names)  # max_to_keep + 1
    # and step 1's folder, kept as the spare the next step is written over
    spares = [n for n in names if n.startswith(".tmp-spare-")]
    assert len(spares) == 1 and len(names) == 5, (p, names)
    spare = os.path.join(_partner_dir(args, partner, p), spares[0], "shards.bin")
    assert os.path.getsize(spare) == os.path.getsize(
      os.path.join(_partner_dir(args, partner, p), "step_5", "shards.bin")
    )
    for step in (2, 3, 4, 5):
      where = os.path.join(_partner_dir(args, partner, p), f"step_{step}")
      body, problems = local_format.verify_step_dir(where)
      assert problems == [] and body["process_index"] == p, (where, problems)


def test_a_lost_host_is_rebuilt_from_its_partner(one_slice, shm_dir, fault_matrix):
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1)
  got = rh.restart(args, 4, 1)
  fault_matrix.check(
    "redundancy.partner_host_lost",
    rh.describe(got),
    rh.outcome(got) == {p: (5, "partner" if p == 1 else "local", []) for p in range(4)},
  )
  for r in got.values():
    assert (r["step"], r["bad"]) == (5, []), r
    assert r["data_state"] == {
      "pos": 5000 + r["process"],
      "seed": [r["process"], 5],
      "tag": f"p{r['process']}-s5",
    }
    assert r["all_steps"][-3:] == [6, 7, 8], r


def test_losing_a_host_and_its_partner_falls_back_to_persistent(one_slice, shm_dir, fault_matrix):
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1, 2)  # process 1 and its partner (process 2)
  got = rh.restart(args, 4, 1)
  fault_matrix.check(
    "redundancy.partner_pair_lost",
    rh.describe(got),
    len(got) == 4
    and all((r["step"], r["source"], r["bad"]) == (3, "persistent", []) for r in got.values()),
  )


def test_a_damaged_partner_copy_is_skipped(one_slice, shm_dir, fault_matrix):
  args = rh.copy_run(one_slice, shm_dir)
  rh.wipe_hosts(args, 1)
  where = os.path.join(_partner_dir(args, 2, 1), "step_5")
  body = local_format.read_manifest(where)
  at = body["leaves"][-1]["shards"][0]["offset"] + 3
  with open(os.path.join(where, local_format.SHARDS), "r+b") as f:
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0x01]))
  got = rh.restart(args, 4, 1)
  # step 5's only copy of process 1 is damaged: step 4, from the partner
  fault_matrix.check(
    "redundancy.partner_damaged",
    rh.describe(got),
    rh.outcome(got) == {p: (4, "partner" if p == 1 else "local", []) for p in range(4)},
  )


def test_the_same_position_lost_in_every_slice_is_rebuilt_from_partners(shm_dir):
  args = _save(
    shm_dir, 4, 2, redundancy_overlap=False
  )  # 2 slices x 2 processes; partners: 0<->1, 2<->3
  assert args["overlap"] == [False]  # sent after the local write
  rh.wipe_hosts(args, 1, 3)  # slice position 1 of both slices: no peer slice holds it
  got = rh.restart(args, 4, 2)
  for p, r in got.items():
    assert (r["step"], r["bad"]) == (5, []), r
    assert r["source"] == ("partner" if p in (1, 3) else "local"), r


@pytest.mark.parametrize(
  ("required", "persistent_interval", "want"),
  [(True, 100, [1, 3]), (False, 100, [1, 2, 3]), (True, 2, [1, 2, 3])],
)
def test_a_step_commits_only_once_its_partner_holds_it(
  shm_dir, required, persistent_interval, want
):
  """Process 1 (process 0's partner) cannot store step 2: with redundancy
  required, step 2 never commits (its state is never written) and the run
  goes on; with local.redundancy_required=False it commits unprotected; a
  persistent step commits anyway (the persistent tier holds it)."""
  args = {
    "slices": 1,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "steps": [1, 2, 3],
    "persistent_interval": persistent_interval,
    "local_keep": 3,
    "redundancy": "partner",
    "redundancy_required": required,
    "sim_hosts": True,
    "state_commit_timeout_s": 3,
  }
  got = run_job(
    "tests.redundancy_scenarios:save_then_list",
    2,
    args,
    env={1: {"EC_FAILPOINTS": "partner.refuse@2"}},
    timeout_s=240,
  ).check()
  assert [r["all_steps"] for r in got] == [want, want], got


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_a_partner_or_member_on_the_same_machine_is_named(shm_dir, scheme):
  """Both processes on one machine (no host_id): no copy would survive
  losing it. The manager says so (placement_problem, and a warning)."""
  args = {
    "slices": 1,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "steps": [1, 2],
    "local_keep": 2,
    "redundancy": scheme,
  }
  got = run_job("tests.redundancy_scenarios:save_then_list", 2, args, timeout_s=240).check()
  for r in got:
    problem = r["placement_problem"] or ""
    assert f"local.redundancy='{scheme}'" in problem and "machine" in problem, r
    # a partner on the same machine protects nothing: saves go on (partner
    # sends none); an XOR group on one machine still keeps its blocks
    assert r["all_steps"] == [1, 2], r
