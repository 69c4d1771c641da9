"""One-shot signals and counters through the JAX coordination service:
hints that something worth looking at happened (a step committed, every
process wrote its state file), never a stand-in for the storage markers
that decide.

A flag or counter is one key under the job's namespace; raising or adding
costs one call, waiting blocks on a get (no polling delay) with a timeout.
Every failure is logged, not raised: storage still decides. Mixed into
Collectives (collectives.py), whose client, namespace and topology it uses.

Called by: any process (see each method); no barrier.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from emergency_ckpt.cluster.topology import Topology

logger = logging.getLogger("emergency_ckpt")


class Signals:
  """Signals and counters of one process; a mixin of Collectives."""

  _client: Any
  """The coordination-service client (None in a single-process job)."""
  _namespace: str
  _topology: Topology

  def _signal_key(self, name: str) -> str:
    return f"emergency_ckpt/{self._namespace}/signal/{name}"

  def signal(self, name: str) -> None:
    """Raises the one-shot flag `name` for every process of the job: a hint
    that something worth looking at happened (readers then check storage
    markers; a flag never stands in for one). Called by: one process. Blocks
    on one call to the coordination service; a failure is logged, not raised.
    A no-op in single-process jobs.

    Args:
      name: the flag's name (unique per event, e.g. per step).
    """
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
    Called by: the one process that owns them (the primary).

    Args:
      signal: the flag to delete, if any.
      count: the counter to delete (with its "reached" flag), if any.
    """
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
    is logged, not raised. A no-op in single-process jobs.

    Args:
      name: the counter's name (unique per event, e.g. per step).
      target: the count at which waiters are woken (None: never).
    """
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
    """Waits until counter `name` reaches `target`. Called by: one process.
    Reads the counter, then waits for its "reached" signal (raised by
    count(name, target) of the last process: no polling delay), reading
    the counter again every `poll_s` in case nobody raises it (counts
    without a target): one call, plus two per `poll_s` of waiting.

    Args:
      name: the counter's name.
      target: the count to wait for.
      timeout_s: the longest wait.
      poll_s: how often the counter is read again.

    Returns:
      True once it reached `target` (at once in single-process jobs:
      nobody counts there); False after `timeout_s`, or if the service
      cannot be read.
    """
    if self._client is None:
      return True
    key, never = self._count_key(name), threading.Event()
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        if self._client.key_value_increment(key, 0) >= target:
          # The last counter raises "reached" just after its increment: let
          # it land, so that the caller's forget() deletes it (else it
          # outlives the step in the coordination service).
          self.wait_signal(_reached(name), timeout_s=poll_s, stop=never, poll_s=poll_s)
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
    """Waits for signal(name) of any process (before or after this call).
    Called by: any process, from a background thread. Blocks up to
    `timeout_s`.

    Args:
      name: the flag's name.
      timeout_s: the longest wait.
      stop: ends the wait early once set (checked every `poll_s`).
      poll_s: the longest single blocking get.

    Returns:
      True once the flag is raised; False after `timeout_s` or once `stop`
      is set, and always in single-process jobs.
    """
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

  def _value_key(self, name: str) -> str:
    return f"emergency_ckpt/{self._namespace}/value/{name}"

  def flag_set(self, name: str) -> bool:
    """Whether signal(name) was raised, without waiting. Called by: any
    process. One call to the coordination service.

    Args:
      name: the flag's name.

    Returns:
      True if the flag is raised, and if the service cannot be read (a
      flag is a veto: when in doubt, assume it was raised); False if it is
      not, and always in single-process jobs.
    """
    if self._client is None:
      return False
    try:
      self._client.key_value_try_get(self._signal_key(name))
      return True
    except Exception as e:  # noqa: BLE001 - absent (NOT_FOUND), or the service is gone
      return "NOT_FOUND" not in str(e).upper().replace(" ", "_")

  def publish(self, name: str, value: str, *, overwrite: bool = False) -> None:
    """Sets the value `name` for every process of the job (e.g. a
    decision). Called by: one process. One call; a failure is logged, not
    raised (readers then time out and take their safe default). A no-op in
    single-process jobs.

    Args:
      name: the value's name (unique per event, unless `overwrite`).
      value: the value.
      overwrite: replace the value if `name` is set already (one writer
        that keeps a value current, e.g. the save cadence's head); else a
        second publish of `name` fails (logged).
    """
    if self._client is None:
      return
    try:
      if overwrite:
        self._client.key_value_set(self._value_key(name), value, allow_overwrite=True)
      else:
        self._client.key_value_set(self._value_key(name), value)
    except Exception as e:  # noqa: BLE001 - readers fall back after their timeout
      logger.warning("%s value %r not published: %s", self._topology.log_prefix(), name, e)

  def try_value(self, name: str) -> str | None:
    """The value publish(name, ...) set, without waiting. Called by: any
    process. One call to the coordination service.

    Args:
      name: the value's name.

    Returns:
      The value; None if it is not set (yet), if the service cannot be
      read, and always in single-process jobs.
    """
    if self._client is None:
      return None
    try:
      return self._client.key_value_try_get(self._value_key(name))
    except Exception:  # noqa: BLE001 - absent (NOT_FOUND), or the service is gone
      return None

  def wait_value(self, name: str, *, timeout_s: float) -> str | None:
    """The value publish(name, ...) set, waiting for it (before or after
    this call). Called by: any process, from a background thread. Blocks
    up to `timeout_s` on one call.

    Args:
      name: the value's name.
      timeout_s: the longest wait.

    Returns:
      The value; None after `timeout_s`, if the service is gone, and always
      in single-process jobs.
    """
    if self._client is None:
      return None
    try:
      return self._client.blocking_key_value_get(
        self._value_key(name), max(1, int(timeout_s * 1000))
      )
    except Exception:  # noqa: BLE001 - a timeout, or the service is going away
      return None

  def forget_value(self, name: str) -> None:
    """Deletes the value `name` once nobody reads it. Called by: the process
    that published it. One call; a failure is logged, not raised."""
    if self._client is None:
      return
    try:
      self._client.key_value_delete(self._value_key(name))
    except Exception as e:  # noqa: BLE001 - it only frees the service's memory
      logger.debug("%s value %r not deleted: %s", self._topology.log_prefix(), name, e)


def _reached(count: str) -> str:
  """The signal that counter `count` reached its target (count(), wait_count)."""
  return f"{count}.reached"
