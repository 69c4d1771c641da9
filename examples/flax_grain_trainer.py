"""A flax nnx + optax + grain trainer using emergency_ckpt (runs in every process).

What a real data-parallel multi-slice trainer does, at toy size:

- mesh axes ("replica", "data"): one mesh row per slice. The train state
  (an nnx MLP + its optax adam state) is replicated over "replica" and
  sharded over "data" through flax partitioning annotations; the batch is
  split over both axes (each process feeds its own rows).
- data: a grain pipeline over an in-memory synthetic dataset, each process
  reading its own shard; its iterator state is the checkpoint's data_state
  (grain's own get_state()/set_state(), through the manager).
- checkpoints: save every step (the manager decides which steps hit a tier);
  on a restart, restore before the loop and continue from r.step + 1.

`train(args)` is what `emergency_ckpt.testing.launcher.run_job` runs in each process;
examples/flax_grain.py is the driver. Each process appends one JSON line per
step to a trace file (loss, iterator state), which survives a crash.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import grain
import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec

DEFAULTS = {
  "examples": 192,  # synthetic dataset size (all processes together)
  "din": 16,
  "hidden": 32,
  "classes": 4,
  "global_batch": 16,
  "lr": 0.01,
  "seed": 0,
  "local_every": 5,
  "persistent_every": 10,
}


class MLP(nnx.Module):
  """Two linear layers; kernels and hidden bias carry "data" partitioning."""

  def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.hidden = nnx.Linear(
      din,
      hidden,
      kernel_init=nnx.with_partitioning(init, (None, "data")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("data",)),
      rngs=rngs,
    )
    self.out = nnx.Linear(
      hidden, dout, kernel_init=nnx.with_partitioning(init, ("data", None)), rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jax.nn.relu(self.hidden(x)))


def make_mesh() -> Mesh:
  """Slices along "replica": the first half of the processes' devices is slice 0.

  On TPU, jax.experimental.mesh_utils.create_hybrid_device_mesh builds this
  from the real slice layout."""
  return Mesh(np.array(jax.devices()).reshape(2, -1), ("replica", "data"))


def make_state_fns(mesh: Mesh, cfg: dict):
  """(graphdef, init, shardings): `init()` builds the sharded train state (an
  nnx.State of model params + optimizer state); `jax.eval_shape(init)` gives
  the abstract state for restore() without allocating anything."""

  def create():
    # The partitioning annotations stay metadata here (no mesh context
    # needed); jit's out_shardings below place every leaf.
    with nnx.use_eager_sharding(False):
      model = MLP(cfg["din"], cfg["hidden"], cfg["classes"], rngs=nnx.Rngs(cfg["seed"]))
      return model, nnx.Optimizer(model, optax.adam(cfg["lr"]), wrt=nnx.Param)

  graphdef, abstract = nnx.split(nnx.eval_shape(create))
  # Optimizer state (adam's mu, nu) inherits each param's annotation; scalars
  # (step counts) have none: replicated.
  specs = nnx.get_partition_spec(abstract)
  shardings = jax.tree.map(
    lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
  )
  init = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)
  return graphdef, init, shardings


def make_train_step(graphdef, shardings, mesh: Mesh):
  """A jitted pure step (state, batch) -> (state, loss); loss replicated."""
  batch_sharding = NamedSharding(mesh, P(("replica", "data")))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      logits = model(batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  jitted = jax.jit(
    step,
    in_shardings=(shardings, batch_sharding),
    out_shardings=(shardings, NamedSharding(mesh, P())),
  )
  return jitted, batch_sharding


def synthetic_records(cfg: dict) -> list[dict]:
  """A fixed labelled dataset: labels from a random linear teacher."""
  rng = np.random.default_rng(1234)
  x = rng.standard_normal((cfg["examples"], cfg["din"]), dtype=np.float32)
  teacher = rng.standard_normal((cfg["din"], cfg["classes"]), dtype=np.float32)
  y = np.argmax(x @ teacher, axis=1).astype(np.int32)
  return [{"x": x[i], "y": y[i]} for i in range(len(x))]


def make_data_iterator(cfg: dict) -> grain.DatasetIterator:
  """This process's shard, reshuffled every epoch, batched; a grain iterator
  (get_state()/set_state() give and take its position as a small dict)."""
  n, me = jax.process_count(), jax.process_index()
  local_batch = cfg["global_batch"] // n
  ds = (
    grain.MapDataset.source(synthetic_records(cfg))[me::n]
    .shuffle(seed=cfg["seed"] + 17)
    .repeat()
    .map(lambda r: {"x": r["x"] * 2.0, "y": r["y"]})
    .batch(local_batch, drop_remainder=True)
  )
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))


def make_options(args: dict, cfg: dict) -> ec.CheckpointManagerOptions:
  """Per-host ramdisk folder (here: one folder per process), shared persistent dir."""
  return ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(
      directory=os.path.join(args["ramdisk_root"], f"host_{jax.process_index()}"),
      save_interval_steps=cfg["local_every"],
      max_to_keep=2,
    ),
    persistent=ec.PersistentTierOptions(
      directory=args["persistent"], save_interval_steps=cfg["persistent_every"], max_to_keep=2
    ),
    replica_axis="replica",
    collective_timeout_s=120,
  )


def _die(trace, step: int) -> None:
  """The whole job dies without warning (no close(), no wait for saves).

  The barrier only makes the example deterministic: every process has logged
  `step` before the first one (maybe the coordinator) dies. A process whose
  barrier is cut short by that death fails instead: dead all the same."""
  trace.flush()
  os.fsync(trace.fileno())
  multihost_utils.sync_global_devices(f"flax_grain_crash_{step}")
  print(f"[process {jax.process_index()}] simulated failure after step {step}", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def train(args: dict) -> dict[str, Any]:
  """Trains to args["until"]. With args["checkpoint"], saves through an
  ec.CheckpointManager (and restores first if a step is restorable); with
  args["crash_at"], dies by SIGKILL after that step. args["fault"] =
  "fresh-iterator" restores the tensors but not the data iterator (what a
  trainer that forgets data_state does; the driver must notice)."""
  cfg = {**DEFAULTS, **args.get("cfg", {})}
  mesh = make_mesh()
  graphdef, init, shardings = make_state_fns(mesh, cfg)
  train_step, batch_sharding = make_train_step(graphdef, shardings, mesh)
  data = make_data_iterator(cfg)
  me = jax.process_index()
  slice_index = me * 2 // jax.process_count()
  os.makedirs(args["trace_dir"], exist_ok=True)
  trace_path = os.path.join(args["trace_dir"], f"{args['name']}_process_{me}.jsonl")

  mngr, start, restored = None, 0, None
  if args.get("checkpoint"):
    mngr = ec.CheckpointManager(make_options(args, cfg), mesh=mesh)
  if mngr is not None and mngr.latest_step() is not None:
    # A restart: restore before the loop. Nothing is allocated for the
    # abstract state; the restored arrays land on its shardings. Passing the
    # iterator makes the manager call data.set_state(<saved state>).
    abstract = jax.eval_shape(init)
    iterator = None if args.get("fault") == "fresh-iterator" else data
    r = mngr.restore(abstract, data_state=iterator)
    state, start = r.state, r.step
    restored = {
      "step": r.step,
      "source": r.source,
      "slice": mngr.topology.slice_index,
      "saved_iterator": r.data_state,
      "iterator_after_restore": data.get_state(),
    }
  else:
    state = init()

  losses = {}
  with open(trace_path, "a") as trace:
    for step in range(start + 1, args["until"] + 1):
      local = next(data)
      batch = {
        k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
        for k, v in local.items()
      }
      state, loss = train_step(state, batch)
      losses[step] = float(np.asarray(loss.addressable_shards[0].data))
      if mngr is not None:
        mngr.save(step, state, data_state=data)  # data.get_state() goes to this process's JSON
      trace.write(json.dumps({"step": step, "loss": losses[step], "iterator": data.get_state()}))
      trace.write("\n")
      if step == args.get("crash_at"):
        _die(trace, step)
  if mngr is not None:
    mngr.close()  # waits for the last saves
  return {"process": me, "slice": slice_index, "losses": losses, "restored": restored}
