"""Code that runs inside the bucket-outage jobs (tests/test_tier_outage.py).

A job trains at a fixed step time, saving locally every step and to the
persistent tier (gs:// through the fault-injecting proxy) every few steps;
process 0 makes the bucket sick for a while in the middle of the run. Each
process returns raw facts (every step's end time and save() duration, the
outage window); the test judges them.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from tests import restart_helpers as rh
from tests import scenarios as sc
from tests.harness.gcs_proxy import ProxyClient


def _start_outage(ctl: ProxyClient, kind: str) -> list[int]:
  """Makes every request to the bucket go wrong; returns the rules' ids."""
  if kind == "hang":  # connections stay open, nothing answers
    return [ctl.hold(times=None)["id"]]
  if kind == "refuse":  # every connection is reset before the server sees it
    return [ctl.reset(times=None, when="request")["id"]]
  if kind == "503":
    return [ctl.fail(times=None, status=503)["id"]]
  if kind == "crawl":  # every body, both ways, at 1 MB/s
    return [ctl.crawl(1e6, times=None)["id"]]
  raise ValueError(f"unknown outage kind {kind!r}")


def _end_outage(ctl: ProxyClient, kind: str, rules: list[int]) -> None:
  if kind == "hang":
    for rule in rules:
      ctl.release(rule)  # what was held goes through now
  ctl.clear()


def _big(mesh, step: int, mib: int):
  """A leaf of `mib` MiB per slice, sharded over the data axis: saves copy
  real bytes, as a trainer's do (the values change every step)."""
  n = mib * 2**20 // 4
  values = np.full(n, step, dtype=np.float32)
  return jax.make_array_from_callback((n,), NamedSharding(mesh, P("data")), lambda i: values[i])


def _local_steps(args: dict) -> int:
  """How many step folders this process's own ramdisk folder holds now."""
  own = rh.process_dir(args, sc.pid())
  try:
    return sum(1 for name in os.listdir(own) if name.startswith("step_"))
  except FileNotFoundError:
    return 0


def train_through_outage(args: dict) -> dict[str, Any]:
  """Trains steps 1..args['steps'] at args['step_s'] seconds per step (the
  train step is a sleep: a step takes max(step_s, its own work)), saving
  every step locally and every args['persistent_interval'] steps to the
  persistent tier. Process 0 starts the outage (args['outage']: "hang",
  "refuse" or "503") when it reaches step args['outage_at'] and ends it
  args['outage_s'] seconds later, on a timer (a blocked save() cannot delay
  the end). At the end every process waits until its saves are finished."""
  mesh = sc.mesh_for(args["slices"])
  ctl = ProxyClient.from_env()
  steps: list[dict] = []
  window: dict[str, float] = {}
  ended = threading.Event()
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in range(1, args["steps"] + 1):
      t_step = time.monotonic()
      if sc.pid() == 0 and step == args["outage_at"]:
        rules = _start_outage(ctl, args["outage"])
        window["start"] = time.time()

        def end(rules=rules) -> None:
          _end_outage(ctl, args["outage"], rules)
          window["end"] = time.time()
          ended.set()

        timer = threading.Timer(args["outage_s"], end)
        timer.daemon = True
        timer.start()
      state = {**sc.make_state(mesh, step), "big": _big(mesh, step, args["big_mib"])}
      t0 = time.monotonic()
      mngr.save(step, state, data_state=sc.data_state(step))
      save_s = time.monotonic() - t0
      persistent = step % args["persistent_interval"] == 0
      time.sleep(max(0.0, args["step_s"] - (time.monotonic() - t_step)))
      steps.append(
        {
          "step": step,
          "end": time.time(),
          "save_s": save_s,
          "persistent": persistent,
          "local_steps": _local_steps(args),
        }
      )
    if sc.pid() == 0 and window:  # an outage started (benchmarks/outage.py runs without one)
      ended.wait(args["outage_s"] + 30)
    sc.barrier("trained")  # the bucket is back everywhere before the final wait
    t0 = time.monotonic()
    mngr.wait_until_finished()
    final_wait_s = time.monotonic() - t0
    health = mngr.health().as_dict()
  return {"steps": steps, "window": window, "final_wait_s": final_wait_s, "health": health}


def end_while_the_bucket_hangs(local_dir: str, persistent: str, timeout_s: float) -> None:
  """A whole program, run as `python -c` by tests/test_bounded_wait.py: one
  process saves steps 1-2 (2 persistent, its upload held by the proxy),
  then closes with `timeout_s` and returns normally, so the interpreter's
  own exit (which joins non-daemon threads) is part of what is timed.
  Prints the error close() raised."""
  from jax.sharding import Mesh  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("replica", "data"))
  options = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=local_dir, save_interval_steps=1),
    persistent=ec.PersistentTierOptions(directory=persistent, save_interval_steps=2),
    run_id="ending",
  )
  mngr = ec.CheckpointManager(options, mesh=mesh)
  for step in (1, 2):
    value = np.full((8, 4), step, np.float32)
    mngr.save(step, {"w": jax.device_put(value, NamedSharding(mesh, P("data")))})
  try:
    mngr.close(timeout_s=timeout_s)
  except ec.PendingWorkTimeoutError as e:
    print(f"CLOSE RAISED: {e}", flush=True)
  print("CLOSED", flush=True)
