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


def train_while_a_peer_stops(args: dict) -> dict:
  """Trains steps 1..args['steps'] at args['step_s'] seconds per step,
  saving locally every step with args['redundancy']. Process 0 stops
  process args['stopped'] (SIGSTOP: it neither answers nor dies) when it
  reaches args['stop_at'] and lets it go on args['stop_s'] seconds later, on
  a timer. Returns each step's save() time and end, the stop window and,
  after everything finished, the restorable steps."""
  import os  # noqa: PLC0415
  import signal  # noqa: PLC0415
  import threading  # noqa: PLC0415
  import time  # noqa: PLC0415

  from emergency_ckpt.demo.job_process import job_output_dir, read_pid  # noqa: PLC0415
  from tests.outage_scenarios import _big  # noqa: PLC0415

  mesh = sc.mesh_for(args["slices"])
  steps, window = [], {}
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in range(1, args["steps"] + 1):
      t_step = time.monotonic()
      if sc.pid() == 0 and step == args["stop_at"]:
        pid = read_pid(job_output_dir(), args["stopped"])
        os.kill(pid, signal.SIGSTOP)
        window["start"] = time.time()

        def go_on(pid=pid) -> None:
          os.kill(pid, signal.SIGCONT)
          window["end"] = time.time()

        timer = threading.Timer(args["stop_s"], go_on)
        timer.start()
      state = sc.make_state(mesh, step)
      if args.get("big_mib"):  # real bytes: a copy the stopped peer cannot take at once
        state["big"] = _big(mesh, step, args["big_mib"])
      t0 = time.monotonic()
      mngr.save(step, state, data_state=sc.data_state(step))
      save_s = time.monotonic() - t0
      time.sleep(max(0.0, args["step_s"] - (time.monotonic() - t_step)))
      steps.append({"step": step, "end": time.time(), "save_s": save_s})
    if sc.pid() == 0:
      timer.join()
    sc.barrier("trained")
    mngr.wait_until_finished()
    return {
      "steps": steps,
      "window": window,
      "all_steps": mngr.all_steps(),
      "health": mngr.health().as_dict(),
      "buffers_allocated": mngr._staging._pool.allocated,  # noqa: SLF001 - host memory
    }
