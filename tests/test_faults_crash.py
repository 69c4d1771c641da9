"""Fault matrix, part 1: a process dies (SIGKILL), hangs (SIGSTOP) or is
preempted (SIGTERM) during a save; then the job restarts.

Real 2-process jax.distributed CPU jobs, 2 slices x 1 process (process 0 =
slice 0 = the primary). One job per fault (a few run at once), then ONE
restart job restores every scenario from its own directories, saves 3 more
steps and restores again: after a crash, training must go on.
"""

from __future__ import annotations

import os

import pytest

from emergency_ckpt.demo.launcher import run_job
from tests.fault_matrix import check_restored, job_failure, run_jobs
from tests.helpers import fault_job_args as _dirs
from tests.helpers import listing as _listing

LOCAL_STEPS = [1, 2, 3]
PERSISTENT_STEPS = [1, 2, 3, 4]

# id -> (victim process, EC_FAILPOINTS, steps); the victim dies at the last step.
CRASHES = {
  "crash.local.before_write": (1, "local.before_write@3", LOCAL_STEPS),
  "crash.local.mid_write": (1, "local.mid_write@3", LOCAL_STEPS),
  "crash.local.before_rename": (1, "local.before_rename@3", LOCAL_STEPS),
  "crash.local.after_rename": (1, "local.after_rename@3", LOCAL_STEPS),
  "crash.state.before_write": (1, "state.before_write@3", LOCAL_STEPS),
  "crash.state.before_commit": (0, "state.before_commit@3", LOCAL_STEPS),
  "crash.persistent.before_save": (0, "persistent.before_save@4", PERSISTENT_STEPS),
  "crash.persistent.after_save_call": (0, "persistent.after_save_call@4", PERSISTENT_STEPS),
  "crash.persistent.unfinalized": (0, None, PERSISTENT_STEPS),  # Orbax finalize patched
  "crash.persistent.after_finalize": (0, "persistent.after_finalize@4", PERSISTENT_STEPS),
}
CONTINUE = 3  # steps saved after the restart, then restored again
TIMEOUT = 3  # collective_timeout_s in the hang scenario
STALE_OFFSET = 100  # the second incarnation's values: make_state(step + 100)


def _victim_dir(args: dict, victim: int) -> str:
  return os.path.join(args["local_root"], f"host_{victim}", "test-run", f"process_{victim}")


@pytest.fixture(scope="module")
def crash_runs(module_shm_dir):
  """Runs every fault job, then the restart job; returns
  {scenario: {"args", "job", "facts", "restart": [per-process records]}}."""
  runs, specs = {}, {}
  for name, (victim, spec, steps) in CRASHES.items():
    args = _dirs(module_shm_dir, name, steps=steps)
    if spec is None:
      args["orbax_finalize_kill"] = steps[-1]
    env = {victim: {"EC_FAILPOINTS": spec}} if spec else None
    runs[name] = {"args": args, "victim": victim}
    specs[name] = dict(
      target="tests.fault_scenarios:save_run", num_processes=2, args=args, env=env, timeout_s=180
    )
  hang = _dirs(
    module_shm_dir,
    "hang.local_save",
    steps=LOCAL_STEPS,
    then_latest=True,
    kill_after=[1],
    collective_timeout_s=TIMEOUT,
  )
  runs["hang.local_save"] = {"args": hang, "victim": 1}
  specs["hang.local_save"] = dict(
    target="tests.fault_scenarios:save_run",
    num_processes=2,
    args=hang,
    env={1: {"EC_FAILPOINTS": "local.mid_write@3:stop"}},
    timeout_s=180,
  )
  preempt = _dirs(
    module_shm_dir,
    "preempt.sigterm",
    local_interval=4,
    persistent_interval=8,
    max_steps=300,
    sigterm_at=5,
    sigterm_sender=0,
    sigterm_target=1,
  )
  runs["preempt.sigterm"] = {"args": preempt, "victim": 1}
  specs["preempt.sigterm"] = dict(
    target="tests.fault_scenarios:preempt_run", num_processes=2, args=preempt, timeout_s=180
  )

  # A crashed incarnation's files of an uncommitted step, then a restarted
  # incarnation saves that step again (other values) and one process dies.
  stale = _dirs(module_shm_dir, "crash.stale_incarnation", steps=LOCAL_STEPS)
  runs["crash.stale_incarnation"] = {"args": stale, "victim": 0}
  specs["crash.stale_incarnation"] = dict(
    target="tests.fault_scenarios:save_run",
    num_processes=2,
    args=stale,
    env={0: {"EC_FAILPOINTS": "state.before_commit@3"}},
    timeout_s=180,
  )

  for name, spec in specs.items():  # job logs and results, removed with the module's dir
    spec["out_dir"] = os.path.join(module_shm_dir, "jobs", name)
  jobs = run_jobs(specs, parallel=3)
  stale.update(resave_steps=[3], value_offset=STALE_OFFSET)
  runs["crash.stale_incarnation"]["resave"] = run_job(
    "tests.fault_scenarios:resume_and_save",
    2,
    stale,
    env={1: {"EC_FAILPOINTS": "local.before_write@3"}},
    timeout_s=180,
    out_dir=os.path.join(module_shm_dir, "jobs", "resave"),
  )
  for name, run in runs.items():
    args, victim = run["args"], run["victim"]
    run["job"] = jobs[name]
    last = args.get("steps", [0])[-1]
    state_dir = os.path.join(args["persistent"], "state", str(last))
    run["facts"] = {
      "victim_entries": _listing(_victim_dir(args, victim)),
      "state_files": _listing(state_dir),
      "tensors": _listing(os.path.join(args["persistent"], "tensors")),
    }

  batch = [
    dict(run["args"], continue_steps=0 if "value_offset" in run["args"] else CONTINUE)
    for run in runs.values()
  ]
  restart = run_job(
    "tests.fault_scenarios:restore_batch",
    2,
    {"scenarios": batch},
    timeout_s=300,
    out_dir=os.path.join(module_shm_dir, "jobs", "restart"),
  )
  for i, run in enumerate(runs.values()):
    run["restart"] = [r[i] if r else None for r in restart.results]
  runs["_restart_job"] = restart
  return runs


