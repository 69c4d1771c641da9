"""Fault matrix, part 3: 2 slices x 2 processes (process 0 and 1 = slice 0,
the primary slice; 2 and 3 = slice 1): a whole slice dies mid-save, the
primary process dies mid-commit, a primary-slice process hangs in an upload;
then restarts on the same topology and on 1 process.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.fault_matrix import check_errors, check_restored, excerpt, job_failure, run_jobs
from tests.helpers import fault_job_args as _dirs
from tests.helpers import listing as _listing

TIMEOUT = 3  # collective_timeout_s in the hang scenario
WAIT_BOUND = 15  # how long the hang scenario lets wait_until_finished() block
CONTINUE = 3


@pytest.fixture(scope="module")
def multislice_runs(module_shm_dir):
  slice_kill = _dirs(module_shm_dir, "crash.slice_mid_save", steps=[1, 2, 3])
  primary_kill = _dirs(module_shm_dir, "crash.primary_mid_commit", steps=[1, 2, 3])
  hang = _dirs(
    module_shm_dir,
    "hang.persistent_upload",
    steps=[1, 2],
    collective_timeout_s=TIMEOUT,
    wait_bound_s=WAIT_BOUND,
    kill_after=[1],
  )
  kill = {"EC_FAILPOINTS": "local.mid_write@3"}
  crash_specs = {
    "crash.slice_mid_save": dict(
      target="tests.fault_scenarios:save_run",
      num_processes=4,
      args=slice_kill,
      env={2: kill, 3: kill},
      timeout_s=180,
    ),
    "crash.primary_mid_commit": dict(
      target="tests.fault_scenarios:save_run",
      num_processes=4,
      args=primary_kill,
      env={0: {"EC_FAILPOINTS": "state.before_commit@3"}},
      timeout_s=180,
    ),
    "hang.persistent_upload": dict(
      target="tests.fault_scenarios:hang_in_upload_run",
      num_processes=4,
      args=hang,
      env={1: {"EC_FAILPOINTS": "persistent.after_save_call@2:stop"}},
      timeout_s=WAIT_BOUND + 120,
    ),
  }
  crash_jobs = run_jobs(_with_out_dirs(crash_specs, module_shm_dir), parallel=3)
  facts = {
    name: {"state_3": _listing(os.path.join(a["persistent"], "state", "3"))}
    for name, a in (
      ("crash.slice_mid_save", slice_kill),
      ("crash.primary_mid_commit", primary_kill),
    )
  }
  # The same run, restarted by ONE process with all 4 devices: copies, taken
  # before the 2x2 restart below changes the originals.
  fewer = dict(slice_kill, name="restart.fewer_processes", continue_steps=2)
  fewer_local = dict(slice_kill, name="restart.fewer_processes_local_only")
  for cfg, tag in ((fewer, "fewer"), (fewer_local, "fewer_local")):
    root = os.path.join(module_shm_dir, tag)
    shutil.copytree(os.path.dirname(slice_kill["local_root"]), root, symlinks=True)
    cfg.update(
      slices=1,
      saved_process_count=4,
      local_root=os.path.join(root, "local"),
      persistent=os.path.join(root, "persistent"),
    )
  shutil.rmtree(os.path.join(fewer_local["persistent"], "tensors"))
  restart_specs = {
    "2x2": dict(
      target="tests.fault_scenarios:restore_batch",
      num_processes=4,
      args={
        "scenarios": [
          dict(slice_kill, wipe_slices=[1], continue_steps=CONTINUE),
          dict(primary_kill, continue_steps=CONTINUE),
        ]
      },
      timeout_s=300,
    ),
    "1 process": dict(
      target="tests.fault_scenarios:restore_batch",
      num_processes=1,
      devices_per_process=4,
      args={"scenarios": [fewer, fewer_local]},
      timeout_s=300,
    ),
  }
  restarts = run_jobs(_with_out_dirs(restart_specs, module_shm_dir), parallel=2)
  return {"crash": crash_jobs, "facts": facts, "restart": restarts}


def _with_out_dirs(specs: dict, root: str) -> dict:
  """Job logs and results under the module's dir (removed with it)."""
  for name, spec in specs.items():
    spec["out_dir"] = os.path.join(root, "jobs", name.replace(" ", "_"))
  return specs


def _restart_records(runs: dict, job: str, index: int) -> list[dict]:
  result = runs["restart"][job]
  recs = [r[index] if r else None for r in result.results]
  if any(r is None for r in recs):
    pytest.fail(f"restart job {job} failed: {job_failure(result)}")
  return recs


