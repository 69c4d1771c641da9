"""One save, from save()'s copy to COMMIT: the order of the steps and who runs them.

In save() (the trainer's thread; the only stall):
  copy this process's shards into a host snapshot (staging.py), inside the
  machine-wide staging window; start the background work below.
In the background (lanes of background.py):
  local write (every slice, the primary too) -> with local.redundancy, the
  partner copy or XOR chunks (with overlap: sent from the snapshot beside
  the write) -> this process's JSON state
  (after the local write, so COMMIT means every process finished its save of
  the step, even a failed one: a peer or the persistent tier may still serve
  it) -> on the primary process, COMMIT once every JSON exists -> retention.
  Primary slice at persistent steps: the upload, from arrays aliasing the
  snapshot on CPU (Orbax inline elsewhere: its device-to-host copy must end
  before the trainer may donate the arrays); its JSON state carries the
  CRC32C of each shard it holds (the local write's, else summed from the
  snapshot), and the primary
  writes the step's shard table before COMMIT (checksums.py).

No collective anywhere in save(); the persistent upload's barriers span the
primary slice's processes only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from emergency_ckpt.core import failpoints
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.core.records import StepRecords
from emergency_ckpt.core.telemetry import EventLog
from emergency_ckpt.errors import PeerTransferError
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local.tier import LocalTier, WriteResult
from emergency_ckpt.persistent import checksums
from emergency_ckpt.persistent import layout as persistent_layout
from emergency_ckpt.retention.retainer import Retainer
from emergency_ckpt.runtime.background import Background
from emergency_ckpt.runtime.staging import HostSnapshot, StagingArea
from emergency_ckpt.save import policies
from emergency_ckpt.state.store import StateStore

logger = logging.getLogger("emergency_ckpt")


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
  """The names of the tiers `decision` saves to."""
  return [t for t, on in (("local", decision.local), ("persistent", decision.persistent)) if on]


@dataclasses.dataclass
class _Checksums:
  """What a persistent step's shard checksums are made from (primary slice)."""

  snapshot: HostSnapshot
  release: Callable[[], None]
  """Lets the snapshot's buffer go (a hold() taken in save())."""
  paths: list[str]
  abstract: list[Any]

  def crcs(self, local: LocalTier | None) -> dict:
    """This process's shard CRC32Cs: from `local`'s manifest of the step if
    its write succeeded (it summed these very bytes), else summed from the
    snapshot (checksums.snapshot_crcs); lets go of the snapshot, once."""
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


