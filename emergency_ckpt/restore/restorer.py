"""Executing a restore: try the newest candidate step, fall back, agree.

For each candidate step (newest first, from the inventory exchange):
1. every process reads what it can (sources.py: its own local copy, its
   host's copies written on another mesh, its own JSON state);
2. one status exchange (only failures are sent); the pure plan
   (plan.decide) says where each slice gets the step: its own copy, a
   peer slice, other hosts' copies resharded, or the persistent tier;
3. execute (sources.py): nothing more if every slice is intact, a transfer
   to the slices that lost it (on failure, every process alike falls back
   to the persistent tier or an older step), or a persistent read (a
   damaged persistent step is skipped on every process alike).
Then newer, unrestorable leftovers are discarded, so new saves never mix
with them (a barrier only when the primary deletes state folders), and the
saved data state is decoded (remapped if saved by another process count).

Called by: every process; see CheckpointManager.restore for what it blocks on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from emergency_ckpt import transport as peer
from emergency_ckpt.core import gc_pause
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import (
  CorruptCheckpointError,
  DataStateError,
  EmergencyCheckpointError,
  NoRestorableCheckpointError,
  PeerTransferError,
  StateMismatchError,
  StepNotRestorableError,
)
from emergency_ckpt.restore import plan as restore_plan
from emergency_ckpt.restore import summary as restore_summary
from emergency_ckpt.restore.phases import PhaseClock
from emergency_ckpt.restore.sources import Loaded, Sources, Target
from emergency_ckpt.state.data_state import SavedDataStates, decode_data_state

if TYPE_CHECKING:
  from emergency_ckpt.cluster.context import JobContext
  from emergency_ckpt.restore.tiers import LocalSource, PersistentSource, StateSource
  from emergency_ckpt.runtime.staging import StagingArea

logger = logging.getLogger("emergency_ckpt")

DataStateRemap = Callable[[Mapping[int, Any], int, int], Any]
"""restore(data_state_remap=...): (saved states, process index, process count) -> data state."""


@dataclasses.dataclass(frozen=True)
class RestoreResult:
  """What restore() gives this process."""

  step: int
  state: Any
  data_state: Any
  """This process's own data_state of `step` (what get_state() returned, if
  an object was saved); None if the step was saved by another process count."""
  source: str
  """Where this process got the tensors: "local" (its own host's ramdisk),
  "peer" (another slice, or other hosts' copies resharded onto this mesh),
  "partner" / "parity" (a lost host rebuilt inside its slice:
  local.redundancy), or "persistent"."""
  phases: Mapping[str, float] = dataclasses.field(default_factory=dict)
  """Seconds each part of this restore took on this process (as the restore
  event's `phases`: wait_saves, inventory, read, agree, then place, transfer
  or persistent)."""


class Restorer:
  """Restores a step on this process, in agreement with every other."""

  def __init__(
    self,
    ctx: JobContext,
    *,
    local: LocalSource,
    persistent: PersistentSource,
    state: StateSource,
    staging: StagingArea,
    orbax_start: Callable[[], None] = lambda: None,
  ):
    """Args:
    ctx: the job.
    local: this process's local tier.
    persistent: the persistent tier.
    state: the state store.
    staging: the staging area (start_background prepares the next save's
      buffer).
    orbax_start: starts Orbax's load (OrbaxLoader.start), whose set-up is a
      barrier of every process: every process calls it before a plan that
      reads the persistent tier, whether or not it reads itself.
    """
    self._ctx = ctx
    self._local = local
    self._state = state
    self._staging = staging
    self._orbax_start = orbax_start
    self._last_target: Target | None = None
    self._persistent = persistent
    self._sources = Sources(ctx, local=local, persistent=persistent, state=state)

  def restore(
    self,
    abstract_state: Any,
    job: restore_summary.JobInventory,
    step: int | None,
    started: float,
    phases: dict[str, float] | None = None,
  ) -> RestoreResult:
    """Restores the newest restorable step (or `step`) of `job` onto
    abstract_state's shardings. Either way (unless mismatched) it records a
    restore event and leaves the next save's staging buffer to
    start_background. Called by: every process.

    Args:
      abstract_state: the tree to restore onto.
      job: the inventory exchange's summary.
      step: the step to restore, or None for the newest restorable one.
      started: time.monotonic() when restore() began.
      phases: seconds the caller spent already, by phase (e.g. the
        inventory exchange): the restore event and the log show them
        beside this restore's own (read, agree, transfer).

    Returns:
      The result, its data_state as stored (decode it with with_data_state).

    Raises:
      NoRestorableCheckpointError: nothing is restorable (naming what was
        found).
      StepNotRestorableError: `step` is not restorable.
      StateMismatchError: abstract_state does not fit the saved step.
      CorruptCheckpointError: only damaged persistent copies were left.
    """
    target = Target.of(abstract_state)
    clock = PhaseClock(phases)
    out, tried = self._restore(target, job, step, clock)
    self._last_target = target  # start_background prepares its save
    if out is None:
      error = self._absence(job, step, tried)
      self._record(started, None, None, 0, tried, str(error), clock)
      raise error
    abstract = target.abstract
    nbytes = shards_lib.state_nbytes(abstract)
    self._record(started, out.step, out.source, nbytes, tried, None, clock)
    return dataclasses.replace(out, phases=clock.rounded())

  def start_background(self) -> None:
    """Starts what the last restore() leaves to the background (once): the
    next save's staging buffer for its tree (its layout, allocated and
    faulted in). Called by: the manager, as its restore() returns, so that
    this work does not share the cores (and the GIL) with the restore.
    Blocks on nothing."""
    target, self._last_target = self._last_target, None
    if target is not None:
      self._staging.prepare(target.paths, target.abstract)

  def _record(
    self,
    started: float,
    step: int | None,
    source: str | None,
    nbytes: int,
    tried: list[str],
    error: str | None,
    clock: PhaseClock,
  ) -> None:
    duration = time.monotonic() - started
    self._ctx.events.record(
      "restore",
      step=step,
      source=source,
      duration_s=round(duration, 6),
      bytes=nbytes,
      tried=tried,
      error=error,
      phases=clock.rounded(),
    )
    if step is not None:
      logger.info(
        "%s restore of step %d from %s: %.3f s (%s)",
        self._ctx.topology.log_prefix(),
        step,
        source,
        duration,
        clock.text(),
      )

  def _restore(
    self, target: Target, job: restore_summary.JobInventory, step: int | None, clock: PhaseClock
  ) -> tuple[RestoreResult | None, list[str]]:
    """(the restored step or None, why candidates were rejected)."""
    topo, options = self._ctx.topology, self._ctx.options
    cands = restore_plan.candidates(job, step=step)
    peer_problem = (  # one slice: no peer to serve or be served (thousands of leaves: ms)
      None
      if topo.num_slices == 1
      else peer.check_peer_compatible(
        target.paths, target.abstract, self._ctx.mesh, topo.replica_axis_name
      )
    )
    read_shared = (  # may the slices split a persistent read?
      options.persistent.shared_read
      and options.peer.transport == "stream"
      and topo.num_slices > 1
      and not peer_problem
    )
    tried: list[str] = []
    damaged = False  # a persistent step was found damaged
    for cand in cands:
      with clock("read"), gc_pause.paused(promote=True):  # many leaves: no collector passes
        loaded = self._sources.load(cand, target)
      with clock("agree"):
        got = self._ctx.collectives.gather_sparse(
          f"restore_status_{cand.step}", None if loaded.status.is_ok else loaded.status.to_json()
        )
      statuses = {p: restore_plan.Status.from_json(v) for p, v in got.items()}  # failures
      mismatch = next((s.mismatch for s in statuses.values() if s.mismatch), None)
      if mismatch:
        raise StateMismatchError(mismatch)
      if peer_problem:  # no slice can serve another: a partial loss needs persistent
        cand = _without_peer(cand, topo.num_slices)
      plan = restore_plan.decide(cand, statuses, topo.slice_processes)
      if plan is None:
        why = {p: s.error or _unread(s) for p, s in statuses.items() if not s.is_ok}
        logger.warning(
          "%s step %d is not restorable after verification: %s", topo.log_prefix(), cand.step, why
        )
        tried.append(f"step {cand.step}: {why}")
        continue
      run = (target, loaded, read_shared, clock)
      try:
        try:
          state, source = self._run(plan, *run)
        except PeerTransferError as e:  # raised on every process alike
          plan = restore_plan.decide(
            _without_peer(cand, topo.num_slices), statuses, topo.slice_processes
          )
          logger.warning(
            "%s %s; %s",
            topo.log_prefix(),
            e,
            "reading the step from the persistent tier" if plan else "trying an older step",
          )
          if plan is None:
            tried.append(f"step {cand.step}: {e}")
            continue
          state, source = self._run(plan, *run)
      except _Damaged as e:  # on every process alike
        tried.append(f"step {cand.step}: {e}")
        damaged = True
        continue
      logger.info("%s restored step %d from %s", topo.log_prefix(), plan.step, source)
      self._discard_newer(plan.step, job, wanted=step)
      return RestoreResult(plan.step, state, loaded.data_state, source), tried
    if damaged:  # nothing left, and a persistent step was damaged: say which leaf
      raise CorruptCheckpointError(
        f"no restorable checkpoint: {'; '.join(tried)}. The persistent tier's copies"
        " are damaged and no ramdisk holds these steps: start from scratch, or restore"
        " a copy of the bucket."
      )
    return None, tried

  def _absence(
    self, job: restore_summary.JobInventory, step: int | None, tried: list[str]
  ) -> EmergencyCheckpointError:
    """The error for 'nothing restorable', naming what was found."""
    dirs = (
      f"local {self._local.directory} (per process), persistent"
      f" {self._ctx.options.persistent.directory}"
    )
    detail = restore_plan.describe_absence(job)
    if tried:
      detail += "; rejected after verification: " + "; ".join(tried)
    if step is not None:
      return StepNotRestorableError(
        f"step {step} is not restorable. Looked in {dirs}. {detail}. Call"
        " all_steps() for the restorable steps."
      )
    return NoRestorableCheckpointError(
      f"no restorable checkpoint. Looked in {dirs}. {detail}. Start from"
      " scratch, or point the options at the run's directories."
    )

  def _discard_newer(
    self, restored: int, job: restore_summary.JobInventory, *, wanted: int | None
  ) -> None:
    """Training resumes at restored + 1 and will save those steps again: what
    a crashed run left of newer steps (a local copy, a JSON without COMMIT,
    persistent tensors no restore can use) must not mix with the new saves.
    Restoring the newest step (`wanted` None), every newer candidate was
    tried and rejected (candidates come newest first), so every newer
    persistent step goes; restoring `wanted`, the newer persistent steps
    with committed state stay (restore(step=...) also serves evaluation;
    saving such a step again is refused by name). Each process deletes its
    own local copies (nobody else writes there); the primary deletes the
    persistent steps and the state folders without COMMIT that the
    inventory listed (the job summary's: no second listing), and then only,
    a barrier, so that no process saves into a folder being deleted. The
    same decision on every process."""
    for step in self._local.held_steps():
      if step > restored:
        self._local.delete(step)
    self._local.drop_newer_leftovers(restored, ())  # damaged ones too
    doomed = [s for s in job.state_uncommitted if s > restored]
    committed = set(job.state_steps) if wanted is not None else set()
    tensors = [s for s in job.persistent_steps if s > restored and s not in committed]
    if not doomed and not tensors:
      return
    if self._ctx.topology.is_primary_process:
      if tensors:
        logger.warning(
          "%s deleting persistent steps %s, newer than the restored step %d and not"
          " restorable: training saves them again",
          self._ctx.topology.log_prefix(),
          tensors,
          restored,
        )
      for step in tensors:
        self._persistent.delete(step)
      for step in doomed:
        self._state.delete(step)
    self._ctx.collectives.barrier(f"restore_discard_{restored}")

  def _run(
    self,
    plan: restore_plan.RestorePlan,
    target: Target,
    loaded: Loaded,
    read_shared: bool,
    clock: PhaseClock,
  ) -> tuple[Any, str]:
    if restore_plan.PERSISTENT in plan.sources:
      phase = "persistent"
    elif plan.peer_source is not None or plan.reshard_slices:
      phase = "transfer"
    else:
      phase = "place"
    with clock(phase):
      return self._run_plan(plan, target, loaded, read_shared)

  def _run_plan(
    self, plan: restore_plan.RestorePlan, target: Target, loaded: Loaded, read_shared: bool
  ) -> tuple[Any, str]:
    """Sources.execute, then (if any slice read the persistent tier) one
    exchange of the persistent readers' failures: a shard that failed its
    checksum on any process raises _Damaged on every process (the step is
    skipped); any other failure raises on every process."""
    execute = self._sources.execute
    if restore_plan.PERSISTENT not in plan.sources:
      return execute(plan, target, loaded, read_shared=read_shared)
    # Every process alike (the same plan): a slice that reads nothing itself
    # (the shared read's receivers) must still join Orbax's set-up barrier.
    self._orbax_start()
    out, failure, raised = None, None, None
    try:
      out = execute(plan, target, loaded, read_shared=read_shared)
    except CorruptCheckpointError as e:
      failure = {"corrupt": True, "error": str(e)}
      logger.warning("%s persistent step %d: %s", self._ctx.topology.log_prefix(), plan.step, e)
    except Exception as e:
      failure, raised = {"corrupt": False, "error": f"{type(e).__name__}: {e}"}, e
    failures = self._ctx.collectives.gather_sparse(f"persistent_read_{plan.step}", failure)
    if raised is not None:
      raise raised
    fatal = {p: f["error"] for p, f in failures.items() if not f["corrupt"]}
    if fatal:
      raise EmergencyCheckpointError(
        f"reading persistent step {plan.step} failed on processes {sorted(fatal)}:"
        f" {next(iter(fatal.values()))}. See those processes' logs."
      )
    if failures:
      first = min(failures)
      error = failures[first]["error"]
      where = "" if error.startswith("process ") else f"process {first}: "
      raise _Damaged(f"persistent step {plan.step} is damaged ({where}{error})")
    return out

  def with_data_state(
    self, result: RestoreResult, target: Any = None, remap: DataStateRemap | None = None
  ) -> RestoreResult:
    """`result` with its data state decoded (and remapped, and set on
    `target`). Called by: every process, after restore(). Blocks on reading
    the saved states the remap accesses (none without a remap).

    Args:
      result: what restore() returned (its data_state as stored).
      target: an object with set_state() that gets the decoded state, or None.
      remap: called when the step was saved by another process count, with
        {saved process: its data state}, this process's index and the
        process count; returns this process's data state.

    Returns:
      `result` with data_state decoded: what get_state() returned when
      saved, the remap's value, or None.

    Raises:
      CorruptCheckpointError: a saved state the remap reads is damaged.
    """
    saved = decode_data_state(result.data_state)
    topo = self._ctx.topology
    if remap is not None:
      count = self._state.saved_process_count(result.step)
      if count is not None and count != topo.process_count:
        states = SavedDataStates(self._state, result.step, count)
        saved = remap(states, topo.process_index, topo.process_count)
    if target is not None and saved is not None:
      target.set_state(saved)
    return dataclasses.replace(result, data_state=saved)


def check_data_state_target(target: Any) -> None:
  """Refuses a restore(data_state=...) that cannot take a state.

  Args:
    target: restore()'s data_state argument.

  Raises:
    DataStateError: `target` is neither None nor an object with set_state().
  """
  if target is not None and not callable(getattr(target, "set_state", None)):
    raise DataStateError(
      f"restore(data_state=...) takes an object with set_state() (the iterator to"
      f" reposition), got a {type(target).__name__}; the saved value is in"
      " result.data_state."
    )


class _Damaged(Exception):
  """A persistent read failed its checksums somewhere: skip the step (every process)."""


def _without_peer(cand: restore_plan.Candidate, num_slices: int) -> restore_plan.Candidate:
  """Local copies count only if every slice has one (no peer can serve)."""
  if len(cand.local_slices) == num_slices:
    return cand
  return restore_plan.Candidate(cand.step, (), cand.in_persistent)


def _unread(status: restore_plan.Status) -> str:
  """What a process without an error message could not read, in words."""
  what = []
  if status.local_ok is False:
    what.append("its local copy failed verification")
  if not status.state_ok:
    what.append("its state file is missing or damaged")
  if status.reshard_bad:
    what.append(f"the copies of slices {list(status.reshard_bad)} on its host are unusable")
  return "; ".join(what) or "not readable"