def _restart_ok(run: dict, step: int) -> tuple[bool, str]:
  recs = run["restart"]
  if any(r is None for r in recs):
    return False, f"restart job failed: {job_failure(run['_job'])}"
  ok, text = check_restored(recs, step, "local")
  problems = [] if ok else [text]
  for r in recs:
    if "error" in r:
      continue
    if step + 1 in r["all_steps"]:
      problems.append(f"process {r['process']} lists step {step + 1}: {r['all_steps']}")
    if any(e.startswith(".tmp") for e in r["entries_at_start"] or []):
      problems.append(f"process {r['process']} .tmp left after start: {r['entries_at_start']}")
    # Listed by each process after its close(): only the primary process's
    # close() waits for the upload (process 1 is not on the primary slice).
    partial = [t for t in r.get("tensors") or [] if not t.isdigit()]
    if partial and r["process"] == 0:
      problems.append(f"persistent tier still holds {partial} after the restart")
    after = r.get("after_continue")
    if after is None or after["step"] != step + CONTINUE or after["mismatches"]:
      problems.append(f"process {r['process']} after saving {CONTINUE} more steps: {after}")
  if problems:
    return False, "; ".join(problems)
  return True, (
    f"restart: {text}; saved {step + 1}-{step + CONTINUE} again and restored"
    f" {step + CONTINUE} bit-exact"
  )


@pytest.mark.parametrize("name", list(CRASHES))
def test_sigkill_during_save(crash_runs, fault_matrix, name):
  run = crash_runs[name]
  run["_job"] = crash_runs["_restart_job"]
  victim, spec, steps = CRASHES[name]
  job, facts = run["job"], run["facts"]
  point = spec or f"Orbax finalize of step {steps[-1]}"
  if job.returncodes[victim] != -9:
    fault_matrix.check(name, f"process {victim} did not die at {point}: {job_failure(job)}", False)
  killed = f"process {victim} SIGKILLed at {point} (wall {job.wall_s:.1f} s)"
  leftovers = [e for e in facts["victim_entries"] if e.startswith(".tmp")]
  if leftovers:
    killed += f", left {leftovers[0][:14]}..."
  committed = "COMMIT" in facts["state_files"]
  expected = steps[-1] if committed else steps[-2]
  if name.startswith("crash.persistent."):
    # The local write, the JSON and COMMIT of step 4 run in background threads
    # and may finish before the kill: then step 4 is committed (its local
    # copies serve it), else step 3 is the newest. Either way: the newest
    # committed step, never the partial persistent one.
    partial = [t for t in facts["tensors"] if not t.isdigit()]
    killed += f"; COMMIT of 4 {'written' if committed else 'absent'}"
    if partial:
      killed += f", partial Orbax save {partial[0][:22]}... left"
    if name == "crash.persistent.after_finalize" and str(steps[-1]) not in facts["tensors"]:
      # The failpoint must fire once the step IS final (renamed into place).
      fault_matrix.check(
        name,
        f"{killed}: but step {steps[-1]} was not finalized when the process died"
        f" (tensors/ held {facts['tensors']}): the failpoint (PersistentTier._finalized,"
        " Orbax's post_finalization_callback) runs BEFORE Orbax renames the step into"
        " place (async_checkpointer: callback [2/3] before _on_commit_callback [3/3])",
        False,
      )
  elif committed:
    fault_matrix.check(name, f"{killed}: step {steps[-1]} was committed anyway", False)
  if name == "crash.state.before_commit":
    n = sum(f.endswith(".json") for f in facts["state_files"])
    killed += f" (COMMIT absent, {n}/2 JSON files present)"
  ok, text = _restart_ok(run, expected)
  fault_matrix.check(name, f"{killed}; {text}", ok)


