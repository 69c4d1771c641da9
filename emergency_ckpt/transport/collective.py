"""Moving a step from slices that hold it to slices that lost it, bit-exactly.

Point to point: one jitted shard_map over the mesh runs a collective permute
over the replica axis from an intact slice to each slice that lost its copy
(lost slices are assigned to intact sources round-robin, so with several
intact slices the sends run in parallel). Intact slices keep their own
(verified) shards; only the lost slices receive, and only once. Rounds are
merged with a select, never arithmetic, and dtypes whose bits a collective
might not keep travel bit-cast to unsigned integers, so -0.0, denormals and
NaN payloads survive (Orbax's broadcast is a float sum-with-zeros that loses
them).

Called by: every process (it is one XLA program with collectives); blocks
until it is done.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from emergency_ckpt.core import placement
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import TopologyError
from emergency_ckpt.runtime.buffers import aligned_empty
from emergency_ckpt.transport.routing import routes

_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _carrier(dtype: np.dtype) -> tuple[np.dtype, int]:
  """(carrier dtype, carriers per element) for `dtype`: itself where the
  permute is known to copy its bytes (no bit-cast copy on arrival: faster),
  else unsigned integers (XLA's CPU collectives widen bfloat16 and friends
  to float32 and back, which does not keep every bit pattern)."""
  dtype = np.dtype(dtype)
  if dtype.kind in "iub" or dtype in (np.dtype(np.float32), np.dtype(np.float64)):
    return dtype, 1
  size = dtype.itemsize
  if size in _UINTS:
    return np.dtype(_UINTS[size]), 1
  if size % 4 == 0:
    return np.dtype(np.uint32), size // 4
  raise TopologyError(f"dtype {dtype} ({size} bytes) cannot cross slices bit-exactly")


@functools.lru_cache(maxsize=8)
def _mover(mesh, replica_axis: str, specs: tuple, dtypes: tuple, factors: tuple, rounds: tuple):
  """The jitted transfer for leaves with these (spec, tail) partition specs."""

  def body(*xs):
    me = jax.lax.axis_index(replica_axis)
    outs = []
    for x, dtype, factor in zip(xs, dtypes, factors):
      # Each lost slice receives in exactly one round: a select (never
      # arithmetic) keeps what it received.
      got = None
      for pairs in rounds:
        moved = jax.lax.ppermute(x, replica_axis, perm=list(pairs))
        if got is None:
          got = moved
        else:
          mine = functools.reduce(jnp.logical_or, [me == dst for _, dst in pairs])
          got = jax.lax.select(jnp.broadcast_to(mine, got.shape), moved, got)
      y = got[0]
      if factor > 1 or y.dtype != dtype:
        y = jax.lax.bitcast_convert_type(y, dtype)
      outs.append(y)
    return outs

  in_specs = tuple(PartitionSpec(replica_axis, *spec, *tail) for spec, tail in specs)
  out_specs = [PartitionSpec(*spec) for spec, _ in specs]
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  return jax.jit(fn)


def transfer(
  abstract: Sequence,
  local: Sequence[dict] | None,
  *,
  mesh,
  replica_axis: str,
  intact: Sequence[int],
  lost: Sequence[int],
) -> list[jax.Array]:
  """Moves a step to the slices that lost it. Called by: every process (one
  XLA program with collectives).

  Args:
    abstract: abstract arrays with shardings, one per leaf.
    local: this process's verified host shards per leaf ({index: array}),
      on intact slices; None on lost ones.
    mesh: the job's mesh.
    replica_axis: the mesh axis the slices span.
    intact: the slices that hold the step (the same on every process).
    lost: the slices that lost it.

  Returns:
    The step's arrays on every process: intact slices keep `local`, lost
    slices receive theirs from an intact slice.

  Raises:
    TopologyError: a dtype cannot cross slices bit-exactly, or no intact
      slice.
  """
  num = mesh.shape[replica_axis]
  have = local is not None
  globals_, dtypes, factors, specs = [], [], [], []
  for i, leaf in enumerate(abstract):
    dtype = np.dtype(jnp.dtype(leaf.dtype))
    carrier, factor = _carrier(dtype)
    shape = tuple(leaf.shape)
    spec = tuple(leaf.sharding.spec) + (None,) * (len(shape) - len(leaf.sharding.spec))
    tail = (factor,) if factor > 1 else ()
    ext_shape = (num, *shape, *tail)
    ext_sharding = NamedSharding(mesh, PartitionSpec(replica_axis, *spec, *((None,) * len(tail))))
    devices, pieces = [], []
    for device, idx in ext_sharding.addressable_devices_indices_map(ext_shape).items():
      index = shards_lib.normalize_index(idx, ext_shape)[1 : 1 + len(shape)]
      piece_shape = (1, *shards_lib.shard_shape(index), *tail)
      if have:
        piece = local[i][index].view(carrier).reshape(piece_shape)
      else:  # overwritten by the transfer; never read, so never touched: page
        # aligned, it is aliased, not copied (np.empty's 16-byte alignment
        # made the receivers copy a whole buffer of garbage)
        piece = aligned_empty(math.prod(piece_shape) * carrier.itemsize)
        piece = piece.view(carrier).reshape(piece_shape)
      devices.append(device)
      pieces.append(piece)
    placed = jax.device_put(pieces, devices, may_alias=True)
    globals_.append(jax.make_array_from_single_device_arrays(ext_shape, ext_sharding, placed))
    dtypes.append(dtype)
    factors.append(factor)
    specs.append((spec, (None,) * len(tail)))
  rounds = tuple(tuple(pairs) for pairs in routes(list(intact), list(lost)))
  fn = _mover(mesh, replica_axis, tuple(specs), tuple(dtypes), tuple(factors), rounds)
  outs = fn(*globals_)
  if have:  # an intact slice keeps its own verified shards (aliased on CPU),
    # after its sends are done (returning earlier could let the process exit
    # or free the sources mid-transfer)
    jax.block_until_ready(outs)
    return placement.assemble_many(abstract, local)
  # A lost slice takes the received shards, rewrapped under exactly the
  # requested sharding (shard_map spells an equivalent one differently, and
  # device_put would reshard: a full copy).
  return [
    jax.make_array_from_single_device_arrays(
      o.shape, a.sharding, [s.data for s in o.addressable_shards]
    )
    for o, a in zip(outs, abstract)
  ]
