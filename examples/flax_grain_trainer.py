"""A flax nnx + optax + grain trainer using emergency_ckpt (runs in every process).

What a real data-parallel multi-slice trainer does, at toy size:

- mesh axes ("replica", "data"): one mesh row per slice. The train state
  (an nnx MLP + its optax adam state) is replicated over "replica" and
  sharded over "data" through flax partitioning annotations; the batch is
  split over both axes (each process feeds its own rows).
- data: a grain pipeline over an in-memory synthetic dataset, each process
  reading its own shard; its iterator state is the checkpoint's data_state
  (grain's own get_state()/set_state(), through the manager).
- elastic data (args["data_shards"] = S): the dataset is cut into S logical
  shards, fixed for the whole run, one grain iterator each; process i of n
  reads S/n of them (ShardedDataIterator). The global batch (one per-shard
  batch of every shard, in shard order) is then the same whatever the process
  count, so a restart onto fewer slices resumes at the same global example
  count: restore(..., data_state_remap=remap_data_shards) hands each new
  process the saved grain states of the shards it now reads.
- checkpoints: save every step (the manager decides which steps hit a tier);
  on a restart, restore before the loop and continue from r.step + 1.

`train(args)` is what `emergency_ckpt.demo.launcher.run_job` runs in each process;
examples/flax_grain.py is the driver. Each process appends one JSON line per
step to a trace file (loss, iterator state, the ids of the examples it fed),
which survives a crash.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
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


def make_mesh(slices: int = 2) -> Mesh:
  """Slices along "replica": the first 1/slices of the processes' devices is
  slice 0, and so on.

  On TPU, jax.experimental.mesh_utils.create_hybrid_device_mesh builds this
  from the real slice layout."""
  return Mesh(np.array(jax.devices()).reshape(slices, -1), ("replica", "data"))


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
  """A fixed labelled dataset: labels from a random linear teacher; "id" is
  the record's index (the driver checks which examples were fed)."""
  rng = np.random.default_rng(1234)
  x = rng.standard_normal((cfg["examples"], cfg["din"]), dtype=np.float32)
  teacher = rng.standard_normal((cfg["din"], cfg["classes"]), dtype=np.float32)
  y = np.argmax(x @ teacher, axis=1).astype(np.int32)
  return [{"x": x[i], "y": y[i], "id": i} for i in range(len(x))]


def shard_dataset(cfg: dict, shard: int, num_shards: int) -> grain.MapDataset:
  """Data shard `shard` of `num_shards`: every num_shards-th record,
  reshuffled every epoch, in batches of global_batch // num_shards."""
  return (
    grain.MapDataset.source(synthetic_records(cfg))[shard::num_shards]
    .shuffle(seed=cfg["seed"] + 17)
    .repeat()
    .map(lambda r: {"x": r["x"] * 2.0, "y": r["y"], "id": r["id"]})
    .batch(cfg["global_batch"] // num_shards, drop_remainder=True)
  )


def _grain_iterator(ds: grain.MapDataset) -> grain.DatasetIterator:
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))


def make_data_iterator(cfg: dict) -> grain.DatasetIterator:
  """This process's shard (one shard per process), reshuffled every epoch,
  batched; a grain iterator (get_state()/set_state() give and take its
  position as a small dict)."""
  return _grain_iterator(shard_dataset(cfg, jax.process_index(), jax.process_count()))


def data_shards_of(process_index: int, process_count: int, num_shards: int) -> range:
  """The logical data shards process `process_index` of `process_count`
  reads: a contiguous block of num_shards // process_count (so the global
  batch, laid out in process order, is always in shard order)."""
  if num_shards % process_count:
    raise ValueError(
      f"{num_shards} data shards cannot be split evenly over {process_count} processes"
      " (choose data_shards as a multiple of every process count the run may use)"
    )
  per = num_shards // process_count
  return range(process_index * per, (process_index + 1) * per)


class ShardedDataIterator:
  """Elastic data loading: this process's logical data shards, one grain
  iterator each; each next() returns one batch of every shard, concatenated in
  shard order (process_count * that = the global batch, whatever the process
  count).

  get_state() -> {"data_shards": S, "batches": t, "shards": {"<s>": <grain
  state of shard s>, ...}}: t global batches were drawn, so the job has
  consumed t * global_batch examples. set_state() takes a state of exactly
  this process's shards (remap_data_shards builds one from another process
  count's states)."""

  def __init__(self, cfg: dict, num_shards: int, process_index: int, process_count: int):
    self.num_shards = num_shards
    self.shards = list(data_shards_of(process_index, process_count, num_shards))
    self._its = {s: _grain_iterator(shard_dataset(cfg, s, num_shards)) for s in self.shards}
    self.batches = 0

  def __iter__(self) -> ShardedDataIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(self._its[s]) for s in self.shards]
    self.batches += 1
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self) -> dict[str, Any]:
    return {
      "data_shards": self.num_shards,
      "batches": self.batches,
      "shards": {str(s): it.get_state() for s, it in self._its.items()},
    }

  def set_state(self, state: dict[str, Any]) -> None:
    mine = sorted(str(s) for s in self.shards)
    if state["data_shards"] != self.num_shards or sorted(state["shards"]) != mine:
      raise ValueError(
        f"a data state of shards {sorted(state['shards'])} of {state['data_shards']} does not"
        f" fit this process (shards {mine} of {self.num_shards}): remap it"
        " (restore(..., data_state_remap=remap_data_shards))"
      )
    for s, it in self._its.items():
      it.set_state(state["shards"][str(s)])
    self.batches = state["batches"]


