"""Persistent tier: Orbax's standard format on gs:// or any path.

Saved by the primary slice only, through an Orbax CheckpointManager set up
for it (orbax_manager.py): the shards of replica 0, which live on the
primary slice, so no copy is made. Restored by every process, each reading
the shards it needs straight from storage (no broadcast, so values come back
bit-exact), onto any topology, every byte checked against its recorded
CRC32C (persistent/read.py).

save() need not call Orbax on the trainer's thread: where upload_memory.py
says so, save_snapshot() hands Orbax arrays built from the local tier's
staged host snapshot (an immutable copy: the trainer may donate or
overwrite its arrays as soon as save() returns) and runs the Orbax save on
a background thread, so the save() stall is the staging copy alone.
Elsewhere save() calls Orbax inline: its device-to-host copy must end
before the trainer may touch the arrays again.

The storage rules that need no JAX (which steps are finalized, deleting a
step, cleanup after a crash) are in persistent/layout.py.

Compression: off by default (persistent.compression turns on Orbax's zstd):
uncompressed chunks cost less CPU to upload and restore faster, for more
bytes stored (see PersistentTierOptions.compression).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from emergency_ckpt.cluster.topology import Topology
from emergency_ckpt.core import compat, failpoints, gcs_retry, layout, placement
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.core.storage import check_bucket
from emergency_ckpt.errors import CollectiveTimeoutError, StepAlreadyExistsError
from emergency_ckpt.options import PersistentTierOptions
from emergency_ckpt.persistent import orbax_manager
from emergency_ckpt.persistent import read as persistent_read
from emergency_ckpt.persistent.admission import is_barrier_timeout
from emergency_ckpt.persistent.in_flight import UploadInFlight
from emergency_ckpt.persistent.layout import cleanup_unfinalized, delete_step, list_steps
from emergency_ckpt.persistent.orbax_loader import orbax
from emergency_ckpt.runtime import exit_guard
from emergency_ckpt.runtime.serial import SerialExecutor
from emergency_ckpt.state.shard_records import Expected

logger = logging.getLogger("emergency_ckpt")


def _check_replicated(tree: Any, replica_axis: str) -> None:
  """TopologyError unless every leaf is replicated over the replica axis (then
  the primary slice alone holds a full copy: replica 0's shards)."""
  paths, leaves, _ = shards_lib.leaf_paths(tree)
  compat.check_replicated(paths, leaves, replica_axis)


class PersistentTier(UploadInFlight):
  """Orbax on the persistent directory's tensors/ folder.

  Args:
    options: the persistent tier's options.
    topology: this job's slices and processes.
    mesh: the train state's mesh.
    barrier_prefix: prefixes Orbax's barrier keys (unique per manager).
    on_finalized: called with each step Orbax finalized (on its thread).
    timeout_s: Orbax's barrier timeout.
    orbax_ready: blocks until Orbax may be used (the manager's multihost
      set-up); called before Orbax is first used.

  Raises:
    StorageError: the bucket does not exist (checked on every process first).
  """

  def __init__(
    self,
    options: PersistentTierOptions,
    *,
    topology: Topology,
    mesh: Mesh,
    barrier_prefix: str,
    on_finalized: Callable[[int], None] | None = None,
    timeout_s: float = 1200.0,
    orbax_ready: Callable[[], None] | None = None,
  ):
    self._options = options
    self._topology = topology
    self._mesh = mesh
    self.directory = layout.tensors_dir(options.directory)
    self._manager = None
    self._on_finalized = on_finalized
    self._saving_step: int | None = None
    self._upload: concurrent.futures.Future | None = None  # the last upload's, if any
    self._upload_step: int | None = None  # the step of the last upload started or queued
    self._upload_started: float | None = None  # time.monotonic() it began (None: queued)
    self._failed: collections.deque[int] = collections.deque(maxlen=16)  # uploads that failed
    self._uploader = SerialExecutor("ec-persistent-upload")  # a daemon: see runtime/serial.py
    # Every process, before anything waits on another: a missing bucket fails
    # each of them at once, naming it (on GCS; no-op elsewhere).
    check_bucket(options.directory, "opening the persistent directory")
    if topology.is_primary_process:
      # Before this job's first save: Orbax's first save barriers with us.
      cleanup_unfinalized(self.directory)
    self._timeout_s = timeout_s
    self._barrier_prefix = barrier_prefix
    self._orbax_ready = orbax_ready
    self._open_lock = threading.Lock()

  def open(self) -> None:
    """Creates the Orbax CheckpointManager that saves (orbax_manager.py), after `orbax_ready`.

    Primary slice only; a no-op elsewhere and once done. Called by: the
    first persistent save on each primary-slice process; blocks on loading
    Orbax the first time. Restores never need it.
    """
    topology = self._topology
    if not topology.is_primary_slice or self._manager is not None:
      return
    if self._orbax_ready is not None:
      self._orbax_ready()  # never under the lock
    with self._open_lock:
      if self._manager is not None:
        return
      self._manager = orbax_manager.create(
        orbax(),
        self.directory,
        topology=topology,
        compression=self._options.compression,
        timeout_s=self._timeout_s,
        barrier_prefix=self._barrier_prefix,
        on_finalized=self._finalized,
      )

  def _finalized(self) -> None:
    # Orbax's finalize thread, on every primary-slice process, once the step
    # is final (its commit file or rename done).
    step = self._saving_step
    if self._on_finalized is not None and step is not None:
      self._on_finalized(step)
      failpoints.hit("persistent.finalize_callback", step)  # before Orbax's rename

  def upload_failed(self, step: int) -> bool:
    """Whether this process's upload of `step` failed (it will never be
    finalized by this upload; on another process of the primary slice a
    successful upload may still wait for the primary's rename). Any thread
    may call it; blocks on nothing.

    Args:
      step: a step whose upload started.
    """
    return step in self._failed

  def steps(self) -> list[int]:
    """The committed (finalized) steps, oldest first. Any process may call it.

    Returns:
      The steps.
    """
    return list_steps(self.directory)

  def _check_ready(self) -> None:
    """save() and save_snapshot() start an upload only when none runs: the
    caller skips a step rather than wait (persistent/admission.py)."""
    if not self._topology.is_primary_slice:
      raise RuntimeError("only the primary slice saves persistently")
    if self.busy():
      raise RuntimeError("an upload is in flight: the caller skips this step (admission)")

  def _prepare(
    self, step: int, make: Callable[[], Any], confirm: Callable[[str | None], bool] | None
  ) -> tuple[bool, Any]:
    """What a process does alone before Orbax's collective save of `step`
    (Orbax's manager opened, `make()` the arrays to upload), then `confirm`.
    A failure here is told to `confirm` (the others then stay out of Orbax's
    save) and raised.

    Returns:
      (True, what make() returned) to go on; (False, None) if another
      process of the primary slice is not ready.
    """
    try:
      failpoints.hit("persistent.before_save", step)
      self.open()
      made = make()
    except Exception as e:
      if confirm is not None:
        confirm(f"{type(e).__name__}: {e}")
      raise gcs_retry.translate(
        e, what=f"preparing the upload of step {step} to", path=self.directory
      ) from e
    if confirm is not None and not confirm(None):
      return False, None
    return True, made

  def _start(self, step: int, tree: Any) -> None:
    """Orbax's save of `step` (after _prepare), collective over the primary slice."""
    self._drain_stale_error(step)
    self._saving_step = step  # before save: the finalize callback reads it
    self._upload_step, self._upload_started = step, time.monotonic()
    ocp = orbax()
    try:
      # force: the manager's cadence decides; without it Orbax silently skips
      # any step not newer than the newest one in the folder
      self._manager.save(step, args=ocp.args.PyTreeSave(tree), force=True)
    except ocp.checkpoint_manager.StepAlreadyExistsError as e:
      raise StepAlreadyExistsError(
        f"step {step} is already in the persistent tier at {self.directory}: a step of an"
        " earlier run, never overwritten (restore() removes the steps newer than the one it"
        " restored; a run started without restore() does not). This step is not uploaded;"
        f" delete the folder of step {step} there, or resume with restore()."
      ) from e
    except Exception as e:  # Orbax re-raises the previous upload's error here too
      raise self._translate(e) from e
    failpoints.hit("persistent.after_save_call", step)

  def _wait_orbax(self) -> None:
    """Orbax's wait for the upload in flight, raising its first error: where
    this process's write failed, Orbax's finalize goes on to a barrier the
    others (still waiting for this process's part) never reach, and that
    barrier's timeout is raised while handling the write's error: the write's
    error (its context) is raised instead."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      if not is_barrier_timeout(e):
        raise
      cause, seen = e.__context__, 0
      while cause is not None and seen < 8 and is_barrier_timeout(cause):
        cause, seen = cause.__context__, seen + 1
      if isinstance(cause, Exception):
        raise cause from e
      raise

  def _drain_stale_error(self, step: int) -> None:
    """Takes a failed upload's error out of Orbax's manager before the save
    of `step`. Orbax raises it again from the next save() call (once per
    calling thread, and once more from its async checkpointer), where it
    would fail `step` too, for an error that belongs to the upload before
    it, reported when it ended (the upload's future)."""
    previous = self._saving_step
    for check in (self._manager.wait_until_finished, self._manager.check_for_errors):
      try:
        check()
      except Exception as e:  # noqa: BLE001 - the previous upload's, reported here
        logger.debug(
          "%s before step %d: the upload of step %s had failed: %s",
          self._topology.log_prefix(),
          step,
          previous,
          e,
        )

  def save(
    self, step: int, tree: Any, *, confirm: Callable[[str | None], bool] | None = None
  ) -> concurrent.futures.Future | None:
    """Starts an async save of device arrays (none may be in flight).

    Called by: every process of the primary slice. Blocks on `confirm`
    and on Orbax's device-to-host copy of the shards.

    Args:
      step: the step.
      tree: the train state (jax.Arrays, replicated over the replica axis).
      confirm: as save_snapshot's.

    Returns:
      The upload's future (as save_snapshot's: True once the step is
      uploaded, its exception if Orbax's background upload failed); None
      if `confirm` said another process is not ready (the step is skipped).

    Raises:
      TopologyError: the state is not replicated over the replica axis.
      StorageError: Orbax failed to start the save (or re-raised an error).
    """
    self._check_ready()
    _check_replicated(tree, self._topology.replica_axis_name)
    go, _ = self._prepare(step, lambda: None, confirm)
    if not go:
      return None
    self._start(step, tree)

    def upload() -> bool:  # Orbax uploads in its own threads: wait for them here
      self._wait_orbax()
      return True

    return self._submit(step, upload)

  def save_snapshot(
    self,
    step: int,
    tree: Any,
    make_tree: Callable[[], Any],
    release: Callable[[], None],
    *,
    admit: Callable[[], bool] | None = None,
    confirm: Callable[[str | None], bool] | None = None,
  ) -> concurrent.futures.Future:
    """Starts a save of an immutable host snapshot (where upload_memory_kind says so).

    Called by: every process of the primary slice, in the same step order,
    when no upload is in flight. Blocks on nothing; the upload's error
    surfaces in its future and at wait_until_finished().

    Args:
      step: the step.
      tree: the train state the snapshot was taken of (checked as save()).
      make_tree: builds arrays from the snapshot, on the upload thread.
      release: runs once Orbax no longer reads the snapshot (the upload
        ended, failed or was not admitted, or this call raised).
      admit: run first on the upload thread (it may block): the upload
        goes on only if it returns True (the primary slice's agreement,
        persistent/admission.py); None admits it.
      confirm: run on the upload thread once this process prepared its
        part (None) or failed to (what failed); it may block: Orbax's save
        starts only if it returns True (every process of the primary slice
        is ready, admission.confirm); None: this process alone decides.

    Returns:
      The upload's future: True once the step is uploaded, False if it was
      not admitted; its exception if the upload failed.

    Raises:
      TopologyError: as save().
    """
    try:
      self._check_ready()
      _check_replicated(tree, self._topology.replica_axis_name)
    except BaseException:
      release()
      raise

    def upload() -> bool:
      try:
        if admit is not None and not admit():
          return False
        go, arrays = self._prepare(step, make_tree, confirm)
        if not go:
          return False
        self._start(step, arrays)
        self._wait_orbax()
        return True
      finally:
        release()

    self._upload_step, self._upload_started = step, None
    return self._submit(step, upload)

  def _submit(self, step: int, upload: Callable[[], bool]) -> concurrent.futures.Future:
    """Runs `upload` of `step` on the upload thread; a failure is recorded
    for upload_failed()."""

    def record(future: concurrent.futures.Future) -> None:
      if not future.cancelled() and future.exception() is not None:
        self._failed.append(step)

    self._upload = self._uploader.submit(upload)
    self._upload.add_done_callback(record)
    return self._upload

  def delete(self, step: int) -> None:
    """Deletes a step, finalization marker first. Called by: the primary process.

    Args:
      step: the step.
    """
    delete_step(self.directory, step)

  def restore(self, step: int, abstract_tree: Any, expected: Expected) -> Any:
    """Reads a step onto abstract_tree's shardings. Called by: every process (all alike).

    Args:
      step: the step.
      abstract_tree: the arrays to read (shape, dtype, sharding per leaf).
      expected: the step's recorded shard checksums; every byte read is
        checked against them.

    Returns:
      abstract_tree's tree of arrays.

    Raises:
      StateMismatchError: abstract_tree does not match the step's record.
      CorruptCheckpointError: naming the leaf, if a shard fails its CRC32C
        or the step's Orbax metadata contradicts its record.
    """
    _, abstract, treedef = shards_lib.leaf_paths(abstract_tree)
    layout, buffer = self.read_into(step, abstract_tree, expected)
    arrays = placement.assemble_buffer(abstract, layout, buffer)
    return jax.tree_util.tree_unflatten(treedef, arrays)

  def read_into(
    self,
    step: int,
    abstract_tree: Any,
    expected: Expected,
    select: Callable[[int, Any], bool] | None = None,
    *,
    buffer: Any = None,
    on_ready: Callable[[int, Any], None] | None = None,
  ) -> tuple[shards_lib.Layout, Any]:
    """restore()'s checks and read, into one host buffer instead of arrays.

    Called by: every process (as restore()), after `orbax_ready`.

    Args:
      step: as restore().
      abstract_tree: as restore().
      expected: as restore().
      select: reads only the slots it accepts (as persistent_read.read_into).
      buffer: write there instead of into a new buffer.
      on_ready: called as each slot is read and checked.

    Returns:
      (this process's layout, the host buffer laid out so).

    Raises:
      StateMismatchError: as restore().
      CorruptCheckpointError: as restore().
    """
    if self._orbax_ready is not None:
      self._orbax_ready()
    path = layout.tensor_step_dir(self.directory, step) / layout.ORBAX_ITEM
    return persistent_read.read_step(
      path, step, abstract_tree, orbax(), expected, select, buffer=buffer, on_ready=on_ready
    )

  def _wait_all(self) -> None:
    upload, self._upload = self._upload, None
    try:
      if upload is not None:  # every upload's task ends with Orbax's own wait
        upload.result()  # re-raises the upload's error, once
    except Exception as e:
      raise self._translate(e) from e

  def _translate(self, e: BaseException) -> BaseException:
    return gcs_retry.translate(
      e, what=f"uploading step {self._saving_step} to", path=self.directory
    )

  def wait_until_finished(self, probe: Callable[[int], str | None] = lambda step: None) -> None:
    """Blocks until the last upload is durable; re-raises its error.

    Args:
      probe: called with the step if Orbax's barrier timed out (it raises
        an untyped error carrying the coordination service's
        DEADLINE_EXCEEDED): an exchange that names missing processes
        (raising CollectiveTimeoutError), then what another process said
        of its part of that step (None: nothing).

    Raises:
      CollectiveTimeoutError: the barrier timed out (from `probe`; naming
        another process's failed part; or saying one process was only slow).
      StorageError: the upload failed.
    """
    try:
      self._wait_all()
    except Exception as e:
      if not is_barrier_timeout(e):
        raise
      step = self._saving_step
      why = probe(step) if step is not None else None
      raise CollectiveTimeoutError(
        f"{self._topology.log_prefix()} the persistent upload of step {step} timed out in"
        f" Orbax's barrier ({e}); "
        + (
          why
          or "every process of the primary slice answered afterwards, so one was only slow:"
          " raise collective_timeout_s."
        )
      ) from e

  def close(self, *, abandon: bool = False) -> None:
    """Waits for the upload in flight, then closes Orbax.

    Args:
      abandon: after a failure: leave the upload to its thread, uncommitted,
        and block on nothing.
    """
    if abandon and self._upload is not None and not self._upload.done():
      logger.warning(
        "%s closing after a failure: the upload of step %s is abandoned (not committed).",
        self._topology.log_prefix(),
        self._saving_step,
      )
      self._uploader.shutdown(wait=False, cancel_futures=True)
      exit_guard.abandoned(f"the upload of step {self._saving_step} to {self.directory}")
      return
    try:
      if self._upload is not None:
        concurrent.futures.wait([self._upload])
    finally:
      self._uploader.shutdown(wait=True)
    if self._manager is not None:
      self._manager.close()
      self._manager = None