def test_hang_in_local_save(crash_runs, fault_matrix):
  run = crash_runs["hang.local_save"]
  run["_job"] = crash_runs["_restart_job"]
  job = run["job"]
  p0 = job.results[0] or {}
  problems = []
  if job.returncodes[1] != -9:
    problems.append(f"process 1 rc {job.returncodes[1]} (expected SIGKILL by process 0)")
  if p0.get("error") != "CollectiveTimeoutError" or "[1]" not in p0.get("message", ""):
    problems.append(f"process 0: {p0.get('error')}: {p0.get('message')} ({job_failure(job)})")
  elif p0["elapsed_s"] > TIMEOUT + 5:
    problems.append(f"took {p0['elapsed_s']} s with collective_timeout_s={TIMEOUT}")
  ok, text = _restart_ok(run, 2)
  if not ok:
    problems.append(text)
  observed = (
    f"process 0: CollectiveTimeoutError naming [1] after {p0.get('elapsed_s')} s"
    f" (collective_timeout_s={TIMEOUT}), step 3 uncommitted; {text}"
  )
  fault_matrix.check("hang.local_save", "; ".join(problems) or observed, not problems)


def test_sigterm_preemption(crash_runs, fault_matrix):
  run = crash_runs["preempt.sigterm"]
  run["_job"] = crash_runs["_restart_job"]
  job = run["job"]
  if job.returncodes != [0, 0]:
    fault_matrix.check("preempt.sigterm", f"job failed: {job_failure(job)}", False)
  at = [r["preempted_at"] for r in job.results]
  sent = job.results[0].get("sent_sigterm_at")
  if at[0] is None or at[0] != at[1] or any(at[0] not in r["saved"] for r in job.results):
    fault_matrix.check(
      "preempt.sigterm", f"reached_preemption disagreed or never fired: {at}", False
    )
  step = at[0]
  recs = run["restart"]
  ok, text = check_restored(recs, step, "local") if all(recs) else (False, "restart failed")
  tensors = run["facts"]["tensors"]
  persisted = str(step) in tensors
  fault_matrix.check(
    "preempt.sigterm",
    f"SIGTERM to process 1 at step {sent}; reached_preemption() True on 2/2 processes at"
    f" step {step}; step {step} saved with force=True (persistent tier: {tensors});"
    f" restart: {text}",
    ok and persisted,
  )


def test_stale_files_of_a_crashed_incarnation(crash_runs, fault_matrix):
  """Incarnation 1 dies before COMMIT of step 3 (every JSON and local copy of
  3 exist). Incarnation 2 restores step 2, saves step 3 again with other
  values, and process 1 dies before writing it. Step 3 must not come back
  as a mix of both incarnations."""
  name = "crash.stale_incarnation"
  run = crash_runs[name]
  resave = run["resave"]
  if resave.returncodes[1] != -9 or resave.results[0] is None:
    fault_matrix.check(
      name, f"second incarnation did not run as planned: {job_failure(resave)}", False
    )
  recs = run["restart"]
  if any(r is None or "error" in r for r in recs):
    fault_matrix.check(name, f"restart failed: {recs}", False)
  step = recs[0]["step"]
  old = [not r["mismatches"] and r["data_state"] == r["expected_data_state"] for r in recs]
  new = [
    not r["mismatches_other"] and (r["data_state"] or {}).get("incarnation") == 2 for r in recs
  ]
  same_step = all(r["step"] == step for r in recs)
  ok = same_step and (all(old) or (step == 3 and all(new)))
  who = ", ".join(
    f"process {r['process']}: {'incarnation 1' if o else 'incarnation 2' if n else 'neither'}"
    f" (data_state {r['data_state']})"
    for r, o, n in zip(recs, old, new)
  )
  observed = f"restart restored step {step}; values and data_state per process: {who}"
  if not ok:
    observed += (
      "; the re-saved step 3 was committed although process 1 never saved it again:"
      " StateStore.commit() counted process 1's JSON left by the crashed incarnation"
      " (and its local step_3 of incarnation 1 was used)"
    )
  fault_matrix.check(name, observed, ok)
