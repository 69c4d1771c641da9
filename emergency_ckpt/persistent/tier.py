"""Persistent tier: Orbax's standard format on gs:// or any path.

Saved by the primary slice only, through an Orbax CheckpointManager whose
barriers span the primary slice's processes only: it gets the global arrays
and writes the shards of replica 0, which live on the primary slice (the
state is replicated over the replica axis), so no copy is made. Restored by every process,
each reading the shards it needs straight from storage (no broadcast, so
values come back bit-exact), onto any topology: Orbax checks the tree, then
persistent_read has tensorstore read the shards into one aligned buffer (one
copy fewer than Orbax's restore).

Where the primary slice's devices are CPUs (host memory is device memory,
and Orbax's "device-to-host copy" is a zero-copy view), save() does not call
Orbax on the trainer's thread: save_snapshot() hands Orbax arrays that alias
the local tier's staged host copy (an immutable snapshot: the trainer may
donate or overwrite its arrays as soon as save() returns) and runs the Orbax
save on a background thread, so the save() stall is the staging copy alone.
On accelerators with pinned host memory (GPUs, TPUs), the upload reads the
snapshot too: save_snapshot() hands Orbax arrays in the devices'
"pinned_host" memory, built from the snapshot on the upload thread (a host
copy), so Orbax's "device-to-host copy" never touches the device and save()
waits for nothing but the staging (upload_memory_kind decides, with a probe
transfer). Elsewhere save() calls Orbax inline: its device-to-host copy must
end before the trainer may touch the arrays again.

The storage rules that need no JAX (which steps are finalized, deleting a
step, cleanup after a crash) are in persistent_layout.py.

Compression: off by default (persistent.compression turns on Orbax's zstd):
it halved upload CPU and restored 1.6x faster cold for 18% more bytes
on float32 weights (see PersistentTierOptions.compression).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from emergency_ckpt.cluster.topology import Topology
from emergency_ckpt.core import compat, failpoints, layout, storage
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.core.storage import check_bucket
from emergency_ckpt.errors import (
  CollectiveTimeoutError,
  CorruptCheckpointError,
  StateMismatchError,
)
from emergency_ckpt.options import PersistentTierOptions
from emergency_ckpt.persistent import checksums
from emergency_ckpt.persistent import read as persistent_read
from emergency_ckpt.persistent.layout import cleanup_unfinalized, delete_step, list_steps

logger = logging.getLogger("emergency_ckpt")


def _ocp():
  import orbax.checkpoint as ocp  # noqa: PLC0415 - heavy import, only when used

  try:
    from absl import flags  # noqa: PLC0415

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
  except ImportError:  # pragma: no cover - absl ships with orbax
    pass
  return ocp


PINNED_HOST = "pinned_host"
CPU_UPLOAD_MEMORY_KIND: str | None = None
"""The memory kind of the arrays an upload from a snapshot builds on CPU
devices (None: their default memory, which aliases the snapshot). Tests set
PINNED_HOST to run the accelerators' path on CPU."""


def upload_memory_kind(devices) -> tuple[bool, str | None]:
  """(whether the persistent upload reads the staged snapshot, the memory
  kind of the arrays it hands Orbax) for this process's `devices`. CPU:
  yes, in their default memory (CPU_UPLOAD_MEMORY_KIND). Accelerators: yes,
  in pinned host memory, where every device has it and a probe transfer
  into it and back works; else no (Orbax copies from the device inline,
  inside save()). Called by: the manager, once per process."""
  devices = list(devices)
  if all(d.platform == "cpu" for d in devices) and CPU_UPLOAD_MEMORY_KIND is None:
    return True, None
  if not devices or not all(
    any(m.kind == PINNED_HOST for m in d.addressable_memories()) for d in devices
  ):
    return False, None
  try:
    want = np.arange(256, dtype=np.float32)
    probe = jax.device_put(
      want.copy(), jax.sharding.SingleDeviceSharding(devices[0], memory_kind=PINNED_HOST)
    )
    ok = np.array_equal(np.asarray(probe), want)
  except Exception as e:  # noqa: BLE001 - any failure: the inline path, which always works
    logger.warning(
      "persistent uploads: a transfer into %s memory of %s failed (%s); Orbax will copy"
      " from the device inside save() instead (a longer stall at persistent steps).",
      PINNED_HOST,
      devices[0],
      e,
    )
    return False, None
  return (True, PINNED_HOST) if ok else (False, None)


