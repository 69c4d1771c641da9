"""Which persistent steps the primary slice uploads, so save() never waits for the bucket.

At most one upload is in flight per process. When a persistent step comes
while the last upload still runs (a hung, refusing or slow bucket), the step
is skipped: queueing it would grow host memory without bound, waiting for
the previous upload would stall training for as long as the bucket is sick.
The primary slice's processes must agree on every skip: Orbax's save of a
step is collective over them (its barriers), so a step that one process
uploads and another skips would hang the first in a barrier.

The slice's first process (the primary process) decides each step, and
nobody waits for the decision in save():

  every other process, from save(): if its own upload still runs, it
    raises the step's veto flag; then it adds one to the step's ready
    counter (one or two calls that never block, on a lane of their own:
    save() only queues them). If it can upload, its upload lane waits for
    the decision before it uploads or lets go of its snapshot.
  the primary process, from save(): if its own upload still runs, it
    decides "skip" at once (published from that lane); else its upload
    lane waits until every other process counted, reads the veto flag and
    publishes "go" or "skip".

A process that never counts (dead or hung) makes the decision "skip" after
`timeout_s`.

Once a step is admitted, each process prepares its part on its upload
lane (the arrays handed to Orbax, Orbax's manager opened) and then says
whether that worked (confirm()): a process that failed there and stayed
out of Orbax's save would hold the others in Orbax's barriers for Orbax's
own timeout (minutes), so the step goes on only where every process of the
slice is ready; the others record it as skipped. O(1) coordination calls
per process per persistent step.

Called by: the save pipeline, on every process of the primary slice (enter()
in save(), decide() on the upload lane).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from emergency_ckpt.cluster.context import JobContext

logger = logging.getLogger("emergency_ckpt")

GO, SKIP = "go", "skip"
FAILED = "persist_failed_{}"
"""The flag a process raises when its part of a step's upload failed (not a
barrier timeout): the others, timed out in Orbax's barrier, name it."""


@dataclasses.dataclass(frozen=True)
class Ticket:
  """One process's entry for one persistent step.

  Attributes:
    step: the persistent step.
    go: False when the step is skipped already (this process's own upload
      still runs, or the primary process decided at once); None while the
      decision is pending (decide() on the upload lane).
    why: for a skip, what the step waits on.
  """

  step: int
  go: bool | None
  why: str = ""


