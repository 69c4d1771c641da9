"""CheckpointManager: the public methods and the order of their calls.

The parts it runs on are built, waited for and closed in parts.py; a save
runs in save/, a restore in restore/ (see each package).
"""

from __future__ import annotations

import time
from typing import Any

import jax

from emergency_ckpt.cluster.jax_runtime import reached_preemption
from emergency_ckpt.cluster.topology import Topology
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.core.goodput import Goodput, StepTimer
from emergency_ckpt.core.health import Health
from emergency_ckpt.errors import (
  CALLER_ERRORS,
  EmergencyCheckpointError,
  PendingWorkTimeoutError,
  StepAlreadyExistsError,
  StepError,
)
from emergency_ckpt.manager.parts import Parts
from emergency_ckpt.options import CheckpointManagerOptions
from emergency_ckpt.restore.inventory import StepMetadata
from emergency_ckpt.restore.restorer import DataStateRemap, RestoreResult, check_data_state_target
from emergency_ckpt.runtime import exit_guard


class CheckpointManager:
  """Saves to a ramdisk on every slice, to persistent storage from the primary
  slice, and restores the newest step every process can load.

  Create one on every process (a collective: it exchanges process ids). Use as
  a context manager, or call close(). Once it is closed, save(), prepare(),
  restore(), delete() and the step queries raise EmergencyCheckpointError.

  Args:
    options: what to save where, and when.
    mesh: the device mesh the train state is sharded over; the entries of
      its `options.replica_axis` are the slices.

  Raises:
    TopologyError: the mesh cannot hold slices along the replica axis.
    StorageError: the persistent directory's bucket is missing or unreachable.
    UnsafeDirectoryError: the local directory is not this user's own.
    CollectiveTimeoutError: a process did not join the set-up in time.
  """

  def __init__(self, options: CheckpointManagerOptions, *, mesh: jax.sharding.Mesh):
    began = time.monotonic()
    self._options = options
    self._parts = parts = Parts.build(options, mesh)
    self._goodput = StepTimer(parts.ctx.events, began=began)
    self._topology, self._collectives = parts.ctx.topology, parts.ctx.collectives
    # The parts tests and the Orbax facade look into.
    self._background, self._records, self._staging = parts.background, parts.records, parts.staging
    self._saves, self._redundancy = parts.saves, parts.redundancy
    self._last_step: int | None = None
    self._closed = False
    exit_guard.close_at_exit(self)  # before the interpreter joins threads at exit

  # ---- properties ----------------------------------------------------------
  @property
  def topology(self) -> Topology:
    """This process's place in the job: its slice and process index, the
    primary process and slice. Called by: any process. Blocks on nothing."""
    return self._topology

  @property
  def placement_problem(self) -> str | None:
    """What machines are shared, and how to fix it; None if no machine runs
    processes of two slices (checked once, by the first inventory exchange)
    and, with local.redundancy, this process's partner or XOR group members
    run on other machines (checked at construction). Logged as a warning (a
    shared slice also in the event log). Called by: any process. Blocks on
    nothing."""
    return self._parts.placement_problem()

  @property
  def closed(self) -> bool:
    """Whether close() was called. Called by: any process. Blocks on nothing."""
    return self._closed

  @property
  def local_directory(self) -> str:
    """This process's own ramdisk folder (run id and process included).
    Called by: any process. Blocks on nothing."""
    return self._parts.local.directory

  # ---- save ----------------------------------------------------------------
  def save(
    self,
    step: int,
    state: Any,
    data_state: Any = None,
    *,
    metrics: dict[str, float] | None = None,
    force: bool = False,
  ) -> bool:
    """Saves `step` to the tiers whose interval it hits (both if `force`).

    Called by: every process, with the same steps. Blocks only on the host
    copy of this process's shards (on accelerators also Orbax's own
    device-to-host copy; with persistent.when_busy="wait" also the previous
    upload); writes finish in the background. No collective. With
    save_interval_steps "auto" or save_interval_s, the primary process
    chooses the steps and every process saves the same ones; a process
    that runs far ahead of the primary waits for its schedule.

    Args:
      step: an integer >= 0, newer than the last step saved or restored.
      state: the train state: jax.Arrays, replicated over the replica axis.
      data_state: this process's non-tensor state: a dict of JSON values,
        or an object with get_state() (e.g. a grain iterator; bytes states
        are kept losslessly), or None.
      metrics: numbers that rank steps for keep_best and best_step() (the
        primary process's values are stored).
      force: save to both tiers, whatever the intervals.

    Returns:
      True if any tier saved; False if `step` hits no interval.

    Raises:
      StepError: `step` is not an integer >= 0, or older than the last one.
      StepAlreadyExistsError: `step` is the last step saved or restored.
      DataStateError: `data_state` cannot be stored as JSON.
      MetricsError: `metrics` is not a dict of finite numbers.
      CollectiveTimeoutError: with "auto" or save_interval_s, the primary
        process published no schedule for `step` within collective_timeout_s.
    """
    self._check_open()
    _check_step(step)
    began, saved = self._goodput.save_began(), False
    try:
      # No process saves before every one set Orbax up (at once after the first
      # save), so a process lost later cannot fail that barrier.
      self._parts.orbax.ready()
      if self._last_step is not None and step <= self._last_step:
        kind = StepAlreadyExistsError if step == self._last_step else StepError
        raise kind(
          f"save(step={step}) after step {self._last_step}: steps must increase."
          " Save each step once, after restore() continue from r.step + 1."
        )
      saved = self._saves.save(step, state, data_state, metrics=metrics, force=force)
    finally:
      self._goodput.save_returned(step, began, saved=saved)
    if saved:
      self._last_step = step
    return saved

  def prepare(self, abstract_state: Any) -> None:
    """Starts preparing, in the background, the host staging buffer that
    saves of `abstract_state`'s layout copy into (restore() does this too),
    so the first save does not fault in fresh memory, page by page, inside
    save(). Optional. Called by: any process (this process only). Blocks on
    nothing.

    Args:
      abstract_state: the train state, or its tree of jax.ShapeDtypeStruct
        with shardings.
    """
    self._check_open()
    paths, abstract, _ = shards_lib.leaf_paths(abstract_state)
    self._staging.prepare(paths, abstract)

  def wait_until_finished(self, timeout_s: float | None = None) -> None:
    """Blocks until every started save is durable (local files, JSON, COMMIT,
    persistent upload) and Orbax is loaded and set up, at most `timeout_s`
    (None: options.finish_timeout_s). Called by: every process.

    Args:
      timeout_s: the longest wait in seconds; None for the options' default.

    Raises:
      PendingWorkTimeoutError: past the timeout, naming each tier's pending
        work and the steps that never reached the persistent tier.
      EmergencyCheckpointError: the first error of background work, as soon
        as it happens (e.g. StorageError from the upload, or
        CollectiveTimeoutError naming the processes the upload's barrier
        missed).
    """
    limit = self._options.finish_timeout_s if timeout_s is None else timeout_s
    self._parts.finish("wait_until_finished", limit)

  def health(self) -> Health:
    """Each tier's state on this process: the newest durable step, the work
    in flight and how long the oldest has run, failures in a row, skipped
    steps. Never raises for a sick tier (save() does not either: a tier
    degrades, training goes on). Called by: any process, any time; blocks
    on nothing.

    Returns:
      A read-only mapping of tier name ("local", "persistent", "state",
      and the redundancy scheme if any) to TierHealth; `.ok` is False while
      a tier's newest work failed, `.problems()` says what is wrong.
    """
    return self._parts.health()

  def check_for_errors(self) -> Health:
    """What a trainer calls between steps. A sick tier's failure (bucket,
    ramdisk, peer) is logged once per new problem and returned, never
    raised (wait_until_finished() still raises it). Called by: any process,
    any time; blocks on nothing.

    Returns:
      health(), as of now.

    Raises:
      EmergencyCheckpointError: the first background error of CALLER_ERRORS
        (e.g. StateMismatchError, DataStateError), once.
    """
    self._background.raise_errors(only=CALLER_ERRORS)
    return self._parts.health(report=True)

  def goodput(self) -> Goodput:
    """Where this process's time went since the manager's construction
    began: training (between save() calls), save() stalls, start-up and
    restore(), and the goodput: the training's share, in %. Measured when
    the trainer calls save() every step (the manager decides which steps
    it saves); work redone after a restart is not known here (`emergency-ckpt
    report` subtracts it). Called by: any process, any time (e.g. every N
    steps, for a metrics system); blocks on nothing.

    Returns:
      A frozen Goodput; `.as_dict()` for a metrics system.
    """
    return self._goodput.snapshot()

  # ---- inventory and restore ----------------------------------------------
  def all_steps(self) -> list[int]:
    """Restorable steps by markers (COMMIT, and a tier that holds the
    tensors). Called by: every process. Blocks on one inventory exchange.

    Returns:
      The steps, oldest first; every process gets the same answer.

    Raises:
      CollectiveTimeoutError: a process did not join the exchange in time.
    """
    self._check_open()
    steps = self._parts.inventory.restorable_steps("all_steps")
    if not steps:  # a fresh start: no restore comes, saves will (every process agrees)
      self._parts.orbax.start()
    return steps

  def latest_step(self) -> int | None:
    """The newest restorable step. Called by: every process. Blocks on one
    inventory exchange.

    Returns:
      The step (the same on every process), or None if none is restorable.

    Raises:
      CollectiveTimeoutError: a process did not join the exchange in time.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(
    self,
    abstract_state: Any,
    step: int | None = None,
    *,
    data_state: Any = None,
    data_state_remap: DataStateRemap | None = None,
  ) -> RestoreResult:
    """Restores the newest restorable step (or `step`) onto abstract_state's
    shardings.

    Called by: every process. Blocks on: background saves, one inventory
    exchange, this process's local read, one status exchange per tried
    step, then nothing more (every slice intact), one cross-slice transfer
    (a slice lost its copy) or a persistent read (no slice has it). As it
    returns it starts, in the background, Orbax's load and the next save's
    staging buffer.
    Training goes on from the restored step, so what is held of newer steps
    and cannot be restored (local copies, persistent tensors without
    committed state or found damaged, state without COMMIT) is deleted
    before it returns; with `step`, newer local copies too, while newer
    restorable persistent steps stay.

    Args:
      abstract_state: the train state's tree of jax.ShapeDtypeStruct, with
        the shardings to restore onto.
      step: the step to restore; None: the newest restorable one.
      data_state: an object with set_state() (the iterator whose
        get_state() was saved) that gets the restored data state, or None.
      data_state_remap: `data_state_remap(saved, process_index,
        process_count)`, called when the step was saved by another process
        count (else each process gets its own saved state and this is not
        called); returns this process's data state (what get_state() would
        return). `saved` maps every saved process index to its data state,
        each read from the state store and verified when first accessed.
        Without it, data_state is None after such a restore.

    Returns:
      The step, the restored state, this process's data state and where
      its tensors came from.

    Raises:
      NoRestorableCheckpointError: nothing is restorable (naming what was
        found where).
      StepNotRestorableError: `step` is not restorable.
      StateMismatchError: abstract_state's tree, shapes or dtypes do not
        match the saved step.
      CorruptCheckpointError: only damaged copies were left, or a saved data
        state the remap reads is damaged.
      DataStateError: `data_state` has no set_state().
      CollectiveTimeoutError: a process did not join an exchange in time.
    """
    self._check_open()
    t0 = time.monotonic()
    parts = self._parts
    result = got = None
    began = False
    try:
      check_data_state_target(data_state)
      parts.wait_saves()
      t1 = time.monotonic()
      began = True
      job = parts.inventory.exchange("restore")
      before = {"wait_saves": t1 - t0, "inventory": time.monotonic() - t1}
      got = parts.restorer.restore(abstract_state, job, step, t0, before)
      self._last_step = got.step
      result = parts.restorer.with_data_state(got, data_state, data_state_remap)
    finally:
      # The background work a restore leaves starts once it is done, not
      # while it runs (a thread running Python beside it halves its pace):
      # on every process, all up, Orbax's load and set-up barrier; the pass
      # a killed run's last retention left; the next save's staging buffer.
      if began:
        parts.orbax.start()
        if got is not None:
          parts.retainer.after_restore()
        parts.restorer.start_background()
      self._goodput.restored(t0, ok=result is not None)
    return result

  def best_step(self) -> int | None:
    """The restorable step with the best `best_metric` (ties: the newest).
    Called by: every process. Blocks on two exchanges.

    Returns:
      The step (the same on every process); None if no restorable step has
      the metric.

    Raises:
      InvalidOptionsError: the options name no best_metric.
      CollectiveTimeoutError: a process did not join an exchange in time.
    """
    self._check_open()
    return self._parts.best_step(self.all_steps())

  def metadata(self, step: int) -> StepMetadata:
    """Which tiers hold `step`, its size, the topology it was saved with, its
    save time and metrics. Called by: every process. Blocks on one exchange.

    Args:
      step: the step.

    Returns:
      Its metadata (the same on every process).

    Raises:
      StepError: no tier has it.
      CollectiveTimeoutError: a process did not join the exchange in time.
    """
    self._check_open()
    return self._parts.inventory.metadata(step)

  # ---- preemption, deletion ------------------------------------------------
  def reached_preemption(self, step: int) -> bool:
    """Whether to stop: once any process got a preemption notice (SIGTERM),
    true on every process at the same step; then save(step, ...,
    force=True), wait_until_finished() and exit. Called by: every process,
    every step. Blocks on JAX's preemption sync service (no extra
    collective).

    Args:
      step: the current step.

    Returns:
      True at the step where every process stops.
    """
    return reached_preemption(step)

  def delete(self, step: int, *, force: bool = False) -> None:
    """Deletes `step` from every tier: each process's local copy, the
    persistent copy and its state. A step becomes unrestorable before any
    of its data goes (COMMIT and finalization markers are removed first).

    Called by: every process. Blocks on background saves, one inventory
    exchange and two barriers.

    Args:
      step: the step.
      force: delete it even if it is the only restorable step.

    Raises:
      ProtectedStepError: it is the only restorable step, without `force`.
      StepError: `step` is not an integer >= 0.
      EmergencyCheckpointError: background work failed (its error).
    """
    self._check_open()
    _check_step(step)
    self.wait_until_finished()
    self._parts.delete(step, restorable=self.all_steps(), force=force)

  # ---- lifecycle -----------------------------------------------------------
  def _check_open(self) -> None:
    if self._closed:
      raise EmergencyCheckpointError("this CheckpointManager is closed; create a new one.")

  def close(self, timeout_s: float | None = None) -> None:
    """Waits for background work (at most `timeout_s`; None:
    options.finish_timeout_s), then releases threads; a second call does
    nothing. After background work failed (its error already raised), or
    once the wait gave up, work still in flight is abandoned, uncommitted
    (never restored; Orbax's next start removes a partial upload).

    Called by: every process. Blocks on wait_until_finished() (after a
    failure, on this process's local writes only), then with
    local.redundancy on one barrier of its slice (the others' last sends
    to this process's receiver; at most collective_timeout_s, then a
    warning), all within `timeout_s`.

    Args:
      timeout_s: the longest wait in seconds; None for the options' default.

    Raises:
      PendingWorkTimeoutError: the wait gave up (the manager is closed all
        the same, its pending work abandoned).
      EmergencyCheckpointError: background work failed while waiting (the
        manager is closed all the same).
    """
    if self._closed:
      return
    abandon = False
    limit = self._options.finish_timeout_s if timeout_s is None else timeout_s
    t0 = time.monotonic()
    try:
      if self._background.failed:
        self._parts.wait_idle()
      else:
        self.wait_until_finished(limit)
        self._parts.retainer.finish()  # the ramdisk left as retention says
    except PendingWorkTimeoutError:
      abandon = True
      raise
    finally:
      if not abandon:  # the peers' last sends to this process's receiver, before it closes
        left = None if limit is None else limit - (time.monotonic() - t0)
        self._parts.settle_links(left)
      self._closed = True
      self._goodput.close()
      self._parts.close(abandon=abandon)

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def _check_step(step: Any) -> None:
  if not isinstance(step, int) or isinstance(step, bool) or step < 0:
    raise StepError(f"step must be an integer >= 0, got {step!r}.")


__all__ = ["CheckpointManager", "RestoreResult", "StepMetadata"]