def check_replicated(tree: Any, replica_axis: str) -> None:
  """Raises TopologyError unless every leaf is replicated over the replica
  axis (then the primary slice alone holds a full copy: replica 0's shards)."""
  paths, leaves, _ = shards_lib.leaf_paths(tree)
  compat.check_replicated(paths, leaves, replica_axis)


def _check_matches(metadata: Any, abstract_tree: Any, where: Any) -> None:
  """StateMismatchError unless abstract_tree has the saved tree, shapes and
  dtypes (Orbax would cast dtypes silently, and raise an untyped error on
  shapes)."""
  saved = getattr(metadata, "item_metadata", metadata)
  saved = getattr(saved, "tree", saved)
  flat = jax.tree_util.tree_flatten_with_path(saved)[0]
  recorded = {
    jax.tree_util.keystr(p): (tuple(getattr(m, "shape", ())), getattr(m, "dtype", None))
    for p, m in flat
  }
  paths, abstract, _ = shards_lib.leaf_paths(abstract_tree)
  compat.check_state(recorded, paths, abstract, where, ordered=False)


class PersistentTier:
  """Orbax on the persistent directory's tensors/ folder."""

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
    """`orbax_ready`: blocks until Orbax may be used (the manager's
    multihost set-up), called before the first save opens Orbax."""
    self._options = options
    self._topology = topology
    self._mesh = mesh
    self.directory = layout.tensors_dir(options.directory)
    self._manager = None
    self._on_finalized = on_finalized
    self._saving_step: int | None = None
    self._upload: concurrent.futures.Future | None = None  # save_snapshot's, if any
    self._uploader = concurrent.futures.ThreadPoolExecutor(1, "ec-persistent-upload")
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
    """Creates the Orbax CheckpointManager that saves (primary slice only;
    a no-op elsewhere and when done), after `orbax_ready`. Called by: the
    first persistent save on each primary-slice process; blocks on loading
    Orbax the first time. Restores never need it."""
    topology = self._topology
    if not topology.is_primary_slice or self._manager is not None:
      return
    if self._orbax_ready is not None:
      self._orbax_ready()  # never under the lock
    with self._open_lock:
      if self._manager is not None:
        return
      options, timeout_s = self._options, self._timeout_s
      ocp = _ocp()
      procs = set(topology.slice_processes[0])
      mp = ocp.options.MultiprocessingOptions(
        primary_host=topology.primary_process,
        active_processes=procs if topology.process_count > 1 else None,
        barrier_sync_key_prefix=self._barrier_prefix,
      )
      self.directory.mkdir(parents=True, exist_ok=True)  # idempotent on every process
      # Writes the shards of replica 0 only: the primary slice's.
      registry = ocp.type_handlers.create_type_handler_registry(
        (
          jax.Array,
          ocp.type_handlers.ArrayHandler(
            primary_host=topology.primary_process, replica_id=0, use_replica_parallel=False
          ),
        )
      )
      self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers=ocp.PyTreeCheckpointHandler(
          multiprocessing_options=mp,
          type_handler_registry=registry,
          use_compression=options.compression,
        ),
        options=ocp.CheckpointManagerOptions(
          max_to_keep=None,  # retention is the manager's (retention.py)
          enable_async_checkpointing=True,
          # timeout: a hung primary-slice process fails Orbax's barriers
          # after collective_timeout_s, not Orbax's default 20 minutes.
          async_options=ocp.AsyncOptions(
            timeout_secs=max(1, int(timeout_s)), post_finalization_callback=self._finalized
          ),
          multiprocessing_options=mp,
          create=False,
        ),
      )

  def _finalized(self) -> None:
    # Orbax's finalize thread, on every primary-slice process, once the step
    # is final (its commit file or rename done).
    step = self._saving_step
    if self._on_finalized is not None and step is not None:
      self._on_finalized(step)

  def steps(self) -> list[int]:
    """Committed (finalized) steps. Any process may call it."""
    return list_steps(self.directory)

  def busy(self) -> bool:
    """True while this process's previous upload is still running."""
    if self._upload is not None and not self._upload.done():
      return True
    return self._manager is not None and self._manager.is_saving_in_progress()

  def wait_previous(self, step: int) -> None:
    """At most ONE upload is in flight: waits for the previous one (and
    re-raises its error). Waiting (rather than skipping this save) needs no
    agreement between the primary slice's processes (a skip decided per
    process would split them across Orbax's barriers) and keeps the
    persistent tier's promised interval; a warning says how long it waited."""
    if self.busy():
      t0 = time.monotonic()
      previous = self._saving_step
      self._wait_all()
      logger.warning(
        "%s persistent save of step %d waited %.1fs for the upload of step %s (at most one"
        " upload is in flight): the bucket is slower than persistent.save_interval_steps"
        " allows; raise the interval or check the bucket's throughput.",
        self._topology.log_prefix(),
        step,
        time.monotonic() - t0,
        previous,
      )
    upload, self._upload = self._upload, None
    try:
      if upload is not None:
        upload.result()  # a finished upload's error surfaces here
    except Exception as e:
      raise self._translate(e) from e

  def _check_ready(self) -> None:
    """save() and save_snapshot() come after wait_previous(): at most one
    upload is in flight, and the caller chooses where to wait for it (the
    manager: before it stages, never inside the staging window)."""
    if not self._topology.is_primary_slice:
      raise RuntimeError("only the primary slice saves persistently")
    if self._upload is not None:
      raise RuntimeError("call wait_previous(step) before starting the next upload")

  def _start(self, step: int, tree: Any) -> None:
    failpoints.hit("persistent.before_save", step)
    self.open()
    self._saving_step = step  # before save: the finalize callback reads it
    try:
      self._manager.save(step, args=_ocp().args.PyTreeSave(tree))
    except Exception as e:  # Orbax re-raises the previous upload's error here too
      raise self._translate(e) from e
    failpoints.hit("persistent.after_save_call", step)

  def save(self, step: int, tree: Any) -> None:
    """Starts an async save of device arrays, after wait_previous(step).
    Called by: every process of the primary slice. Blocks on Orbax's
    device-to-host copy of the shards."""
    self._check_ready()
    check_replicated(tree, self._topology.replica_axis_name)
    self._start(step, tree)

  def save_snapshot(
    self, step: int, tree: Any, make_tree: Callable[[], Any], release: Callable[[], None]
  ) -> None:
    """Starts a save of an immutable host snapshot of `tree` (where
    upload_memory_kind says so): `make_tree()` builds arrays from the
    snapshot (on CPU aliasing it; on accelerators in pinned host memory), on
    the upload thread; `release()` runs once Orbax no longer reads it (the
    upload ended or failed). Called by: every process of the primary slice,
    in the same step order, after wait_previous(step). Blocks on nothing."""
    try:
      self._check_ready()
      check_replicated(tree, self._topology.replica_axis_name)
    except BaseException:
      release()
      raise

    def upload() -> None:
      try:
        self._start(step, make_tree())
        self._manager.wait_until_finished()
      finally:
        release()

    self._saving_step = step
    self._upload = self._uploader.submit(upload)

  def delete(self, step: int) -> None:
    """Deletes `step` (finalization marker first). Called by: the primary process."""
    delete_step(self.directory, step)

  def restore(self, step: int, abstract_tree: Any, expected: checksums.Expected) -> Any:
    """Reads `step` onto abstract_tree's shardings, every byte checked
    against `expected` (CorruptCheckpointError naming the leaf otherwise).
    Called by: every process (all alike)."""
    _, abstract, treedef = shards_lib.leaf_paths(abstract_tree)
    layout, buffer = self.read_into(step, abstract_tree, expected)
    arrays = shards_lib.assemble_buffer(abstract, layout, buffer)
    return jax.tree_util.tree_unflatten(treedef, arrays)

  def read_into(
    self,
    step: int,
    abstract_tree: Any,
    expected: checksums.Expected,
    select: Callable[[int, Any], bool] | None = None,
    *,
    buffer: Any = None,
    on_ready: Callable[[int, Any], None] | None = None,
  ) -> tuple[shards_lib.Layout, Any]:
    """restore()'s checks and read, into (layout, host buffer) instead of
    arrays; `select`, `buffer`, `on_ready`: as persistent_read.read_into.
    Called by: every process (as restore())."""
    if self._orbax_ready is not None:
      self._orbax_ready()
    ocp = _ocp()
    path = layout.tensor_step_dir(self.directory, step) / layout.ORBAX_ITEM
    # What was saved, from the step's own checksummed record: a mismatch
    # there is the caller's; one with Orbax's metadata after it is damage.
    paths, abstract, _ = shards_lib.leaf_paths(abstract_tree)
    compat.check_state(
      {p: (shape, shards_lib.dtype_from_name(dt)) for p, (shape, dt) in expected.arrays.items()},
      paths,
      abstract,
      path,
      ordered=False,
    )
    try:
      with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        _check_matches(ckptr.metadata(path), abstract_tree, path)
      return persistent_read.read_into(
        path, abstract_tree, ocp, expected, select, buffer=buffer, on_ready=on_ready
      )
    except StateMismatchError as e:
      what = str(e).split(" Pass the abstract_state")[0]
      raise CorruptCheckpointError(
        f"persistent step {step}'s stored array metadata is damaged: it contradicts the"
        f" step's checksummed record of its shapes and dtypes ({what})"
      ) from e

  def _wait_all(self) -> None:
    upload, self._upload = self._upload, None
    try:
      if upload is not None:
        upload.result()  # re-raises the upload's error
      if self._manager is not None:
        self._manager.wait_until_finished()
    except Exception as e:
      raise self._translate(e) from e

  def _translate(self, e: BaseException) -> BaseException:
    return storage.translate(e, what=f"uploading step {self._saving_step} to", path=self.directory)

  def wait_until_finished(self, probe: Callable[[], Any] = lambda: None) -> None:
    """Blocks until the last upload is durable; re-raises its error. If
    Orbax's barrier timed out (it raises an untyped error carrying the
    coordination service's DEADLINE_EXCEEDED), calls `probe()` (an exchange
    that names missing processes, raising CollectiveTimeoutError) and else
    raises CollectiveTimeoutError saying one process was only slow."""
    try:
      self._wait_all()
    except Exception as e:
      text = str(e)
      if not (isinstance(e, TimeoutError) or "DEADLINE" in text or "timed out" in text.lower()):
        raise
      probe()
      raise CollectiveTimeoutError(
        f"{self._topology.log_prefix()} the persistent upload's barrier timed out ({e});"
        " every process of the primary slice answered afterwards, so one was only slow:"
        " raise collective_timeout_s."
      ) from e

  def in_flight(self) -> concurrent.futures.Future | None:
    """The background upload started last (done or not), or None."""
    return self._upload

  def close(self, *, abandon: bool = False) -> None:
    """Waits for the upload in flight, unless `abandon` (after a failure):
    then it is left to its thread, uncommitted, and nothing here blocks."""
    if abandon and self._upload is not None and not self._upload.done():
      logger.warning(
        "%s closing after a failure: the upload of step %s is abandoned (not committed).",
        self._topology.log_prefix(),
        self._saving_step,
      )
      self._uploader.shutdown(wait=False, cancel_futures=True)
      return
    try:
      if self._upload is not None:
        concurrent.futures.wait([self._upload])
    finally:
      self._uploader.shutdown(wait=True)
    if self._manager is not None:
      self._manager.close()
      self._manager = None