def remap_data_shards(saved: Mapping[int, Any], process_index: int, process_count: int) -> dict:
  """`restore(..., data_state_remap=remap_data_shards)` for ShardedDataIterator
  states: the job restarts on another process count (e.g. 2 slices -> 1).

  `saved[i]` is saved process i's get_state(); this returns this process's:
  for each shard it now reads (data_shards_of(process_index, process_count,
  S)), the grain state the old process that read that shard saved. Every
  shard continues exactly where it stopped, so the job resumes at the same
  global example count, and no example is skipped or fed twice. Reads only
  the saved states of the old processes that held this process's shards
  (`saved` reads each file when first accessed). Raises ValueError if the
  saved states disagree (shard count, batches drawn) or lack a shard.

  Copy it with ShardedDataIterator (or keep your loader's per-shard states
  under "shards" the same way); the shard count S must be a multiple of every
  process count the run may use."""
  old_count = len(saved)
  # The old process holding this process's first shard (shards are
  # contiguous blocks both before and after): it also says how many there are.
  first = saved[process_index * old_count // process_count]
  num_shards = first["data_shards"]
  if num_shards % old_count:
    raise ValueError(f"{old_count} saved processes cannot have read {num_shards} data shards")
  shards, batches = {}, set()
  for s in data_shards_of(process_index, process_count, num_shards):
    owner = s * old_count // num_shards
    state = saved[owner]
    if state["data_shards"] != num_shards or str(s) not in state["shards"]:
      raise ValueError(
        f"saved process {owner} holds shards {sorted(state['shards'])} of"
        f" {state['data_shards']}, not shard {s} of {num_shards}"
      )
    shards[str(s)] = state["shards"][str(s)]
    batches.add(state["batches"])
  if len(batches) != 1:
    raise ValueError(f"the saved processes drew different numbers of batches: {sorted(batches)}")
  return {"data_shards": num_shards, "batches": batches.pop(), "shards": shards}


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


def _die(trace, step: int, settle: ec.CheckpointManager | None = None) -> None:
  """The whole job dies without warning (no close(), no wait for saves).

  The barrier only makes the example deterministic: every process has logged
  `step` before the first one (maybe the coordinator) dies. A process whose
  barrier is cut short by that death fails instead: dead all the same.

  `settle`: first wait until that manager's saves in flight are durable (so
  the newest save is restorable, and the restored step fixed; without it a
  save a few steps back may still be committing when the job dies, and the
  restart takes the one before)."""
  if settle is not None:
    settle.wait_until_finished()
  trace.flush()
  os.fsync(trace.fileno())
  multihost_utils.sync_global_devices(f"flax_grain_crash_{step}")
  print(f"[process {jax.process_index()}] simulated failure after step {step}", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def train(args: dict) -> dict[str, Any]:
  """Trains to args["until"]. With args["checkpoint"], saves through an
  ec.CheckpointManager (and restores first if a step is restorable); with
  args["crash_at"], dies by SIGKILL after that step (args["settle"]: once its
  saves in flight are durable). args["fault"] =
  "fresh-iterator" restores the tensors but not the data iterator (what a
  trainer that forgets data_state does; the driver must notice).

  args["slices"] (default 2): the mesh's replica axis. args["data_shards"]:
  elastic data (ShardedDataIterator over that many logical shards, restored
  with remap_data_shards when the process count changed); without it, one
  grain iterator per process."""
  cfg = {**DEFAULTS, **args.get("cfg", {})}
  slices = args.get("slices", 2)
  mesh = make_mesh(slices)
  graphdef, init, shardings = make_state_fns(mesh, cfg)
  train_step, batch_sharding = make_train_step(graphdef, shardings, mesh)
  me, count = jax.process_index(), jax.process_count()
  if args.get("data_shards"):
    data = ShardedDataIterator(cfg, args["data_shards"], me, count)
  else:
    data = make_data_iterator(cfg)
  slice_index = me * slices // count
  os.makedirs(args["trace_dir"], exist_ok=True)
  trace_path = os.path.join(args["trace_dir"], f"{args['name']}_process_{me}.jsonl")

  mngr, start, restored = None, 0, None
  if args.get("checkpoint"):
    mngr = ec.CheckpointManager(make_options(args, cfg), mesh=mesh)
  if mngr is not None and mngr.latest_step() is not None:
    # A restart: restore before the loop. Nothing is allocated for the
    # abstract state; the restored arrays land on its shardings. Passing the
    # iterator makes the manager call data.set_state(<saved state>); if the
    # step was saved by another process count, remap_data_shards first
    # builds this process's state from the saved processes' states.
    abstract = jax.eval_shape(init)
    iterator = None if args.get("fault") == "fresh-iterator" else data
    remap = remap_data_shards if args.get("data_shards") else None
    r = mngr.restore(abstract, data_state=iterator, data_state_remap=remap)
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
        k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(local[k]))
        for k in ("x", "y")
      }
      state, loss = train_step(state, batch)
      losses[step] = float(np.asarray(loss.addressable_shards[0].data))
      if mngr is not None:
        mngr.save(step, state, data_state=data)  # data.get_state() goes to this process's JSON
      rec = {"step": step, "loss": losses[step], "iterator": data.get_state()}
      rec["ids"] = np.asarray(local["id"]).tolist()  # the examples this process fed
      trace.write(json.dumps(rec) + "\n")
      if step == args.get("crash_at"):
        _die(trace, step, settle=mngr if args.get("settle") else None)
  if mngr is not None:
    mngr.close()  # waits for the last saves
  return {"process": me, "slice": slice_index, "losses": losses, "restored": restored}
