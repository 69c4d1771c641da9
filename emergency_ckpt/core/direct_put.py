"""Many replicated leaves placed on their devices at a few microseconds
each: what jax.device_put does underneath, without its per-array checks.

Each leaf is one host value that every addressable device of its sharding
holds whole. The first leaf of each (shape, dtype, sharding) goes through
jax.device_put; its aval and device order then serve the rest of that
kind through jax's own batched_device_put. This reaches jax._src (the one
other place than cluster/jax_runtime.py, which this pure layer may not
import): tested with jax 0.10.2 and 0.12; without the call, or if it
fails, every leaf goes through jax.device_put.

Called by: placement.assemble_many (the restore's placement); no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def put_whole(
  leaves: Sequence[tuple[int, np.ndarray, Any, tuple]], copy_up_to: int
) -> list[jax.Array]:
  """Leaves whose every device holds the whole array, from one host value
  each: the first of each (shape, dtype, sharding) through jax.device_put,
  the rest through the call it makes underneath (`_BATCHED_PUT`) with its
  aval and device order (a few us per leaf instead of tens: jax's own
  per-array checks are what a state of thousands of leaves pays for).
  Leaves up to `copy_up_to` bytes are copied, bigger ones aliased on CPU
  (as device_put(may_alias=True) does). Without that call (another jax),
  or if it fails, every leaf goes through jax.device_put.
  """
  out: list[Any] = []
  known: dict[tuple, tuple] = {}
  for _, x, sharding, shape in leaves:
    copy = x.nbytes <= copy_up_to
    key = (shape, x.dtype, sharding)
    k = known.get(key) if _BATCHED_PUT is not None else None
    if k is not None:
      aval, devices = k
      try:
        out.append(_BATCHED_PUT(aval, sharding, [x] * len(devices), devices, True, copy))
        continue
      except Exception:  # noqa: BLE001 - the private call changed: the public one
        pass
    if copy:
      x = np.array(x)  # its own bytes: jax may alias what it is given
    arr = jax.device_put(x, sharding, may_alias=True)
    aval = jax.typeof(arr)
    if aval.shape == shape and aval.dtype == x.dtype and not aval.weak_type:
      known[key] = (aval, [s.device for s in arr.addressable_shards])
    out.append(arr)
  return out


def _batched_put() -> Any:
  """jax's batched_device_put(aval, sharding, xs, devices, committed,
  force_copy) (jax._src: 0.10.2 to 0.12 tested), or None."""
  try:
    from jax._src.lib import xla_client  # noqa: PLC0415

    return xla_client.batched_device_put
  except (ImportError, AttributeError):
    return None


_BATCHED_PUT = _batched_put()
