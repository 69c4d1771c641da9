"""CheckpointManager: the public methods and the order of their calls.

Everything else lives in one module per concept: staging (host snapshots),
local_tier / persistent_tier / state_store (the tiers), saving (a save's
background flow), retainer (retention), inventory (what every process holds),
restorer (executing a restore), background (threads, errors, waits),
topology (identity and collectives), policies (when to save).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from etils import epath

from emergency_ckpt.cluster.topology import (
  Collectives,
  host_identity,
  job_key,
  reached_preemption,
  topology_from_mesh,
)
from emergency_ckpt.core import layout
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.core.records import StepRecords, check_metrics
from emergency_ckpt.core.telemetry import EventLog
from emergency_ckpt.errors import (
  DataStateError,
  EmergencyCheckpointError,
  InvalidOptionsError,
  ProtectedStepError,
  StepAlreadyExistsError,
  StepError,
)
from emergency_ckpt.local.tier import LocalTier
from emergency_ckpt.options import CheckpointManagerOptions
from emergency_ckpt.persistent import layout as persistent_layout
from emergency_ckpt.persistent.orbax_loader import OrbaxLoader
from emergency_ckpt.persistent.tier import PersistentTier, upload_memory_kind
from emergency_ckpt.redundancy import links as redundancy
from emergency_ckpt.restore.inventory import Inventory, StepMetadata
from emergency_ckpt.restore.restorer import Restorer, RestoreResult
from emergency_ckpt.retention import rules as retention
from emergency_ckpt.retention.retainer import Retainer
from emergency_ckpt.runtime.background import Background
from emergency_ckpt.runtime.staging import StagingArea
from emergency_ckpt.save import policies
from emergency_ckpt.save.pipeline import SavePipeline
from emergency_ckpt.state.store import (
  SavedDataStates,
  StateStore,
  decode_data_state,
  encode_data_state,
)

logger = logging.getLogger("emergency_ckpt")

# Lanes closed first, in this order, at close(): writes before what follows them.
_CLOSE_ORDER = (
  "local-write",
  "prepare",
  "redundancy",
  "state-write",
  "commit",
  "commit-watch",
  "retention",
)
# close() waits at most this long for the primary's queued key deletions
# (Collectives: they only free the coordination service's memory).
_KEY_DELETE_WAIT_S = 5.0


class CheckpointManager:
  """Saves to a ramdisk on every slice, to persistent storage from the primary
  slice, and restores the newest step every process can load.

  Create one on every process (a collective: it exchanges process ids). Use as
  a context manager, or call close().
  """

  def __init__(self, options: CheckpointManagerOptions, *, mesh: jax.sharding.Mesh):
    self._options = options
    self._topology = topo = topology_from_mesh(mesh, options.replica_axis)
    self._run_id = options.effective_run_id
    self._collectives = Collectives(
      topo, namespace=self._run_id, timeout_s=options.collective_timeout_s
    )
    self._background = Background(topo.log_prefix())
    self._records = StepRecords()
    self._staging = StagingArea(
      buffers=options.local.staging_buffers,
      job=job_key(),
      preparer=self._background.lane("prepare", low_priority=True),
      filler=self._background.lane("d2h"),
      device_snapshot=options.local.device_snapshot,
    )
    # Orbax loads in the background (OrbaxLoader), started once the restore
    # path is behind: at the end of restore(), when all_steps() finds
    # nothing to restore, or by the first save (which then waits for it).
    self._orbax = OrbaxLoader(self._background, topo.log_prefix())
    self._local = LocalTier(
      options.local,
      run_id=self._run_id,
      topology=topo,
      background=self._background,
      orbax_ready=self._orbax.imported,
    )
    root = epath.Path(options.persistent.directory)
    self._state = StateStore(
      layout.state_dir(root), process_index=topo.process_index, process_count=topo.process_count
    )
    self._persistent = PersistentTier(
      options.persistent,
      topology=topo,
      mesh=mesh,
      barrier_prefix=f"ec_{self._run_id}",
      on_finalized=lambda step: self._saves.persistent_finalized(step),
      timeout_s=options.collective_timeout_s,
      orbax_ready=self._orbax.ready,
    )
    self._events = EventLog(options.event_log, process=topo.process_index, slice=topo.slice_index)
    tiers = dict(local=self._local, persistent=self._persistent, state=self._state)
    self._retainer = Retainer(
      options,
      topology=topo,
      collectives=self._collectives,
      records=self._records,
      background=self._background,
      **tiers,
    )
    host = host_identity(options.host_id)
    self._redundancy = redundancy.start(
      options,
      topology=topo,
      collectives=self._collectives,
      process_dir=self._local.directory,
      host_label=host,
      mapped=self._local.mapped,
    )
    uploads = upload_memory_kind(mesh.local_devices)
    self._saves = SavePipeline(
      options,
      topology=topo,
      staging=self._staging,
      retainer=self._retainer,
      collectives=self._collectives,
      records=self._records,
      events=self._events,
      background=self._background,
      # The upload reads the staged snapshot (CPU; accelerators with pinned
      # host memory), else Orbax copies from the devices inline.
      upload_snapshots=uploads[0],
      upload_memory_kind=uploads[1],
      redundancy=self._redundancy,
      **tiers,
    )
    self._inventory = Inventory(
      topology=topo,
      collectives=self._collectives,
      events=self._events,
      host=host,
      **tiers,
    )
    self._restorer = Restorer(
      options,
      topology=topo,
      mesh=mesh,
      collectives=self._collectives,
      staging=self._staging,
      events=self._events,
      orbax_start=self._orbax.start,
      **tiers,
    )
    self._last_step: int | None = None
    self._closed = False
    if topo.is_primary_process:
      persistent_layout.write_run_info(
        root,
        {
          "run_id": self._run_id,
          "topology": topo.fingerprint(),
          "local_save_interval_steps": options.local.save_interval_steps,
          "persistent_save_interval_steps": options.persistent.save_interval_steps,
        },
      )
    self._events.record(
      "run_start",
      run_id=self._run_id,
      topology=topo.fingerprint(),
      local=self._local.directory,
      persistent=str(root),
    )
    logger.info(
      "%s emergency_ckpt manager ready: run_id=%s, local=%s, persistent=%s",
      topo.log_prefix(),
      self._run_id,
      self._local.directory,
      root,
    )

  # ---- properties ----------------------------------------------------------
  @property
  def topology(self):
    return self._topology

  @property
  def placement_problem(self) -> str | None:
    """None if no machine runs processes of two slices (checked at the
    first restore() / all_steps() / latest_step(): the processes of each
    machine compare their slices once) and, with local.redundancy, this
    process's partner or XOR group members run on other machines (checked
    at construction); else what is shared and how to fix it (also logged
    as a warning; a shared slice is recorded in the event log)."""
    problems = [
      self._inventory.placement_problem,
      None if self._redundancy is None else self._redundancy.problem,
    ]
    return "; ".join(p for p in problems if p) or None

  @property
  def local_directory(self) -> str:
    """This process's own ramdisk folder (run id and process included)."""
    return self._local.directory

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

    `data_state`: this process's non-tensor state: a dict of JSON values, or
    an object with get_state() (e.g. a grain iterator; bytes states are kept
    losslessly). `metrics`: numbers that rank steps for keep_best and
    best_step() (the primary process's values are stored).

    Called by: every process, with the same steps. Blocks only on the host
    copy of this process's shards (plus, on the primary slice at persistent
    steps, the previous upload if it still runs: at most one is in flight;
    and on accelerators Orbax's own device-to-host copy); writes finish in
    the background. No collective. Returns True if any tier saved.
    """
    self._check_open()
    _check_step(step)
    # No process saves before every one set Orbax up (at once after the first
    # save), so a process lost later cannot fail that barrier.
    self._orbax.ready()
    if self._last_step is not None and step <= self._last_step:
      kind = StepAlreadyExistsError if step == self._last_step else StepError
      raise kind(
        f"save(step={step}) after step {self._last_step}: steps must increase."
        " Save each step once, after restore() continue from r.step + 1."
      )
    decision = policies.decide_save(
      step,
      local_interval=self._options.local.save_interval_steps,
      persistent_interval=self._options.persistent.save_interval_steps,
      force=force,
    )
    if not decision.any:
      return False
    t0 = time.monotonic()
    data_state = encode_data_state(data_state)
    metrics = check_metrics(metrics)
    self._background.raise_errors()
    self._saves.save(step, state, data_state, decision, metrics, started=t0)
    self._last_step = step
    return True

  def prepare(self, abstract_state: Any) -> None:
    """Starts preparing, in the background, the host staging buffer that
    saves of `abstract_state`'s layout copy into (restore() does this too),
    so the first save does not fault in fresh memory, page by page, inside
    save(). Optional. Called by: any process (this process only). Blocks on
    nothing."""
    self._check_open()
    paths, abstract, _ = shards_lib.leaf_paths(abstract_state)
    self._staging.prepare(paths, abstract)

  def wait_until_finished(self) -> None:
    """Blocks until every started save is durable (local files, JSON, COMMIT,
    persistent upload) and Orbax is loaded and set up. Called by: every
    process. Re-raises the first error of background work as soon as it
    happens."""
    self._wait_saves()
    self._orbax.ready()

  def _wait_saves(self) -> None:
    """wait_until_finished() without waiting for Orbax's load (restore()
    never waits for it)."""
    self._wait_idle()
    self._background.wait(self._persistent.in_flight)
    # Orbax's finalize queues persistent retention: wait for it first. If
    # Orbax's barrier gave up (after collective_timeout_s) without naming
    # who is missing, one short exchange over the primary slice names them.
    self._persistent.wait_until_finished(
      probe=lambda: self._collectives.barrier(
        "persistent_barrier_probe",
        processes=self._topology.slice_processes[0],
        timeout_s=min(10.0, self._options.collective_timeout_s),
      )
    )
    self._background.drain()
    self._wait_idle()

  def _wait_idle(self) -> None:
    """Local writes and the buffer being prepared (work a caller timing CPU
    or RAM should count)."""
    self._local.wait()
    self._staging.wait_prepared()

  # ---- inventory and restore ----------------------------------------------
  def all_steps(self) -> list[int]:
    """Restorable steps by markers, oldest first. Called by: every process
    (one exchange); every process gets the same answer."""
    self._check_open()
    steps = self._inventory.restorable_steps("all_steps")
    if not steps:  # a fresh start: no restore comes, saves will (every process agrees)
      self._orbax.start()
    return steps

  def latest_step(self) -> int | None:
    """The newest restorable step, agreed by all processes. Called by: every
    process (one exchange)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(
    self,
    abstract_state: Any,
    step: int | None = None,
    *,
    data_state: Any = None,
    data_state_remap: Callable[[Mapping[int, Any], int, int], Any] | None = None,
  ) -> RestoreResult:
    """Restores the newest restorable step (or `step`) onto abstract_state's
    shardings. If `data_state` is an object with set_state() (the iterator
    whose get_state() was saved), its state is set too.

    `data_state_remap(saved, process_index, process_count)`: called when the
    restored step was saved by another process count (else each process
    gets its own saved state and this is not called); returns this
    process's data state (what get_state() would return). `saved` maps
    every saved process index to its data state, each read from the state
    store and verified when first accessed (a remap that needs a few reads
    only those; a damaged file raises CorruptCheckpointError). Without it,
    data_state is None after such a restore.

    Called by: every process. Blocks on: one inventory exchange, reading this
    process's local copy, one status exchange per tried step, and then either
    nothing more (every slice intact), one cross-slice transfer (a slice lost
    its copy) or a persistent read (no slice has it). Whatever it finds, it
    then prepares the next save's staging buffer in the background.
    """
    self._check_open()
    t0 = time.monotonic()
    target = data_state
    if target is not None and not callable(getattr(target, "set_state", None)):
      raise DataStateError(
        f"restore(data_state=...) takes an object with set_state() (the iterator to"
        f" reposition), got a {type(target).__name__}; the saved value is in"
        " result.data_state."
      )
    self._wait_saves()
    try:
      out = self._restorer.restore(abstract_state, self._inventory.exchange("restore"), step, t0)
    finally:  # every process, all up: Orbax's set-up barrier starts off the restore path
      self._orbax.start()
    self._last_step = out.step
    saved = decode_data_state(out.data_state)
    if data_state_remap is not None:
      count = self._state.saved_process_count(out.step)
      if count is not None and count != self._topology.process_count:
        states = SavedDataStates(self._state, out.step, count)
        saved = data_state_remap(states, self._topology.process_index, self._topology.process_count)
    if target is not None and saved is not None:
      target.set_state(saved)
    return RestoreResult(out.step, out.state, saved, out.source)

  def best_step(self) -> int | None:
    """The restorable step with the best `best_metric` (ties: the newest);
    None if no restorable step has it. Called by: every process (two
    exchanges); every process gets the same answer."""
    self._check_open()
    metric = self._options.best_metric
    if metric is None:
      raise InvalidOptionsError(
        "best_step() needs best_metric in CheckpointManagerOptions (the"
        " save(metrics=...) key that ranks steps) and best_mode (min or max)."
      )
    steps = self.all_steps()
    ranked = self._from_primary(
      "best_step",
      lambda: retention.best_steps(
        self._retainer.metrics_of(steps), metric, self._options.best_mode, n=1
      ),
    )
    return ranked[0] if ranked else None

  def _from_primary(self, name: str, fn) -> Any:
    """fn() run by the primary process, its JSON result given to all."""
    value = fn() if self._topology.is_primary_process else None
    return self._collectives.broadcast(name, value, source=self._topology.primary_process)

  def metadata(self, step: int) -> StepMetadata:
    """Which tiers hold `step`, its size, the topology it was saved with, its
    save time and metrics. Called by: every process (one exchange); every
    process gets the same answer. Raises StepError if no tier has it."""
    self._check_open()
    return self._inventory.metadata(step)

  # ---- preemption, deletion ------------------------------------------------
  def reached_preemption(self, step: int) -> bool:
    """True on every process at the same step once any process got a
    preemption notice (SIGTERM): then save(step, ..., force=True),
    wait_until_finished() and exit. Called by: every process, every step
    (JAX's preemption sync service; no extra collective)."""
    return reached_preemption(step)

  def delete(self, step: int, *, force: bool = False) -> None:
    """Deletes `step` from every tier: each process's local copy, the
    persistent copy and its state. Refuses (ProtectedStepError) to delete the
    only restorable step unless `force`. A step becomes unrestorable before
    any of its data goes (COMMIT and finalization markers are removed first).

    Called by: every process. Blocks on background saves, one inventory
    exchange and a final barrier.
    """
    self._check_open()
    _check_step(step)
    self.wait_until_finished()
    restorable = self.all_steps()
    if restorable == [step] and not force:
      raise ProtectedStepError(
        f"step {step} is the only restorable step; deleting it leaves nothing to"
        " restore. Save a newer step first, or pass force=True."
      )
    if self._topology.is_primary_process:
      self._state.delete(step)  # unrestorable from here on
      self._persistent.delete(step)
    self._collectives.barrier(f"delete_{step}_state")
    self._local.delete(step)
    self._records.forget(step)
    self._collectives.barrier(f"delete_{step}")
    logger.info("%s deleted step %d", self._topology.log_prefix(), step)

  # ---- lifecycle -----------------------------------------------------------
  def _check_open(self) -> None:
    if self._closed:
      raise EmergencyCheckpointError("this CheckpointManager is closed; create a new one.")

  def close(self) -> None:
    """Waits for background work, then releases threads. Called by: every
    process. After background work failed (its error already raised), close
    waits only for this process's own work: an upload still in flight is
    abandoned, uncommitted (it may wait in Orbax's barrier for processes
    that failed too; never restored, it is removed by Orbax's next start)."""
    if self._closed:
      return
    try:
      if self._background.failed:
        self._wait_idle()
      else:
        self.wait_until_finished()
    finally:
      self._closed = True
      self._retainer.close()
      self._local.close()
      self._background.close(_CLOSE_ORDER)
      if self._redundancy is not None:
        self._redundancy.close()
      self._staging.close()
      self._persistent.close(abandon=self._background.failed)
      self._events.close()
      # Its thread idle before the caller may shut jax.distributed down.
      self._collectives.wait_deleted(_KEY_DELETE_WAIT_S)

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _check_step(step: Any) -> None:
  if not isinstance(step, int) or isinstance(step, bool) or step < 0:
    raise StepError(f"step must be an integer >= 0, got {step!r}.")


__all__ = ["CheckpointManager", "RestoreResult", "StepMetadata"]
