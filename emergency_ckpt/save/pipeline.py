"""One save, from save()'s copy to COMMIT: the order of the steps and who runs them.

In save() (the trainer's thread; the only stall): copy this process's
shards into a host snapshot (runtime/staging.py), inside the machine-wide
staging window; start the background work below.
In the background (lanes of runtime/background.py): local write (every
slice, the primary too) -> with local.redundancy, the partner copy or XOR
chunks (with overlap: sent from the snapshot beside the write) -> this
process's JSON state (after the local write, so COMMIT means every process
finished its save of the step, even a failed one: a peer or the persistent
tier may still serve it) -> on the primary, COMMIT once every JSON exists
-> retention (commit.py). Primary slice at persistent steps: the upload,
from arrays aliasing the snapshot on CPU (Orbax inline elsewhere: its
device-to-host copy must end before the trainer may donate the arrays);
its JSON state carries the CRC32C of each shard it holds, and the primary
writes the step's shard table before COMMIT.

No collective anywhere in save(); the persistent upload's barriers span the
primary slice's processes only. Called by: the manager's save(), on the
trainer's thread; the rest runs on the background lanes.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.core.records import check_metrics
from emergency_ckpt.errors import TopologyError
from emergency_ckpt.persistent.admission import Ticket, UploadAdmission
from emergency_ckpt.persistent.upload_memory import upload_memory_kind
from emergency_ckpt.save import policies
from emergency_ckpt.save.commit import ShardSums
from emergency_ckpt.save.protection import EarlyHold, Protection
from emergency_ckpt.state.data_state import encode_data_state

if TYPE_CHECKING:
  from emergency_ckpt.cluster.context import JobContext
  from emergency_ckpt.core.records import StepRecords
  from emergency_ckpt.local.tier import WriteResult
  from emergency_ckpt.runtime.background import Background
  from emergency_ckpt.runtime.staging import StagingArea
  from emergency_ckpt.save.cadence import Cadence
  from emergency_ckpt.save.commit import Commits
  from emergency_ckpt.save.tiers import LocalWriter, RedundancyLink

logger = logging.getLogger("emergency_ckpt")


class LeafSpec(NamedTuple):
  """A leaf's shape, dtype and sharding, taken in save() (a few attribute
  reads; a jax.ShapeDtypeStruct per leaf costs several microseconds more,
  so the upload thread makes those)."""

  shape: tuple[int, ...]
  dtype: Any
  sharding: Any


def _once(fn: Callable[[], None]) -> Callable[[], None]:
  """`fn`, run by the first call only."""
  lock = threading.Lock()
  left = [fn]

  def call() -> None:
    with lock:
      todo = left.pop() if left else None
    if todo is not None:
      todo()

  return call


def tiers_of(decision: policies.SaveDecision) -> list[str]:
  """The names of the tiers a decision saves to.

  Args:
    decision: the save decision.

  Returns:
    ["local"], ["persistent"], both, or [].
  """
  return [t for t, on in (("local", decision.local), ("persistent", decision.persistent)) if on]


class SavePipeline:
  """Starts and tracks the saves of one process."""

  def __init__(
    self,
    ctx: JobContext,
    *,
    commits: Commits,
    local: LocalWriter,
    staging: StagingArea,
    records: StepRecords,
    background: Background,
    redundancy: RedundancyLink | None = None,
    cadence: Cadence | None = None,
  ):
    """Decides, once, whether the persistent upload reads the staged
    snapshot instead of Orbax copying the device arrays inline, and in
    which memory kind it hands Orbax those arrays
    (upload_memory.upload_memory_kind: a probe transfer on accelerators).

    Args:
      ctx: the job.
      commits: the end of each save (state file, COMMIT, finalization),
        with the persistent tier and the retainer.
      local: this process's local tier.
      staging: the staging area (host snapshots).
      records: the manager's per-step records.
      background: the manager's background lanes.
      redundancy: the partner or XOR link (redundancy.links.start), or None.
      cadence: which steps the tiers save, when an interval is "auto" or in
        seconds (cadence.for_job); None: the fixed intervals decide.
    """
    self._ctx = ctx
    self._commits = commits
    self._persistent = commits.persistent
    self._local = local
    self._staging = staging
    self._records = records
    self._background = background
    self._redundancy = redundancy
    self._cadence = cadence
    self._protection = Protection(ctx, commits=commits, local=local, redundancy=redundancy)
    self._upload_snapshots, self._upload_memory_kind = upload_memory_kind(ctx.mesh.local_devices)
    self._admission = UploadAdmission(
      ctx, on_failed=lambda step, error: commits.durable(step, "persistent", None, error)
    )

  def save(
    self,
    step: int,
    state: Any,
    data_state: Any,
    *,
    metrics: dict[str, float] | None,
    force: bool,
  ) -> bool:
    """Saves `step` to the tiers whose interval it hits (both if `force`; with
    "auto" or save_interval_s, the steps the cadence agreed): stages `state`
    and starts the background work; records the save event.
    Called by: every process (the manager's save(), which checked the step).
    Blocks on the copy only (and on a free staging buffer); never on the
    persistent tier: a persistent step that comes while the last upload
    still runs is skipped (persistent/admission.py). With a cadence, also
    on its rare wait for the primary's schedule (cadence.py).

    Args:
      step: the step.
      state: the train state (jax.Arrays).
      data_state: this process's data state, as save() got it.
      metrics: the step's metrics, as save() got them.
      force: save to both tiers, whatever the intervals.

    Returns:
      True if any tier saves; False if `step` hits no interval.

    Raises:
      DataStateError: `data_state` cannot be stored as JSON.
      MetricsError: `metrics` is not a dict of finite numbers.
      CollectiveTimeoutError: with a cadence, the primary's schedule for
        `step` did not come within collective_timeout_s.
    """
    if self._cadence is not None:  # "auto" or seconds: the agreed schedule (cadence.py)
      decision = self._cadence.decide(step, force=force)
    else:
      decision = self._fixed(step, force)
    if not decision.any:
      return False
    started = time.monotonic()
    data_state = encode_data_state(data_state)
    metrics = check_metrics(metrics)
    # No background error is raised here: a sick tier degrades (warnings,
    # events, health()); wait_until_finished() and close() report it.
    returned = threading.Event()  # the upload starts its Python work after save() returns
    try:
      self._start(step, state, data_state, decision, metrics, started, returned)
    finally:
      returned.set()
      if self._cadence is not None:  # the stall ends here: measured
        self._cadence.saved(step, decision)
    return True

  def would_save(self, step: int) -> policies.SaveDecision:
    """Which tiers save(step) would save, as far as this process knows now
    (exact for fixed intervals; with "auto" or seconds, up to the steps
    agreed so far). Called by: any process. Blocks on nothing.

    Args:
      step: the step.
    """
    if self._cadence is not None:
      return self._cadence.would_save(step)
    return self._fixed(step)

  def _fixed(self, step: int, force: bool = False) -> policies.SaveDecision:
    """The fixed intervals' decision for `step`."""
    options = self._ctx.options
    return policies.decide_save(
      step,
      local_interval=options.local.save_interval_steps,
      persistent_interval=options.persistent.save_interval_steps,
      force=force,
    )

  def _start(
    self,
    step: int,
    state: Any,
    data_state: dict | None,
    decision: policies.SaveDecision,
    metrics: dict,
    started: float,
    returned: threading.Event,
  ) -> None:
    """Stages `state` and starts the background work of `decision`; records
    the save event (`started`: time.monotonic() when save() began;
    `returned`: set once save() returns, the upload waits for it)."""
    topo = self._ctx.topology
    self._records.started.put(step, started)
    paths, leaves, treedef = shards_lib.leaf_paths(state)  # paths cached per structure
    # a local step stages: its (cached) layout also knows the state's bytes
    layout = shards_lib.layout_for(paths, leaves) if decision.local else None
    self._records.metrics.put(step, metrics)
    self._records.info.put(
      step,
      {
        "topology": topo.fingerprint(),
        "bytes": layout.state_nbytes
        if layout is not None
        else int(sum(getattr(x, "nbytes", 0) for x in leaves)),
        "saved_at": time.time(),
        "tiers": tiers_of(decision),
      },
    )
    persistent = decision.persistent and topo.is_primary_slice
    ticket = None
    if persistent:  # at most one upload in flight: wait for it, or skip this step
      if self._ctx.options.persistent.when_busy == "wait":
        # every process of the slice waited: nobody is busy, nothing to agree on
        self._persistent.wait_idle(step)
        ticket = Ticket(step, True)
      else:
        ticket = self._admission.enter(
          step,
          busy=self._persistent.running(),
          defer=lambda calls: self._background.submit("admission", calls),
        )
      if ticket.go is None and not self._upload_snapshots:  # Orbax copies inline: decide now
        ticket = self._admission.decide(ticket)
      if ticket.go is False:
        self._admission.skipped(ticket)
        persistent = False
    snapshot_upload = persistent and self._upload_snapshots
    reserved = None
    # A persistent step is staged even without a local write: its shard
    # checksums are then summed from the snapshot (checksums.py).
    if decision.local or persistent:
      reserved = self._staging.reserve(paths, leaves, layout)  # may wait for a running local write
    # Co-located processes start their background work only once no process
    # of the job on this machine is inside this block; nothing in it waits
    # for this process's own background work.
    with self._staging.staging():
      snapshot = None
      if reserved is not None:
        snapshot = self._staging.stage(step, paths, leaves, reserved)
        logger.debug("%s step %d staged in %.3fs", topo.log_prefix(), step, snapshot.stall_s)
      release = snapshot.hold() if snapshot_upload else None  # before the write frees it
      specs, sums = None, None
      if persistent:  # the leaves' shapes and shardings; made abstract on the upload thread
        specs = [LeafSpec(x.shape, x.dtype, x.sharding) for x in leaves]
        sums = ShardSums(snapshot, snapshot.hold(), paths, specs)
      nbytes = 0
      on_persistent = decision.persistent and (ticket is None or ticket.go is not False)
      if decision.local:
        nbytes = snapshot.layout.nbytes
        link = self._redundancy
        early = link is not None and link.active and link.overlap
        # overlap: the step goes from the snapshot beside the write
        hold = EarlyHold(_once(snapshot.hold())) if early else None  # before the write frees it
        self._ctx.health.begin("local", step, "write")
        try:
          write = self._local.write_async(
            snapshot,
            on_done=lambda r: self._after_local(r, data_state, sums, on_persistent, early=hold),
          )
        except BaseException:
          if hold is not None:
            hold()
          raise
        self._background.track(write)
        if early:
          self._protection.queued(step)
          self._background.submit(
            "redundancy",
            self._protection.protect_early,
            snapshot,
            hold,
            write,
            data_state,
            sums,
            on_persistent,
          )
      else:
        if snapshot is not None:
          snapshot.release()
        self._commits.queue_state(step, data_state, sums)
      if snapshot_upload:

        def snapshot_tree() -> Any:  # on the upload thread
          snapshot.wait_filled()
          snapshot.wait_others_staged()
          abstract = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding) for s in specs]
          arrays = snapshot.arrays(abstract, self._upload_memory_kind)
          return jax.tree_util.tree_unflatten(treedef, arrays)

        def admit() -> bool:  # on the upload thread, once save() returned: no GIL taken from it
          returned.wait()
          return self._admission.admit(ticket)

        upload = self._persistent.save_snapshot(
          step,
          state,
          snapshot_tree,
          release,
          admit=admit,
          confirm=functools.partial(self._admission.confirm, step),
        )
        upload.add_done_callback(lambda f: self._admission.uploaded(step, f))
      elif persistent:
        self._ctx.health.begin("persistent", step, "upload")
        try:  # Orbax copies inline, then uploads in its own background
          upload = self._persistent.save(
            step, state, confirm=functools.partial(self._admission.confirm, step)
          )
        except TopologyError:  # the caller's state is wrong: say so now
          raise
        except Exception as e:  # noqa: BLE001 - a sick tier never stops training
          upload = concurrent.futures.Future()
          upload.set_exception(e)
        if upload is None:  # another process was not ready: skipped
          upload = concurrent.futures.Future()
          upload.set_result(False)
        upload.add_done_callback(lambda f: self._admission.uploaded(step, f))
    self._ctx.events.record(
      "save",
      step=step,
      tiers=tiers_of(decision),
      bytes=nbytes,
      stall_s=round(time.monotonic() - started, 6),
    )

  # ---- background ------------------------------------------------------------
  def _after_local(
    self,
    result: WriteResult,
    data_state: dict | None,
    sums: ShardSums | None,
    persistent: bool = False,
    *,
    early: EarlyHold | None = None,
  ) -> None:
    """`early`: the redundancy lane already sends the step (Protection.protect_early)
    and queues its state; its snapshot is let go unless that send began."""
    self._commits.durable(result.step, "local", result.nbytes, result.error)
    link = self._redundancy
    if early is not None:
      early.write_done()
    elif link is not None and link.active and not result.ok:
      # the group does not wait for this process's chunks until its timeout
      self._background.submit("redundancy", link.send_failed, result.step, result.error or "")
      self._commits.queue_state(result.step, data_state, sums)
    elif result.ok and link is not None and link.active:
      # The partner's copy first, then the state file: the step commits
      # once its partner holds it.
      self._protection.queued(result.step)
      self._background.submit(
        "redundancy", self._protection.protect, result.step, data_state, sums, persistent
      )
    else:
      self._commits.queue_state(
        result.step, data_state, sums, written=result.ok, persistent=persistent
      )
    if result.ok:
      self._commits.retainer.after_local_write(result.step)
