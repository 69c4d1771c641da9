"""A written step's redundancy: the partner copy or the XOR chunks, then its state file.

Runs on the redundancy lane of runtime/background.py. The step commits
once its copy is stored; if it was not and local.redundancy_required is
set, the process's state file is never written and the commit is told
so (Commits.queue_state(unsaved=...)), so the step never commits, unless
it is a persistent step (the persistent tier holds it).

A slow or stopped peer never builds a queue: when a step's send is about
to begin while a newer step already waits behind it on the lane, the older
step is skipped (a warning, a save_skipped event, health's skipped steps),
exactly as a redundancy failure: the newest step is the one worth
protecting, and commits never lag the saves by more than the send in
flight.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from emergency_ckpt.errors import PeerTransferError

if TYPE_CHECKING:
  from emergency_ckpt.cluster.context import JobContext
  from emergency_ckpt.runtime.staging import HostSnapshot
  from emergency_ckpt.save.commit import Commits, ShardSums
  from emergency_ckpt.save.tiers import LocalWriter, RedundancyLink

logger = logging.getLogger("emergency_ckpt")


class EarlyHold:
  """The snapshot an overlapped redundancy send reads, held for it only
  while the send may still use it: once the local write is done, a send
  that has not started yet lets go of it (and later sends the written step
  from the ramdisk instead), so a slow or stopped peer, which keeps the
  redundancy lane busy, never holds the staging buffers the next save()
  needs.

  Args:
    release: lets go of the snapshot (idempotent).
  """

  def __init__(self, release: Callable[[], None]):
    self._release = release
    self._lock = threading.Lock()
    self._state = "waiting"  # then "sending" (start) or "released" (write_done)

  def start(self) -> bool:
    """The send begins: True if it may read the snapshot (held until it is sent)."""
    with self._lock:
      if self._state == "waiting":
        self._state = "sending"
      return self._state == "sending"

  def write_done(self) -> None:
    """The local write ended: lets go unless the send already began."""
    with self._lock:
      if self._state != "waiting":
        return
      self._state = "released"
    self._release()

  def __call__(self) -> None:
    """The send is done with the bytes (or never began)."""
    self._release()


class _Skipped(Exception):
  """Why a step's send was skipped (handled as a send that failed)."""


