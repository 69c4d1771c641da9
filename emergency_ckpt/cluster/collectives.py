"""Exchanges between processes through the JAX coordination service's
key-value store (no XLA, no device memory): all-gathers, two-level gathers,
sparse gathers, groupings, assignments, broadcasts and barriers.

Each runs under a unique, namespaced key and a timeout whose error names
the processes that never arrived (rendezvous.py: keys, waits, cleanup);
the one-shot signals and counters come from signals.py. Tests replace
`Collectives` to exercise pure logic.

Called by: the manager, the tiers and the restore planner, on every process
taking part in an exchange (see each method).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from emergency_ckpt.cluster.rendezvous import Rendezvous, span
from emergency_ckpt.cluster.signals import Signals
from emergency_ckpt.errors import CollectiveTimeoutError

logger = logging.getLogger("emergency_ckpt")

ASSIGN_THREADS = 16  # concurrent sets by the member that computes an assign's parts


class Collectives(Rendezvous, Signals):
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

  def sequenced(self, name: str) -> str:
    """`name` with a sequence number of its own: "<name>/<n>", where n counts
    this process's calls for `name` on this coordination service, so it is
    the same on every process that calls it in the same order (e.g. once per
    manager, at its construction) and a later manager of the same run never
    reads an earlier one's keys. Called by: every process. Blocks on
    nothing (no call to the service).

    Args:
      name: the keys' name.

    Returns:
      The sequenced name, to use with publish() / try_value().
    """
    return self._key(name).removeprefix(f"emergency_ckpt/{self._namespace}/")

  def exchange(
    self,
    name: str,
    payload: Any,
    *,
    processes: Sequence[int] | None = None,
    timeout_s: float | None = None,
  ) -> dict[int, Any]:
    """All-gathers one JSON value per process. Blocks until all arrive.

    Three calls per process, whatever the process count: set its own key,
    one barrier, one directory get. Called by: every process in `processes`.

    Args:
      name: the exchange's name (the same on every process, in order).
      payload: this process's JSON value.
      processes: who takes part (default: every process).
      timeout_s: the longest wait (default: the collectives' timeout).

    Returns:
      {process: its value} of every process taking part.

    Raises:
      CollectiveTimeoutError: naming the processes that did not arrive.
    """
    me = self._topology.process_index
    procs = self._group(name, processes)
    encoded = json.dumps(payload, sort_keys=True)
    if self._client is None or len(procs) == 1:
      return {me: json.loads(encoded)}
    key = self._key(name)
    self._client.key_value_set(f"{key}/{me}", encoded)
    self._wait(name, key, f"{key}/all", procs, f"{key}/", timeout_s)
    got = self._values(f"{key}/")
    return {p: json.loads(got[p]) for p in procs}

  def barrier(
    self, name: str, *, processes: Sequence[int] | None = None, timeout_s: float | None = None
  ) -> None:
    """Blocks until every process in `processes` arrives. Two calls per
    process. Called by: every process in `processes`.

    Args:
      name: the barrier's name; processes, timeout_s: as for exchange().

    Raises:
      CollectiveTimeoutError: naming the processes that did not arrive.
    """
    procs = self._group(name, processes)
    if self._client is None or len(procs) == 1:
      return
    key = self._key(name)
    self._client.key_value_set(f"{key}/a/{self._topology.process_index}", "")
    self._wait(name, key, f"{key}/all", procs, f"{key}/a/", timeout_s)

  def gather_sparse(self, name: str, payload: Any, *, timeout_s: float | None = None) -> dict:
    """Gathers the payloads that are not None (e.g. errors: normally none).
    Blocks until every process arrives. Called by: every process.

    Args:
      name, timeout_s: as for exchange().
      payload: this process's JSON value, or None to say nothing.

    Returns:
      {process: payload} of those that were not None, the same everywhere.

    Raises:
      CollectiveTimeoutError: naming the processes that did not arrive.
    """
    me = self._topology.process_index
    if self._client is None or self._topology.process_count == 1:
      return {} if payload is None else {me: json.loads(json.dumps(payload))}
    key = self._key(name)
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
    """A job-wide summary of one JSON value per process, in two levels.
    Nobody receives every process's value (O(N^2) bytes on the service), and
    nobody waits for anyone but the job summary: each process publishes its
    value and adds one to its slice's counter; the one that completes it
    (the slice's last to arrive) publishes the slice's summary and adds one
    to the job's counter; the one that completes that publishes the job
    summary, for which every other process blocks (one wave of wake-ups in
    all). Blocks until every process arrives. Called by: every process.

    Args:
      name, payload, timeout_s: as for exchange().
      per_slice: (slice, {process: value}) -> the slice's summary; pure
        (whichever process comes last runs it).
      combine: {slice: summary} -> the job summary; pure.

    Returns:
      combine's JSON value, the same on every process.

    Raises:
      CollectiveTimeoutError: naming the processes that never arrived, or
        those that stalled while summarising.
    """
    topo = self._topology
    me, s = topo.process_index, topo.slice_index
    encoded = json.dumps(payload, sort_keys=True)
    if self._client is None or topo.process_count == 1:
      return json.loads(json.dumps(combine({s: per_slice(s, {me: json.loads(encoded)})})))
    key = self._key(name)
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

  def group_by(
    self, name: str, label: str, value: Any, *, timeout_s: float | None = None
  ) -> dict[int, Any]:
    """Groups the processes by `label` (e.g. the machine they run on). Three
    calls per process; each receives only its own group. Called by: every
    process.

    Args:
      name, timeout_s: as for exchange().
      label: this process's group.
      value: this process's JSON value.

    Returns:
      {process: value} of the processes with the same label, this one included.

    Raises:
      CollectiveTimeoutError: naming the processes that did not arrive.
    """
    me = self._topology.process_index
    encoded = json.dumps(value, sort_keys=True)
    if self._client is None or self._topology.process_count == 1:
      return {me: json.loads(encoded)}
    key = self._key(name)
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
    (e.g. a slice): the function runs once, in the last member to arrive
    (it reads the values in one directory get and sets the others' parts),
    and each member receives only its part: O(P) bytes per group of P,
    where an all-gather costs P^2. Blocks until every member arrives.
    Called by: every process in `processes`.

    Args:
      name, payload, timeout_s: as for exchange().
      processes: the group.
      assign: {member: payload} -> {member: its JSON part}, pure.

    Returns:
      This process's part.

    Raises:
      CollectiveTimeoutError: naming the members that never arrived, or
        saying that the part was never published (the assigner stalled).
    """
    me = self._topology.process_index
    procs = self._group(name, processes)
    encoded = json.dumps(payload, sort_keys=True)
    if self._client is None or len(procs) == 1:
      return json.loads(json.dumps(assign({me: json.loads(encoded)})[me]))
    key = self._key(name)
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
      f" every process of {span(procs)} arrived, but this process's part was never"
      " published; the last of them to arrive stalled or failed while computing the"
      " parts. Check their logs for an error, then restart the job."
    ) from None

  def broadcast(self, name: str, value: Any, *, source: int, timeout_s: float | None = None) -> Any:
    """Gives every process one process's value. One call per process.
    Called by: every process.

    Args:
      name, timeout_s: as for exchange().
      value: the JSON value on `source` (others pass None).
      source: the process whose value is given.

    Returns:
      `source`'s value.

    Raises:
      CollectiveTimeoutError: `source` never published it.
    """
    me = self._topology.process_index
    encoded = json.dumps(value, sort_keys=True)
    if self._client is None or self._topology.process_count == 1:
      return json.loads(encoded)
    key = self._key(name)
    self._finished.append(key)
    if me == source:
      self._client.key_value_set(f"{key}/v", encoded)
      return json.loads(encoded)
    return json.loads(self._get(name, f"{key}/v", source, timeout_s))

  def exchange_some(
    self, name: str, payload: Any, *, wanted: Sequence[int], timeout_s: float | None = None
  ) -> dict[int, Any]:
    """The values of the `wanted` processes only. One call, plus one per
    wanted process, against one deadline. Called by: every process (the
    same name, in the same order; `wanted` differs).

    Args:
      name, timeout_s: as for exchange().
      payload: this process's JSON value, published unless None.
      wanted: the processes whose values this process needs (each must
        publish a payload that is not None).

    Returns:
      {process: value} of the `wanted` processes.

    Raises:
      CollectiveTimeoutError: naming the first that never published.
    """
    me = self._topology.process_index
    if self._client is None or self._topology.process_count == 1:
      return {me: json.loads(json.dumps(payload))} if me in wanted else {}
    key = self._key(name)
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
    """The values of the `wanted` keys, whoever publishes them. One call per
    key published and one per key wanted, against one deadline. Called by:
    every process (the same name, in the same order; payloads and wanted
    differ).

    Args:
      name, timeout_s: as for exchange().
      payloads: {key: JSON value} this process publishes (a key another
        process published first keeps that value: any publisher serves).
      wanted: the keys this process needs.

    Returns:
      {key: value} of the `wanted` keys.

    Raises:
      CollectiveTimeoutError: naming the first key nobody published.
    """
    if self._client is None or self._topology.process_count == 1:
      missing = [k for k in wanted if k not in payloads]
      if missing:
        raise CollectiveTimeoutError(
          f"{self._topology.log_prefix()} exchange {name!r}: nobody published {missing[0]!r}"
        )
      return {k: json.loads(json.dumps(payloads[k])) for k in wanted}
    key = self._key(name)
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