def _continued(recs: list[dict], step: int) -> tuple[bool, str]:
  bad = [
    r["process"]
    for r in recs
    if not r.get("after_continue")
    or r["after_continue"]["step"] != step + CONTINUE
    or r["after_continue"]["mismatches"]
  ]
  if bad:
    return False, f"processes {bad} could not save {CONTINUE} more steps and restore them"
  return True, f"saved {step + 1}-{step + CONTINUE} and restored {step + CONTINUE} bit-exact"


def test_whole_slice_killed_mid_save(multislice_runs, fault_matrix):
  name = "crash.slice_mid_save"
  job = multislice_runs["crash"][name]
  if job.returncodes[2:] != [-9, -9]:
    fault_matrix.check(name, f"slice 1 did not die at local.mid_write@3: {job_failure(job)}", False)
  recs = _restart_records(multislice_runs, "2x2", 0)
  ok, text = check_restored(recs, 2, {0: "local", 1: "peer"})
  ok2, text2 = _continued(recs, 2) if ok else (False, "")
  fault_matrix.check(
    name,
    f"processes 2+3 SIGKILLed at local.mid_write@3, their ramdisks wiped; restart: {text}; {text2}",
    ok and ok2,
  )


def test_primary_killed_mid_commit(multislice_runs, fault_matrix):
  name = "crash.primary_mid_commit"
  job = multislice_runs["crash"][name]
  if job.returncodes[0] != -9:
    fault_matrix.check(
      name, f"process 0 did not die at state.before_commit@3: {job_failure(job)}", False
    )
  files = multislice_runs["facts"][name]["state_3"]
  if "COMMIT" in files:
    fault_matrix.check(name, f"COMMIT of step 3 was written: {files}", False)
  recs = _restart_records(multislice_runs, "2x2", 1)
  ok, text = check_restored(recs, 2, "local")
  ok2, text2 = _continued(recs, 2) if ok else (False, "")
  n_json = sum(f.endswith(".json") for f in files)
  fault_matrix.check(
    name,
    f"process 0 SIGKILLed at state.before_commit@3 ({n_json}/4 JSON files, no COMMIT);"
    f" survivors exited normally (rc {job.returncodes[1:]}); restart: {text}; {text2}",
    ok and ok2,
  )


def test_hang_in_persistent_upload(multislice_runs, fault_matrix):
  name = "hang.persistent_upload"
  job = multislice_runs["crash"][name]
  p0 = job.results[0]
  if p0 is None:
    fault_matrix.check(name, f"process 0 gave no result: {job_failure(job)}", False)
  ok = p0.get("wait_error") in ("CollectiveTimeoutError",) and "1" in p0["wait"]
  ok = ok and p0["wait_s"] <= 3 * TIMEOUT + 5
  fault_matrix.check(
    name,
    f"process 1 stopped right after starting step 2's upload; wait_until_finished() on"
    f" process 0: {p0['wait'][:300]} ({p0['wait_s']} s, collective_timeout_s={TIMEOUT});"
    f" then latest_step(): {p0.get('error')} after {p0.get('elapsed_s')} s"
    f" ({excerpt(p0.get('message', ''), 'processes')})",
    ok,
  )


def test_restart_on_fewer_processes(multislice_runs, fault_matrix):
  name = "restart.fewer_processes"
  (rec,) = _restart_records(multislice_runs, "1 process", 0)
  ok, text = check_restored([rec], 2, "persistent", data_state="none")
  after = rec.get("after_continue") or {}
  ok = ok and after.get("step") == 4 and not after.get("mismatches")
  fault_matrix.check(
    name,
    f"1 process x 4 devices: local copy refused (other topology); {text}; then saved 3-4"
    f" on the new topology and restored {after.get('step')} bit-exact",
    ok,
  )


def test_restart_on_fewer_processes_local_only(multislice_runs, fault_matrix):
  name = "restart.fewer_processes_local_only"
  recs = _restart_records(multislice_runs, "1 process", 1)
  ok, text = check_errors(recs, {0: ("NoRestorableCheckpointError", ["topology"])})
  fault_matrix.check(name, text, ok)


