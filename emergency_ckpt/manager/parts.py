"""One process's parts, built in the order they need each other, waited
for and closed: the manager's composition root.

Build order (every process, the same): topology and collectives; the
background lanes, per-step records and staging area; Orbax's background
loader; the local tier; the state store; the event log and the JobContext
every orchestrator takes; Commits, which builds the persistent tier (the
tier reports each finalized step to Commits, so Commits exists first) and
the retainer (which needs that tier; where an interval is chosen by the
manager it follows the cadence's persistent steps, save/cadence_job.py); the
redundancy link (an exchange: after the persistent tier's bucket check,
so a missing bucket fails every process before any waits on another);
the save pipeline, with its cadence where an interval is "auto" or in
seconds; the inventory and the restorer. Then the primary process
records the run (run.json; with a chosen interval, this run's starts
counted).

Waiting (for durable saves) and closing (lanes first, writes before what
follows them) walk the same parts, so they are here too.

Called by: CheckpointManager (manager/__init__.py) only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from etils import epath

from emergency_ckpt.cluster.collectives import Collectives
from emergency_ckpt.cluster.context import JobContext
from emergency_ckpt.cluster.topology import host_identity, job_key, topology_from_mesh
from emergency_ckpt.core import layout
from emergency_ckpt.core.health import Health, HealthTracker
from emergency_ckpt.core.records import StepRecords
from emergency_ckpt.core.telemetry import EventLog
from emergency_ckpt.errors import (
  CollectiveTimeoutError,
  EmergencyCheckpointError,
  InvalidOptionsError,
  PendingWorkTimeoutError,
  ProtectedStepError,
  StorageError,
)
from emergency_ckpt.local.tier import LocalTier
from emergency_ckpt.persistent import admission
from emergency_ckpt.persistent import layout as persistent_layout
from emergency_ckpt.persistent.orbax_loader import OrbaxLoader
from emergency_ckpt.redundancy import links as redundancy_links
from emergency_ckpt.restore.inventory import Inventory
from emergency_ckpt.restore.restorer import Restorer
from emergency_ckpt.retention import rules as retention
from emergency_ckpt.runtime.background import Background, run_within
from emergency_ckpt.runtime.staging import StagingArea
from emergency_ckpt.save import cadence_job as cadence_lib
from emergency_ckpt.save.cadence import managed
from emergency_ckpt.save.cadence_targets import FailureHistory
from emergency_ckpt.save.commit import Commits
from emergency_ckpt.save.pipeline import SavePipeline
from emergency_ckpt.state.store import StateStore

if TYPE_CHECKING:
  import jax

  from emergency_ckpt.options import CheckpointManagerOptions
  from emergency_ckpt.persistent.tier import PersistentTier
  from emergency_ckpt.redundancy.links import Partner, Xor
  from emergency_ckpt.retention.retainer import Retainer

logger = logging.getLogger("emergency_ckpt")

CLOSE_ORDER = (
  "local-write",
  "prepare",
  "redundancy",
  "state-write",
  "commit",
  "commit-watch",
  "retention",
)
"""Lanes closed first, in this order, at close(): writes before what follows them."""

KEY_DELETE_WAIT_S = 5.0
"""close() waits at most this long for the primary's queued key deletions
(Collectives: they only free the coordination service's memory)."""


_PERSISTENT_FIX = (
  "point persistent.directory at a folder this user may create and write (a shared"
  " filesystem or gs://bucket/path)"
)


@contextlib.contextmanager
def _directory_errors(option: str, path: str, fix: str) -> Iterator[None]:
  """A tier's folder that cannot be made or read at start-up (a file in
  its place, a read-only or missing mount): StorageError naming the option,
  the path, the OS error and the fix, not the raw OSError."""
  try:
    yield
  except EmergencyCheckpointError:
    raise
  except OSError as e:
    raise StorageError(
      f"{option} {path!r} cannot be used: {type(e).__name__}: {e}. Fix: {fix}."
    ) from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parts:
  """What one process's CheckpointManager runs on."""

  ctx: JobContext
  run_id: str
  background: Background
  records: StepRecords
  staging: StagingArea
  orbax: OrbaxLoader
  """Loads Orbax in the background, started once the restore path is
  behind: at the end of restore(), when all_steps() finds nothing to
  restore, or by the first save (which then waits for it)."""
  local: LocalTier
  state: StateStore
  persistent: PersistentTier
  retainer: Retainer
  redundancy: Partner | Xor | None
  saves: SavePipeline
  inventory: Inventory
  restorer: Restorer

  @classmethod
  def build(cls, options: CheckpointManagerOptions, mesh: jax.sharding.Mesh) -> Parts:
    """Builds every part, in order, and records the run's start.

    Called by: every process (a collective: it exchanges process ids, and
    with local.redundancy sets up the partner or XOR links).

    Args:
      options: the manager's options.
      mesh: the device mesh.

    Returns:
      The parts.

    Raises:
      TopologyError: the mesh cannot hold slices along the replica axis.
      StorageError: the persistent directory's bucket is missing or unreachable.
      UnsafeDirectoryError: the local directory is not this user's own.
      CollectiveTimeoutError: a process did not join the set-up in time.
    """
    topo = topology_from_mesh(mesh, options.replica_axis)
    run_id = options.effective_run_id
    collectives = Collectives(topo, namespace=run_id, timeout_s=options.collective_timeout_s)
    background = Background(topo.log_prefix())
    records = StepRecords()
    staging = StagingArea(
      buffers=options.local.staging_buffers,
      job=job_key(),
      preparer=background.lane("prepare", low_priority=True),
      filler=background.lane("d2h"),
      device_snapshot=options.local.device_snapshot,
      keep_buffers=options.local.keep_staging_buffer,
    )
    orbax = OrbaxLoader(background, topo.log_prefix())
    with _directory_errors(
      "local.directory",
      options.local.directory,
      "point local.directory at a folder this user may create and write, on a node-local"
      " ramdisk (e.g. /dev/shm/<job>)",
    ):
      local = LocalTier(
        options.local,
        run_id=run_id,
        topology=topo,
        background=background,
        orbax_ready=orbax.imported,
      )
    root = epath.Path(options.persistent.directory)
    state = StateStore(
      layout.state_dir(root), process_index=topo.process_index, process_count=topo.process_count
    )
    events = EventLog(options.event_log, process=topo.process_index, slice=topo.slice_index)
    tracked = ["local", "persistent", "state"]
    if options.local.redundancy != "none":
      tracked.append(options.local.redundancy)
    ctx = JobContext(
      topology=topo,
      collectives=collectives,
      mesh=mesh,
      options=options,
      events=events,
      health=HealthTracker(tracked),
    )
    with _directory_errors("persistent.directory", options.persistent.directory, _PERSISTENT_FIX):
      commits = Commits(
        ctx,
        local=local,
        state=state,
        records=records,
        background=background,
        orbax_ready=orbax.ready,
      )
    # run.json is read at start only where a chosen interval plans with the run's failures
    history = _history(root, run_id) if topo.is_primary_process and managed(options) else None
    tiers = dict(local=local, persistent=commits.persistent, state=state)
    host = host_identity(options.host_id)
    link = redundancy_links.start(
      options,
      topology=topo,
      collectives=collectives,
      process_dir=local.directory,
      host_label=host,
      mapped=local.mapped,
    )
    cadence = cadence_lib.for_job(ctx, background=background, history=history)
    if cadence is not None:  # the state of the steps it sends to the persistent tier
      commits.retainer.follow_uploads(cadence.persistent_steps)
    saves = SavePipeline(
      ctx,
      commits=commits,
      local=local,
      staging=staging,
      records=records,
      background=background,
      redundancy=link,
      cadence=cadence,
    )
    parts = cls(
      ctx=ctx,
      run_id=run_id,
      background=background,
      records=records,
      staging=staging,
      orbax=orbax,
      local=local,
      state=state,
      persistent=commits.persistent,
      retainer=commits.retainer,
      redundancy=link,
      saves=saves,
      inventory=Inventory(ctx, host=host, **tiers),
      restorer=Restorer(ctx, staging=staging, orbax_start=orbax.start, **tiers),
    )
    with _directory_errors("persistent.directory", options.persistent.directory, _PERSISTENT_FIX):
      parts._started(root, history)  # the primary writes run.json there
    return parts

  def _started(self, root: epath.Path, history: FailureHistory | None) -> None:
    """The run's record (the primary's run.json, with this start counted in
    `history`), its first event and log line."""
    topo, options = self.ctx.topology, self.ctx.options
    if topo.is_primary_process:
      persistent_layout.write_run_info(
        root,
        {
          "run_id": self.run_id,
          "topology": topo.fingerprint(),
          **cadence_lib.run_record(options),
          **(history.as_record() if history is not None else {}),
        },
      )
    self.ctx.events.record(
      "run_start",
      run_id=self.run_id,
      topology=topo.fingerprint(),
      local=self.local.directory,
      persistent=str(root),
    )
    logger.info(
      "%s emergency_ckpt manager ready: run_id=%s, local=%s, persistent=%s",
      topo.log_prefix(),
      self.run_id,
      self.local.directory,
      root,
    )

  def wait_saves(self) -> None:
    """Blocks until every started save is durable, without waiting for
    Orbax's load (restore() never waits for it). Called by: every process.

    Raises:
      EmergencyCheckpointError: the first error of background work.
    """
    topo, options = self.ctx.topology, self.ctx.options
    self.wait_idle()
    self.background.wait(self.persistent.in_flight)

    # Orbax's finalize queues persistent retention: wait for it first. If
    # Orbax's barrier gave up (after collective_timeout_s) without naming
    # who is missing, one short exchange over the primary slice names them,
    # and a flag says whether another process's part failed.
    def probe(step: int) -> str | None:
      # a process whose part failed raises its own error, never joins the
      # exchange, and raises a flag first
      collectives, failed = self.ctx.collectives, admission.FAILED.format(step)
      if not collectives.flag_set(failed):
        try:
          collectives.barrier(
            "persistent_barrier_probe",
            processes=topo.slice_processes[0],
            timeout_s=min(10.0, options.collective_timeout_s),
          )
          return None
        except CollectiveTimeoutError:
          if not collectives.flag_set(failed):
            raise
      return (
        f"another process of the primary slice failed its part of step {step}'s upload"
        " (its wait_until_finished() and health() name the error): this process"
        " waited for it in Orbax's barrier until collective_timeout_s."
      )

    self.persistent.wait_until_finished(probe=probe)
    self.background.drain()
    self.wait_idle()

  def wait_idle(self) -> None:
    """Blocks on local writes and the buffer being prepared (work a caller
    timing CPU or RAM should count). Called by: any process."""
    self.local.wait()
    self.staging.wait_prepared()

  def health(self, *, report: bool = False) -> Health:
    """Every tier's health, a stopped redundancy receiver counted as the
    scheme's failure; `report`: with a warning when the problems changed."""
    link, health = self.redundancy, self.ctx.health
    if link is not None and not link.receiver.healthy():
      scheme = self.ctx.options.local.redundancy
      health.down(scheme, f"the {scheme} receiver stopped: {link.receiver.error}")
    return health.report(self.ctx.topology.log_prefix()) if report else health.snapshot()

  def placement_problem(self) -> str | None:
    """CheckpointManager.placement_problem's answer: the inventory's shared
    machines and the redundancy link's, joined; None if neither has one."""
    link = self.redundancy
    problems = [self.inventory.placement_problem, None if link is None else link.problem]
    return "; ".join(p for p in problems if p) or None

  def best_step(self, steps: list[int]) -> int | None:
    """The step of `steps` with the best best_metric (ties: the newest),
    ranked by the primary, its answer given to all. Called by: every
    process (CheckpointManager.best_step). Blocks on one exchange.

    Raises:
      InvalidOptionsError: the options name no best_metric.
    """
    options, topo = self.ctx.options, self.ctx.topology
    if options.best_metric is None:
      raise InvalidOptionsError(
        "best_step() needs best_metric in CheckpointManagerOptions (the"
        " save(metrics=...) key that ranks steps) and best_mode (min or max)."
      )
    ranked = None
    if topo.is_primary_process:
      metrics = self.retainer.metrics_of(steps)
      ranked = retention.best_steps(metrics, options.best_metric, options.best_mode, n=1)
    ranked = self.ctx.collectives.broadcast("best_step", ranked, source=topo.primary_process)
    return ranked[0] if ranked else None

  def delete(self, step: int, *, restorable: list[int], force: bool) -> None:
    """Deletes `step` from every tier, markers first (CheckpointManager.delete).
    Called by: every process. Blocks on two barriers.

    Raises:
      ProtectedStepError: it is the only restorable step, without `force`.
    """
    if restorable == [step] and not force:
      raise ProtectedStepError(
        f"step {step} is the only restorable step; deleting it leaves nothing to"
        " restore. Save a newer step first, or pass force=True."
      )
    topo, collectives = self.ctx.topology, self.ctx.collectives
    if topo.is_primary_process:
      self.state.delete(step)  # unrestorable from here on
      self.persistent.delete(step)
    collectives.barrier(f"delete_{step}_state")
    self.local.delete(step)
    self.records.forget(step)
    collectives.barrier(f"delete_{step}")
    logger.info("%s deleted step %d", topo.log_prefix(), step)

  def finish(self, what: str, timeout_s: float | None) -> None:
    """wait_saves(), then Orbax's load, at most `timeout_s` (None: as long
    as they take). Called by: every process.

    Args:
      what: the caller's name, for the error ("wait_until_finished").
      timeout_s: the longest wait, or None.

    Raises:
      PendingWorkTimeoutError: naming the work still pending after `timeout_s`.
      EmergencyCheckpointError: the first error of background work.
    """

    def work() -> None:
      self.wait_saves()
      self.orbax.ready()

    if not run_within(work, timeout_s):
      raise PendingWorkTimeoutError(self._pending(what, timeout_s))

  def _pending(self, what: str, timeout_s: float) -> str:
    health = self.ctx.health.snapshot()
    busy = [
      f"{t.tier}: {', '.join(t.in_flight)} (the oldest running for {t.oldest_in_flight_s:.0f}s)"
      for t in health.values()
      if t.in_flight
    ]
    p = health["persistent"]
    missing = sorted({*p.skipped_steps, *(int(op.rsplit(" ", 1)[1]) for op in p.in_flight)})
    return (
      f"{self.ctx.topology.log_prefix()} {what}() gave up after {timeout_s:.0f}s; still"
      f" pending: {'; '.join(busy) or 'Orbax loading'}."
      + (f" Steps that never reached the persistent tier: {missing}." if missing else "")
      + (f" The persistent tier's last error: {p.last_error}." if p.last_error else "")
      + " Check the bucket; raise the timeout (finish_timeout_s) if it is only slow."
    )

  def settle_links(self, timeout_s: float | None) -> None:
    """Keeps this process's redundancy receiver open until every process of
    its slice is done sending: a process that closed first would refuse its
    sender's last step (sent after this process's own wait returned), and
    that step would never commit. Called by: every process of a slice with
    local.redundancy, from CheckpointManager.close() once its own saves are
    done (or failed). Blocks on one barrier of the slice (2 calls), at most
    `timeout_s` and collective_timeout_s; past it, or if the coordination
    service fails, a warning (naming the processes that did not arrive),
    and close goes on: it never raises.

    Args:
      timeout_s: the longest wait in seconds (None: collective_timeout_s).
    """
    if self.redundancy is None:
      return
    topo, options = self.ctx.topology, self.ctx.options
    limit = options.collective_timeout_s
    if timeout_s is not None:
      limit = max(0.0, min(timeout_s, limit))
    try:
      self.ctx.collectives.barrier(
        f"redundancy_closing_{topo.slice_index}",
        processes=topo.slice_processes[topo.slice_index],
        timeout_s=limit,
      )
    except Exception as e:  # noqa: BLE001 - close() releases every part whatever happens here
      logger.warning(
        "%s closing the %s receiver before every process of slice %d is done sending"
        " (their last step may not commit): %s",
        topo.log_prefix(),
        options.local.redundancy,
        topo.slice_index,
        e,
      )

  def close(self, *, abandon: bool = False) -> None:
    """Releases every part, lanes first. Called by: every process, once,
    after waiting (CheckpointManager.close). An upload still in flight is
    abandoned if background work failed or `abandon` (the wait gave up):
    then nothing here waits for work still in flight."""
    self.retainer.close()
    self.local.close()
    self.background.close(CLOSE_ORDER, abandon=abandon)
    if self.redundancy is not None:
      self.redundancy.close()
    self.staging.close()
    self.persistent.close(abandon=abandon or self.background.failed)
    self.ctx.events.close()
    # Its thread idle before the caller may shut jax.distributed down.
    self.ctx.collectives.wait_deleted(KEY_DELETE_WAIT_S)


def _history(root: epath.Path, run_id: str) -> FailureHistory:
  """This run's starts, this one counted, from the run.json an earlier
  start of the run wrote (the primary process: persistent "auto" estimates
  the mean time between failures from them). An unreadable run.json counts
  as none: this start is then the run's first."""
  try:
    previous = persistent_layout.read_run_info(root)
  except Exception as e:  # noqa: BLE001 - only the MTBF estimate suffers
    logger.debug("run.json unreadable, restarts not counted: %s", e)
    previous = None
  return FailureHistory.after(previous, run_id, time.time())