class UploadAdmission:
  """The agreement on which persistent steps the primary slice uploads."""

  def __init__(self, ctx: JobContext, *, on_failed: Callable[[int, str], None]):
    """Args:
    ctx: the job (collectives for the agreement; health and events for skips).
    on_failed: records a failed upload (step, error): the save_failed event.
    """
    self._ctx = ctx
    self._coll = ctx.collectives
    self._topology = ctx.topology
    self._timeout_s = ctx.options.collective_timeout_s
    self._on_failed = on_failed
    self._others = len(ctx.topology.slice_processes[0]) - 1
    self._decided: list[int] = []  # the primary's decided steps, oldest first
    self._skipping = False  # the last persistent step was skipped (one warning per run)

  @property
  def _deciding(self) -> bool:
    return self._topology.is_primary_process

  def enter(
    self,
    step: int,
    *,
    busy: str | None,
    defer: Callable[[Callable[[], None]], object] | None = None,
  ) -> Ticket:
    """Joins the decision of `step`. Its calls to the coordination service
    (one or two, never blocking) run inline, or through `defer`.

    Args:
      step: the persistent step being saved.
      busy: None if this process can start an upload now, else what its
        running upload is (e.g. "the upload of step 12, running for 8.1 s").
      defer: runs a task later, in order, off save() (the pipeline's
        admission lane); None runs the calls here.

    Returns:
      The ticket: go=False if the step is skipped already, else pending.
    """
    calls = self._calls(step, busy)
    if calls is not None:
      if defer is None:
        calls()
      else:
        defer(calls)
    if busy is None:
      return Ticket(step, None)
    if self._deciding:
      return Ticket(step, False, f"the previous upload still runs ({busy})")
    return Ticket(step, False, f"this process's previous upload still runs ({busy})")

  def _calls(self, step: int, busy: str | None) -> Callable[[], None] | None:
    """enter()'s calls to the coordination service, or None."""
    if self._deciding:
      if busy is None:
        return None
      return lambda: self._publish(step, SKIP, f"the previous upload still runs ({busy})")

    def join() -> None:
      if busy is not None:
        self._coll.signal(f"persist_veto_{step}")
      self._coll.count(f"persist_ready_{step}", self._others)

    return join

  def decide(self, ticket: Ticket) -> Ticket:
    """The decision on a pending ticket. Blocks on the slice's other
    processes (the primary process) or on the primary's decision (the
    others), at most `timeout_s`: call it on the upload lane.

    Args:
      ticket: a ticket from enter().

    Returns:
      The ticket decided: go=True if every process of the primary slice
      uploads the step, else go=False and why.
    """
    if ticket.go is not None:
      return ticket
    step = ticket.step
    if self._deciding:
      self._forget_old()
      counted = self._coll.wait_count(
        f"persist_ready_{step}", self._others, timeout_s=self._timeout_s
      )
      vetoed = counted and self._coll.flag_set(f"persist_veto_{step}")
      if not counted:
        why = (
          f"not every process of the primary slice joined its upload within"
          f" {self._timeout_s:.0f}s (one is hung, dead or far behind)"
        )
      elif vetoed:
        why = "another process of the primary slice is still uploading the previous step"
      else:
        why = ""
      self._publish(step, SKIP if why else GO, why)
      return Ticket(step, not why, why)
    got = self._coll.wait_value(f"persist_decision_{step}", timeout_s=self._timeout_s)
    if got is None:
      return Ticket(
        step, False, f"the primary process decided nothing within {self._timeout_s:.0f}s"
      )
    decision, _, why = got.partition(":")
    return Ticket(step, decision == GO, why or "the primary process skipped it")

  def confirm(self, step: int, error: str | None) -> bool:
    """After admit() said go, on the upload lane of every process of the
    primary slice: whether every one of them is ready to enter Orbax's save
    of `step`. Each says so (`error` None) or raises the step's veto (its
    preparation failed); a ready process then waits until all of them said
    it, at most `timeout_s`, and goes on only if nobody vetoed. A process
    that is not ready, or stops waiting, is recorded here: a skip on the
    ready ones (the failing one records its own failure). Two or three
    calls to the coordination service, and the wait.

    Args:
      step: the admitted persistent step.
      error: None if this process is ready, else what failed.

    Returns:
      True if this process enters Orbax's save of `step`.
    """
    everyone = self._others + 1
    if everyone == 1:
      return error is None
    veto, ready = f"persist_unready_{step}", f"persist_prepared_{step}"
    if error is not None:
      self._coll.signal(veto)  # before counting: whoever sees the count sees the veto
    self._coll.count(ready, everyone)
    if error is not None:
      return False
    if not self._coll.wait_count(ready, everyone, timeout_s=self._timeout_s):
      self._coll.signal(veto)  # a late process must not go in alone
      why = (
        f"not every process of the primary slice was ready to upload it within"
        f" {self._timeout_s:.0f}s (one is hung, dead or far behind)"
      )
    elif self._coll.flag_set(veto):
      why = "another process of the primary slice failed to prepare its part of the upload"
    else:
      return True
    self._ctx.health.forget("persistent", step)
    self.skipped(Ticket(step, False, why))
    return False

  def _publish(self, step: int, decision: str, why: str = "") -> None:
    """The primary's decision of `step`, for every process."""
    self._coll.publish(f"persist_decision_{step}", f"{decision}:{why}" if why else decision)
    self._decided.append(step)

  def _forget_old(self) -> None:
    """On the primary's upload lane, never in save(): deletes the keys of
    every step decided before the last two (each process read those
    decisions before the primary could decide again: its own upload, or
    its skip, came first)."""
    while len(self._decided) > 2:
      old = self._decided.pop(0)
      self._coll.forget(signal=f"persist_veto_{old}", count=f"persist_ready_{old}")
      self._coll.forget(signal=f"persist_unready_{old}", count=f"persist_prepared_{old}")
      self._coll.forget_value(f"persist_decision_{old}")
      self._coll.forget(signal=FAILED.format(old))

  # ---- bookkeeping: health, events, warnings ---------------------------------
  def admit(self, ticket: Ticket) -> bool:
    """decide() on the upload thread, recorded: True to upload (the upload
    is then in flight in health()); a skip is recorded as skipped()."""
    ticket = self.decide(ticket)
    if not ticket.go:
      self.skipped(ticket)
      return False
    self._ctx.health.begin("persistent", ticket.step, "upload")
    return True

  def skipped(self, ticket: Ticket) -> None:
    """Records a skipped persistent step: health, a save_skipped event, and
    one warning per run of skips (the next successful upload ends the run)."""
    self._ctx.health.skip("persistent", ticket.step)
    self._ctx.events.record(
      "save_skipped", step=ticket.step, tier="persistent", waiting_on=ticket.why
    )
    log = logger.info if self._skipping else logger.warning
    self._skipping = True
    log(
      "%s persistent step %d skipped: %s. Training goes on; the first persistent step after"
      " the upload ends is saved (health() lists the skipped steps).",
      self._topology.log_prefix(),
      ticket.step,
      ticket.why,
    )

  def uploaded(self, step: int, upload: concurrent.futures.Future) -> None:
    """The end of an upload thread's task: a failure is recorded (on_failed,
    a warning; wait_until_finished() raises it), a success ends a run of
    skips."""
    error = upload.exception()
    if error is not None:
      if not is_barrier_timeout(error):  # the others' barrier timeout then names it
        self._coll.signal(FAILED.format(step))
      self._on_failed(step, f"{type(error).__name__}: {error}")
      logger.warning(
        "%s persistent upload of step %d failed: %s. Training goes on; the next persistent"
        " step is tried again.",
        self._topology.log_prefix(),
        step,
        error,
      )
    elif upload.result():
      self._skipping = False
      # this process's part is written (the primary also records the step
      # durable once Orbax finalizes it)
      self._ctx.health.end("persistent", step)


def is_barrier_timeout(error: BaseException) -> bool:
  """Whether an upload's error is Orbax's barrier giving up (it raises an
  untyped error carrying the coordination service's DEADLINE_EXCEEDED)."""
  text = str(error)
  return isinstance(error, TimeoutError) or "DEADLINE" in text or "timed out" in text.lower()
