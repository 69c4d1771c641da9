"""Cross-process barriers for benchmark workers: the one module that touches
jax's private coordination client (no XLA, no device memory)."""

from __future__ import annotations

import itertools

import jax

_COUNTER = itertools.count()
_TIMEOUT_MS = 600_000


def barrier(name: str) -> None:
  """Blocks until every process of the job reaches the same barrier.

  Called by: every process, in the same order (the n-th call gets the same
  unique key everywhere). A no-op in single-process jobs.
  """
  if jax.process_count() == 1:
    return
  client = jax._src.distributed.global_state.client  # noqa: SLF001
  client.wait_at_barrier(f"bench/{next(_COUNTER)}/{name}", _TIMEOUT_MS)
