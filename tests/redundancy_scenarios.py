"""Job functions for the redundancy tests (run by run_job)."""

from __future__ import annotations

import dataclasses

import emergency_ckpt as ec
from tests import scenarios as sc


def save_then_list(args: dict) -> dict:
  """Saves args['steps'], waits, and lists the restorable steps."""
  mesh = sc.mesh_for(args["slices"])
  options = sc.options(args)
  if "redundancy_required" in args:
    local = dataclasses.replace(options.local, redundancy_required=args["redundancy_required"])
    options = dataclasses.replace(options, local=local)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    for step in args["steps"]:
      mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
    mngr.wait_until_finished()
    return {"all_steps": mngr.all_steps(), "placement_problem": mngr.placement_problem}
