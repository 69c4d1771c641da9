"""Cross-process barriers and a key-value rendezvous for benchmark
workers, straight on JAX's coordination client (no XLA, no device memory;
the client comes from cluster/jax_runtime.py, the one module that touches
JAX's internals).

Called by: the benchmark's worker processes; barriers every one in the
same order.
"""

from __future__ import annotations

import itertools
import time

import jax

from emergency_ckpt.cluster import jax_runtime

_COUNTER = itertools.count()
_TIMEOUT_MS = 600_000


def barrier(name: str) -> None:
  """Blocks until every process of the job reaches the same barrier.

  Called by: every process, in the same order (the n-th call gets the same
  unique key everywhere). A no-op in single-process jobs.

  Args:
    name: the barrier's name (part of its key; for the service's messages).
  """
  if jax.process_count() == 1:
    return
  client = jax_runtime.distributed_client()
  client.wait_at_barrier(f"bench/{next(_COUNTER)}/{name}", _TIMEOUT_MS)


def start_together(name: str, lead_s: float = 0.25) -> float:
  """A barrier, then every process sleeps until one shared instant (process
  0's clock `lead_s` after it left the barrier, published through the
  coordination service), so that a timed call starts at once everywhere.
  A barrier alone releases the processes one after another: process 0
  (which hosts the coordination service and answers everyone else's
  release first) leaves it last, and the first to leave would then time
  their wait for it. The instant is a CLOCK_MONOTONIC time, so the
  processes must share one machine (as the launcher's jobs do).

  Called by: every process, in the same order; a plain barrier-free no-op
  in single-process jobs.

  Args:
    name: the barrier's name (part of its keys).
    lead_s: how far past process 0's release the shared instant lies.

  Returns:
    How late this process woke past the instant (0.0 if on time; a figure
    to report, which says whether `lead_s` sufficed).
  """
  if jax.process_count() == 1:
    return 0.0
  barrier(name)
  client = jax_runtime.distributed_client()
  key = f"bench/{next(_COUNTER)}/{name}/at"
  if jax.process_index() == 0:
    at = time.monotonic() + lead_s
    client.key_value_set(key, repr(at))
  else:
    at = float(client.blocking_key_value_get(key, _TIMEOUT_MS))
  left = at - time.monotonic()
  if left > 0:
    time.sleep(left)
  return max(0.0, time.monotonic() - at)


_LOCAL: dict[str, str] = {}  # the rendezvous of a single-process job


def publish(key: str, value: str) -> None:
  """Sets a rendezvous key (once per job: keys must be unique) for the
  other processes to lookup(); through the coordination service.

  Called by: any one process per key.
  """
  client = jax_runtime.distributed_client()
  if jax.process_count() == 1 or client is None:
    _LOCAL[key] = value
    return
  client.key_value_set(f"bench/kv/{key}", value)


def lookup(key: str) -> str:
  """A rendezvous key's value, waiting until some process publish()es it.

  Called by: any process.
  """
  client = jax_runtime.distributed_client()
  if jax.process_count() == 1 or client is None:
    return _LOCAL[key]
  return client.blocking_key_value_get(f"bench/kv/{key}", _TIMEOUT_MS)
