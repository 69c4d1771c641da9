"""What every process of a soak round runs (`run_job("tests.soak.job:soak_round", ...)`).

One round of the training run: restore (or start fresh when restore finds
nothing), check every bit of what came back, train (save every step locally,
persistently every args['persistent_interval'] steps), wait once for every
save to be durable, meet the other processes, and list this host's ramdisk
once the retention the last commit allows ran (the retention check), then
train on until the parent SIGKILLs the job, or stop cleanly after
args['max_steps'] steps.

The process reports raw facts as JSON files in its job's output folder
(written atomically, as it goes, so a process killed later still reports
them); the parent (tests/soak/runner.py) judges them:
  progress_<i>.json   phase ("restoring", "training"), steps saved, last step
  restored_<i>.json   restored step, source, bit mismatches, data_state, or
                      the error restore raised (typed or not)
  quiet_<i>.json      after the first args['train_steps'] saves and a wait:
                      every step folder, spare and in-progress entry on this host
  train_error_<i>.json  an exception a save or wait raised (then re-raised)
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

import jax

import emergency_ckpt as ec
from emergency_ckpt.demo.job_process import job_output_dir
from tests import scenarios as sc
from tests.helpers import barrier
from tests.soak import files
from tests.soak.files import PROGRESS, QUIET, RESTORED, TRAIN_ERROR, host_listing


def report(name: str, doc: dict[str, Any]) -> None:
  """Writes `doc` to <job output>/<name>, atomically (the parent polls it)."""
  path = os.path.join(job_output_dir(), name)
  with open(path + ".tmp", "w") as f:
    json.dump(doc, f)
  os.replace(path + ".tmp", path)


def soak_round(args: dict) -> dict[str, Any]:
  me = jax.process_index()
  mesh = sc.mesh_for(args["slices"])
  report(PROGRESS.format(me), {"phase": "restoring", "steps": 0, "t": time.monotonic()})
  mngr, restored = _open_and_restore(args, mesh)
  report(RESTORED.format(me), {**restored, "t": time.monotonic()})
  if mngr is None or restored.get("typed") is False:
    return restored  # an untyped exception: the parent fails the round
  with mngr:
    start = restored["step"] + 1 if "step" in restored else args["fresh_from"]
    try:
      _train(mngr, mesh, args, start)
    except BaseException as e:
      report(
        TRAIN_ERROR.format(me),
        {
          "error": type(e).__name__,
          "typed": isinstance(e, ec.EmergencyCheckpointError),
          "message": str(e)[:4000],
          "traceback": traceback.format_exc()[-8000:],
          "t": time.monotonic(),
        },
      )
      raise
  return {"finished": True}


def _open_and_restore(args: dict, mesh) -> tuple[ec.CheckpointManager | None, dict[str, Any]]:
  """A fresh manager and its restore(); the manager is None if it could not
  be made. A typed error leaves the manager to train from scratch."""
  t0 = time.monotonic()
  mngr = None
  try:
    mngr = ec.CheckpointManager(sc.options(args), mesh=mesh)
    r = mngr.restore(sc.abstract_state(mesh))
  except Exception as e:  # noqa: BLE001 - the parent judges every error
    typed = isinstance(e, ec.EmergencyCheckpointError)
    rec = {
      "error": type(e).__name__,
      "typed": typed,
      "in": "restore()" if mngr is not None else "CheckpointManager()",
      "message": str(e)[:4000],
      "restore_s": round(time.monotonic() - t0, 2),
    }
    if not typed:
      rec["traceback"] = traceback.format_exc()[-8000:]
    return mngr, rec
  return mngr, {
    "step": r.step,
    "source": r.source,
    "mismatches": sc.mismatches(r.state, r.step),
    "data_state": r.data_state,
    "expected_data_state": sc.data_state(r.step),
    "restore_s": round(time.monotonic() - t0, 2),
  }


SETTLE_S = 3.0
"""The longest wait at the quiet point for the retention a last commit allows."""


def _settled(folders: dict, args: dict, saved: int) -> bool:
  """Whether every folder on this process's host holds what the runner's
  retention checks allow after `saved` saves: its own within
  files.over_budget, and the folders it adopted (other processes' on this
  host) empty once `local_keep` + 2 saves made their steps droppable (the
  pass that empties them may wait for a commit signal, like its own)."""
  own = f"process_{jax.process_index()}"
  keep = args["local_keep"]
  for folder, ent in folders.items():
    if folder.split("/")[0] == own:
      if files.over_budget(folder, ent, own, keep):
        return False
    elif saved >= keep + 2 and (
      ent["steps"] or any(t.startswith(".tmp-spare-") for t in ent["tmp"])
    ):
      return False
  return True


def _train(mngr: ec.CheckpointManager, mesh, args: dict, start: int) -> None:
  me = jax.process_index()
  for done, step in enumerate(range(start, start + args["max_steps"]), 1):
    # A training step is collective: a process whose sibling died stops here
    # (as it would in its next all-reduce) instead of saving on alone.
    barrier(f"soak-step-{step}", timeout_s=args["step_barrier_s"])
    mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
    report(
      PROGRESS.format(me),
      {"phase": "training", "steps": done, "step": step, "t": time.monotonic()},
    )
    if done == args["train_steps"]:
      t0 = time.monotonic()
      mngr.wait_until_finished()
      wait_s = time.monotonic() - t0
      # Every process's saves are durable, so the primary's wait covered the
      # last commit; the others' retention runs once they see it (their
      # commit watch): the listing is taken when it settled, at most SETTLE_S.
      barrier(f"soak-quiet-{step}", timeout_s=args["step_barrier_s"])
      t1 = time.monotonic()
      folders = host_listing(sc.host_dir(args))
      while not _settled(folders, args, done) and time.monotonic() - t1 < SETTLE_S:
        time.sleep(0.05)
        folders = host_listing(sc.host_dir(args))
      report(
        QUIET.format(me),
        {
          "step": step,
          "saved_since_restore": done,
          "wait_s": round(wait_s, 2),
          "settle_s": round(time.monotonic() - t1, 2),
          "folders": folders,
        },
      )
    time.sleep(args["step_s"])
  mngr.wait_until_finished()
