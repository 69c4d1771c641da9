"""Cross-process barriers for benchmark workers: the one module that touches
jax's private coordination client (no XLA, no device memory)."""

from __future__ import annotations

import itertools
import time

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


def start_together(name: str, lead_s: float = 0.25) -> float:
  """A barrier, then every process sleeps until one shared instant (process
  0's clock `lead_s` after it left the barrier, published through the
  coordination service), so that a timed call starts at once everywhere.
  A barrier alone releases the processes one after another: in a 64-process
  job on 2 cores, process 0 (which hosts the coordination service and
  answers everyone else's release first) left it up to 94 ms after the
  first, and the first to leave then timed their wait for it. Returns how
  late this process woke past the instant (0.0 if on time; a figure to
  report, which says whether `lead_s` sufficed). The instant is a
  CLOCK_MONOTONIC time, so the processes must share one machine (as the
  launcher's jobs do). Called by: every process, in the same order; a
  plain barrier-free no-op in single-process jobs."""
  if jax.process_count() == 1:
    return 0.0
  barrier(name)
  client = jax._src.distributed.global_state.client  # noqa: SLF001
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
