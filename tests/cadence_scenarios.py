"""Job functions for test_cadence (run by run_job): save_interval_steps "auto"."""

from __future__ import annotations

import dataclasses
import json
import time

import emergency_ckpt as ec
from tests.scenarios import make_state, mesh_for, options, pid


def train_auto(args: dict) -> dict:
  """Calls save() every step with local.save_interval_steps "auto" (a budget
  that every-step saves meet), at a step time of this process's own
  (args["step_s"][pid]); after each save that saved, sleeps
  args["extra_after_save_s"][pid] more (a slowdown only this process sees).
  Returns the steps saved, this process's `cadence` events and the
  restorable steps at the end."""
  me = str(pid())
  base = options({**args, "slices": 1, "local_keep": 2, "persistent_interval": 1000})
  opts = dataclasses.replace(
    base,
    local=dataclasses.replace(base.local, save_interval_steps="auto", overhead_budget=0.5),
  )
  mesh = mesh_for(1)
  saved = []
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    for step in range(1, args["steps"] + 1):
      time.sleep(args["step_s"][me])
      if mngr.save(step, make_state(mesh, step)):
        saved.append(step)
        time.sleep(args["extra_after_save_s"][me])
    mngr.wait_until_finished()
    restorable = mngr.all_steps()
  path = args["event_log"].replace("{process}", me)
  with open(path) as f:
    events = [json.loads(line) for line in f]
  cadence = [
    {k: e[k] for k in ("tier", "interval_steps", "from_step")}
    for e in events
    if e["event"] == "cadence"
  ]
  return {"saved": saved, "cadence": cadence, "restorable": restorable}
