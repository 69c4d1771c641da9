"""Slices, process identity and collectives: the ONE module that touches them.

Slices come from the mesh's replica axis. Exchanges go through the JAX
coordination service's key-value store (no XLA, no device memory), each under a
unique, namespaced key, each with a timeout whose error names the processes
that never arrived. Tests replace `Collectives` to exercise pure logic.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from emergency_ckpt.core import reshard
from emergency_ckpt.errors import CollectiveTimeoutError, TopologyError

logger = logging.getLogger("emergency_ckpt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
  """Who this process is, and how processes group into slices."""

  process_index: int
  process_count: int
  slice_index: int
  slice_processes: tuple[tuple[int, ...], ...]
  """slice_processes[s] = sorted process indices of slice s."""
  replica_axis_index: int
  replica_axis_name: str
  mesh_shape: tuple[int, ...]
  mesh_axis_names: tuple[str, ...]
  slice_grid: tuple[int, ...] | None = None
  process_origin: tuple[int, ...] | None = None
  """process_origin[p]: the flat mesh index of process p's first device:
  where its data shard sits (a restart that moves processes across mesh
  coordinates maps each saved data state to the process now there)."""
  """The slice position of the process owning each device of this process's
  slice, row-major over the mesh without the replica axis (recorded with
  local copies, so another mesh can reshard them: reshard.py)."""

  @property
  def num_slices(self) -> int:
    return len(self.slice_processes)

  @property
  def is_primary_slice(self) -> bool:
    return self.slice_index == 0

  @property
  def primary_process(self) -> int:
    """The process that writes markers: the first process of slice 0."""
    return self.slice_processes[0][0]

  @property
  def is_primary_process(self) -> bool:
    return self.process_index == self.primary_process

  @functools.cached_property
  def slice_of(self) -> dict[int, int]:
    """{process: its slice} (built once, on first use)."""
    return {p: s for s, procs in enumerate(self.slice_processes) for p in procs}

  def fingerprint(self) -> dict[str, Any]:
    """What a local-tier step must match to be read back by this job (a
    fresh dict each call; its O(processes) lists are built once: every save
    records it)."""
    return dict(self._fingerprint)

  @functools.cached_property
  def _fingerprint(self) -> dict[str, Any]:
    return {
      "process_count": self.process_count,
      "slice_processes": [list(p) for p in self.slice_processes],
      "mesh_shape": list(self.mesh_shape),
      "mesh_axis_names": list(self.mesh_axis_names),
      "replica_axis": self.replica_axis_name,
      **({} if self.process_origin is None else {"process_origin": list(self.process_origin)}),
    }

  def log_prefix(self) -> str:
    return f"[process={self.process_index}][slice={self.slice_index}]"

  @property
  def slice_position(self) -> int:
    """This process's place among its slice's processes (0 = the first)."""
    return list(self.slice_processes[self.slice_index]).index(self.process_index)


def slice_shape(fingerprint: dict[str, Any]) -> tuple | None:
  """What one slice of a topology looks like (the mesh without its replica
  axis, the processes per slice), or None if the fingerprint is malformed.
  Two topologies with the same slice shape place the same shards on the
  process at the same slice position, whatever the slice count or the
  process indices: a local copy written by one serves the other."""
  try:
    names = list(fingerprint["mesh_axis_names"])
    replica = names.index(fingerprint["replica_axis"])
    shape = [int(d) for i, d in enumerate(fingerprint["mesh_shape"]) if i != replica]
    per_slice = sorted({len(p) for p in fingerprint["slice_processes"]})
    return (tuple(shape), tuple(n for i, n in enumerate(names) if i != replica), tuple(per_slice))
  except (KeyError, TypeError, ValueError):
    return None


def slice_position_of(fingerprint: dict[str, Any], process: int) -> int | None:
  """The slice position of `process` in a topology's fingerprint, or None."""
  for procs in fingerprint.get("slice_processes", []):
    if process in procs:
      return list(procs).index(process)
  return None


