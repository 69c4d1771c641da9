"""The end of each save, in the background: this process's JSON state, the
primary's COMMIT, the persistent step's finalization, the durability
events, and the retention each of them lets run.

After the local write (and the redundancy send, if any) the pipeline
queues the state file (queue_state); once it is written the primary
process writes the step's shard table (a persistent step) and COMMIT as
soon as every process's file exists (the coordination service's counter is
the hint). Orbax's finalize thread reports each finalized persistent step
(persistent_finalized); the commit lane waits for its marker and records
it. A persistent step's shard checksums (ShardSums) come from the local
write's manifest, else are summed from the staged snapshot.

Commits builds the persistent tier and the retainer: the tier reports each
finalized step to Commits, so Commits must exist first; the retainer,
which the commit and the finalization run, needs the tier.

Called by: the save pipeline (pipeline.py) and the manager (which reads
`persistent` and `retainer`), on every process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from emergency_ckpt.core import failpoints, gcs_retry
from emergency_ckpt.persistent import checksums
from emergency_ckpt.persistent import layout as persistent_layout
from emergency_ckpt.persistent.tier import PersistentTier
from emergency_ckpt.retention.retainer import Retainer

if TYPE_CHECKING:
  from emergency_ckpt.cluster.context import JobContext
  from emergency_ckpt.core.records import StepRecords
  from emergency_ckpt.runtime.background import Background
  from emergency_ckpt.runtime.staging import HostSnapshot
  from emergency_ckpt.save.tiers import LocalWriter, StateWriter

logger = logging.getLogger("emergency_ckpt")

WRITTEN = "state_written_{}"
"""The counter of state files written for a step (the commit's hint)."""
UNSAVED = "unsaved_{}"
"""The flag a process raises when its save of a step must not commit."""
DROPPED = "dropped_{}"
"""The flag a process raises when it lacks its local copy of a persistent
step (retention deleted it first, or its write failed): the step then
commits only once the persistent tier holds it."""


@dataclasses.dataclass
class ShardSums:
  """What a persistent step's shard checksums are made from (primary slice)."""

  snapshot: HostSnapshot
  release: Callable[[], None]
  """Lets the snapshot's buffer go (a hold() taken in save())."""
  paths: list[str]
  abstract: list[Any]
  """Each leaf's shape, dtype and global sharding (pipeline.LeafSpec)."""
  resolved: dict | None = None
  """The CRC32Cs once resolve() took them from the local write's manifest."""

  def resolve(self, local: LocalWriter) -> None:
    """Takes the CRC32Cs from `local`'s manifest of the step now (cheap: the
    write summed them) and lets go of the snapshot; crcs() then returns
    them. If the manifest cannot be read, nothing changes (crcs() sums the
    snapshot later)."""
    try:
      got = checksums.manifest_crcs(local.manifest(self.snapshot.step))
    except (OSError, ValueError, KeyError, TypeError):  # gone or damaged: sum later
      return
    if got is not None:
      self.resolved = got
      self.let_go()

  def crcs(self, local: LocalWriter | None) -> dict:
    """This process's shard CRC32Cs; lets go of the snapshot, once.

    Args:
      local: the local tier if its write of the step succeeded (its
        manifest summed these very bytes), else None.

    Returns:
      {leaf path: checksums}: from `local`'s manifest of the step, else
      summed from the snapshot (checksums.snapshot_crcs).
    """
    if self.resolved is not None:
      return self.resolved
    try:
      if local is not None:
        try:
          got = checksums.manifest_crcs(local.manifest(self.snapshot.step))
        except (OSError, ValueError, KeyError, TypeError):  # gone or damaged: sum again
          got = None
        if got is not None:
          return got
      self.snapshot.wait_filled()
      return checksums.snapshot_crcs(self.snapshot.layout, self.snapshot.buffer)
    finally:
      self.let_go()

  def let_go(self) -> None:
    """Lets go of the snapshot (once; later calls do nothing)."""
    release, self.release = self.release, lambda: None
    release()


class Commits:
  """The state files, COMMIT and persistent finalization of one process's saves."""

  def __init__(
    self,
    ctx: JobContext,
    *,
    local: LocalWriter,
    state: StateWriter,
    records: StepRecords,
    background: Background,
    orbax_ready: Callable[[], None],
  ):
    """Builds the persistent tier (reporting to this object) and the retainer.

    Args:
      ctx: the job.
      local: this process's local tier.
      state: the state store.
      records: the manager's per-step records.
      background: the manager's background lanes.
      orbax_ready: blocks until Orbax may be used (OrbaxLoader.ready).
    """
    options, topo = ctx.options, ctx.topology
    self._ctx = ctx
    self._local = local
    self._state = state
    self._records = records
    self._background = background
    self._lacking: set[int] = set()  # persistent steps this process holds no local copy of
    self._deferred: set[int] = set()  # the primary: COMMITs waiting for their upload
    self.persistent = PersistentTier(
      options.persistent,
      topology=topo,
      mesh=ctx.mesh,
      barrier_prefix=f"ec_{options.effective_run_id}",
      on_finalized=self.persistent_finalized,
      timeout_s=options.collective_timeout_s,
      orbax_ready=orbax_ready,
    )
    self.retainer = Retainer(
      options,
      topology=topo,
      collectives=ctx.collectives,
      records=records,
      background=background,
      local=local,
      persistent=self.persistent,
      state=state,
    )

  def durable(self, step: int, tier: str, nbytes: int | None, error: str | None = None) -> None:
    """Records that `tier` holds `step` (or failed to), in the event log.

    Args:
      step: the step.
      tier: "local", "persistent", "state" or the redundancy scheme.
      nbytes: bytes written, if known.
      error: why it failed, or None.
    """
    t0 = self._records.started.get(step)
    self._ctx.health.end(tier, step, error=error)
    self._ctx.events.record(
      "save_durable" if error is None else "save_failed",
      step=step,
      tier=tier,
      durable_s=None if t0 is None else round(time.monotonic() - t0, 6),
      bytes=nbytes,
      error=error,
    )

  def queue_state(
    self,
    step: int,
    data_state: dict | None,
    sums: ShardSums | None,
    *,
    written: bool = False,
    unsaved: str | None = None,
    persistent: bool = False,
  ) -> None:
    """Queues this process's state file of `step` and, on the primary, its
    COMMIT. Blocks on nothing.

    Args:
      step: the step.
      data_state: this process's encoded data state.
      sums: a persistent step's shard checksum sources, or None.
      written: the local write of `step` succeeded (its manifest holds the
        shard CRC32Cs a persistent step records).
      unsaved: why this process's save of `step` must not commit (its
        required redundancy copy was not stored): no state file is written;
        the primary is told (a flag, then the state counter), so its commit
        gives the step up at once instead of waiting for the missing file.
      persistent: `step` is a persistent step (it commits even where local
        retention deleted this process's copy first: the persistent tier
        holds it).
    """
    topo, collectives = self._ctx.topology, self._ctx.collectives

    if unsaved is not None:
      if sums is not None:
        sums.let_go()
      if not topo.is_primary_process:
        self._background.submit("state-write", self._veto, step)
      else:  # the primary gives the step up itself; the others' files go with it
        self._background.submit("commit", self._give_up, step, unsaved)
      return

    if sums is not None and written:  # the manifest's CRCs: let go of the snapshot now,
      sums.resolve(self._local)  # not when the state lane (a sick bucket) gets to it

    persistent = persistent or sums is not None  # shard checksums: a persistent step

    def write_state() -> bool:
      # Local retention keeps a claimed step until it commits; a step it
      # deleted before this lane got to it must not commit, unless the
      # persistent tier holds it (retention/claims.py).
      claimed = self.retainer.claims.claim(step) if written else True
      if not claimed and not persistent:
        logger.warning(
          "%s step %d is not committed: local retention deleted it before its state"
          " file was written (the state lane is more than local.max_to_keep steps"
          " behind the saves: is the state store slow?)",
          topo.log_prefix(),
          step,
        )
        self._ctx.health.skip("state", step)
        if not topo.is_primary_process:
          self._veto(step)
        return False
      if persistent and not (claimed and written):  # the persistent tier must hold it first
        if topo.is_primary_process:
          self._lacking.add(step)
        else:
          collectives.signal(DROPPED.format(step))
      self._ctx.health.begin("state", step, "write")
      try:
        with self._storage_errors(f"writing step {step}'s state to"):
          crcs = None if sums is None else sums.crcs(self._local if written else None)
          self._state.write(step, data_state, crcs)
      except Exception as e:
        if written:
          self.retainer.claims.release(step)
        self.durable(step, "state", None, f"{type(e).__name__}: {e}")
        if not topo.is_primary_process:  # the primary gives the step up at once
          self._veto(step, quiet=True)  # (not after state_commit_timeout_s)
        raise
      # the primary's commit hint; the last writer wakes its wait
      collectives.count(WRITTEN.format(step), topo.process_count)
      self.durable(step, "state", None)
      return True

    write = self._background.submit("state-write", write_state)
    if topo.is_primary_process:
      self._background.submit("commit", self._commit, write, step, sums, persistent)

  def _veto(self, step: int, *, quiet: bool = False) -> None:
    """A non-primary process: `step` must not commit. The flag first: the
    primary reads it once the count is full. `quiet`: a failure to tell
    the primary is logged, not raised (the caller raises its own error;
    the primary then gives up after state_commit_timeout_s)."""
    collectives, topo = self._ctx.collectives, self._ctx.topology
    try:
      collectives.signal(UNSAVED.format(step))
      collectives.count(WRITTEN.format(step), topo.process_count)
    except Exception as e:
      if not quiet:
        raise
      logger.warning(
        "%s could not tell the primary that step %d will not commit: %s",
        topo.log_prefix(),
        step,
        e,
      )

  def _give_up(self, step: int, why: str) -> None:
    """The primary: `step` will not commit (`why`); its COMMIT is never written."""
    logger.warning("%s step %d is not committed: %s", self._ctx.topology.log_prefix(), step, why)
    self._ctx.events.record("commit_skipped", step=step, reason=why)

  def _commit(
    self, write: concurrent.futures.Future, step: int, sums: ShardSums | None, persistent: bool
  ) -> None:
    try:
      if not self._try_commit(write, step, sums, persistent):
        return
    finally:
      self._lacking.discard(step)
      # every step: a process of another slice may have raised it for a
      # persistent step this slice skipped (then not read here)
      if self._ctx.topology.process_count > 1:
        self._ctx.collectives.forget(signal=DROPPED.format(step))
    self.retainer.after_commit(step)

  def _try_commit(
    self, write: concurrent.futures.Future, step: int, sums: ShardSums | None, persistent: bool
  ) -> bool:
    topo, collectives = self._ctx.topology, self._ctx.collectives
    timeout_s = self._ctx.options.state_commit_timeout_s
    deadline = time.monotonic() + timeout_s
    if not write.result():  # retention deleted the primary's copy first
      self._give_up(step, "local retention deleted it before its state file was written")
      return False
    counted = collectives.wait_count(WRITTEN.format(step), topo.process_count, timeout_s=timeout_s)
    # The counter was the commit's hint only: late writers add to a fresh one.
    collectives.forget(count=WRITTEN.format(step))
    if counted and collectives.flag_set(UNSAVED.format(step)):
      collectives.forget(signal=UNSAVED.format(step))
      if sums is not None:
        sums.let_go()
      self._give_up(
        step,
        "a process vetoed it (its required redundancy copy is missing, or its state write"
        " failed: see that process's log)",
      )
      return False
    with self._storage_errors(f"committing step {step} in"):
      if sums is not None:  # a persistent step: its shard table, before COMMIT
        primary = topo.slice_processes[0]
        self._state.write_shard_table(
          step, checksums.shard_table(step, sums.paths, sums.abstract, primary)
        )
      if persistent and (not counted or self._lacks_copies(step)):
        # a process lacks its copy (or is late: its flag may come after this
        # read): COMMIT waits for the persistent tier to hold the step
        # (_after_persistent), else a restart could find the step committed
        # and held nowhere whole
        if not self._records.persistent_final.get(step):
          self._deferred.add(step)
          logger.info(
            "%s step %d commits once its persistent upload is finalized: a process's"
            " local copy is gone (deleted by retention or never written)",
            topo.log_prefix(),
            step,
          )
          return False
      return self._write_commit(step, max(0.0, deadline - time.monotonic()))

  def _write_commit(self, step: int, timeout_s: float) -> bool:
    """The primary: COMMIT of `step` once every file is there (state store's commit)."""
    return self._state.commit(
      step,
      timeout_s=timeout_s,
      metrics=self._records.metrics.get(step),
      info=self._records.info.get(step),
    )

  def _commit_deferred(self, step: int) -> None:
    """The primary, on the commit lane: the COMMIT of a persistent step
    that waited for its upload (every state file is written already)."""
    with self._storage_errors(f"committing step {step} in"):
      done = self._write_commit(step, self._ctx.options.state_commit_timeout_s)
    if done:
      self.retainer.after_commit(step)

  @contextlib.contextmanager
  def _storage_errors(self, what: str) -> Iterator[None]:
    """Raises a storage failure inside as a StorageError naming `what` and
    the state store (a full disk, a permission error; on GCS already one)."""
    try:
      yield
    except Exception as e:
      err = gcs_retry.translate(e, what=what, path=self._state.root)
      if err is e:
        raise
      raise err from e

  def _lacks_copies(self, step: int) -> bool:
    """The primary: whether a process lacks its local copy of persistent
    step `step` (its DROPPED flag; one call)."""
    if step in self._lacking:  # the primary's own (forgotten by _commit)
      return True
    if self._ctx.topology.process_count == 1:
      return False
    return self._ctx.collectives.flag_set(DROPPED.format(step))  # forgotten by _commit

  def persistent_finalized(self, step: int) -> None:
    """Follows up a finalized persistent step on the commit lane. Called
    by: Orbax's finalize thread, on every primary-slice process, BEFORE
    Orbax renames the step / writes its commit file (the lane waits for
    that). Blocks on nothing.

    Args:
      step: the step Orbax finalized.
    """
    self._background.submit("commit", self._after_persistent, step)

  def _after_persistent(self, step: int) -> None:
    if not persistent_layout.wait_finalized(
      self.persistent.directory,
      step,
      self._ctx.options.collective_timeout_s,
      failed=lambda: self.persistent.upload_failed(step),
    ):
      if not self.persistent.upload_failed(step):  # else its upload reported its error
        self.durable(step, "persistent", None, "not finalized in time")
      return
    failpoints.hit("persistent.after_finalize", step)
    self._records.persistent_final.put(step, True)
    self.durable(step, "persistent", None)
    if self._ctx.topology.is_primary_process:
      if step in self._deferred:  # its COMMIT waited for this (_try_commit)
        self._deferred.discard(step)
        self._commit_deferred(step)
      # uploads run one at a time: an older deferred step's upload failed
      self._deferred = {s for s in self._deferred if s > step}
      self.retainer.persistent()
