"""Fault matrix, part 2: damaged checkpoints, hostile ramdisk folders, wrong
restore arguments, another topology, a hang in the restore agreement, and a
full ramdisk.

One 2-process job (2 slices x 1 process) saves a pristine run (steps 1-5;
local every step, 3 kept: 3, 4, 5; persistent every 2nd: 2, 4) plus another
run into the same ramdisk roots. One more job then, per variant, resets every
disk to the pristine copy, damages it, restores with a fresh manager and
records what happened on each process.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from emergency_ckpt.demo.launcher import run_job
from tests.fault_matrix import check_errors, check_restored, job_failure
from tests.fault_scenarios import read_records
from tests.helpers import mount_tmpfs

TIMEOUT = 3  # collective_timeout_s where a process is expected to be missing


def _flip(by, step):
  return {"op": "flip_shard", "by": by, "step": step}


BOTH = [0, 1]
# name -> variant (see fault_scenarios.damage_variants)
VARIANTS = {
  "state.json_torn": {"damage": [{"op": "json_torn", "by": [0], "step": 5, "process": 1}]},
  "state.json_edited": {"damage": [{"op": "json_edit", "by": [0], "step": 5, "process": 0}]},
  "state.json_missing": {"damage": [{"op": "json_rm", "by": [0], "step": 5, "process": 1}]},
  "state.commit_torn": {"damage": [{"op": "commit_torn", "by": [0], "step": 5}]},
  "state.commit_missing": {"damage": [{"op": "commit_rm", "by": [0], "step": 5}]},
  "local.flip_one_slice": {"damage": [_flip([1], 5)]},
  "local.flip_primary_slice": {"damage": [_flip([0], 5)]},
  "local.truncated_shard": {"damage": [{"op": "truncate_shard", "by": [1], "step": 5}]},
  "local.deleted_shard": {
    "damage": [{"op": "rm_local", "by": [1], "step": 5, "file": "shards.bin"}]
  },
  "local.corrupt_manifest": {"damage": [{"op": "flip_manifest", "by": [1], "step": 5}]},
  "local.flip_all_slices_fallback": {"damage": [_flip(BOTH, 5)]},
  "local.flip_all_slices_persistent": {"damage": [_flip(BOTH, 5), _flip(BOTH, 4)]},
  "local.nothing_good": {"damage": [_flip(BOTH, "all"), {"op": "rm_persistent", "by": [0]}]},
  "dir.foreign_run": {"damage": [{"op": "plant_foreign", "by": [1], "step": 5}]},
  "dir.symlink": {
    "damage": [{"op": "symlink_run_dir", "by": [1]}],
    "options": {"collective_timeout_s": TIMEOUT},
  },
  "dir.loose_permissions": {"damage": [{"op": "chmod_process_dir", "by": BOTH, "mode": 0o755}]},
  "dir.foreign_owner": {"damage": [{"op": "chown_process_dir", "by": BOTH, "uid": 4242}]},
  "api.abstract_dtype": {"abstract": "dtype"},
  "api.abstract_shape": {"abstract": "shape"},
  "api.abstract_tree": {"abstract": "tree"},
  "api.abstract_dtype_persistent": {"options": {"slices": 1}, "abstract": "int_dtype"},
  "api.abstract_shape_persistent": {"options": {"slices": 1}, "abstract": "shape"},
  "restart.other_slice_count": {"options": {"slices": 1}},
  "restart.other_slice_count_local_only": {
    "options": {"slices": 1},
    "damage": [{"op": "rm_persistent", "by": [0]}],
  },
  # Last: process 1 is SIGKILLed at the end.
  "hang.restore_agreement": {
    "stop_at_status_exchange": 1,
    "options": {"collective_timeout_s": TIMEOUT},
    "last": True,
    "kill_after": [1],
  },
}
if os.geteuid() != 0:  # chown needs root; test_faults_api covers the check with a fake stat
  del VARIANTS["dir.foreign_owner"]


@pytest.fixture(scope="module")
def damage_runs(module_shm_dir):
  args = {
    "slices": 2,
    "local_root": os.path.join(module_shm_dir, "local"),
    "persistent": os.path.join(module_shm_dir, "persistent"),
    "other_persistent": os.path.join(module_shm_dir, "other_persistent"),
    "steps": [1, 2, 3, 4, 5],
    "local_keep": 3,
    "persistent_interval": 2,
  }
  base = run_job(
    "tests.fault_scenarios:damage_base",
    2,
    args,
    timeout_s=180,
    out_dir=os.path.join(module_shm_dir, "base_job"),
  )
  base.check()
  for facts in base.results:
    # Local retention keeps 3, but never drops a step before a newer one is
    # committed, and a non-primary process does not wait for the primary's
    # COMMIT: it may keep older steps until its next save.
    assert {"step_3", "step_4", "step_5"} <= set(facts["local_entries"]), facts
  assert base.results[0]["tensors"] == ["2", "4"], base.results[0]
  args["variants"] = [dict(v, name=name) for name, v in VARIANTS.items()]
  out_dir = os.path.join(module_shm_dir, "variants_job")
  job = run_job("tests.fault_scenarios:damage_variants", 2, args, timeout_s=300, out_dir=out_dir)
  by_name = {}
  for p in range(2):
    for rec in read_records(out_dir, p):
      by_name.setdefault(rec["name"], {})[p] = rec
  return {"job": job, "records": by_name, "base": base.results}


def _records(damage_runs, name) -> list[dict]:
  recs = damage_runs["records"].get(name, {})
  if len(recs) < 2 and name != "hang.restore_agreement":
    pytest.fail(f"{name}: no record from every process: {job_failure(damage_runs['job'])}")
  return [recs[p] for p in sorted(recs)]


# name -> (step, sources per slice or one for all, data_state)
RESTORES = {
  "state.json_torn": (4, "local"),
  "state.json_edited": (4, "local"),
  "state.json_missing": (4, "local"),
  "state.commit_torn": (4, "local"),
  "state.commit_missing": (4, "local"),
  "local.flip_one_slice": (5, {0: "local", 1: "peer"}),
  "local.flip_primary_slice": (5, {0: "peer", 1: "local"}),
  "local.truncated_shard": (5, {0: "local", 1: "peer"}),
  "local.deleted_shard": (5, {0: "local", 1: "peer"}),
  "local.corrupt_manifest": (5, {0: "local", 1: "peer"}),
  "local.flip_all_slices_fallback": (4, "local"),
  "local.flip_all_slices_persistent": (4, "persistent"),
  "dir.foreign_run": (5, {0: "local", 1: "peer"}),
  "restart.other_slice_count": (5, "local"),
  "restart.other_slice_count_local_only": (5, "local"),
}


@pytest.mark.parametrize("name", list(RESTORES))
def test_damaged_checkpoint_restores(damage_runs, fault_matrix, name):
  step, sources = RESTORES[name]
  recs = _records(damage_runs, name)
  ok, text = check_restored(recs, step, sources)
  if ok and name == "dir.foreign_run":
    other = [r["other_run_entries"] for r in recs]
    before = [b["other_entries"] for b in damage_runs["base"]]
    ok = other == before and all(other)
    text += f"; the other run's folders untouched ({other} == {before})"
  if ok and name.startswith("restart.other_slice_count"):
    text = "1 slice x 2 processes: the ramdisk copies of 2 slices x 1 process, resharded; " + text
  fault_matrix.check(name, text, ok)


ERRORS = {
  "local.nothing_good": (
    {p: ("NoRestorableCheckpointError", ["step 5", "step 4", "step 3", "checksum"]) for p in BOTH}
  ),
  "dir.symlink": {
    0: ("CollectiveTimeoutError", ["[1]"]),
    1: ("UnsafeDirectoryError", ["symlink", "test-run"]),
  },
  "dir.loose_permissions": {p: ("UnsafeDirectoryError", ["0o755", "chmod 700"]) for p in BOTH},
  "dir.foreign_owner": {p: ("UnsafeDirectoryError", ["uid 4242"]) for p in BOTH},
  "api.abstract_dtype": {p: ("StateMismatchError", ["['w']", "float16", "float32"]) for p in BOTH},
  "api.abstract_shape": {p: ("StateMismatchError", ["['w']", "32"]) for p in BOTH},
  "api.abstract_tree": {p: ("StateMismatchError", ["['mask']"]) for p in BOTH},
  "api.abstract_dtype_persistent": {p: ("StateMismatchError", ["['ids']"]) for p in BOTH},
  "api.abstract_shape_persistent": {p: ("StateMismatchError", ["['w']"]) for p in BOTH},
}


@pytest.mark.parametrize("name", [n for n in ERRORS if n in VARIANTS])
def test_damaged_checkpoint_errors(damage_runs, fault_matrix, name):
  recs = _records(damage_runs, name)
  ok, text = check_errors(recs, ERRORS[name])
  if not ok:
    restored = [r for r in recs if "step" in r]
    if restored:
      r = restored[0]
      text += (
        f" [restored step {r['step']} from {r['source']}, bit mismatches:"
        f" {r['mismatches'][:3] or 'none'}]"
      )
  if ok and name == "dir.symlink":
    text = "process 1 refuses the planted symlink; " + text
  fault_matrix.check(name, text, ok)


def test_hang_in_restore_agreement(damage_runs, fault_matrix):
  name = "hang.restore_agreement"
  job = damage_runs["job"]
  recs = damage_runs["records"].get(name, {})
  r0 = recs.get(0)
  problems = []
  if r0 is None:
    problems.append(f"no record from process 0: {job_failure(job)}")
  elif r0.get("error") != "CollectiveTimeoutError" or "[1]" not in r0.get("message", ""):
    problems.append(f"process 0: {r0.get('error')}: {r0.get('message')}")
  elif "restore_status" not in r0["message"]:
    problems.append(f"timed out elsewhere than the status exchange: {r0['message']}")
  elif r0["elapsed_s"] > TIMEOUT + 5:
    problems.append(f"took {r0['elapsed_s']} s with collective_timeout_s={TIMEOUT}")
  if job.returncodes[1] != -9:
    problems.append(f"process 1 rc {job.returncodes[1]}, expected SIGKILL after the test")
  observed = (
    f"process 1 stopped at 'restore_status'; process 0: CollectiveTimeoutError naming [1]"
    f" at exchange 'restore_status_5' after {r0 and r0.get('elapsed_s')} s"
    f" (collective_timeout_s={TIMEOUT}); process 1 SIGKILLed afterwards"
  )
  fault_matrix.check(name, "; ".join(problems) or observed, not problems)


# ---- a full ramdisk ------------------------------------------------------------------


def test_ramdisk_full(shm_dir, fault_matrix):
  name = "disk.enospc"
  args = {
    "slices": 2,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "persistent_interval": 2,
    "local_keep": 3,
  }
  primary_host = os.path.join(args["local_root"], "host_0")
  forced = os.environ.get("EC_FAULT_ENOSPC_MODE")  # "rlimit": exercise the fallback
  mounted = forced != "rlimit" and mount_tmpfs(primary_host, "1m")
  if mounted:
    args.update(mode="tmpfs", victim=0)
    how = "a real 1 MiB tmpfs as the primary's ramdisk, filled up"
  else:
    # No tmpfs without CAP_SYS_ADMIN: a per-process file size limit gives a
    # real EFBIG on process 1's (non-primary) shard file instead.
    args.update(mode="rlimit", victim=1, big=4 << 20, rlimit_bytes=2 << 20)
    why = "forced" if forced == "rlimit" else "no tmpfs mount possible"
    how = f"RLIMIT_FSIZE (EFBIG; {why}) on process 1"
  try:
    job = run_job(
      "tests.fault_scenarios:enospc_run",
      2,
      args,
      timeout_s=180,
      out_dir=os.path.join(shm_dir, "job"),
    )
  finally:
    if mounted:
      subprocess.run(["umount", "-l", primary_host], check=False)
  if job.returncodes != [0, 0]:
    fault_matrix.check(name, f"job failed: {job_failure(job)}", False)
  victim = args["victim"]
  rv = job.results[victim]
  log = job.logs[victim]
  problems = []
  if "save_error" in rv:
    problems.append(f"save raised: {rv['save_error']}")
  if sorted(rv["saved"]) != [3, 4]:
    problems.append(f"save() returned {rv['saved']} for steps 3-4")
  errno_text = "No space left on device" if mounted else "File too large"
  if "local save of step 3 failed" not in log or errno_text not in log:
    problems.append("no warning naming the failed local save and the OS error")
  listed = [n for n in rv["local_entries_while_full"] if n != ".owner"]  # the folder's lock
  if listed != ["step_1", "step_2"]:
    problems.append(f"ramdisk listing while full: {listed} (want step_1, step_2 only)")
  if "4" not in job.results[0]["tensors"]:
    problems.append(f"persistent tier lacks step 4: {job.results[0]['tensors']}")
  sources = {0: "peer", 1: "local"} if victim == 0 else {0: "local", 1: "peer"}
  ok, text = check_restored(job.results, 4, sources)
  if not ok:
    problems.append(text)
  observed = (
    f"{how}: save() of steps 3-4 returned True, warning '{errno_text}', ramdisk lists"
    f" only {listed}, persistent tier {job.results[0]['tensors']}; {text}"
  )
  fault_matrix.check(name, "; ".join(problems) or observed, not problems)