def resolve_replica_axis(mesh: jax.sharding.Mesh, replica_axis: str | int) -> int:
  names = tuple(mesh.axis_names)
  if isinstance(replica_axis, int):
    if not 0 <= replica_axis < len(names):
      raise TopologyError(
        f"replica_axis={replica_axis} is out of range for a mesh with axes"
        f" {names}; pass one of {list(names)} or an index below {len(names)}."
      )
    return replica_axis
  if replica_axis not in names:
    raise TopologyError(
      f"replica_axis={replica_axis!r} is not an axis of the mesh {names};"
      " set CheckpointManagerOptions(replica_axis=...) to the axis whose"
      " entries are slices (data-parallel replicas)."
    )
  return names.index(replica_axis)


def topology_from_mesh(mesh: jax.sharding.Mesh, replica_axis: str | int) -> Topology:
  """Splits processes into slices along the replica axis (pure given the mesh)."""
  axis = resolve_replica_axis(mesh, replica_axis)
  devices = np.asarray(mesh.devices)
  slices: list[tuple[int, ...]] = []
  owner: dict[int, int] = {}
  for s in range(devices.shape[axis]):
    procs = sorted({d.process_index for d in devices.take(s, axis=axis).flat})
    for p in procs:
      if p in owner:
        raise TopologyError(
          f"process {p} owns devices in slices {owner[p]} and {s} of replica"
          f" axis {mesh.axis_names[axis]!r}; every process must belong to"
          " exactly one slice. Put whole hosts on each replica-axis entry."
        )
      owner[p] = s
    slices.append(tuple(procs))
  me = jax.process_index()
  count = jax.process_count()
  origin: dict[int, int] = {}
  for flat, d in enumerate(devices.flat):
    origin.setdefault(int(d.process_index), flat)
  if sorted(owner) != list(range(count)):
    missing = sorted(set(range(count)) - set(owner))
    raise TopologyError(
      f"processes {missing} own no device of the mesh; the mesh must span every process of the job."
    )
  return Topology(
    process_index=me,
    process_count=count,
    slice_index=owner[me],
    slice_processes=tuple(slices),
    replica_axis_index=axis,
    replica_axis_name=str(mesh.axis_names[axis]),
    mesh_shape=tuple(devices.shape),
    mesh_axis_names=tuple(str(n) for n in mesh.axis_names),
    slice_grid=tuple(reshard.slice_grid(devices.take(owner[me], axis=axis), slices[owner[me]])),
    process_origin=tuple(origin[p] for p in range(count)),
  )


# One sequence per exchange name and coordination-service client (one per
# process, or per simulated process in the scale benchmark): every process
# makes the same calls in the same order, so the n-th call of a name gets the
# same key everywhere, even across several managers in one process.
# Each entry keeps its client alive: an id() is unique only while its object
# lives, and a new client (a re-initialised jax.distributed, a test's fake)
# given a dead one's id must not continue that client's sequence.
_SEQUENCES: dict[tuple[int, str], tuple[Any, itertools.count]] = {}
_SEQ_LOCK = threading.Lock()


ASSIGN_THREADS = 16  # concurrent sets by the member that computes an assign's parts


class _KeyDeleter:
  """The primary's deletions of finished exchanges' keys, on a thread of
  their own. Inline, each came right after a job-wide release, when every
  process's next call queues at the coordination service: 5-110 ms per
  deletion with 64 processes on 2 cores (traced in the scale benchmark's
  real job), on the primary's way to the next exchange, which everyone
  then waited for. Deletion only frees the service's memory, so nothing
  waits for it; a failure is logged."""

  def __init__(self, client: Any, log_prefix: str):
    self._client = client
    self._log_prefix = log_prefix
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None

  def delete(self, keys: Sequence[str]) -> None:
    """Queues `keys` (key folders) for deletion. Never blocks on the service."""
    if not keys:
      return
    with self._lock:
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name="ec-key-deleter", daemon=True)
        self._thread.start()
    for key in keys:
      self._queue.put(key)

  def wait(self, timeout_s: float | None = None) -> bool:
    """True once every deletion queued so far was tried (for tests)."""
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