class Protection:
  """Sends written steps to their partner or XOR group, then queues their state.

  Args:
    ctx: the job.
    commits: where each step's state file is queued and its tiers recorded.
    local: this process's local tier.
    redundancy: the partner or XOR link.
  """

  def __init__(
    self,
    ctx: JobContext,
    *,
    commits: Commits,
    local: LocalWriter,
    redundancy: RedundancyLink | None,
  ):
    self._ctx = ctx
    self._commits = commits
    self._local = local
    self._redundancy = redundancy
    self._lock = threading.Lock()
    self._queued: set[int] = set()  # steps whose send is on the lane, not begun
    # A send waits behind at most this many newer steps: local retention
    # keeps max_to_keep + 1 uncommitted steps, so an older one could be
    # deleted before its turn (and its commit would only come late).
    self._backlog = ctx.options.local.max_to_keep  # an integer >= 1
    self._skipping = False  # the last send was skipped (one warning per run of skips)

  def queued(self, step: int) -> None:
    """Notes that `step`'s send was put on the redundancy lane (before it
    is submitted): an older step's send that has not begun is skipped once
    local.max_to_keep newer steps wait behind it. Called by: the save
    pipeline."""
    with self._lock:
      self._queued.add(step)

  def _superseded(self, step: int) -> int | None:
    """The newest step queued behind `step`'s send if enough newer steps
    wait that `step` is skipped, else None (send it); `step`'s send begins
    (or is skipped) now."""
    with self._lock:
      self._queued.discard(step)
      newer = sorted(s for s in self._queued if s > step)
    if len(newer) >= self._backlog:
      return newer[-1]
    if self._skipping:
      self._skipping = False
      logger.info(
        "%s %s copies go again from step %d",
        self._ctx.topology.log_prefix(),
        self._ctx.options.local.redundancy,
        step,
      )
    return None

  def _skip(
    self,
    step: int,
    newer: int,
    written: bool,
    data_state: dict | None,
    sums: ShardSums | None,
    persistent: bool,
  ) -> None:
    """`step`'s send is skipped for `newer`'s: recorded, then handled as a
    send that failed (protected())."""
    scheme = self._ctx.options.local.redundancy
    why = (
      f"{self._backlog} newer step(s), up to step {newer}, were saved before this"
      f" step's {scheme} copy could begin"
    )
    log = logger.info if self._skipping else logger.warning
    self._skipping = True
    log(
      "%s %s copy of step %d skipped: %s (a slow or stopped peer; the newest step goes next)",
      self._ctx.topology.log_prefix(),
      scheme,
      step,
      why,
    )
    self._ctx.health.skip(scheme, step)
    self._ctx.events.record("save_skipped", step=step, tier=scheme, waiting_on=why)
    if not written:  # as after a failed write: the state says the save ended
      self._commits.queue_state(step, data_state, sums)
      return
    try:
      self._redundancy.send_failed(step, why)  # an XOR group stops waiting for it
    except (OSError, PeerTransferError) as e:
      logger.debug("%s send_failed(%d): %s", self._ctx.topology.log_prefix(), step, e)
    self.protected(step, None, _Skipped(why), data_state, sums, persistent, skipped=True)

  def protect(
    self, step: int, data_state: dict | None, sums: ShardSums | None, persistent: bool
  ) -> None:
    """On the redundancy lane: sends the written step to the partner or
    the XOR group, then protected(); skipped if a newer step waits."""
    newer = self._superseded(step)
    if newer is not None:
      self._skip(step, newer, True, data_state, sums, persistent)
      return
    nbytes, error = None, None
    try:
      nbytes, _ = self._redundancy.send(self._local.step_dir(step))
    except (OSError, PeerTransferError) as e:
      error = e
    self.protected(step, nbytes, error, data_state, sums, persistent)

  def protect_early(
    self,
    snapshot: HostSnapshot,
    hold: EarlyHold,
    write: concurrent.futures.Future,
    data_state: dict | None,
    sums: ShardSums | None,
    persistent: bool,
  ) -> None:
    """On the redundancy lane, beside the local write `write` of `snapshot`
    (held by `hold` until its bytes are sent; if the write ended before
    this send began, the written step is sent instead: protect()): sends the partner copy or
    the XOR chunks from the snapshot, each followed by the manifest once
    the write is done; then, as after a write (SavePipeline._after_local), the state
    file: not if the write raised, unprotected if it failed, else
    protected()."""
    step = snapshot.step
    newer = self._superseded(step)
    if newer is not None:  # a newer step waits: let go, skip this one
      hold()
      try:
        result = write.result()
      except Exception:  # noqa: BLE001 - raised (and reported) by the write's own future
        return
      self._skip(step, newer, result.ok, data_state, sums, persistent)
      return
    if not hold.start():  # the write ended first and let go: send the written step
      try:
        result = write.result()
      except Exception:  # noqa: BLE001 - raised (and reported) by the write's own future
        return
      if not result.ok:
        self._commits.queue_state(step, data_state, sums)
        return
      self.protect(step, data_state, sums, persistent)
      return

    def manifest() -> bytes:  # the senders' trailer: waits for the write
      result = write.result()
      if not result.ok:
        raise OSError(f"the local write failed: {result.error}")
      return result.manifest  # read right after the write: the step may be gone by now

    nbytes, error = None, None
    try:
      snapshot.wait_filled()
      snapshot.wait_others_staged()
      data = snapshot.buffer[: snapshot.layout.nbytes]
      spans = [(s.offset, s.nbytes) for leaf in snapshot.layout.leaves for s in leaf.slots]
      nbytes, _ = self._redundancy.send_snapshot(step, data, spans, manifest, hold)
    except (OSError, PeerTransferError) as e:
      error = e
    finally:
      hold()
    try:
      result = write.result()
    except Exception:  # noqa: BLE001 - raised (and reported) by the write's own future
      return
    if not result.ok:  # as SavePipeline._after_local: the state still says the save ended
      self._commits.queue_state(step, data_state, sums)
      return
    self.protected(step, nbytes, error, data_state, sums, persistent)

  def protected(
    self,
    step: int,
    nbytes: int | None,
    error: Exception | None,
    data_state: dict | None,
    sums: ShardSums | None,
    persistent: bool,
    *,
    skipped: bool = False,
  ) -> None:
    """After the redundancy send of a written step: queues the state file;
    if the copy or parity was not stored (`error`) and redundancy is
    required, the state is never written (the commit is told, so it does
    not wait for it), so the step never commits, unless it is a persistent
    step (the persistent tier holds it: it commits, its local copy
    unprotected). `skipped`: the send never began (health counts it as
    skipped, not failed)."""
    options = self._ctx.options
    scheme = options.local.redundancy
    if error is not None:
      why = f"{type(error).__name__}: {error}"
      if not skipped:  # a skip is health's skipped step, not a failure
        self._commits.durable(step, scheme, None, why)
      if options.local.redundancy_required and not persistent:
        (logger.info if skipped else logger.error)(
          "%s step %d will not commit: its %s copy was not stored (%s);"
          " local.redundancy_required=False lets steps commit without it",
          self._ctx.topology.log_prefix(),
          step,
          scheme,
          error,
        )
        self._commits.queue_state(step, data_state, sums, unsaved=f"its {scheme} copy: {why}")
        return
    else:
      self._commits.durable(step, scheme, nbytes)
    self._commits.queue_state(step, data_state, sums, written=True, persistent=persistent)
