"""The goodput study's trainer: what runs in each process of its jobs.

`train(args)` (the run_job target) builds the 2-slice mesh (one process
per slice, its CPU devices the 'data' axis), a state of 4 float32 leaves of
args['mib'] MiB in all per slice (emergency_ckpt.bench.state.Layout, the
shape the Orbax adapters take), and the checkpoint manager of
args['manager']: emergency_ckpt's CheckpointManager (local interval
args['local_interval'], an integer or "auto", persistent interval
args['persistent_interval'], event log args['event_log']) or Orbax's
multislice emergency manager through emergency_ckpt.bench.adapters at the
same intervals. It restores the newest step if there is one, then trains
until it is killed: each step adds 1 to every element (a jitted op),
joins an all-reduce over every device (multihost_utils.sync_global_devices:
the processes step in lockstep, as a data-parallel job's do) and sleeps to
args['step_s'] from its start, then calls save(step) (the
manager decides by its intervals whether it saves).

Every process appends its timeline to args['timeline'] ("{process}" in the
path becomes its index), one JSON line per record, each a single write, so
a SIGKILL loses at most the record being written:

  {"inc": k, "ev": "ready", "t": ...}                 the function began
  {"inc": k, "ev": "restored", "step", "t0", "t1", "source", "ok"}
                                                      restore() (step 0, source
                                                      "fresh": nothing to restore)
  {"inc": k, "ev": "step", "step", "t0", "t1"}        one train step
  {"inc": k, "ev": "save", "step", "t0", "t1", "saved"}  one save() call

Times are unix seconds (time.time(): every process and the driver share
the machine's clock). `ok`: every element of this process's restored shards
equals the restored step (the state is the step count). With
emergency_ckpt, a `train_step` event (step, duration_s) per step also goes
to the manager's event log, for `emergency-ckpt report`'s redone work.

Called by: benchmarks/goodput.py through run_job, in every process.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from emergency_ckpt.bench import adapters
from emergency_ckpt.bench import state as bench_state

OURS = "emergency_ckpt"
ORBAX = adapters.ORBAX_MS
SLICES = 2


class Timeline:
  """One process's timeline file (module docstring)."""

  def __init__(self, path: str, inc: int):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    self._inc = inc

  def record(self, ev: str, **fields: Any) -> None:
    os.write(self._fd, (json.dumps({"inc": self._inc, "ev": ev, **fields}) + "\n").encode())


def layout(mib: int) -> bench_state.Layout:
  """Slice s = process s, its devices along 'data'."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices).reshape(SLICES, -1), ("replica", "data"))
  return bench_state.Layout(
    name=f"{SLICES}x1",
    mesh=mesh,
    slice_index=jax.process_index(),
    num_slices=SLICES,
    rows=bench_state.rows_per_leaf(mib),
  )


def _initial(lay: bench_state.Layout) -> dict[str, jax.Array]:
  abstract = lay.abstract
  shardings = {k: v.sharding for k, v in abstract.items()}
  make = jax.jit(
    lambda: {k: jnp.zeros(v.shape, v.dtype) for k, v in abstract.items()},
    out_shardings=shardings,
  )
  return make()


def _holds(state: dict[str, jax.Array], step: int) -> bool:
  """Every element of this process's shards equals `step`."""
  return all(
    bool(np.all(np.asarray(s.data) == np.float32(step)))
    for a in state.values()
    for s in a.addressable_shards
  )


class _Ours:
  """emergency_ckpt's manager, driven as its README's quickstart does."""

  def __init__(self, args: dict, lay: bench_state.Layout, local_dir: str, persistent: str):
    import emergency_ckpt as ec  # noqa: PLC0415

    self._ec = ec
    options = ec.CheckpointManagerOptions(
      local=ec.LocalTierOptions(
        directory=local_dir, save_interval_steps=args["local_interval"], max_to_keep=2
      ),
      persistent=ec.PersistentTierOptions(
        directory=persistent, save_interval_steps=args["persistent_interval"], max_to_keep=2
      ),
      replica_axis="replica",
      run_id=args["run_id"],
      event_log=args["event_log"],
    )
    self._m = ec.CheckpointManager(options, mesh=lay.mesh)
    self._abstract = lay.abstract
    self._events = None
    if args.get("event_log"):
      from emergency_ckpt.core.telemetry import EventLog  # noqa: PLC0415

      self._events = EventLog(args["event_log"], process=jax.process_index(), slice=lay.slice_index)

  def restore(self) -> tuple[Any, int, str] | None:
    if self._m.latest_step() is None:
      self._m.prepare(self._abstract)
      return None
    try:
      r = self._m.restore(self._abstract, data_state=None)
    except self._ec.NoRestorableCheckpointError:
      self._m.prepare(self._abstract)
      return None
    return r.state, r.step, r.source

  def save(self, step: int, state) -> bool:
    return self._m.save(step, state, data_state={"step": step})

  def trained(self, step: int, duration_s: float) -> None:
    if self._events is not None:
      self._events.record("train_step", step=step, duration_s=round(duration_s, 6))


class _Orbax:
  """Orbax's multislice emergency manager, through the benchmark's adapter."""

  def __init__(self, args: dict, lay: bench_state.Layout, local_dir: str, persistent: str):
    self._a = adapters.make(
      ORBAX,
      lay,
      local_dir,
      persistent,
      local_interval=args["local_interval"],
      persistent_interval=args["persistent_interval"],
    )

  def restore(self) -> tuple[Any, int, str] | None:
    if self._a.latest_step() is None:
      return None
    return self._a.restore()

  def save(self, step: int, state) -> bool:
    return bool(self._a.save(step, state))

  def trained(self, step: int, duration_s: float) -> None:
    return None


def train(args: dict) -> None:
  """Restores, then trains until the driver kills the job (module docstring)."""
  me = jax.process_index()
  line = Timeline(args["timeline"].replace("{process}", str(me)), args["inc"])
  line.record("ready", t=time.time())
  lay = layout(args["mib"])
  local_dir = os.path.join(args["local_root"], f"host_{me}")
  kind = _Ours if args["manager"] == OURS else _Orbax
  mngr = kind(args, lay, local_dir, args["persistent"])
  t0 = time.time()
  restored = mngr.restore()
  if restored is None:
    state, start, source = _initial(lay), 0, "fresh"
  else:
    state, start, source = restored
    start = int(start)
  jax.block_until_ready(state)
  ok = _holds(state, start)
  line.record("restored", step=start, t0=t0, t1=time.time(), source=str(source), ok=ok)
  if not ok:
    raise AssertionError(f"process {me}: the state restored at step {start} is not all {start}")
  shardings = {k: v.sharding for k, v in lay.abstract.items()}
  add = jax.jit(
    lambda s: jax.tree.map(lambda x: x + 1.0, s), in_shardings=(shardings,), out_shardings=shardings
  )
  add = add.lower(state).compile()
  step, step_s = start, args["step_s"]
  while True:
    step += 1
    t_step = time.time()
    state = jax.block_until_ready(add(state))
    # an all-reduce over every device, as a data-parallel step's gradient
    # sum: the processes train in lockstep, as a real job's do
    multihost_utils.sync_global_devices("goodput step")
    time.sleep(max(0.0, step_s - (time.time() - t_step)))
    t_end = time.time()
    line.record("step", step=step, t0=t_step, t1=t_end)
    mngr.trained(step, t_end - t_step)
    saved = mngr.save(step, state)
    line.record("save", step=step, t0=t_end, t1=time.time(), saved=bool(saved))
