"""A small data-parallel trainer using emergency_ckpt (runs in every process).

Run by emergency_ckpt.demo.main through the launcher (`train` is the job
target). Model: linear regression, params sharded over 'data', replicated over
'replica' (the slices). Data: a deterministic iterator whose position is the
per-process non-tensor state.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec

DIN, DOUT, BATCH = 64, 32, 16
_BATCH_SHAPES = ((BATCH, DIN), (BATCH, DOUT))


class DataIterator:
  """Deterministic batches; get_state/set_state like grain's iterators."""

  def __init__(self, seed: int):
    self.seed = seed
    self.position = 0

  def get_state(self) -> dict:
    return {"position": self.position, "seed": self.seed}

  def set_state(self, state: dict) -> None:
    self.position, self.seed = state["position"], state["seed"]

  def __next__(self) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([self.seed, self.position])
    self.position += 1
    x = rng.standard_normal((BATCH, DIN), dtype=np.float32)
    w_true = np.linspace(-1, 1, DIN * DOUT, dtype=np.float32).reshape(DIN, DOUT)
    return x, (x @ w_true).astype(np.float32)


def mesh() -> Mesh:
  return Mesh(np.array(jax.devices()).reshape(2, -1), ("replica", "data"))


def shardings(m: Mesh) -> dict:
  return {"w": NamedSharding(m, P(None, "data")), "b": NamedSharding(m, P("data"))}


def init_params(m: Mesh) -> dict:
  s = shardings(m)
  return {
    "w": jax.device_put(jnp.zeros((DIN, DOUT), jnp.float32), s["w"]),
    "b": jax.device_put(jnp.zeros((DOUT,), jnp.float32), s["b"]),
  }


def make_step(m: Mesh):
  s = shardings(m)
  rep = NamedSharding(m, P())

  def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  def step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), loss

  return jax.jit(step, in_shardings=(s, rep, rep), out_shardings=(s, rep)), rep


def train(args: dict) -> dict:
  """Trains to args['until']; checkpoints if args['config'] is set (with the
  event log at args['event_log'] if given); restores first if args['restore'].
  Returns losses and where this process restored from."""
  m = mesh()
  step_fn, rep = make_step(m)
  params = init_params(m)
  data = DataIterator(seed=1234)  # same stream on every process (global batch)
  start, restored = 0, None
  mngr = None
  if args.get("config"):
    overrides = [f"event_log={args['event_log']}"] if args.get("event_log") else []
    mngr = ec.CheckpointManager(ec.load_config(args["config"], overrides), mesh=m)
  # Compiled before the restore: the goodput (`emergency-ckpt report`)
  # counts the compilation as start-up, not as the first step's training.
  batch = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep) for shape in _BATCH_SHAPES]
  step_fn = step_fn.lower(params, *batch).compile()
  if mngr is not None and args.get("restore"):
    abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
    )
    r = mngr.restore(abstract)
    params, start = r.state, r.step
    data.set_state(r.data_state["iterator"])
    restored = {
      "step": r.step,
      "source": r.source,
      "data_state": r.data_state,
      "slice": mngr.topology.slice_index,
    }
  losses = {}
  for step in range(start + 1, args["until"] + 1):
    x, y = next(data)
    gx = jax.make_array_from_callback(x.shape, rep, lambda i, x=x: x[i])
    gy = jax.make_array_from_callback(y.shape, rep, lambda i, y=y: y[i])
    params, loss = step_fn(params, gx, gy)
    losses[step] = float(np.asarray(loss.addressable_shards[0].data))
    if mngr is not None:
      mngr.save(
        step, params, data_state={"iterator": data.get_state(), "host": os.environ.get("EC_HOST")}
      )
  if mngr is not None:
    mngr.close()
  return {"losses": losses, "restored": restored, "process": jax.process_index()}
