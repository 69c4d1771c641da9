"""Applies the retention rules to this process's tiers, in the background.

The plans (which steps to keep) are pure (rules.py, plans.py, shared with
`emergency-ckpt gc`); this module lists the tiers, asks the rules, and
deletes. When it runs:
- local: after each local write of this process, and again when a commit
  may free a step (the primary signals each commit through the coordination
  service: a hint only, the markers in storage decide);
- state store and persistent tier: on the primary process, after a commit
  and after a persistent step is finalized.

Called by: the manager's background lanes ("retention", "commit-watch").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

from emergency_ckpt.core.records import StepRecords
from emergency_ckpt.retention import plans
from emergency_ckpt.retention.claims import CommitClaims
from emergency_ckpt.retention.commit_reads import CommitReads
from emergency_ckpt.retention.rules import Rules
from emergency_ckpt.runtime.background import Background

logger = logging.getLogger("emergency_ckpt")


FINAL_COMMIT_WAIT_S = 5.0
"""How long a clean close waits for the commit of the newest step this
process wrote before its last local retention pass (Retainer.finish)."""


class Retainer:
  """Retention of one process's local copies (every process) and of the
  state store and persistent tier (the primary process).

  Args:
    options: the manager's options (each tier's rules, best_metric).
    topology: this job's slices and processes.
    local: this process's local tier.
    persistent: the persistent tier.
    state: the state store.
    collectives: the commit signals between processes.
    records: the metrics of this process's saves.
    background: the manager's background lanes.
  """

  def __init__(
    self,
    options,
    *,
    topology,
    local,
    persistent,
    state,
    collectives,
    records,
    background: Background,
  ):
    self._options = options
    self._topology = topology
    self._local = local
    self._persistent = persistent
    self._state = state
    self._collectives = collectives
    self._records: StepRecords = records
    self._background = background
    self._lock = threading.Lock()
    self._watch_stop: threading.Event | None = None  # the newest watch's; set = give up
    self._signalled: int | None = None  # the newest committed_<step> signal raised
    self._closed = False
    self._written: int | None = None  # the newest step written, for the queued pass
    self._pass_queued = False
    # uncommitted local steps: the state lane's claims against this retention's drops
    self.claims = CommitClaims()
    # which steps committed, never waiting on a hung state store (commit_reads.py)
    self.commits = CommitReads(state.has_commit, log_prefix=topology.log_prefix())
    self._uploads: Callable[[int | None], Collection[int]] | None = None

  def follow_uploads(self, steps: Callable[[int | None], Collection[int]]) -> None:
    """Where the manager's cadence decides the saves (an interval "auto" or
    in seconds): `steps(newer_than)` names the steps it sent to the
    persistent tier newer than a step, forced ones too
    (Cadence.persistent_steps); the state store keeps their state while
    their upload may be in flight (with a chosen persistent interval,
    exactly theirs). Called by: the manager's parts, once, before the
    first save."""
    self._uploads = steps

  def _uploading(self, newest: int | None) -> tuple[int | None, Collection[int]]:
    """The persistent steps whose upload may be in flight, as state_plan
    takes them: (the fixed interval, the steps named by follow_uploads)
    newer than `newest`, the newest finalized step. A chosen interval that
    nobody names the steps of: every step (interval 1)."""
    tier = self._options.persistent
    steps = tier.save_interval_steps
    fixed = steps if isinstance(steps, int) and tier.save_interval_s is None else None
    if self._uploads is None:
      return (1 if fixed is None else fixed), ()
    return fixed, self._uploads(newest)

  # ---- ranking ---------------------------------------------------------------
  def metrics_of(self, steps) -> dict[int, dict]:
    """Metrics of steps, from save() calls, else from their COMMIT records.

    Args:
      steps: the steps to rank.

    Returns:
      {step: metrics} of those whose metrics are known (uncommitted steps
      are unknown, never counted as best); {} without a best_metric.
    """
    if self._options.best_metric is None:
      return {}
    out = {}
    for step in steps:
      metrics = self._records.metrics.get(step)
      if metrics is None:
        record = self._state.record(step)
        if record is None:
          continue
        metrics = record.get("metrics") or {}
        self._records.metrics.put(step, metrics)
      out[step] = metrics
    return out

  # ---- the tiers ---------------------------------------------------------------
  def local(self) -> None:
    """Deletes this process's local steps the rules drop (their files become
    spares for later saves), and the copies found in other processes'
    folders on this host by the same rules (a restart onto other hosts)."""
    steps = self._local.held_steps()
    # no listing per save; one bounded read per step per pass, known commits free
    is_committed = self.commits.asker()
    newest = plans.newest_committed(steps, is_committed)
    self.claims.settle(newest)
    plan = plans.local_plan(
      steps,
      Rules.for_tier(self._options, "local"),
      is_committed=is_committed,
      metrics=self.metrics_of(steps),
      claimed=self.claims.claimed(),
    )
    # a step claimed since the plan (its state file on its way) stays; the
    # others are dropped: their claims fail, so they never commit
    keep = set(plan.keep) | self.claims.drop(plan.delete)
    pending = sorted(s for s in plan.keep if "not committed yet" in plan.reasons[s])
    if plan.delete and len(pending) > self._options.local.max_to_keep:
      waiting = sorted(self.claims.claimed() & set(pending))
      logger.warning(
        "%s local steps %s are not committed yet and older ones are deleted"
        " (max_to_keep=%d; kept until they commit, their state written: %s): is the"
        " persistent directory (the state store) reachable, is a process of the job slow?",
        self._topology.log_prefix(),
        pending,
        self._options.local.max_to_keep,
        waiting,
      )
    # Runs beside the next writes: only steps of this listing may go.
    self._local.apply_retention(keep, among=steps)
    if keep:
      self.commits.forget_below(min(keep))

  def state(self) -> None:
    """Primary process: deletes state steps no tier needs any more."""
    listed = self._state.listed_steps()  # one listing of the root per save
    committed = self._state.committed_steps(listed)  # new COMMITs read, once each
    persistent = self._persistent.steps()
    interval, uploading = self._uploading(max(persistent, default=None))
    plan = plans.state_plan(
      listed,
      committed,
      Rules.for_tier(self._options, "local"),
      persistent=persistent,
      persistent_interval=interval,
      uploading=uploading,
      metrics=self.metrics_of(committed),
      extra_newest=plans.LOCAL_LAG_STEPS,
    )
    for step in sorted(plan.delete):
      self._state.delete(step)

  def persistent(self) -> None:
    """Primary process: deletes persistent steps the rules drop; never the
    newest restorable one (newest finalized step with committed state) nor
    anything newer."""
    committed = self._state.committed_steps()
    plan = plans.persistent_plan(
      self._persistent.steps(),
      Rules.for_tier(self._options, "persistent"),
      committed=committed,
      metrics=self.metrics_of(committed),
      capped=True,
    )
    for step in sorted(plan.delete):
      logger.info("%s retention deletes persistent step %d", self._topology.log_prefix(), step)
      self._persistent.delete(step)

  def after_restore(self) -> None:
    """Primary process: queues one persistent retention pass on the commit
    lane. A job killed before its last passes ran leaves more persistent
    steps than the rules keep, and otherwise only a later upload's finalize
    or commit would run one. Called by: every process, after a restore
    (the others do nothing). Blocks on nothing; a failing pass is logged."""
    if not self._topology.is_primary_process:
      return

    def run() -> None:
      try:
        self.persistent()
      except Exception as e:  # noqa: BLE001 - the next upload's pass tries again
        logger.warning(
          "%s persistent retention after the restore failed: %s", self._topology.log_prefix(), e
        )

    self._background.try_submit("commit", run)

  # ---- scheduling ------------------------------------------------------------
  def after_local_write(self, step: int) -> None:
    """Queues local retention after this process's local write of a step.

    Runs off the write thread: deleting old steps is not this save's
    durability. At most one pass waits: a write while one waits joins it
    (a slow pass, e.g. reading COMMITs from a slow bucket, never builds a
    queue of passes behind it).

    Args:
      step: the step just written.
    """
    with self._lock:
      self._written = step
      if self._pass_queued:
        return
      self._pass_queued = True
    self._background.submit("retention", self._after_write)

  def _after_write(self) -> None:
    with self._lock:
      self._pass_queued = False
      step = self._written
    self.local()
    if not self._topology.is_primary_process:
      self._watch_commit(step)

  def over_budget(self) -> bool:
    """Whether a new commit may free a local step.

    Returns:
      True if this process holds more local steps than max_to_keep.
    """
    return len(self._local.held_steps()) > self._options.local.max_to_keep

  def local_soon(self) -> None:
    """Queues a local retention pass (nothing once closing)."""
    self._background.try_submit("retention", self.local)

  def _watch_commit(self, step: int) -> None:
    """Non-primary processes, after the retention pass that follows their
    local write of `step`: if they still hold more than max_to_keep steps,
    local retention runs again once the primary signals that `step`
    committed. Without it, a step that only this commit makes droppable stays
    on the ramdisk until the next local write: with max_to_keep=1, two copies
    between saves. A newer step's watch (or close) ends this one. Not
    tracked: a commit that never comes costs nothing but this thread's wait."""
    if not self.over_budget():
      return
    stop = threading.Event()
    with self._lock:
      if self._closed:
        return
      if self._watch_stop is not None:
        self._watch_stop.set()
      self._watch_stop = stop

    def watch() -> None:
      if self._collectives.wait_signal(
        f"committed_{step}",
        timeout_s=self._options.state_commit_timeout_s,
        stop=stop,
        poll_s=0.5,
      ):
        self.commits.learned(step)
        self.local_soon()

    try:
      self._background.lane("commit-watch").submit(watch)
    except RuntimeError:  # closing
      pass

  def after_commit(self, step: int) -> None:
    """Signals a commit and runs the retention it allows.

    Called by: the primary process, on the commit lane.

    Args:
      step: the step whose state just committed.
    """
    self.commits.learned(step)
    self._collectives.signal(f"committed_{step}")
    if self._signalled is not None:  # watchers of older steps were ended by newer ones
      self._collectives.forget(signal=f"committed_{self._signalled}")
    self._signalled = step
    if self.over_budget():
      self.local_soon()
    self.state()
    if step in self._records.persistent_final:
      self.persistent()

  def finish(self, timeout_s: float = FINAL_COMMIT_WAIT_S) -> None:
    """One last local pass once every save is durable (a clean close).

    A process that lagged the primary's commits still holds steps that only
    those commits make droppable, and no later save runs a pass for them. A
    process other than the primary first waits for the commit of the newest
    step it wrote (the primary's wait_until_finished() waits for it).
    Called by: every process, from CheckpointManager.close() after
    wait_until_finished() returned. Blocks on that wait (at most
    `timeout_s`) and the pass.

    Args:
      timeout_s: the longest wait for the commit signal.
    """
    with self._lock:
      step = self._written
    if step is None or not self.over_budget():
      return
    if not self._topology.is_primary_process:
      self._collectives.wait_signal(
        f"committed_{step}", timeout_s=timeout_s, stop=threading.Event(), poll_s=0.5
      )
    self._background.try_submit("retention", self.local)
    self._background.flush("retention")

  def close(self) -> None:
    """Ends a commit watch still waiting (within its 0.5 s poll)."""
    with self._lock:
      self._closed = True
      if self._watch_stop is not None:
        self._watch_stop.set()
    self.commits.close()