class SavePipeline:
  """Starts and tracks the saves of one process."""

  def __init__(
    self,
    options,
    *,
    topology,
    staging: StagingArea,
    local: LocalTier,
    persistent,
    state: StateStore,
    retainer: Retainer,
    collectives,
    records: StepRecords,
    events: EventLog,
    background: Background,
    upload_snapshots: bool,
    upload_memory_kind: str | None = None,
    redundancy=None,
  ):
    """`upload_snapshots`: the persistent upload reads the staged snapshot
    instead of Orbax copying the device arrays inline, handing Orbax arrays
    in `upload_memory_kind` (persistent_tier.upload_memory_kind).
    `redundancy`: the partner link (redundancy.start), or None."""
    self._options = options
    self._topology = topology
    self._staging = staging
    self._local = local
    self._persistent = persistent
    self._state = state
    self._retainer = retainer
    self._collectives = collectives
    self._records = records
    self._events = events
    self._background = background
    self._upload_snapshots = upload_snapshots
    self._upload_memory_kind = upload_memory_kind
    self._redundancy = redundancy

  def save(
    self,
    step: int,
    state: Any,
    data_state: dict | None,
    decision: policies.SaveDecision,
    metrics: dict,
    *,
    started: float,
  ) -> None:
    """Stages `state` and starts the background work of `decision`; records
    the save event (`started`: time.monotonic() when save() began). Blocks on
    the copy only (and on a free staging buffer, and on the primary slice at
    persistent steps on the previous upload: at most one is in flight)."""
    topo = self._topology
    self._records.started.put(step, started)
    paths, leaves, treedef = shards_lib.leaf_paths(state)
    self._records.metrics.put(step, metrics)
    self._records.info.put(
      step,
      {
        "topology": topo.fingerprint(),
        "bytes": int(sum(getattr(x, "nbytes", 0) for x in leaves)),
        "saved_at": time.time(),
        "tiers": tiers_of(decision),
      },
    )
    persistent = decision.persistent and topo.is_primary_slice
    if persistent:  # at most one upload in flight: wait for the previous one here
      self._persistent.wait_previous(step)
    snapshot_upload = persistent and self._upload_snapshots
    reserved = None
    # A persistent step is staged even without a local write: its shard
    # checksums are then summed from the snapshot (checksums.py).
    if decision.local or persistent:
      reserved = self._staging.reserve(paths, leaves)  # may wait for a running local write
    # Co-located processes start their background work only once no process
    # of the job on this machine is inside this block; nothing in it waits
    # for this process's own background work.
    with self._staging.staging():
      snapshot = None
      if reserved is not None:
        snapshot = self._staging.stage(step, paths, leaves, reserved)
        logger.debug("%s step %d staged in %.3fs", topo.log_prefix(), step, snapshot.stall_s)
      release = snapshot.hold() if snapshot_upload else None  # before the write frees it
      abstract, sums = None, None
      if persistent:
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
        sums = _Checksums(snapshot, snapshot.hold(), paths, abstract)
      nbytes = 0
      if decision.local:
        nbytes = snapshot.layout.nbytes
        link = self._redundancy
        early = link is not None and link.active and link.overlap
        # overlap: the step goes from the snapshot beside the write
        hold = _once(snapshot.hold()) if early else None  # before the write frees it
        try:
          write = self._local.write_async(
            snapshot,
            on_done=lambda r: self._after_local(
              r, data_state, sums, decision.persistent, early=early
            ),
          )
        except BaseException:
          if hold is not None:
            hold()
          raise
        self._background.track(write)
        if early:
          self._background.submit(
            "redundancy",
            self._protect_early,
            snapshot,
            hold,
            write,
            data_state,
            sums,
            decision.persistent,
          )
      else:
        if snapshot is not None:
          snapshot.release()
        self._queue_state(step, data_state, sums)
      if snapshot_upload:

        def snapshot_tree() -> Any:  # on the upload thread
          snapshot.wait_filled()
          snapshot.wait_others_staged()
          arrays = snapshot.arrays(abstract, self._upload_memory_kind)
          return jax.tree_util.tree_unflatten(treedef, arrays)

        self._persistent.save_snapshot(step, state, snapshot_tree, release)
      elif persistent:
        self._persistent.save(step, state)
    self._events.record(
      "save",
      step=step,
      tiers=tiers_of(decision),
      bytes=nbytes,
      stall_s=round(time.monotonic() - started, 6),
    )

  # ---- background ------------------------------------------------------------
  def durable(self, step: int, tier: str, nbytes: int | None, error: str | None = None) -> None:
    """Records that `tier` holds `step` (or failed to)."""
    t0 = self._records.started.get(step)
    self._events.record(
      "save_durable" if error is None else "save_failed",
      step=step,
      tier=tier,
      durable_s=None if t0 is None else round(time.monotonic() - t0, 6),
      bytes=nbytes,
      error=error,
    )

  def _after_local(
    self,
    result: WriteResult,
    data_state: dict | None,
    sums: _Checksums | None,
    persistent: bool = False,
    *,
    early: bool = False,
  ) -> None:
    """`early`: the redundancy lane already sends the step (_protect_early)
    and queues its state."""
    self.durable(result.step, "local", result.nbytes, result.error)
    link = self._redundancy
    if early:
      pass
    elif link is not None and link.active and not result.ok:
      # the group does not wait for this process's chunks until its timeout
      self._background.submit("redundancy", link.send_failed, result.step, result.error or "")
      self._queue_state(result.step, data_state, sums)
    elif result.ok and link is not None and link.active:
      # The partner's copy first, then the state file: the step commits
      # once its partner holds it.
      self._background.submit(
        "redundancy", self._protect, result.step, data_state, sums, persistent
      )
    else:
      self._queue_state(result.step, data_state, sums, written=result.ok)
    if result.ok:
      self._retainer.after_local_write(result.step)

  def _protect(
    self, step: int, data_state: dict | None, sums: _Checksums | None, persistent: bool
  ) -> None:
    """On the redundancy lane: sends the written step to the partner or
    the XOR group, then _protected."""
    nbytes, error = None, None
    try:
      nbytes, _ = self._redundancy.send(self._local.step_dir(step))
    except (OSError, PeerTransferError) as e:
      error = e
    self._protected(step, nbytes, error, data_state, sums, persistent)

  def _protect_early(
    self,
    snapshot: HostSnapshot,
    hold: Callable[[], None],
    write: concurrent.futures.Future,
    data_state: dict | None,
    sums: _Checksums | None,
    persistent: bool,
  ) -> None:
    """On the redundancy lane, beside the local write `write` of `snapshot`
    (held by `hold` until its bytes are sent): sends the partner copy or
    the XOR chunks from the snapshot, each followed by the manifest once
    the write is done; then, as after a write (_after_local), the state
    file: not if the write raised, unprotected if it failed, else
    _protected."""
    step = snapshot.step

    def manifest() -> bytes:  # the senders' trailer: waits for the write
      result = write.result()
      if not result.ok:
        raise OSError(f"the local write failed: {result.error}")
      with open(os.path.join(self._local.step_dir(step), local_format.MANIFEST), "rb") as f:
        return f.read()

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
    if not result.ok:  # as _after_local: the state still says the save ended
      self._queue_state(step, data_state, sums)
      return
    self._protected(step, nbytes, error, data_state, sums, persistent)

  def _protected(
    self,
    step: int,
    nbytes: int | None,
    error: Exception | None,
    data_state: dict | None,
    sums: _Checksums | None,
    persistent: bool,
  ) -> None:
    """After the redundancy send of a written step: queues the state file;
    if the copy or parity was not stored (`error`) and redundancy is
    required, the state is never written, so the step never commits,
    unless it is a persistent step (the persistent tier holds it: it
    commits, its local copy unprotected)."""
    scheme = self._options.local.redundancy
    if error is not None:
      self.durable(step, scheme, None, f"{type(error).__name__}: {error}")
      if self._options.local.redundancy_required and not persistent:
        logger.error(
          "%s step %d will not commit: its %s copy was not stored (%s);"
          " local.redundancy_required=False lets steps commit without it",
          self._topology.log_prefix(),
          step,
          scheme,
          error,
        )
        if sums is not None:
          sums.let_go()
        return
    else:
      self.durable(step, scheme, nbytes)
    self._queue_state(step, data_state, sums, written=True)

  def _queue_state(
    self, step: int, data_state: dict | None, sums: _Checksums | None, *, written: bool = False
  ) -> None:
    """`written`: the local write of `step` succeeded (its manifest holds
    the shard CRC32Cs a persistent step records)."""

    def write_state() -> None:
      try:
        crcs = None if sums is None else sums.crcs(self._local if written else None)
        self._state.write(step, data_state, crcs)
      except Exception as e:
        self.durable(step, "state", None, f"{type(e).__name__}: {e}")
        raise
      # the primary's commit hint; the last writer wakes its wait
      self._collectives.count(f"state_written_{step}", self._topology.process_count)
      self.durable(step, "state", None)

    write = self._background.submit("state-write", write_state)
    if self._topology.is_primary_process:
      self._background.submit("commit", self._commit, write, step, sums)

  def _commit(self, write: concurrent.futures.Future, step: int, sums: _Checksums | None) -> None:
    write.result()
    if sums is not None:  # a persistent step: its shard table, before COMMIT
      primary = self._topology.slice_processes[0]
      self._state.write_shard_table(
        step, checksums.shard_table(step, sums.paths, sums.abstract, primary)
      )
    committed = self._state.commit(
      step,
      timeout_s=self._options.state_commit_timeout_s,
      metrics=self._records.metrics.get(step),
      info=self._records.info.get(step),
      written=lambda timeout_s: self._collectives.wait_count(
        f"state_written_{step}", self._topology.process_count, timeout_s=timeout_s
      ),
    )
    # The counter was the commit's hint only: late writers add to a fresh one.
    self._collectives.forget(count=f"state_written_{step}")
    if committed:
      self._retainer.after_commit(step)

  def persistent_finalized(self, step: int) -> None:
    """Orbax's finalize thread, on every primary-slice process, BEFORE Orbax
    renames the step / writes its commit file: waits for that elsewhere."""
    self._background.submit("commit", self._after_persistent, step)

  def _after_persistent(self, step: int) -> None:
    if not persistent_layout.wait_finalized(
      self._persistent.directory, step, self._options.collective_timeout_s
    ):
      self.durable(step, "persistent", None, "not finalized in time")
      return
    failpoints.hit("persistent.after_finalize", step)
    self._records.persistent_final.put(step, True)
    self.durable(step, "persistent", None)
    if self._topology.is_primary_process:
      self._retainer.persistent()
