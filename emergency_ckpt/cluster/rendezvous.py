"""The meeting point every exchange of Collectives shares: its keys on the
JAX coordination service's key-value store, its waits, and their cleanup.

Each exchange runs under a unique, namespaced key (one sequence per
exchange name and client, so the n-th call of a name gets the same key on
every process), waits at a barrier or a blocking get with a timeout whose
error names the processes that never arrived, and leaves keys that the
primary deletes, in the background, once every process has read them.
Collectives (collectives.py) builds its exchanges on this base.

Called by: Collectives' methods, on every process taking part.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from emergency_ckpt.cluster import jax_runtime
from emergency_ckpt.cluster.topology import Topology
from emergency_ckpt.errors import CollectiveTimeoutError, TopologyError

logger = logging.getLogger("emergency_ckpt")

# One sequence per exchange name and coordination-service client (one per
# process, or per simulated process in the scale benchmark): every process
# makes the same calls in the same order, so the n-th call of a name gets the
# same key everywhere, even across several managers in one process.
# Each entry keeps its client alive: an id() is unique only while its object
# lives, and a new client (a re-initialised jax.distributed, a test's fake)
# given a dead one's id must not continue that client's sequence.
_SEQUENCES: dict[tuple[int, str], tuple[Any, itertools.count]] = {}
_SEQ_LOCK = threading.Lock()


def _next_key(namespace: str, name: str, client: Any) -> str:
  with _SEQ_LOCK:
    _, counter = _SEQUENCES.setdefault(
      (id(client), f"{namespace}/{name}"), (client, itertools.count())
    )
    return f"emergency_ckpt/{namespace}/{name}/{next(counter)}"


class KeyDeleter:
  """The primary's deletions of finished exchanges' keys, on a thread of
  their own. Inline, each came right after a job-wide release, when every
  process's next call queues at the coordination service, so each deletion
  sat on the primary's way to the next exchange, which everyone then
  waited for. Deletion only frees the service's memory, so nothing waits
  for it; a failure is logged."""

  def __init__(self, client: Any, log_prefix: str):
    self._client = client
    self._log_prefix = log_prefix
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None

  def delete(self, keys: Sequence[str]) -> None:
    """Queues `keys` for deletion. Never blocks on the service.

    Args:
      keys: key folders ("<key>", deleted with everything under them).
    """
    if not keys:
      return
    with self._lock:
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name="ec-key-deleter", daemon=True)
        self._thread.start()
    for key in keys:
      self._queue.put(key)

  def wait(self, timeout_s: float | None = None) -> bool:
    """Waits until every deletion queued so far was tried (for tests).

    Args:
      timeout_s: the longest wait (None: no limit).

    Returns:
      True once they were tried; False if `timeout_s` passed first.
    """
    with self._lock:
      if self._thread is None:
        return True
    done = threading.Event()
    self._queue.put(done)
    return done.wait(timeout_s)

  def _run(self) -> None:
    while True:
      key = self._queue.get()
      if isinstance(key, threading.Event):
        key.set()
        continue
      try:
        self._client.key_value_delete(key)
      except Exception as e:  # noqa: BLE001 - leftover keys cost memory, not correctness
        logger.debug("%s keys %r not deleted: %s", self._log_prefix, key, e)


class Rendezvous:
  """One process's client binding and the waits, reads and cleanup that
  every exchange of Collectives shares. Single-process jobs need no
  coordination service (the client stays None)."""

  def __init__(self, topology: Topology, *, namespace: str, timeout_s: float, client: Any = None):
    """Binds this process to the coordination service.

    Args:
      topology: this process's Topology.
      namespace: the prefix of every key (one per manager and run).
      timeout_s: the default timeout of every wait.
      client: the coordination-service client (default: jax.distributed's;
        the scale benchmark passes simulated processes' own clients).

    Raises:
      TopologyError: a multi-process job without jax.distributed initialised.
    """
    self._topology = topology
    self._namespace = namespace
    self._timeout_s = timeout_s
    self._client = client
    self._finished: list[str] = []
    """Key folders of exchanges this process finished (see _passed_all)."""
    self._deleter: KeyDeleter | None = None  # the primary's, once it deletes
    if client is None and topology.process_count > 1:
      client = jax_runtime.distributed_client()
      if client is None:
        raise TopologyError(
          "this job has several processes but jax.distributed is not"
          " initialized; call jax.distributed.initialize() first."
        )
      self._client = client

  @property
  def topology(self) -> Topology:
    """This process's Topology."""
    return self._topology

  def _key(self, name: str) -> str:
    """The next key of exchange `name` (the same on every process)."""
    return _next_key(self._namespace, name, self._client)

  def _wait(
    self,
    name: str,
    key: str,
    barrier_id: str,
    procs: Sequence[int],
    arrivals: str,
    timeout_s: float | None,
  ) -> None:
    """Waits at barrier `barrier_id` of `procs`; on timeout raises the error
    naming those of `procs` that set no key under `arrivals`."""
    timeout_s = self._timeout_s if timeout_s is None else timeout_s
    every = len(procs) == self._topology.process_count
    try:
      self._client.wait_at_barrier(
        barrier_id, max(1, int(timeout_s * 1000)), None if every else list(procs)
      )
    except Exception:  # noqa: BLE001 - the client raises a generic error on timeout
      got = self._values(arrivals)
      missing = [p for p in procs if p not in got]
      raise self._timeout_error(name, timeout_s, missing, procs) from None
    if every:
      self._passed_all(key)
    elif key not in self._finished:
      self._finished.append(key)  # deleted after the next job-wide barrier

  def _passed_all(self, key: str) -> None:
    """Every process passed a job-wide barrier of exchange `key`, so every
    process finished reading the exchanges before it: the primary deletes
    their keys, in the background (KeyDeleter: one call per finished
    exchange)."""
    done = [k for k in self._finished if k != key]
    self._finished = [key]
    if self._topology.process_index != self._topology.primary_process or not done:
      return
    if self._deleter is None:
      self._deleter = KeyDeleter(self._client, self._topology.log_prefix())
    self._deleter.delete(done)

  def wait_deleted(self, timeout_s: float | None = None) -> bool:
    """Waits for the key deletions this process queued so far (the
    primary's; nothing to wait for elsewhere). For tests and benchmarks
    that count calls.

    Args:
      timeout_s: the longest wait (None: no limit).

    Returns:
      True once they were tried; False if `timeout_s` passed first.
    """
    return self._deleter is None or self._deleter.wait(timeout_s)

  def _values(self, folder: str) -> dict[int, str]:
    """{process: its raw value} under `folder` ("<key>/"), in one directory get."""
    out = {}
    for k, v in self._client.key_value_dir_get(folder):
      tail = k.rsplit("/", 1)[-1]
      if tail.isdigit():
        out[int(tail)] = v
    return out

  def _group(self, name: str, processes: Sequence[int] | None) -> list[int]:
    me = self._topology.process_index
    procs = list(range(self._topology.process_count)) if processes is None else sorted(processes)
    if me not in procs:
      raise ValueError(f"process {me} is not among processes {span(procs)} for exchange {name!r}")
    return procs

  def _tree_get(self, name: str, key: str, timeout_s: float | None) -> str:
    """Blocks on the job summary of gather_tree `key` (its values under
    "<key>/s/", slice summaries under "<key>/sum/", the job's at
    "<key>/job"); on timeout raises the error naming the processes that set
    no value (one directory get of every process's key, on this failure
    path only), or, if all came, the processes that were to summarise and
    did not."""
    timeout_s = self._timeout_s if timeout_s is None else timeout_s
    topo = self._topology
    got = self._get_or_name_missing(
      name, f"{key}/job", f"{key}/s/", range(topo.process_count), timeout_s
    )
    if got is not None:
      return got
    summed = self._values_or_none(f"{key}/sum/")  # {slice: its summary}
    unsummed = [i for i in range(topo.num_slices) if i not in summed]
    if unsummed:  # the last of those slices' processes to arrive stalled
      suspects = [p for i in unsummed for p in topo.slice_processes[i]]
      what = f"the summary of slices {span(unsummed)} (one of their processes)"
    else:  # every slice summarised: the one that completed the count stalled
      suspects = sorted(json.loads(v)["by"] for v in summed.values())
      what = "the job summary (the last of the slices' summarisers)"
    raise CollectiveTimeoutError(
      f"{topo.log_prefix()} exchange {name!r} timed out after {timeout_s:.0f}s:"
      f" every process arrived, but {what} was never published; one of processes"
      f" {span(suspects)} stalled or failed while summarising. Check their logs"
      " for an error, then restart the job."
    ) from None

  def _get_or_name_missing(
    self, name: str, key: str, arrivals: str, procs: Sequence[int], timeout_s: float
  ) -> str | None:
    """The value of `key` (one blocking get, up to `timeout_s`). On timeout
    raises the error naming those of `procs` that set no key under
    `arrivals` (one directory get, on this failure path only), or returns
    None if all of them came (the caller names who stalled)."""
    try:
      return self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except Exception:  # noqa: BLE001 - the client raises a generic error on timeout
      pass
    came = self._values_or_none(arrivals)
    missing = [p for p in procs if p not in came]
    if missing:
      raise self._timeout_error(name, timeout_s, missing, procs) from None
    return None

  def _values_or_none(self, folder: str) -> dict[int, str]:
    """_values, or {} when the service cannot answer (for error messages)."""
    try:
      return self._values(folder)
    except Exception:  # noqa: BLE001 - the service itself is gone
      return {}

  def _timeout_error(
    self, name: str, timeout_s: float, missing: Sequence[int], procs: Sequence[int]
  ) -> CollectiveTimeoutError:
    """The error of exchange `name` that waited `timeout_s` for `missing` of `procs`."""
    return CollectiveTimeoutError(
      f"{self._topology.log_prefix()} exchange {name!r} timed out after"
      f" {timeout_s:.0f}s waiting for processes {span(missing)} (of"
      f" {span(procs)}); they may be hung, stopped or dead. Check their"
      " logs, then restart the job; raise collective_timeout_s if they are"
      " only slow."
    )

  def _get(self, name: str, key: str, source: int, timeout_s: float | None) -> str:
    """The value of `key`, set (or to be set) by process `source`."""
    timeout_s = self._timeout_s if timeout_s is None else timeout_s
    try:
      return self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except Exception:  # noqa: BLE001 - the client raises a generic error on timeout
      raise CollectiveTimeoutError(
        f"{self._topology.log_prefix()} exchange {name!r} timed out after"
        f" {timeout_s:.0f}s waiting for process {source}; it may be hung,"
        " stopped or dead. Check its log, then restart the job; raise"
        " collective_timeout_s if it is only slow."
      ) from None


def span(procs: Sequence[int]) -> str:
  """A process list for a message, short even at thousands of processes.

  Args:
    procs: process indices.

  Returns:
    "[3, 7]", "0-4095", or the first 64 "and N more".
  """
  procs = list(procs)
  if len(procs) > 2 and procs == list(range(procs[0], procs[-1] + 1)):
    return f"{procs[0]}-{procs[-1]}"
  return f"{procs[:64]}" + (f" and {len(procs) - 64} more" if len(procs) > 64 else "")
