"""A written step's redundancy: the partner copy or the XOR chunks, then its state file.

Runs on the redundancy lane of runtime/background.py. The step commits
once its copy is stored; if it was not and local.redundancy_required is
set, the state file is never written, so the step never commits, unless
it is a persistent step (the persistent tier holds it).
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

  def protect(
    self, step: int, data_state: dict | None, sums: ShardSums | None, persistent: bool
  ) -> None:
    """On the redundancy lane: sends the written step to the partner or
    the XOR group, then protected()."""
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
  ) -> None:
    """After the redundancy send of a written step: queues the state file;
    if the copy or parity was not stored (`error`) and redundancy is
    required, the state is never written, so the step never commits,
    unless it is a persistent step (the persistent tier holds it: it
    commits, its local copy unprotected)."""
    options = self._ctx.options
    scheme = options.local.redundancy
    if error is not None:
      self._commits.durable(step, scheme, None, f"{type(error).__name__}: {error}")
      if options.local.redundancy_required and not persistent:
        logger.error(
          "%s step %d will not commit: its %s copy was not stored (%s);"
          " local.redundancy_required=False lets steps commit without it",
          self._ctx.topology.log_prefix(),
          step,
          scheme,
          error,
        )
        if sums is not None:
          sums.let_go()
        return
    else:
      self._commits.durable(step, scheme, nbytes)
    self._commits.queue_state(step, data_state, sums, written=True)
