"""Worker code for tests/test_gcs_retention.py (runs inside multi-process jobs)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax

import emergency_ckpt as ec
from tests.scenarios import abstract_state, data_state, make_state, mesh_for, mismatches, options

# A loss per step: best-2 by min are steps 4 (0.25) and 8 (0.5).
LOSSES = {2: 3.0, 4: 0.25, 6: 2.0, 8: 0.5, 10: 4.0, 12: 5.0, 14: 6.0, 16: 7.0}


def retention_job(args: dict) -> dict:
  """Saves steps 1..16 (persistent every 2nd) with metrics, waiting after
  each, then exercises best_step, metadata and delete on every process."""
  mesh = mesh_for(args["slices"])
  base = options(args)
  opts = dataclasses.replace(
    base,
    persistent=dataclasses.replace(base.persistent, max_to_keep=2, keep_period=6, keep_best=2),
    best_metric="loss",
    best_mode="min",
  )
  out: dict = {}
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    for step in range(1, 17):
      mngr.save(
        step, make_state(mesh, step), data_state(step), metrics={"loss": LOSSES.get(step, 9.0)}
      )
      mngr.wait_until_finished()
    out["all_steps"] = mngr.all_steps()
    out["best_step"] = mngr.best_step()
    md = mngr.metadata(4)
    out["metadata_4"] = dataclasses.asdict(md)
    md16 = mngr.metadata(16)
    out["metadata_16"] = dataclasses.asdict(md16)
    mngr.delete(16)  # newest, but 15 and others stay restorable
    out["after_delete_16"] = mngr.all_steps()
    r = mngr.restore(abstract_state(mesh))
    out["restored"] = {
      "step": r.step,
      "source": r.source,
      "mismatches": mismatches(r.state, r.step),
      "data_state_ok": r.data_state == data_state(r.step),
    }
    r4 = mngr.restore(abstract_state(mesh), step=mngr.best_step())
    out["restored_best"] = {
      "step": r4.step,
      "source": r4.source,
      "mismatches": mismatches(r4.state, r4.step),
      "data_state_ok": r4.data_state == data_state(r4.step),
    }
  return out


def delete_only_step(args: dict) -> dict:
  """One restorable step: delete() refuses on every process, force deletes."""
  mesh = mesh_for(args["slices"])
  out: dict = {}
  with ec.CheckpointManager(options(args), mesh=mesh) as mngr:
    mngr.save(2, make_state(mesh, 2), data_state(2))
    mngr.wait_until_finished()
    try:
      mngr.delete(2)
      out["refused"] = None
    except ec.ProtectedStepError as e:
      out["refused"] = str(e)
    out["still"] = mngr.all_steps()
    mngr.delete(2, force=True)
    out["after_force"] = mngr.all_steps()
  return out


def _local_listing(directory: str) -> list[int]:
  """Step folders of this process's ramdisk folder that hold a manifest."""
  return sorted(
    int(name[len("step_") :])
    for name in os.listdir(directory)
    if name.startswith("step_")
    and name[len("step_") :].isdigit()
    and os.path.isfile(os.path.join(directory, name, "manifest.json"))
  )


def local_retention_after_commit(args: dict) -> dict:
  """max_to_keep=1: saves steps 1..3, waiting after each; then each process
  polls its own ramdisk folder (up to 15 s) until it holds step 3 alone.
  A step becomes droppable only when the next one commits, which happens
  after this process's own write: the listing shows whether retention ran
  again once the commit came."""
  mesh = mesh_for(args["slices"])
  base = options(args)
  opts = dataclasses.replace(base, local=dataclasses.replace(base.local, max_to_keep=1))
  out: dict = {}
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    for step in (1, 2, 3):
      mngr.save(step, make_state(mesh, step), data_state(step))
      mngr.wait_until_finished()
    deadline = time.monotonic() + 15
    listing = _local_listing(mngr.local_directory)
    while listing != [3] and time.monotonic() < deadline:
      time.sleep(0.05)
      listing = _local_listing(mngr.local_directory)
    out["local_steps"] = listing
    out["all_steps"] = mngr.all_steps()
  return out


def local_retention_at_close(args: dict) -> dict:
  """max_to_keep=1: saves steps 1..3 back to back and closes at once (the
  primary's commit of step 3 may lag: a failpoint there); returns this
  process's ramdisk listing after close()."""
  mesh = mesh_for(args["slices"])
  base = options(args)
  opts = dataclasses.replace(base, local=dataclasses.replace(base.local, max_to_keep=1))
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    for step in (1, 2, 3):
      mngr.save(step, make_state(mesh, step), data_state(step))
    directory = mngr.local_directory
  return {"local_steps": _local_listing(directory)}


def placement_job(args: dict) -> dict:
  """Two managers in turn: default host ids (this machine's, shared by
  every process), then one named host per process."""
  mesh = mesh_for(args["slices"])
  events = args["events"].replace("{process}", str(jax.process_index()))
  out: dict = {}
  opts = dataclasses.replace(options(args), event_log=args["events"])
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    assert mngr.placement_problem is None  # not known before the first exchange
    mngr.all_steps()
    out["same_machine"] = mngr.placement_problem
    mngr.all_steps()  # checked once
  with open(events) as f:
    out["placement_events"] = sum(json.loads(line)["event"] == "placement" for line in f)
  named = dataclasses.replace(options(args), host_id=f"sim-host-{jax.process_index()}")
  with ec.CheckpointManager(named, mesh=mesh) as mngr:
    mngr.all_steps()
    out["named_hosts"] = mngr.placement_problem
  return out
