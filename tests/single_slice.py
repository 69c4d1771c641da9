"""The small one-slice train state the single-process manager tests share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def state(mesh, value: float) -> dict:
  """{"w": a (4, 2) float32 array full of `value`, replicated on `mesh`}."""
  return {"w": jax.device_put(jnp.full((4, 2), value, jnp.float32), NamedSharding(mesh, P()))}
