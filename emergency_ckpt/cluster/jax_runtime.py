"""The JAX and Orbax runtime as this library reaches it: the ONE module that
touches their private internals.

What it reaches: JAX's distributed client and coordinator address
(`jax._src.distributed.global_state`), the coordination service and clients
a benchmark creates for simulated processes (`jax._src.lib._jax`), Orbax's
multihost id tables (`orbax.checkpoint._src.multihost`), and JAX's
preemption sync point. JAX and Orbax move private modules between releases
(Orbax between minor ones, hence its upper bound in pyproject.toml), so
every such access lives here: one module to fix when they move, and one
place that says which versions were tested (pyproject.toml's dependency
comments name this module). Nothing else in emergency_ckpt or benchmarks/
imports `_src`.

Called by: the cluster (collectives, process identity), the manager, the
persistent tier's Orbax loader, the benchmark's synchronised start and
Orbax adapters, and the research studies in benchmarks/. No collective of
its own, except where a function says so.
"""

from __future__ import annotations

import threading
from typing import Any

import jax


def distributed_client() -> Any | None:
  """JAX's coordination-service client of this process.

  Returns:
    The client jax.distributed.initialize() created, or None if it was not
    called (a single-process job).
  """
  return jax._src.distributed.global_state.client  # noqa: SLF001


def coordinator_address() -> str | None:
  """The JAX coordinator's address ("host:port").

  Returns:
    The address jax.distributed was initialised with, or None in a
    single-process job (nothing initialised).
  """
  return getattr(jax._src.distributed.global_state, "coordinator_address", None)  # noqa: SLF001


def coordination_service(address: str, num_processes: int) -> Any:
  """A JAX coordination service of its own, in this process (for studies
  that simulate many processes on one machine).

  Args:
    address: "host:port" the service listens on.
    num_processes: how many clients must register.

  Returns:
    The service object; it serves until dropped (or its shutdown()).
  """
  from jax._src.lib import _jax  # noqa: PLC0415 - only the studies need it

  return _jax.get_distributed_runtime_service(address, num_processes)


def coordination_client(address: str, process_id: int, *, timeout_s: int) -> Any:
  """A coordination-service client for simulated process `process_id` (the
  key-value calls Collectives makes; connect() registers it).

  Args:
    address: "host:port" of the service.
    process_id: the simulated process's index.
    timeout_s: its connect and shutdown timeouts, in seconds.

  Returns:
    The unconnected client.
  """
  from jax._src.lib import _jax  # noqa: PLC0415 - only the studies need it

  return _jax.get_distributed_runtime_client(
    address, process_id, init_timeout=timeout_s, shutdown_timeout=timeout_s
  )


_ORBAX_INIT_LOCK = threading.Lock()


def init_orbax_multihost() -> None:
  """What Orbax needs before its multi-process use (idempotent): with Orbax's
  defaults, nothing. Its CheckpointManager and its barriers over process
  subsets take JAX process indices as they are; only with its experimental
  flag `experimental_orbax_use_distributed_process_id` does it translate
  them, through a table that its initialize_runtime_to_distributed_ids()
  builds by an all-gather of every process (a key each, a barrier of every
  process, then a directory get of all N keys on every process: N^2 values
  through the coordination service at start-up), so only then is it built.
  Its other table (every process's device ids, another such all-gather)
  serves only Orbax's own emergency managers and is never built here.

  Called by: every process, once, when Orbax is loaded (a barrier of every
  process only where that flag is set).
  """
  if jax.process_count() == 1:
    return
  from orbax.checkpoint._src.multihost import multihost  # noqa: PLC0415

  if not multihost.use_experimental_distributed_process_id():
    return
  # Two managers of one process set up on their own threads: Orbax's
  # check-then-initialise is not atomic (the second one's key exists).
  with _ORBAX_INIT_LOCK:
    if not multihost.is_runtime_to_distributed_ids_initialized():
      multihost.initialize_runtime_to_distributed_ids()


def init_orbax_id_tables() -> None:
  """Builds both of Orbax's process id tables (runtime to distributed ids,
  distributed ids to device ids), each unless built already: what Orbax's
  own emergency managers expect outside absl.app.run. Each is an all-gather
  of every process through the coordination service.

  Called by: every process of a multi-process job, once, before an Orbax
  emergency manager is made (the benchmark's Orbax adapters).
  """
  from orbax.checkpoint._src.multihost import multihost  # noqa: PLC0415

  if not multihost.is_runtime_to_distributed_ids_initialized():
    multihost.initialize_runtime_to_distributed_ids()
  if not multihost.is_distributed_to_device_ids_initialized():
    multihost.initialize_distributed_to_device_ids()


def reached_preemption(step: int) -> bool:
  """Whether the job reached its preemption sync point, through JAX's
  preemption sync service: True on every process at the same step once any
  process got a preemption notice (SIGTERM); the service agrees on the step
  after the largest one any process had reached.

  Called by: every process, at every step.

  Args:
    step: the step this process is at.

  Returns:
    True at the agreed step after a notice; False otherwise, and always in
    a single-process job or with the service disabled.
  """
  from jax.experimental import multihost_utils  # noqa: PLC0415

  try:
    return bool(multihost_utils.reached_preemption_sync_point(step))
  except RuntimeError:  # the service is disabled (jax_enable_preemption_service=False)
    return False