def _next_key(namespace: str, name: str, client: Any) -> str:
  with _SEQ_LOCK:
    _, counter = _SEQUENCES.setdefault(
      (id(client), f"{namespace}/{name}"), (client, itertools.count())
    )
    return f"emergency_ckpt/{namespace}/{name}/{next(counter)}"


class Collectives:
  """Exchanges between processes, each with a timeout naming missing processes.

  Every method is called by every process in `processes` (default: all), in
  the same order. Single-process jobs need no coordination service.

  What each costs one process, in calls to the coordination service (N
  processes, S slices), and what it receives:
  - exchange: 3 calls; every process's value (N values: for small groups);
  - gather_tree: 3 calls (the last of a slice to arrive 6, the last of
    those 7); one job-wide summary (the last of a slice to arrive reads its
    slice's values, the last of those the S slice summaries);
  - gather_sparse: 3 calls (2 with nothing to say); only the values that
    were not None (e.g. errors);
  - exchange_some: 1 call + 1 per process wanted; those processes' values;
  - exchange_keyed: 1 call per key published + 1 per key wanted;
  - group_by: 3 calls; the values of the processes with the same label;
  - assign: 3 calls (the last of the group to arrive: 3 + one per other
    member); this process's part of a function of the group's values;
  - broadcast: 1 call; one value;
  - barrier: 2 calls; nothing.
  Keys of finished exchanges are deleted by the primary process after the
  next job-wide barrier or gather_tree (every process has read them by
  then): one call, on a thread of its own.
  """

  def __init__(self, topology: Topology, *, namespace: str, timeout_s: float, client: Any = None):
    """`client`: the coordination-service client (default: jax.distributed's;
    the scale benchmark passes simulated processes' own clients)."""
    self._topology = topology
    self._namespace = namespace
    self._timeout_s = timeout_s
    self._client = client
    self._finished: list[str] = []
    """Key folders of exchanges this process finished (see _passed_all)."""
    self._deleter: _KeyDeleter | None = None  # the primary's, once it deletes
    if client is None and topology.process_count > 1:
      client = jax._src.distributed.global_state.client  # noqa: SLF001
      if client is None:
        raise TopologyError(
          "this job has several processes but jax.distributed is not"
          " initialized; call jax.distributed.initialize() first."
        )
      self._client = client

  @property
  def topology(self) -> Topology:
    return self._topology

  def exchange(
    self,
    name: str,
    payload: Any,
    *,
    processes: Sequence[int] | None = None,
    timeout_s: float | None = None,
  ) -> dict[int, Any]:
    """All-gathers one JSON value per process. Blocks until all arrive.

    Three calls to the coordination service per process, whatever the
    process count: set its own key, one barrier, one directory get (before,
    one blocking get per process: N calls each, N^2 on the service).

    Called by: every process in `processes` (all by default).
    Raises CollectiveTimeoutError naming the processes that did not arrive.
    """
    me = self._topology.process_index
    procs = self._group(name, processes)
    encoded = json.dumps(payload, sort_keys=True)
    if self._client is None or len(procs) == 1:
      return {me: json.loads(encoded)}
    key = _next_key(self._namespace, name, self._client)
    self._client.key_value_set(f"{key}/{me}", encoded)
    self._wait(name, key, f"{key}/all", procs, f"{key}/", timeout_s)
    got = self._values(f"{key}/")
    return {p: json.loads(got[p]) for p in procs}

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
    their keys, in the background (_KeyDeleter: one call per finished
    exchange)."""
    done = [k for k in self._finished if k != key]
    self._finished = [key]
    if self._topology.process_index != self._topology.primary_process or not done:
      return
    if self._deleter is None:
      self._deleter = _KeyDeleter(self._client, self._topology.log_prefix())
    self._deleter.delete(done)

  def wait_deleted(self, timeout_s: float | None = None) -> bool:
    """True once the key deletions this process queued so far were tried
    (the primary's; at once elsewhere). For tests and benchmarks that count
    calls."""
    return self._deleter is None or self._deleter.wait(timeout_s)

  def _values(self, folder: str) -> dict[int, str]:
    """{process: its raw value} under `folder` ("<key>/"), in one directory get."""
    out = {}
    for k, v in self._client.key_value_dir_get(folder):
      tail = k.rsplit("/", 1)[-1]
      if tail.isdigit():
        out[int(tail)] = v
    return out

  def barrier(
    self, name: str, *, processes: Sequence[int] | None = None, timeout_s: float | None = None
  ) -> None:
    """Blocks until every process in `processes` (default: all) arrives. Two
    calls per process. Called by: every process in `processes`."""
    procs = self._group(name, processes)
    if self._client is None or len(procs) == 1:
      return
    key = _next_key(self._namespace, name, self._client)
    self._client.key_value_set(f"{key}/a/{self._topology.process_index}", "")
    self._wait(name, key, f"{key}/all", procs, f"{key}/a/", timeout_s)

  def _group(self, name: str, processes: Sequence[int] | None) -> list[int]:
    me = self._topology.process_index
    procs = list(range(self._topology.process_count)) if processes is None else sorted(processes)
    if me not in procs:
      raise ValueError(f"process {me} is not among processes {_span(procs)} for exchange {name!r}")
    return procs

  def gather_sparse(self, name: str, payload: Any, *, timeout_s: float | None = None) -> dict:
    """{process: payload} of the processes whose payload is not None (e.g.
    errors: normally none), the same on every process. Blocks until every
    process arrives. Called by: every process."""
    me = self._topology.process_index
    if self._client is None or self._topology.process_count == 1:
      return {} if payload is None else {me: json.loads(json.dumps(payload))}
    key = _next_key(self._namespace, name, self._client)
    if payload is not None:
      self._client.key_value_set(f"{key}/v/{me}", json.dumps(payload, sort_keys=True))
    self._client.key_value_set(f"{key}/a/{me}", "")
    self._wait(name, key, f"{key}/all", range(self._topology.process_count), f"{key}/a/", timeout_s)
    return {p: json.loads(v) for p, v in sorted(self._values(f"{key}/v/").items())}

  def gather_tree(
    self,
    name: str,
    payload: Any,
    *,
    per_slice: Callable[[int, dict[int, Any]], Any],
    combine: Callable[[dict[int, Any]], Any],
    timeout_s: float | None = None,
  ) -> Any:
    """A job-wide summary of one JSON value per process, in two levels: the
    slice's values are summarised by `per_slice(slice, {process: value})`,
    the S slice summaries by `combine({slice: summary})`, which every
    process returns. Nobody receives every process's value (what made
    exchanges O(N^2) bytes on the service), and nobody waits for anyone but
    the job summary: each process publishes its value and adds one to its
    slice's counter; the one that completes it (the slice's last to arrive)
    reads the slice's values, publishes their summary and adds one to the
    job's counter; the one that completes that reads the S summaries and
    publishes the job summary, for which every other process blocks (one
    wave of wake-ups in all; per_slice and combine must be pure functions,
    since whichever process comes last runs them). Blocks until every
    process arrives, up to `timeout_s`; the error names the processes that
    never arrived. Called by: every process."""
    topo = self._topology
    me, s = topo.process_index, topo.slice_index
    encoded = json.dumps(payload, sort_keys=True)
    if self._client is None or topo.process_count == 1:
      return json.loads(json.dumps(combine({s: per_slice(s, {me: json.loads(encoded)})})))
    key = _next_key(self._namespace, name, self._client)
    self._client.key_value_set(f"{key}/s/{s}/{me}", encoded)
    job = None
    if self._client.key_value_increment(f"{key}/n/{s}", 1) == len(topo.slice_processes[s]):
      values = {p: json.loads(v) for p, v in self._values(f"{key}/s/{s}/").items()}
      summary = {"by": me, "summary": per_slice(s, values)}
      self._client.key_value_set(f"{key}/sum/{s}", json.dumps(summary))
      if self._client.key_value_increment(f"{key}/n", 1) == topo.num_slices:
        summaries = {i: json.loads(v)["summary"] for i, v in self._values(f"{key}/sum/").items()}
        job = json.dumps(combine(summaries))
        self._client.key_value_set(f"{key}/job", job)
    if job is None:
      job = self._tree_get(name, key, timeout_s)
    # Every slice summary is in, so every process has come this far and
    # finished reading the exchanges before this one: the primary may
    # delete their keys (what a job-wide barrier does elsewhere).
    self._passed_all(key)
    return json.loads(job)

  def _tree_get(self, name: str, key: str, timeout_s: float | None) -> str:
    """Blocks on gather_tree `key`'s job summary; on timeout raises the
    error naming the processes that set no value (one directory get of
    every process's key, on this failure path only), or, if all came, the
    processes that were to summarise and did not."""
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
      what = f"the summary of slices {_span(unsummed)} (one of their processes)"
    else:  # every slice summarised: the one that completed the count stalled
      suspects = sorted(json.loads(v)["by"] for v in summed.values())
      what = "the job summary (the last of the slices' summarisers)"
    raise CollectiveTimeoutError(
      f"{topo.log_prefix()} exchange {name!r} timed out after {timeout_s:.0f}s:"
      f" every process arrived, but {what} was never published; one of processes"
      f" {_span(suspects)} stalled or failed while summarising. Check their logs"
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
      f" {timeout_s:.0f}s waiting for processes {_span(missing)} (of"
      f" {_span(procs)}); they may be hung, stopped or dead. Check their"
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

  def group_by(
    self, name: str, label: str, value: Any, *, timeout_s: float | None = None
  ) -> dict[int, Any]:
    """{process: value} of the processes that passed the same `label` (e.g.
    the machine they run on), this one included. Three calls per process;
    each receives only its own group. Called by: every process."""
    me = self._topology.process_index
    encoded = json.dumps(value, sort_keys=True)
    if self._client is None or self._topology.process_count == 1:
      return {me: json.loads(encoded)}
    key = _next_key(self._namespace, name, self._client)
    group = hashlib.sha256(label.encode()).hexdigest()[:32]
    self._client.key_value_set(f"{key}/{group}/{me}", encoded)
    self._wait(name, key, f"{key}/all", range(self._topology.process_count), f"{key}/", timeout_s)
    return {p: json.loads(v) for p, v in sorted(self._values(f"{key}/{group}/").items())}

  def assign(
    self,
    name: str,
    payload: Any,
    *,
    processes: Sequence[int],
    assign: Callable[[dict[int, Any]], dict[int, Any]],
    timeout_s: float | None = None,
  ) -> Any:
    """This process's part of `assign({process: payload})` over `processes`
    (e.g. a slice): the function that needs every member's value runs once,
    in the last member to arrive, and each member receives only its part
    (where an all-gather gives every member every value: P^2 on the service
    per group of P). Each member sets its value and adds one to the group's
    counter, then blocks on its part (3 calls); the one that completes the
    count reads the values in one directory get and sets the others' parts
    (3 + P - 1 calls; O(P) bytes in all). `assign` must be a pure function
    returning a JSON value for every member. Blocks until every member
    arrives, up to `timeout_s`; the error names those that never did.
    Called by: every process in `processes`."""
    me = self._topology.process_index
    procs = self._group(name, processes)
    encoded = json.dumps(payload, sort_keys=True)
    if self._client is None or len(procs) == 1:
      return json.loads(json.dumps(assign({me: json.loads(encoded)})[me]))
    key = _next_key(self._namespace, name, self._client)
    self._finished.append(key)  # deleted after the next job-wide barrier
    self._client.key_value_set(f"{key}/v/{me}", encoded)
    if self._client.key_value_increment(f"{key}/n", 1) == len(procs):
      values = {p: json.loads(v) for p, v in self._values(f"{key}/v/").items()}
      parts = {p: json.dumps(part, sort_keys=True) for p, part in assign(values).items()}
      others = [p for p in procs if p != me]
      # The sets are independent: ASSIGN_THREADS at a time (the client
      # releases the GIL while a call waits on the service).
      with concurrent.futures.ThreadPoolExecutor(min(ASSIGN_THREADS, len(others))) as pool:
        list(pool.map(lambda p: self._client.key_value_set(f"{key}/r/{p}", parts[p]), others))
      return json.loads(parts[me])
    timeout_s = self._timeout_s if timeout_s is None else timeout_s
    got = self._get_or_name_missing(name, f"{key}/r/{me}", f"{key}/v/", procs, timeout_s)
    if got is not None:
      return json.loads(got)
    raise CollectiveTimeoutError(
      f"{self._topology.log_prefix()} exchange {name!r} timed out after {timeout_s:.0f}s:"
      f" every process of {_span(procs)} arrived, but this process's part was never"
      " published; the last of them to arrive stalled or failed while computing the"
      " parts. Check their logs for an error, then restart the job."
    ) from None

  def broadcast(self, name: str, value: Any, *, source: int, timeout_s: float | None = None) -> Any:
    """`value` of process `source` (others pass None), given to every process.
    One call per process. Called by: every process."""
    me = self._topology.process_index
    encoded = json.dumps(value, sort_keys=True)
    if self._client is None or self._topology.process_count == 1:
      return json.loads(encoded)
    key = _next_key(self._namespace, name, self._client)
    self._finished.append(key)
    if me == source:
      self._client.key_value_set(f"{key}/v", encoded)
      return json.loads(encoded)
    return json.loads(self._get(name, f"{key}/v", source, timeout_s))

  def exchange_some(
    self, name: str, payload: Any, *, wanted: Sequence[int], timeout_s: float | None = None
  ) -> dict[int, Any]:
    """{process: value} of the `wanted` processes (each must publish one: a
    payload that is not None); this process publishes `payload` unless None.
    One call, plus one per wanted process, against one deadline; raises
    CollectiveTimeoutError naming the first that never published. Called
    by: every process (the same name, in the same order; `wanted` differs)."""
    me = self._topology.process_index
    if self._client is None or self._topology.process_count == 1:
      return {me: json.loads(json.dumps(payload))} if me in wanted else {}
    key = _next_key(self._namespace, name, self._client)
    self._finished.append(key)
    if payload is not None:
      self._client.key_value_set(f"{key}/{me}", json.dumps(payload, sort_keys=True))
    timeout_s = self._timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    out = {}
    for p in sorted(set(wanted)):
      left = max(0.001, deadline - time.monotonic())
      out[p] = json.loads(self._get(name, f"{key}/{p}", p, left))
    return out

  def exchange_keyed(
    self,
    name: str,
    payloads: dict[str, Any],
    *,
    wanted: Sequence[str],
    timeout_s: float | None = None,
  ) -> dict[str, Any]:
    """{key: value} of the `wanted` keys, whoever publishes them: this
    process publishes `payloads` (a key another process published first
    keeps that value: any publisher serves). One call per key published and
    one per key wanted, against one deadline; raises CollectiveTimeoutError
    naming the first key nobody published. Called by: every process (the
    same name, in the same order; payloads and wanted differ)."""
    if self._client is None or self._topology.process_count == 1:
      missing = [k for k in wanted if k not in payloads]
      if missing:
        raise CollectiveTimeoutError(
          f"{self._topology.log_prefix()} exchange {name!r}: nobody published {missing[0]!r}"
        )
      return {k: json.loads(json.dumps(payloads[k])) for k in wanted}
    key = _next_key(self._namespace, name, self._client)
    self._finished.append(key)
    for k, v in payloads.items():
      try:
        self._client.key_value_set(f"{key}/{k}", json.dumps(v, sort_keys=True))
      except Exception:  # noqa: BLE001 - already published by another process: it serves
        logger.debug("%s %s/%s already published", self._topology.log_prefix(), name, k)
    timeout_s = self._timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    out = {}
    for k in sorted(set(wanted)):
      left = max(0.001, deadline - time.monotonic())
      try:
        out[k] = json.loads(self._client.blocking_key_value_get(f"{key}/{k}", int(left * 1000)))
      except Exception:  # noqa: BLE001 - the client raises a generic error on timeout
        raise CollectiveTimeoutError(
          f"{self._topology.log_prefix()} exchange {name!r} timed out after"
          f" {timeout_s:.0f}s: nobody published {k!r}; its holder may be hung,"
          " stopped or dead. Check the logs, then restart the job."
        ) from None
    return out

  def _signal_key(self, name: str) -> str:
    return f"emergency_ckpt/{self._namespace}/signal/{name}"

  def signal(self, name: str) -> None:
    """Raises the one-shot flag `name` for every process of the job: a hint
    that something worth looking at happened (readers then check storage
    markers; a flag never stands in for one). Called by: one process. Blocks
    on one call to the coordination service; a failure is logged, not raised.
    A no-op in single-process jobs."""
    if self._client is None:
      return
    try:
      self._client.key_value_set(self._signal_key(name), "1")
    except Exception as e:  # noqa: BLE001 - already raised, or the service is gone
      logger.debug("%s signal %r not set: %s", self._topology.log_prefix(), name, e)

  def forget(self, *, signal: str | None = None, count: str | None = None) -> None:
    """Deletes signal `signal` and/or counter `count` from the coordination
    service (one call per key), once nobody needs them: per-step hints would
    otherwise pile up for the whole job. A failure is logged, not raised.
    Called by: the one process that owns them (the primary)."""
    if self._client is None:
      return
    for key in (
      self._signal_key(signal) if signal else None,
      self._count_key(count) if count else None,
      self._signal_key(_reached(count)) if count else None,
    ):
      if key is None:
        continue
      try:
        self._client.key_value_delete(key)
      except Exception as e:  # noqa: BLE001 - leftover keys cost memory, not correctness
        logger.debug("%s %r not deleted: %s", self._topology.log_prefix(), key, e)

  def _count_key(self, name: str) -> str:
    return f"emergency_ckpt/{self._namespace}/count/{name}"

  def count(self, name: str, target: int | None = None) -> None:
    """Adds one to the job-wide counter `name`: a hint, like signal() (e.g.
    "my state file of step N is written"; readers still check storage).
    The process whose addition makes it `target` also raises the counter's
    "reached" signal, which wakes wait_count at once. Called by: any process.
    One call to the coordination service (two for that last one); a failure
    is logged, not raised. A no-op in single-process jobs."""
    if self._client is None:
      return
    try:
      reached = self._client.key_value_increment(self._count_key(name), 1) == target
    except Exception as e:  # noqa: BLE001 - the service is gone: storage still decides
      logger.debug("%s count %r not raised: %s", self._topology.log_prefix(), name, e)
      return
    if reached:
      self.signal(_reached(name))

  def wait_count(self, name: str, target: int, *, timeout_s: float, poll_s: float = 0.5) -> bool:
    """True once counter `name` reached `target` (at once in single-process
    jobs: nobody counts there); False after `timeout_s`. Called by: one
    process. Reads the counter, then waits for its "reached" signal (raised
    by count(name, target) of the last process: no polling delay), reading
    the counter again every `poll_s` in case nobody raises it (counts
    without a target): one call, plus two per `poll_s` of waiting."""
    if self._client is None:
      return True
    key, never = self._count_key(name), threading.Event()
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        if self._client.key_value_increment(key, 0) >= target:
          return True
      except Exception as e:  # noqa: BLE001 - the service is gone: storage decides
        logger.debug("%s count %r unreadable: %s", self._topology.log_prefix(), name, e)
        return False
      left = deadline - time.monotonic()
      if left <= 0:
        return False
      wait = min(left, poll_s)
      if self.wait_signal(_reached(name), timeout_s=wait, stop=never, poll_s=wait):
        return True

  def wait_signal(
    self, name: str, *, timeout_s: float, stop: threading.Event, poll_s: float = 1.0
  ) -> bool:
    """True once signal(name) was called by any process (before or after
    this call); False after `timeout_s` or once `stop` is set (checked every
    `poll_s`). Called by: any process, from a background thread. Blocks up
    to `timeout_s`. Always False in single-process jobs."""
    if self._client is None:
      return False
    key = self._signal_key(name)
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
      left = deadline - time.monotonic()
      if left <= 0:
        return False
      t0 = time.monotonic()
      wait_s = min(left, poll_s)
      try:
        self._client.blocking_key_value_get(key, max(1, int(wait_s * 1000)))
        return True
      except Exception:  # noqa: BLE001 - a timeout, or the service is going away
        if time.monotonic() - t0 < wait_s / 2:  # failed at once: do not spin
          stop.wait(wait_s)
    return False


def _reached(count: str) -> str:
  """The signal that counter `count` reached its target (count(), wait_count)."""
  return f"{count}.reached"


def _span(procs: Sequence[int]) -> str:
  """A process list for a message, short even at thousands of processes:
  "[3, 7]", "0-4095" or the first 64 "and N more"."""
  procs = list(procs)
  if len(procs) > 2 and procs == list(range(procs[0], procs[-1] + 1)):
    return f"{procs[0]}-{procs[-1]}"
  return f"{procs[:64]}" + (f" and {len(procs) - 64} more" if len(procs) > 64 else "")


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


_ORBAX_INIT_LOCK = threading.Lock()


def reached_preemption(step: int) -> bool:
  """True on every process at the same step once any process got a
  preemption notice (SIGTERM), through JAX's preemption sync service. Called
  by: every process, at every step (the service agrees on the step after the
  largest one any process had reached). False in a single-process job."""
  from jax.experimental import multihost_utils  # noqa: PLC0415

  try:
    return bool(multihost_utils.reached_preemption_sync_point(step))
  except RuntimeError:  # the service is disabled (jax_enable_preemption_service=False)
    return False


def peer_host(override: str | None) -> str | None:
  """The address peer slices reach this process at: `override`, else the
  address of the interface that routes to the JAX coordinator (a UDP
  "connect" sends nothing), else None. Called by: any process."""
  if override:
    return override
  coordinator = getattr(jax._src.distributed.global_state, "coordinator_address", None)  # noqa: SLF001
  if not coordinator:
    return "127.0.0.1"  # a single-process job: nobody else to serve
  host = coordinator.rsplit(":", 1)[0].strip("[]")
  try:
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
      s.connect(addr)
      return s.getsockname()[0]
  except OSError as e:
    logger.warning("cannot find the address that routes to %s (%s); set peer.host", host, e)
    return None


def host_identity(override: str | None = None) -> str:
  """The machine this process runs on: `override`, else the kernel's boot id
  (shared by every process and container on one machine, whatever their
  hostnames; new at each boot), else the hostname. Called by: any process."""
  if override:
    return override
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot_id = f.read().strip()
    if boot_id:
      return f"boot:{boot_id}"  # whole: thousands of hosts must not collide
  except OSError:
    pass
  return socket.gethostname()


def job_key() -> str | None:
  """A short id shared by the processes of this job and no other (a digest
  of the coordinator's address and the process count), or None in a
  single-process job. Called by: any process."""
  coordinator = getattr(jax._src.distributed.global_state, "coordinator_address", None)  # noqa: SLF001
  if not coordinator or jax.process_count() == 1:
    return None
  raw = f"{coordinator}/{jax.process_count()}".encode()
  return hashlib.sha256(raw).hexdigest()[:16]