def test_peer_transfer_damaged_then_refused(shm_dir, fault_matrix):
  """Steps 1-5 saved (persistent: 2 and 4), slice 1's ramdisks wiped; on
  slice 0, step 5's stream is damaged on the wire and step 4's senders drop
  the connection."""
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415

  args = {
    "slices": 2,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "steps": [1, 2, 3, 4, 5],
    "variants": [{"name": "stream_fails", "wipe_slices": [1]}],
  }
  saved = run_job("tests.scenarios:save_steps", 4, args)
  if saved.returncodes != [0, 0, 0, 0]:
    for name in ("peer.damaged_in_transit", "peer.sender_refuses"):
      fault_matrix.check(name, f"save job failed: {job_failure(saved)}", False)
  armed = {"EC_FAILPOINTS": "peer.corrupt_send@5,peer.refuse@4"}
  job = run_job("tests.scenarios:restore_variants", 4, args, env={0: armed, 1: armed})
  if job.returncodes != [0, 0, 0, 0]:
    for name in ("peer.damaged_in_transit", "peer.sender_refuses"):
      fault_matrix.check(name, f"restore job failed: {job_failure(job)}", False)
  recs = [r[0] for r in job.results]
  receivers = job.logs[2] + job.logs[3]
  damaged = "step 5" in receivers and "fails its checksum on arrival" in receivers
  got = sorted({(r.get("step"), r.get("source")) for r in recs})
  text = (
    f"receivers logged a CRC32C failure of step 5: {damaged}; no process restored step 5"
    f" (restored {got})"
  )
  fault_matrix.check(
    "peer.damaged_in_transit", text, damaged and all(r.get("step") != 5 for r in recs)
  )
  ok = all(
    "error" not in r
    and (r["step"], r["source"]) == (4, "persistent")
    and r["mismatches"] == []
    and r["data_state"] == r["expected_data_state"]
    for r in recs
  )
  fallback = "reading the step from the persistent tier" in receivers
  text = (
    f"every process restored {got}, bit mismatches {[r.get('mismatches') for r in recs]},"
    f" data_state ok {[r.get('data_state') == r.get('expected_data_state') for r in recs]};"
    f" receivers logged the persistent fallback: {fallback}"
  )
  fault_matrix.check("peer.sender_refuses", text, ok and fallback)


UPLOAD_ERROR_STEPS = list(range(1, 17))


def test_one_process_upload_fails(shm_dir, fault_matrix):
  """1 slice x 2 processes (both upload), persistent every 2nd step with
  when_busy 'skip': process 1 fails to prepare its upload of step 2 (an
  injected EIO before Orbax's save). Process 0 must not enter Orbax's save
  alone (its barriers would hold it for Orbax's 5-minute timeout, and every
  later step with it): step 2 is skipped there, and the next steps upload.
  Both upload paths: from the snapshot (CPU, accelerators with pinned host
  memory) and Orbax's inline copy inside save()."""
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415

  name = "sick.upload_one_process"
  seen, good = [], True
  for path in ("snapshot", "inline"):
    args = _dirs(
      shm_dir,
      f"{name}.{path}",
      slices=1,
      steps=UPLOAD_ERROR_STEPS,
      step_s=0.3,
      collective_timeout_s=TIMEOUT,
      persistent_when_busy="skip",
      wait_bound_s=WAIT_BOUND,
      inline=path == "inline",
    )
    armed = {"EC_FAILPOINTS": "persistent.before_save@2:raise"}
    job = run_job("tests.fault_scenarios:upload_error_run", 2, args, env={1: armed}, timeout_s=180)
    if job.returncodes != [0, 0]:
      fault_matrix.check(name, f"{path}: job failed: {job_failure(job)}", False)
    ok, text = _upload_error_outcome(job.results)
    good = good and ok
    seen.append(f"{path}: {text}")
  fault_matrix.check(name, "; ".join(seen), good)


def _upload_error_outcome(results: list[dict]) -> tuple[bool, str]:
  p0, p1 = results
  tensors = sorted(int(t) for t in p0["tensors"] or [] if t.isdigit())
  stalls = [s for p in results for s in p["stalls"].values()]
  restored = [p["restored"] for p in results]
  h0, h1 = p0["health"], p1["health"]
  ok = (
    "failpoint persistent.before_save@2" in (h1["last_error"] or "")
    and 2 in h0["skipped_steps"]
    and all(p["first_wait"] == p["second_wait"] == "returned" for p in results)
    and all(p["health"]["consecutive_failures"] == 0 for p in results)
    and 2 not in tensors
    and tensors[-1:] == [UPLOAD_ERROR_STEPS[-1]]
    and max(stalls) < TIMEOUT
    and all(
      (r["step"], r["source"]) == (tensors[-1], "persistent")
      and r["mismatches"] == []
      and r["data_state"] == r["expected_data_state"]
      for r in restored
    )
  )
  text = (
    f"process 1's health: {h1['last_error']}; process 0 skipped {h0['skipped_steps']} (never"
    f" entered Orbax's save); every save() returned within {max(stalls):.2f} s; the bucket"
    f" holds steps {tensors} and wait_until_finished() returned on both; with every ramdisk"
    f" wiped, restored {sorted({(r['step'], r['source']) for r in restored})}, bit mismatches"
    f" {[r['mismatches'] for r in restored]}"
  )
  return ok, text
