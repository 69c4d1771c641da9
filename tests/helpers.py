"""Plain functions several test modules share (fixtures are in conftest.py)."""

from __future__ import annotations

import os
import subprocess

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def abstract(mesh, shape=(4, 2), dtype=jnp.float32) -> dict:
  """{"w": a replicated ShapeDtypeStruct on `mesh`}: by default, the abstract
  state of tests.single_slice.state."""
  return {"w": jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))}


def abstract_of(tree):
  """The abstract state of a tree of jax.Arrays: each leaf's shape, dtype and sharding."""
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


def listing(path: str) -> list[str]:
  """The sorted names in `path`, or [] if it is not a directory."""
  return sorted(os.listdir(path)) if os.path.isdir(path) else []


def fault_job_args(root: str, name: str, **kw) -> dict:
  """A fault scenario's job args (tests/fault_scenarios.py): 2 slices, its own
  local and persistent directories under root/<name>, short commit timeouts."""
  d = os.path.join(root, name.replace(".", "_"))
  args = {
    "name": name,
    "slices": 2,
    "local_root": os.path.join(d, "local"),
    "persistent": os.path.join(d, "persistent"),
    "persistent_interval": 2,
    "state_commit_timeout_s": 2,
  }
  args.update(kw)
  return args


def barrier(name: str, timeout_s: float = 120) -> None:
  """Inside a multi-process job: waits for every process at a coordination-
  service barrier (no XLA collective, so it works while a scenario has left
  the devices busy), at most `timeout_s`. One process: returns."""
  if jax.process_count() == 1:
    return
  client = jax._src.distributed.global_state.client  # noqa: SLF001
  client.wait_at_barrier(f"ec-test/{name}", int(timeout_s * 1000))


def mount_tmpfs(path: str, size: str) -> bool:
  """Mounts a real tmpfs of `size` at `path` (needs CAP_SYS_ADMIN); False if
  it cannot (the caller falls back to RLIMIT_FSIZE)."""
  os.makedirs(path, mode=0o700, exist_ok=True)
  proc = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
    capture_output=True,
  )
  return proc.returncode == 0
