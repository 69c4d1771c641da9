"""Code that runs inside the multi-process GCS fault jobs (tests/test_gcs_faults.py).

Each function is a job target (`run_job("tests.gcs_fault_scenarios:fn", ...)`).
The fault-injecting proxy (tests/harness/gcs_proxy.py) runs in the test process; a
worker reaches it through EC_GCS_FAULTS_URL (`ProxyClient.from_env()`).
Workers return raw facts; the tests judge them.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import jax

import emergency_ckpt as ec
from emergency_ckpt.demo import job_process
from emergency_ckpt.state.store import StateStore
from tests import scenarios as sc
from tests.harness.gcs_proxy import ProxyClient


def _state_store(args: dict) -> StateStore:
  import jax  # noqa: PLC0415

  return StateStore(
    f"{args['persistent']}/state",
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )


def _wait_committed(args: dict, steps: set[int], timeout_s: float) -> list[int]:
  """Polls the state store until `steps` are all committed (or timeout);
  returns the committed steps seen last."""
  store = _state_store(args)
  deadline = time.monotonic() + timeout_s
  while True:
    committed = store.committed_steps()
    if steps <= set(committed) or time.monotonic() > deadline:
      return committed
    time.sleep(0.2)


def _persistent_steps(args: dict) -> list[int]:
  from emergency_ckpt.persistent.tier import list_steps  # noqa: PLC0415

  return list_steps(f"{args['persistent']}/tensors")


def revoke_mid_run(args: dict) -> dict:
  """Saves args['steps_before'] and waits; then process 0 makes the proxy
  answer 403 to everything for the bucket (permission revoked); then saves
  args['steps_after'] as a trainer would, letting the error propagate. The
  error, when it comes, ends the process (rc 1, traceback in the result)."""
  mesh = sc.mesh_for(args["slices"])
  ctl = ProxyClient.from_env()
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in args["steps_before"]:
      mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
    mngr.wait_until_finished()
    sc.barrier("before-revoke")
    if sc.pid() == 0:
      ctl.fail(times=None, status=403, path=f"/b/{args['bucket']}/")
    sc.barrier("revoked")
    t0 = time.monotonic()
    try:
      for step in args["steps_after"]:
        mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
      mngr.wait_until_finished()
    finally:
      print(f"revoke_mid_run: failed after {time.monotonic() - t0:.1f}s", flush=True)
  return {"unexpected": "no error"}


def slow_bucket_saves(args: dict) -> dict[str, Any]:
  """The proxy holds tensorstore's uploads of step args['persistent_step']
  (rule args['hold_rule'], made by the test). This saves that step (the
  primary slice starts its persistent upload), waits until the upload is
  held, saves args['local_steps'] (local only), then checks, while the upload
  is still held, that they are committed and listed. Then process 0
  releases the upload and everything finishes."""
  mesh = sc.mesh_for(args["slices"])
  ctl = ProxyClient.from_env()
  rule = args["hold_rule"]
  first = args["persistent_step"]
  out: dict[str, Any] = {}
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    mngr.save(first, sc.make_state(mesh, first), data_state=sc.data_state(first))
    ctl.wait_held(rule, 1, timeout=60)
    sc.barrier("upload-held")
    for step in args["local_steps"]:
      mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
    out["saves_returned_while_held"] = ctl.rule(rule)["held_now"] > 0
    out["committed_while_held"] = _wait_committed(args, set(args["local_steps"]), 60)
    out["local_entries_while_held"] = sorted(os.listdir(mngr.local_directory))
    out["all_steps_while_held"] = mngr.all_steps()  # one exchange, every process
    out["persistent_while_held"] = _persistent_steps(args)
    state = ctl.rule(rule)
    out["held_now_after_checks"] = state["held_now"]
    out["released_before_checks"] = state["released"]
    sc.barrier("checked")
    if sc.pid() == 0:
      ctl.release(rule)
    mngr.wait_until_finished()
    sc.barrier("finished")  # the primary slice's upload is done everywhere
    out["persistent_after"] = _persistent_steps(args)
    out["all_steps_after"] = mngr.all_steps()
  return out


def kill_mid_upload(args: dict) -> None:
  """Saves args['steps_before'] (a persistent step among them) and waits;
  then saves args['steps_after'], whose persistent upload the proxy holds
  (rule args['hold_rule']: the upload's manifests, so its data files land);
  once it is held and the last step's state is committed, every process
  SIGKILLs itself."""
  mesh = sc.mesh_for(args["slices"])
  ctl = ProxyClient.from_env()
  rule = args["hold_rule"]
  mngr = ec.CheckpointManager(sc.options(args), mesh=mesh)
  for step in args["steps_before"]:
    mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
  mngr.wait_until_finished()
  sc.barrier("before-held-save")
  for step in args["steps_after"]:
    mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
  ctl.wait_held(rule, 1, timeout=60)
  committed = _wait_committed(args, {args["steps_after"][-1]}, 60)
  print(f"kill_mid_upload: held; committed {committed}; killing myself", flush=True)
  sc.barrier("kill")
  me = jax.process_index()
  if me == 0:
    # Process 0 hosts the coordination service: a client that loses it
    # aborts (SIGABRT) before it reaches its own kill, so it goes last.
    job_process.wait_for_siblings(
      job_process.job_output_dir(), me, jax.process_count(), 30, until_gone=True
    )
  os.kill(os.getpid(), signal.SIGKILL)


def fail_while_upload_held(args: dict) -> dict[str, Any]:
  """Saves args['step'] to both tiers while the proxy holds its tensor upload
  (rule args['hold_rule']) and refuses its state JSON (403). Times how long
  wait_until_finished() takes to raise, then close(), both while the upload
  is still held."""
  mesh = sc.mesh_for(args["slices"])
  ctl = ProxyClient.from_env()
  rule, step = args["hold_rule"], args["step"]
  out: dict[str, Any] = {"error": None}
  mngr = ec.CheckpointManager(sc.options(args), mesh=mesh)
  # gcsfs sends the small state files (JSON, COMMIT) as multipart uploads,
  # whose object name is in the body; Orbax's metadata goes resumable.
  refuse = ctl.fail(
    times=None, status=403, method="POST", path="uploadType=multipart", client="python-gcsfs"
  )
  mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
  ctl.wait_held(rule, 1, timeout=60)
  t0 = time.monotonic()
  try:
    mngr.wait_until_finished()
  except Exception as e:  # noqa: BLE001 - the test judges it
    out["error"] = f"{type(e).__name__}: {e}"
  out["wait_s"] = time.monotonic() - t0
  out["held_after_wait"] = ctl.rule(rule)["held_now"]
  t0 = time.monotonic()
  mngr.close()
  out["close_s"] = time.monotonic() - t0
  out["held_after_close"] = ctl.rule(rule)["held_now"]
  out["refused"] = ctl.rule(refuse["id"])["hits"]
  return out
