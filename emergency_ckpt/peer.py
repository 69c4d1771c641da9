"""Moving a step from a source slice to slices that lost it, bit-exactly.

Every process puts its shards into a (replicas, ...) array sharded over the
replica axis: the source slice contributes the real bytes, every other slice
zeros. One jitted integer sum over the replica axis then delivers the source's
bytes everywhere. The values travel bit-cast to unsigned integers, and x + 0
is exact for integers, so -0.0, denormals and NaN payloads survive (Orbax's
float sum-with-zeros loses them).

Called by: every process (it is one XLA collective); blocks until it is done.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from emergency_ckpt import shards as shards_lib
from emergency_ckpt.errors import TopologyError

_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _carrier(dtype: np.dtype) -> tuple[np.dtype, int]:
  """(unsigned carrier dtype, carriers per element) for `dtype`."""
  size = np.dtype(dtype).itemsize
  if size in _UINTS:
    return np.dtype(_UINTS[size]), 1
  if size % 4 == 0:
    return np.dtype(np.uint32), size // 4
  raise TopologyError(f"dtype {dtype} ({size} bytes) cannot cross slices bit-exactly")


def check_peer_compatible(
  paths: Sequence[str], abstract: Sequence, mesh, replica_axis: str
) -> str | None:
  """Why a peer transfer cannot serve `abstract`, or None if it can."""
  for path, leaf in zip(paths, abstract):
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
      return f"leaf {path} is not a NamedSharding on the manager's mesh"
    for entry in sharding.spec:
      names = entry if isinstance(entry, tuple) else (entry,)
      if replica_axis in names:
        return (
          f"leaf {path} is sharded over the replica axis {replica_axis!r}, so no"
          " other slice holds its shards"
        )
  return None


@functools.lru_cache(maxsize=8)
def _summer(dtypes: tuple, factors: tuple, out_shardings: tuple):
  def run(xs):
    outs = []
    for x, dtype, factor in zip(xs, dtypes, factors):
      total = jnp.sum(x, axis=0, dtype=x.dtype)
      if dtype == np.bool_:
        outs.append(total.astype(jnp.bool_))
      elif factor == 1 and total.dtype == dtype:
        outs.append(total)
      else:
        outs.append(jax.lax.bitcast_convert_type(total, dtype))
    return outs

  return jax.jit(run, out_shardings=list(out_shardings))


def transfer(
  abstract: Sequence, local: Sequence[dict] | None, *, mesh, replica_axis: str, is_source: bool
) -> list[jax.Array]:
  """Returns the source slice's arrays on every process of every slice.

  `local`: this process's verified host shards per leaf (needed on the source
  slice only; ignored elsewhere).
  """
  num = mesh.shape[replica_axis]
  globals_, dtypes, factors, outs = [], [], [], []
  for i, leaf in enumerate(abstract):
    dtype = np.dtype(jnp.dtype(leaf.dtype))
    carrier, factor = _carrier(dtype)
    shape = tuple(leaf.shape)
    spec = tuple(leaf.sharding.spec) + (None,) * (len(shape) - len(leaf.sharding.spec))
    ext_shape = (num, *shape) + ((factor,) if factor > 1 else ())
    ext_spec = PartitionSpec(replica_axis, *spec, *((None,) if factor > 1 else ()))
    ext_sharding = NamedSharding(mesh, ext_spec)
    devices, pieces = [], []
    for device, idx in ext_sharding.addressable_devices_indices_map(ext_shape).items():
      index = shards_lib.normalize_index(idx, ext_shape)[1 : 1 + len(shape)]
      piece_shape = (1, *shards_lib.shard_shape(index)) + ((factor,) if factor > 1 else ())
      if is_source:
        piece = local[i][index].view(carrier).reshape(piece_shape)
      else:
        piece = np.zeros(piece_shape, carrier)
      devices.append(device)
      pieces.append(piece)
    placed = jax.device_put(pieces, devices, may_alias=True)
    globals_.append(jax.make_array_from_single_device_arrays(ext_shape, ext_sharding, placed))
    dtypes.append(dtype)
    factors.append(factor)
    outs.append(leaf.sharding)
  fn = _summer(tuple(dtypes), tuple(factors), tuple(outs))
  return fn(globals_)
