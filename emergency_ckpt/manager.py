"""The multi-tier emergency checkpoint manager: orchestration only.

I/O lives in local_tier, persistent_tier and state_store; decisions in
policies and restore_plan; collectives in topology; cross-slice moves in peer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import threading
import time
from typing import Any

import jax
from etils import epath

from emergency_ckpt import (
  failpoints,
  peer,
  peer_stream,
  persistent_tier,
  placement,
  policies,
  restore_plan,
)
from emergency_ckpt import shards as shards_lib
from emergency_ckpt.errors import (
  CollectiveTimeoutError,
  CorruptCheckpointError,
  DataStateError,
  EmergencyCheckpointError,
  InvalidOptionsError,
  MetricsError,
  NoRestorableCheckpointError,
  PeerTransferError,
  ProtectedStepError,
  StateMismatchError,
  StepAlreadyExistsError,
  StepError,
  StepNotRestorableError,
  TopologyMismatchError,
)
from emergency_ckpt.local_tier import LocalTier, WriteResult
from emergency_ckpt.options import CheckpointManagerOptions
from emergency_ckpt.persistent_tier import PersistentTier
from emergency_ckpt.state_store import StateStore, decode_data_state, encode_data_state
from emergency_ckpt.storage import atomic_write
from emergency_ckpt.telemetry import EventLog
from emergency_ckpt.topology import (
  Collectives,
  host_identity,
  init_orbax_multihost,
  peer_host,
  reached_preemption,
  topology_from_mesh,
)

logger = logging.getLogger("emergency_ckpt")


@dataclasses.dataclass(frozen=True)
class RestoreResult:
  """What restore() gives this process."""

  step: int
  state: Any
  data_state: Any
  """This process's own data_state of `step` (what get_state() returned, if
  an object was saved); None if the step was saved by another process count."""
  source: str
  """Where this process's slice got the tensors: local, peer or persistent."""


@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """What metadata(step) knows of a saved step; the same on every process."""

  step: int
  restorable: bool
  """Its state is committed and some tier holds its tensors."""
  local_slices: tuple[int, ...]
  """Slices every process of which has a local copy (by listing)."""
  persistent: bool
  """The persistent tier holds a finalized copy."""
  state_committed: bool
  local_bytes: int
  """Bytes of every process's local copy, summed."""
  persistent_bytes: int | None
  """Bytes of the persistent copy (None if there is none)."""
  topology: dict | None
  """The topology it was saved with (slices, processes, mesh)."""
  saved_at: float | None
  """Unix time its state was committed."""
  metrics: dict
  """What save(metrics=...) got for it."""


class CheckpointManager:
  """Saves to a ramdisk on every slice, to persistent storage from the primary
  slice, and restores the newest step every process can load.

  Create one on every process (a collective: it exchanges process ids). Use as
  a context manager, or call close().
  """

  def __init__(self, options: CheckpointManagerOptions, *, mesh: jax.sharding.Mesh):
    self._options = options
    self._mesh = mesh
    self._topology = topo = topology_from_mesh(mesh, options.replica_axis)
    self._run_id = options.effective_run_id
    init_orbax_multihost()
    self._collectives = Collectives(
      topo, namespace=self._run_id, timeout_s=options.collective_timeout_s
    )
    self._local = LocalTier(options.local, run_id=self._run_id, topology=topo)
    root = epath.Path(options.persistent.directory)
    self._state = StateStore(
      root / "state", process_index=topo.process_index, process_count=topo.process_count
    )
    self._persistent = PersistentTier(
      options.persistent,
      topology=topo,
      mesh=mesh,
      barrier_prefix=f"ec_{self._run_id}",
      on_finalized=self._persistent_finalized,
      timeout_s=options.collective_timeout_s,
    )
    # CPU devices: the persistent upload reads the staged snapshot in the
    # background (see persistent_tier); accelerators: Orbax copies inline.
    self._upload_snapshots = all(d.platform == "cpu" for d in mesh.local_devices)
    self._state_writer = concurrent.futures.ThreadPoolExecutor(1, "ec-state-write")
    self._committer = concurrent.futures.ThreadPoolExecutor(1, "ec-state-commit")
    self._retainer = concurrent.futures.ThreadPoolExecutor(1, "ec-local-retention")
    self._commit_watch = concurrent.futures.ThreadPoolExecutor(1, "ec-commit-watch")
    self._watch_stop: threading.Event | None = None  # the newest watch's; set = give up
    self._lock = threading.Lock()
    self._pending: list[concurrent.futures.Future] = []
    self._errors: list[BaseException] = []
    self._failed = False  # some background work failed (sticky; see close)
    self._raised: list[BaseException] = []  # raised before their callback ran
    self._last_step: int | None = None
    self._metrics: dict[int, dict] = {}
    self._persistent_final: set[int] = set()
    self._save_t0: dict[int, float] = {}
    log_path = options.event_log
    if log_path is not None:
      log_path = log_path.replace("{process}", str(topo.process_index))
    self._events = EventLog(log_path, process=topo.process_index, slice=topo.slice_index)
    self._info: dict[int, dict] = {}
    self._host = host_identity(options.host_id)
    self._placement_problem: str | None = None
    self._placement_checked = False
    self._closed = False
    if topo.is_primary_process:
      root.mkdir(parents=True, exist_ok=True)
      atomic_write(
        root / "run.json",
        json.dumps(
          {
            "run_id": self._run_id,
            "topology": topo.fingerprint(),
            "local_save_interval_steps": options.local.save_interval_steps,
            "persistent_save_interval_steps": options.persistent.save_interval_steps,
          },
          indent=1,
        ).encode(),
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
    """None if no machine runs processes of two slices (or before the first
    restore() / all_steps(), whose exchange carries each process's host id);
    else what is shared and how to fix it (also logged as a warning by the
    primary process, and recorded in the event log). The same on every
    process."""
    return self._placement_problem

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
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise StepError(f"step must be an integer >= 0, got {step!r}.")
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
    self._save_t0[step] = t0
    if len(self._save_t0) > 64:  # durable events of older steps came long ago
      self._save_t0.pop(min(self._save_t0))
    metrics = _check_metrics(metrics)
    paths, leaves, treedef = shards_lib.leaf_paths(state)
    self._raise_background_errors()
    self._metrics[step] = metrics
    self._info[step] = {
      "topology": self._topology.fingerprint(),
      "bytes": int(sum(getattr(x, "nbytes", 0) for x in leaves)),
      "saved_at": time.time(),
      "tiers": [
        t for t, on in (("local", decision.local), ("persistent", decision.persistent)) if on
      ],
    }
    persistent = decision.persistent and self._topology.is_primary_slice
    if persistent:  # at most one upload in flight: wait for the previous one here
      self._persistent.wait_previous(step)
    reserved = None
    if decision.local or (persistent and self._upload_snapshots):
      reserved = self._local.reserve(paths, leaves)  # may wait for the previous local write
    # Co-located processes of this job start their background work only
    # once no process on this machine is inside this part (colocated.py).
    # Nothing in it waits for this process's own background work, which
    # waits for this part to end.
    with self._local.staging():
      nbytes = self._stage_and_dispatch(
        step, state, data_state, decision, paths, leaves, treedef, reserved
      )
    self._last_step = step
    self._events.record(
      "save",
      step=step,
      tiers=self._info[step]["tiers"],
      bytes=nbytes,
      stall_s=round(time.monotonic() - t0, 6),
    )
    return True

  def _stage_and_dispatch(
    self, step, state, data_state, decision, paths, leaves, treedef, reserved
  ) -> int:
    """save()'s copy (into `reserved`) and the background work it starts;
    returns the bytes staged for the local tier (0 if it does not save
    locally)."""
    nbytes = 0
    persistent = decision.persistent and self._topology.is_primary_slice
    staged = None
    if reserved is not None:
      staged = self._local.stage(step, paths, leaves, reserved)
      logger.debug("%s step %d staged in %.3fs", self._topology.log_prefix(), step, staged.stall_s)
    release = None
    if persistent and self._upload_snapshots:
      release = self._local.hold(staged)  # before the local write can free it
    if decision.local:
      nbytes = staged.layout.nbytes
      self._track(
        self._local.write_async(staged, on_done=lambda r: self._after_local(r, data_state))
      )
    else:
      if staged is not None:
        self._local.discard(staged)
      self._queue_state(step, data_state)
    if persistent and self._upload_snapshots:
      abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]

      def snapshot_tree() -> Any:  # on the upload thread
        self._local.wait_others_staged(staged)
        return jax.tree_util.tree_unflatten(treedef, self._local.snapshot_arrays(staged, abstract))

      self._persistent.save_snapshot(step, state, snapshot_tree, release)
    elif persistent:
      self._persistent.save(step, state)
    return nbytes

  def _durable(self, step: int, tier: str, nbytes: int | None, error: str | None = None) -> None:
    t0 = self._save_t0.get(step)
    self._events.record(
      "save_durable" if error is None else "save_failed",
      step=step,
      tier=tier,
      durable_s=None if t0 is None else round(time.monotonic() - t0, 6),
      bytes=nbytes,
      error=error,
    )

  def _after_local(self, result: WriteResult, data_state: dict | None) -> None:
    # The JSON is written after the local write, so COMMIT means "every
    # process finished its save of this step" (even if the write failed: a
    # peer slice or the persistent tier may still serve the tensors).
    self._durable(result.step, "local", result.nbytes, result.error)
    self._queue_state(result.step, data_state)
    if result.ok:  # off the write thread: deleting old steps is not this save's durability
      self._track(self._retainer.submit(self._retain_after_write, result.step))

  def _retain_after_write(self, step: int) -> None:
    self._apply_local_retention()
    if not self._topology.is_primary_process:
      self._watch_commit(step)  # only if a step still waits for a commit

  def _queue_state(self, step: int, data_state: dict | None) -> None:
    def write_state() -> None:
      try:
        self._state.write(step, data_state)
      except Exception as e:
        self._durable(step, "state", None, f"{type(e).__name__}: {e}")
        raise
      self._durable(step, "state", None)

    write = self._state_writer.submit(write_state)
    self._track(write)
    if self._topology.is_primary_process:
      self._track(self._committer.submit(self._commit, write, step))

  def _commit(self, write: concurrent.futures.Future, step: int) -> None:
    write.result()
    committed = self._state.commit(
      step,
      timeout_s=self._options.state_commit_timeout_s,
      metrics=self._metrics.get(step),
      info=self._info.get(step),
    )
    if committed:
      self._collectives.signal(f"committed_{step}")
      if self._local_over_budget():
        self._retain_local_soon()
      self._apply_state_retention()
      if step in self._persistent_final:
        self._apply_persistent_retention()

  def _local_over_budget(self) -> bool:
    """More local steps than max_to_keep: a new commit may free one."""
    return len(self._local.steps()) > self._options.local.max_to_keep

  def _retain_local_soon(self) -> None:
    try:
      self._track(self._retainer.submit(self._apply_local_retention))
    except RuntimeError:  # closing: the executor takes no more work
      pass

  def _watch_commit(self, step: int) -> None:
    """Non-primary processes, after the retention pass that follows their
    local write of `step`: if they still hold more than max_to_keep steps,
    local retention runs again once the primary signals that `step`
    committed (it reads the markers; the signal only says when to look).
    Without it, a step that only this commit makes droppable stays on the
    ramdisk until the next local write: with max_to_keep=1, two copies
    between saves. A newer step's watch (or close) ends this one. Not
    tracked: a commit that never comes costs nothing but this thread's wait."""
    if not self._local_over_budget():
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
        self._retain_local_soon()

    try:
      self._commit_watch.submit(watch)
    except RuntimeError:  # closing
      pass

  def _metrics_of(self, steps) -> dict[int, dict]:
    """Metrics of `steps`: from save() calls, else from their COMMIT records."""
    if self._options.best_metric is None:
      return {}
    out = {}
    for step in steps:
      if step not in self._metrics:
        record = self._state.record(step)
        if record is None:
          continue  # not committed (yet): unknown, never counted as best
        self._metrics[step] = record.get("metrics") or {}
      out[step] = self._metrics[step]
    return out

  def _apply_state_retention(self) -> None:
    listed = self._state.listed_steps()
    committed = self._state.committed_steps()
    keep = policies.keep_state(
      listed,
      committed,
      self._persistent.steps(),
      local_keep=self._options.retention("local"),
      persistent_interval=self._options.persistent.save_interval_steps,
      metrics=self._metrics_of(committed),
    )
    for step in sorted(set(listed) - keep):
      self._state.delete(step)

  def _persistent_finalized(self, step: int) -> None:
    # Orbax's finalize thread, on every primary-slice process, BEFORE Orbax
    # renames the step / writes its commit file: wait for that elsewhere.
    self._track(self._committer.submit(self._after_persistent, step))

  def _after_persistent(self, step: int) -> None:
    if not persistent_tier.wait_finalized(
      self._persistent.directory, step, self._options.collective_timeout_s
    ):
      self._durable(step, "persistent", None, "not finalized in time")
      return
    failpoints.hit("persistent.after_finalize", step)
    self._persistent_final.add(step)
    self._durable(step, "persistent", None)
    if self._topology.is_primary_process:
      self._apply_persistent_retention()

  def _apply_persistent_retention(self) -> None:
    """Deletes persistent steps the rules drop; never the newest restorable
    one (newest finalized step with committed state) nor anything newer."""
    steps = self._persistent.steps()
    committed = set(self._state.committed_steps())
    restorable = [s for s in steps if s in committed]
    if not restorable:
      return
    protected = {s for s in steps if s >= restorable[-1]}
    keep = policies.retain(
      steps,
      self._options.retention("persistent"),
      metrics=self._metrics_of(restorable),
      protected=protected,
    )
    for step in sorted(set(steps) - keep):
      logger.info("%s retention deletes persistent step %d", self._topology.log_prefix(), step)
      self._persistent.delete(step)

  def _apply_local_retention(self) -> None:
    steps = self._local.steps()
    committed = next((s for s in reversed(steps) if self._state.is_committed(s)), None)
    keep = policies.keep_local(
      steps, self._options.retention("local"), committed, self._metrics_of(steps)
    )
    if len(keep) > self._options.local.max_to_keep + 2:
      logger.warning(
        "%s keeping %d local steps (max_to_keep=%d): their state is not committed yet;"
        " is the persistent directory reachable?",
        self._topology.log_prefix(),
        len(keep),
        self._options.local.max_to_keep,
      )
    # Runs beside the next writes: only steps of this listing may go.
    self._local.apply_retention(keep, among=steps)

  def _track(self, fut: concurrent.futures.Future) -> None:
    def done(f: concurrent.futures.Future) -> None:
      if f.exception() is not None:
        logger.error(
          "%s background checkpoint work failed: %s", self._topology.log_prefix(), f.exception()
        )
        with self._lock:
          if not any(x is f.exception() for x in self._raised):
            self._errors.append(f.exception())
          self._failed = True

    with self._lock:
      self._pending = [f for f in self._pending if not f.done()]
      self._pending.append(fut)
    fut.add_done_callback(done)

  def _raise_background_errors(self) -> None:
    with self._lock:
      errors, self._errors = self._errors, []
    if errors:
      raise errors[0]

  def _wait_background(self) -> None:
    """Waits for tracked background work and the background upload, raising
    the first error as soon as any of them fails: a process whose step failed
    must not sit behind an upload that waits in Orbax's barrier for a process
    that already failed the same way (and exited)."""
    while True:
      self._raise_background_errors()
      with self._lock:
        pending = [f for f in self._pending if not f.done()]
      upload = self._persistent.in_flight()
      if upload is not None and upload.done():
        if upload.exception() is not None:
          return  # persistent.wait_until_finished() raises it, translated
        upload = None
      waiting = pending + ([upload] if upload is not None else [])
      if not waiting:
        return
      done, _ = concurrent.futures.wait(waiting, return_when=concurrent.futures.FIRST_COMPLETED)
      for f in done:
        if f is upload:
          continue  # checked above, next round
        e = f.exception()
        if e is not None:  # its done-callback may not have recorded it yet
          with self._lock:
            self._failed = True
            self._errors = [x for x in self._errors if x is not e]
            self._raised.append(e)
          raise e

  def prepare(self, abstract_state: Any) -> None:
    """Starts preparing, in the background, the host staging buffer that
    saves of `abstract_state`'s layout copy into (restore() does this too),
    so the first save does not fault in fresh memory, page by page, inside
    save(). Optional. Called by: any process (this process only). Blocks on
    nothing."""
    self._check_open()
    paths, abstract, _ = shards_lib.leaf_paths(abstract_state)
    self._local.prepare(paths, abstract)

  def wait_until_finished(self) -> None:
    """Blocks until every started save is durable (local files, JSON, COMMIT,
    persistent upload). Called by: every process. Re-raises the first error
    of background work as soon as it happens."""
    self._local.wait_idle()
    self._wait_background()
    # Orbax's finalize queues persistent retention: wait for it first.
    try:
      self._persistent.wait_until_finished()
    except Exception as e:
      if "DEADLINE" not in str(e) and "timed out" not in str(e).lower():
        raise
      # Orbax's barrier gave up (after collective_timeout_s) without naming
      # who is missing: one short exchange over the primary slice names them.
      self._collectives.exchange(
        "persistent_barrier_probe",
        None,
        processes=self._topology.slice_processes[0],
        timeout_s=min(10.0, self._options.collective_timeout_s),
      )
      raise CollectiveTimeoutError(
        f"{self._topology.log_prefix()} the persistent upload's barrier timed out ({e});"
        " every process of the primary slice answered afterwards, so one was only slow:"
        " raise collective_timeout_s."
      ) from e
    while True:
      with self._lock:
        pending = [f for f in self._pending if not f.done()]
      if not pending:
        break
      concurrent.futures.wait(pending)
    self._local.wait_idle()
    self._raise_background_errors()

  # ---- inventory and agreement ---------------------------------------------
  def _inventories(self, name: str) -> list[restore_plan.Inventory]:
    topo = self._topology
    local, rejected = self._local.usable_steps()
    inv = restore_plan.Inventory(
      process=topo.process_index,
      slice=topo.slice_index,
      local_steps=tuple(local),
      local_rejected=rejected,
      persistent_steps=tuple(self._persistent.steps()) if topo.is_primary_process else None,
      state_steps=tuple(self._state.committed_steps()) if topo.is_primary_process else None,
      host=self._host,
    )
    got = self._collectives.exchange(name, inv.to_json())
    invs = [restore_plan.Inventory.from_json(got[p]) for p in sorted(got)]
    if not self._placement_checked:
      self._check_placement(invs)
    return invs

  def _check_placement(self, invs: list[restore_plan.Inventory]) -> None:
    """Once per manager: does any machine run processes of two slices?"""
    self._placement_checked = True
    shared = placement.shared_hosts(
      {inv.process: inv.host for inv in invs}, self._topology.slice_processes
    )
    self._placement_problem = placement.describe(shared)
    if self._placement_problem and self._topology.is_primary_process:
      self._events.record(
        "placement", hosts=len({inv.host for inv in invs}), error=self._placement_problem
      )

  def all_steps(self) -> list[int]:
    """Restorable steps by markers, oldest first. Called by: every process
    (one exchange); every process gets the same answer."""
    self._check_open()
    invs = self._inventories("all_steps")
    return sorted(c.step for c in restore_plan.candidates(invs, self._topology.slice_processes))

  def latest_step(self) -> int | None:
    """The newest restorable step, agreed by all processes. Called by: every
    process (one exchange)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  # ---- restore -------------------------------------------------------------
  def restore(
    self, abstract_state: Any, step: int | None = None, *, data_state: Any = None
  ) -> RestoreResult:
    """Restores the newest restorable step (or `step`) onto abstract_state's
    shardings. If `data_state` is an object with set_state() (the iterator
    whose get_state() was saved), its state is set too.

    Called by: every process. Blocks on: one inventory exchange, reading this
    process's local copy, one status exchange per tried step, and then either
    nothing more (every slice intact), one cross-slice transfer (a slice lost
    its copy) or a persistent read (no slice has it). Whatever it finds, it
    then prepares the next save's staging buffer in the background.
    """
    self._check_open()
    t_restore = time.monotonic()
    data_state_target = data_state
    if data_state_target is not None and not callable(getattr(data_state, "set_state", None)):
      raise DataStateError(
        f"restore(data_state=...) takes an object with set_state() (the iterator to"
        f" reposition), got a {type(data_state).__name__}; the saved value is in"
        " result.data_state."
      )
    self.wait_until_finished()
    topo = self._topology
    paths, abstract, treedef = shards_lib.leaf_paths(abstract_state)
    invs = self._inventories("restore")
    cands = restore_plan.candidates(invs, topo.slice_processes, step=step)
    peer_problem = peer.check_peer_compatible(paths, abstract, self._mesh, topo.replica_axis_name)
    tried = []
    for cand in cands:
      status, local, data_state = self._try_load(cand, paths, abstract)
      got = self._collectives.exchange(f"restore_status_{cand.step}", status.to_json())
      statuses = {p: restore_plan.Status.from_json(v) for p, v in got.items()}
      mismatch = next((s.mismatch for s in statuses.values() if s.mismatch), None)
      if mismatch:
        raise StateMismatchError(mismatch)
      if peer_problem:  # no slice can serve another: a partial loss needs persistent
        cand = _without_peer(cand, topo.num_slices)
      plan = restore_plan.decide(cand, statuses, topo.slice_processes)
      if plan is None:
        why = {p: s.error for p, s in statuses.items() if s.error}
        logger.warning(
          "%s step %d is not restorable after verification: %s", topo.log_prefix(), cand.step, why
        )
        tried.append(f"step {cand.step}: {why}")
        continue
      try:
        state = self._execute(plan, abstract_state, paths, abstract, treedef, local)
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
        state = self._execute(plan, abstract_state, paths, abstract, treedef, local)
      self._last_step = plan.step
      source = plan.sources[topo.slice_index]
      logger.info("%s restored step %d from %s", topo.log_prefix(), plan.step, source)
      self._discard_newer(plan.step, {c.step for c in cands})
      saved = decode_data_state(data_state)
      if data_state_target is not None and saved is not None:
        data_state_target.set_state(saved)
      self._local.prepare(paths, abstract)  # the next save's buffer, while training starts
      self._events.record(
        "restore",
        step=plan.step,
        source=source,
        duration_s=round(time.monotonic() - t_restore, 6),
        bytes=int(sum(math.prod(a.shape) * a.dtype.itemsize for a in abstract)),
        tried=tried,
        error=None,
      )
      return RestoreResult(plan.step, state, saved, source)
    dirs = (
      f"local {self._local.directory} (per process), persistent"
      f" {self._options.persistent.directory}"
    )
    self._local.prepare(paths, abstract)  # the first save's buffer, while the trainer initializes
    detail = restore_plan.describe_absence(invs, topo.slice_processes)
    if tried:
      detail += "; rejected after verification: " + "; ".join(tried)
    self._events.record(
      "restore",
      step=None,
      source=None,
      duration_s=round(time.monotonic() - t_restore, 6),
      bytes=0,
      tried=tried,
      error=detail,
    )
    if step is not None:
      raise StepNotRestorableError(
        f"step {step} is not restorable. Looked in {dirs}. {detail}. Call"
        " all_steps() for the restorable steps."
      )
    raise NoRestorableCheckpointError(
      f"no restorable checkpoint. Looked in {dirs}. {detail}. Start from"
      " scratch, or point the options at the run's directories."
    )

  def _discard_newer(self, restored: int, restorable: set[int]) -> None:
    """Training resumes at restored + 1 and will save those steps again: what
    a crashed run left of unrestorable newer steps (a local copy, a JSON
    without COMMIT) must not mix with the new saves. Restorable steps are
    kept. Ends with a barrier, so no new save starts before the cleanup."""
    for step in self._local.steps():
      if step > restored and step not in restorable:
        self._local.delete(step)
    if self._topology.is_primary_process:
      committed = set(self._state.committed_steps())
      for step in self._state.listed_steps():
        if step > restored and step not in committed:
          self._state.delete(step)
    self._collectives.barrier(f"restore_discard_{restored}")

  def _try_load(self, cand, paths, abstract):
    topo = self._topology
    local_ok, error, mismatch, local = None, None, None, None
    if topo.slice_index in cand.local_slices:
      try:
        local = self._local.read(cand.step, paths, abstract)
        local_ok = True
      except StateMismatchError as e:
        local_ok, mismatch = False, str(e)
      except (CorruptCheckpointError, TopologyMismatchError, OSError) as e:
        local_ok, error = False, f"local copy: {e}"
        logger.warning("%s local copy of step %d unusable: %s", topo.log_prefix(), cand.step, e)
    try:
      saved_count = self._state.saved_process_count(cand.step)
      if saved_count is not None and saved_count != topo.process_count:
        # Per-process iterator positions cannot be mapped onto another
        # process count: the tensors restore (resharded), data_state is None.
        logger.warning(
          "%s step %d was saved by %d processes, this job has %d: data_state is None;"
          " re-initialise the data pipeline for the new topology.",
          topo.log_prefix(),
          cand.step,
          saved_count,
          topo.process_count,
        )
        data_state, state_ok = None, True
      else:
        data_state, state_ok = self._state.read(cand.step), True
    except CorruptCheckpointError as e:
      data_state, state_ok = None, False
      error = f"{error}; state: {e}" if error else f"state: {e}"
    status = restore_plan.Status(local_ok, state_ok, error, mismatch)
    return status, local, data_state

  def _execute(self, plan, abstract_state, paths, abstract, treedef, local):
    topo = self._topology
    if plan.peer_source is not None:
      intact = [s for s, src in enumerate(plan.sources) if src == restore_plan.LOCAL]
      intact.sort(key=lambda s: s != plan.peer_source)  # the planned source first
      lost = [s for s, src in enumerate(plan.sources) if src == restore_plan.PEER]
      mine = local if plan.sources[topo.slice_index] == restore_plan.LOCAL else None
      if self._options.peer_transport == "stream":
        arrays = peer_stream.transfer(
          plan.step,
          abstract,
          paths,
          mine,
          mesh=self._mesh,
          topology=topo,
          collectives=self._collectives,
          intact=intact,
          lost=lost,
          host=peer_host(self._options.peer_host) if mine is not None else None,
          timeout_s=self._options.collective_timeout_s,
          ports=self._options.peer_port_range,
        )
      else:
        arrays = peer.transfer(
          abstract,
          None if mine is None else mine.arrays,
          mesh=self._mesh,
          replica_axis=topo.replica_axis_name,
          intact=intact,
          lost=lost,
        )
      return jax.tree_util.tree_unflatten(treedef, arrays)
    if plan.sources[topo.slice_index] == restore_plan.LOCAL:
      arrays = [shards_lib.assemble(a, by_index) for a, by_index in zip(abstract, local.arrays)]
      return jax.tree_util.tree_unflatten(treedef, arrays)
    return self._persistent.restore(plan.step, abstract_state)

  # ---- preemption, deletion, metadata ---------------------------------------
  def reached_preemption(self, step: int) -> bool:
    """True on every process at the same step once any process got a
    preemption notice (SIGTERM): then save(step, ..., force=True),
    wait_until_finished() and exit. Called by: every process, every step
    (JAX's preemption sync service; no extra collective)."""
    return reached_preemption(step)

  def _from_primary(self, name: str, fn) -> Any:
    """fn() run by the primary process, its JSON result given to all."""
    value = fn() if self._topology.is_primary_process else None
    got = self._collectives.exchange(name, value)
    return got[self._topology.primary_process]

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
      lambda: policies.best_steps(self._metrics_of(steps), metric, self._options.best_mode, n=1),
    )
    return ranked[0] if ranked else None

  def delete(self, step: int, *, force: bool = False) -> None:
    """Deletes `step` from every tier: each process's local copy, the
    persistent copy and its state. Refuses (ProtectedStepError) to delete the
    only restorable step unless `force`. A step becomes unrestorable before
    any of its data goes (COMMIT and finalization markers are removed first).

    Called by: every process. Blocks on background saves, one inventory
    exchange and a final barrier.
    """
    self._check_open()
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise StepError(f"step must be an integer >= 0, got {step!r}.")
    self.wait_until_finished()
    restorable = self.all_steps()
    if restorable == [step] and not force:
      raise ProtectedStepError(
        f"step {step} is the only restorable step; deleting it leaves nothing to"
        " restore. Save a newer step first, or pass force=True."
      )
    with self._lock:
      if self._topology.is_primary_process:
        self._state.delete(step)  # unrestorable from here on
        self._persistent.delete(step)
      self._collectives.barrier(f"delete_{step}_state")
      self._local.delete(step)
      self._metrics.pop(step, None)
    self._collectives.barrier(f"delete_{step}")
    logger.info("%s deleted step %d", self._topology.log_prefix(), step)

  def metadata(self, step: int) -> StepMetadata:
    """Which tiers hold `step`, its size, the topology it was saved with, its
    save time and metrics. Called by: every process (one exchange); every
    process gets the same answer. Raises StepError if no tier has it."""
    self._check_open()
    topo = self._topology
    mine = {"local": None}
    if step in self._local.steps():
      d = self._local.step_dir(step)
      try:
        mine["local"] = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
      except OSError:  # deleted meanwhile
        mine["local"] = None
    if topo.is_primary_process:
      record = self._state.record(step)
      committed = self._state.is_committed(step)
      mine["primary"] = {
        "persistent_bytes": persistent_tier.step_bytes(self._persistent.directory, step)
        if step in self._persistent.steps()
        else None,
        "committed": committed,
        "record": record,
      }
    got = self._collectives.exchange(f"metadata_{step}", mine)
    primary = got[topo.primary_process]["primary"]
    local_slices = tuple(
      s
      for s, procs in enumerate(topo.slice_processes)
      if all(got[p]["local"] is not None for p in procs)
    )
    record = primary["record"] or {}
    info = record.get("info") or {}
    persistent = primary["persistent_bytes"] is not None
    if not local_slices and not persistent and not record:
      raise StepError(f"step {step} is in no tier; all_steps() lists the restorable steps.")
    return StepMetadata(
      step=step,
      restorable=primary["committed"] and (bool(local_slices) or persistent),
      local_slices=local_slices,
      persistent=persistent,
      state_committed=primary["committed"],
      local_bytes=sum(v["local"] or 0 for v in got.values()),
      persistent_bytes=primary["persistent_bytes"],
      topology=info.get("topology"),
      saved_at=info.get("saved_at", record.get("committed_at")),
      metrics=record.get("metrics") or {},
    )

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
      if self._failed:
        self._local.wait_idle()
      else:
        self.wait_until_finished()
    finally:
      with self._lock:
        self._closed = True
        if self._watch_stop is not None:
          self._watch_stop.set()
      self._local.close()
      self._state_writer.shutdown(wait=True)
      self._committer.shutdown(wait=True)
      self._commit_watch.shutdown(wait=True)  # ends within its 0.5 s poll
      self._retainer.shutdown(wait=True)
      self._persistent.close(abandon=self._failed)
      self._events.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _check_metrics(metrics: Any) -> dict:
  if metrics is None:
    return {}
  if not isinstance(metrics, dict):
    raise MetricsError(f"metrics must be a dict of name -> number, got a {type(metrics).__name__}.")
  out = {}
  for k, v in metrics.items():
    if not isinstance(k, str):
      raise MetricsError(f"metrics key {k!r} must be a str.")
    if hasattr(v, "item") and callable(v.item):  # numpy / jax scalars
      v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      raise MetricsError(f"metrics[{k!r}]={v!r} must be a finite number.")
    out[k] = float(v)
  return out


def _without_peer(cand: restore_plan.Candidate, num_slices: int) -> restore_plan.Candidate:
  """Local copies count only if every slice has one (no peer can serve)."""
  if len(cand.local_slices) == num_slices:
    return cand
  return restore_plan.Candidate(cand.step, (), cand.in_persistent)


__all__ = ["CheckpointManager", "RestoreResult", "StepMetadata"]
