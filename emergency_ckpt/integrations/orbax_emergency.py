"""A stand-in for Orbax's emergency `CheckpointManager`, run by emergency_ckpt.

Code written for `orbax.checkpoint.experimental.emergency.checkpoint_manager.
CheckpointManager` (MaxText's emergency checkpointing, for one) builds this
class with the same arguments and calls the same methods:

    mngr = CheckpointManager(local_dir, persistent_dir, global_mesh=mesh,
                             abstract_state=abstract, options=orbax_options)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    state = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract, restore_args=...))).state

Underneath is one `emergency_ckpt.CheckpointManager`: every slice keeps a
ramdisk copy (Orbax's own primary slice keeps none), a restart restores
each slice from its own copy, a lost slice from a peer, bit-exactly.
`isinstance(mngr, orbax's CheckpointManager)` is True: this class is
registered as a virtual subclass of Orbax's (an ABC), because trainers pick
their emergency code path with that check. Nothing of Orbax's class is
inherited or run; every public method Orbax's class has is defined here
(orbax_args.py translates its options and args).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as orbax_emergency

from emergency_ckpt.core.health import Health
from emergency_ckpt.errors import InvalidOptionsError, StateMismatchError
from emergency_ckpt.integrations import prng_keys
from emergency_ckpt.integrations.orbax_args import abstract_for_restore, only_state, to_options
from emergency_ckpt.integrations.replica_axis import find_replica_axis
from emergency_ckpt.manager import CheckpointManager as _Manager
from emergency_ckpt.restore.restorer import RestoreResult

_log = logging.getLogger(__name__)

OrbaxOptions = orbax_emergency.CheckpointManagerOptions
LocalCheckpointOptions = orbax_emergency.LocalCheckpointOptions
PersistentCheckpointOptions = orbax_emergency.PersistentCheckpointOptions


class CheckpointManager:
  """Orbax's emergency CheckpointManager interface over emergency_ckpt.

  Called by: every process (a collective, like Orbax's). Blocks on:
  exchanging process ids; Orbax loads in the background.

  Args:
    local_directory: the ramdisk directory (Orbax's local directory).
    persistent_directory: the persistent directory.
    global_mesh: the device mesh the train state is sharded over.
    abstract_state: the train state's abstract tree (restore()'s default
      target).
    options: Orbax's emergency CheckpointManagerOptions (intervals,
      max_to_keep, keep_period); None: Orbax's defaults.
    metadata: Orbax's root metadata: accepted, not kept.
    logger: Orbax's step logger: accepted, not used.
    item_handlers: must be None (the facade saves `state` with its own).
    handler_registry: must be None.
    persistent_non_replicated_directory: must be None (no `dataset` item).
    replica_axis: the mesh axis whose entries are slices; None:
      `options.replica_axis_index` if that axis has more than one entry,
      else the first axis that can hold slices (find_replica_axis).
    overrides: emergency_ckpt option overrides, "key.sub=value".

  Raises:
    InvalidOptionsError: an argument or option the facade cannot honour
      (named), or an invalid override.
    TopologyError: no mesh axis can hold the slices as asked.
  """

  def __init__(
    self,
    local_directory: Any,
    persistent_directory: Any,
    global_mesh: jax.sharding.Mesh,
    abstract_state: Any,
    *,
    options: OrbaxOptions | None = None,
    metadata: dict[str, Any] | None = None,
    logger: Any = None,
    item_handlers: Any = None,
    handler_registry: Any = None,
    persistent_non_replicated_directory: Any = None,
    replica_axis: str | int | None = None,
    overrides: Iterable[str] = (),
  ):
    del metadata, logger  # Orbax's root metadata and step logger: not kept
    if item_handlers is not None or handler_registry is not None:
      raise InvalidOptionsError(
        "item_handlers / handler_registry are set, but the emergency_ckpt facade"
        " saves `state` with its own handlers; leave them unset."
      )
    if persistent_non_replicated_directory is not None:
      raise InvalidOptionsError(
        "persistent_non_replicated_directory is set, but the emergency_ckpt facade"
        " has no `dataset` item; save non-tensor state with"
        " emergency_ckpt.CheckpointManager.save(data_state=...) instead."
      )
    options = options or OrbaxOptions()
    if replica_axis is None:
      replica_axis = find_replica_axis(
        global_mesh, abstract_state, preferred=options.replica_axis_index
      )
    self._global_mesh = global_mesh
    self._abstract_state = abstract_state
    self._options = to_options(
      local_directory, persistent_directory, options, replica_axis, overrides
    )
    self._manager = _Manager(self._options, mesh=global_mesh)
    self._newest: int | None = None  # the newest step saved or restored here
    self._newest_saved: int | None = None  # the newest step saved here
    self.last_restore: RestoreResult | None = None
    """The last restore()'s result (step, data_state, source: local, peer or
    persistent), for logs and tests."""
    topo = self._manager.topology
    _log.info(
      "%s orbax_emergency facade: replica axis %r (%d slices)",
      topo.log_prefix(),
      topo.replica_axis_name,
      len(topo.slice_processes),
    )

  # ---- what Orbax's class exposes --------------------------------------------
  @property
  def manager(self) -> _Manager:
    """The emergency_ckpt manager underneath. Called by: any process."""
    return self._manager

  @property
  def directory(self) -> Any:
    """The persistent directory (epath.Path), as Orbax's. Called by: any process."""
    from etils import epath  # noqa: PLC0415

    return epath.Path(self._options.persistent.directory)

  @property
  def global_mesh(self) -> jax.sharding.Mesh:
    """The mesh the manager was built with. Called by: any process."""
    return self._global_mesh

  @property
  def in_primary_slice(self) -> bool:
    """True on slice 0's processes (the one that uploads). Called by: any process."""
    return self._manager.topology.slice_index == 0

  def all_steps(self, read: bool | None = None) -> list[int]:
    """Restorable steps, plus, as in Orbax (which lists a save as soon as it
    starts), the newest step this manager saved even while that save is
    still in flight: callers use it to skip saving a step twice. Called by:
    every process. Blocks on one inventory exchange.

    Args:
      read: accepted for Orbax's signature; the answer comes from storage
        markers either way.

    Returns:
      The steps, oldest first (the same on every process).

    Raises:
      CollectiveTimeoutError: a process did not join the exchange in time.
    """
    del read
    steps = self._manager.all_steps()
    if self._newest_saved is not None and self._newest_saved not in steps:
      steps = sorted([*steps, self._newest_saved])
    return steps

  def latest_step(self) -> int | None:
    """The newest of all_steps(). Called by: every process. Blocks on one
    inventory exchange.

    Returns:
      The step, or None.

    Raises:
      CollectiveTimeoutError: a process did not join the exchange in time.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """Not available, as in Orbax's emergency manager: no metrics reach it
    through Orbax's save().

    Raises:
      NotImplementedError: always.
    """
    raise NotImplementedError(
      "best_step() needs metrics, which Orbax's save(args=...) does not carry; use"
      " emergency_ckpt.CheckpointManager.save(metrics=...) and best_step() directly."
    )

  def reload(self) -> None:
    """Nothing to reload: listings read storage markers. Called by: any; blocks on nothing."""

  def reached_preemption(self, step: int) -> bool:
    """Whether to save now and stop (CheckpointManager.reached_preemption).
    Called by: every process, every step. Blocks on JAX's preemption sync
    point (no extra collective).

    Args:
      step: the current step.

    Returns:
      True at the step where every process stops.
    """
    return self._manager.reached_preemption(step)

  def should_save(self, step: int) -> bool:
    """Whether save(step) would save on any tier. Called by: any process.
    Blocks on nothing (pure; no collective).

    Args:
      step: the step.

    Returns:
      True if `step` hits the local or the persistent interval (with
      "auto" or save_interval_s: the steps agreed so far, see
      SavePipeline.would_save).
    """
    return self._manager._saves.would_save(step).any  # noqa: SLF001 - the facade looks in

  def delete(self, step: int) -> None:
    """Deletes `step` from every tier (CheckpointManager.delete). Called
    by: every process. Blocks on background saves, one exchange and two
    barriers.

    Args:
      step: the step.

    Raises:
      ProtectedStepError: it is the only restorable step.
    """
    self._manager.delete(step)

  def save(
    self,
    step: int,
    args: Any,
    *,
    force: bool = False,
    custom_metadata: dict[str, Any] | None = None,
  ) -> bool:
    """Saves `args.state` at `step` on the tiers whose interval it hits
    (every tier if `force`). Typed PRNG keys are saved as their key data
    (prng_keys.py). As Orbax's: a step not newer than the newest one saved
    or restored by this manager is not saved unless `force`. Called by:
    every process. Blocks on the host copy of this process's shards only;
    no collective.

    Args:
      step: the step.
      args: Composite(state=PyTreeSave(item=tree)), the tree of jax.Arrays
        replicated over the replica axis (PyTreeSave's save_args, Orbax's
        chunking, do not apply).
      force: save on every tier, even a step not newer than the last.
      custom_metadata: accepted, not kept.

    Returns:
      True if any tier saved.

    Raises:
      StepAlreadyExistsError: `force` and `step` is the newest step saved.
      StateMismatchError: `args` has no item.
      InvalidOptionsError: `args` has items other than `state`.
    """
    del custom_metadata
    if not force and self._newest is not None and step <= self._newest:
      _log.info("save(step=%d) skipped: step %d was already saved or restored", step, self._newest)
      return False
    item = only_state(args, "save")
    state = getattr(item, "item", item)
    if state is None:
      raise StateMismatchError("save(args=Composite(state=PyTreeSave(item=...))) has no item.")
    saved = self._manager.save(step, prng_keys.to_data(state), force=force)
    if saved:
      self._newest = self._newest_saved = step
    return saved

  def restore(self, step: int | None, args: Any = None) -> Any:
    """Restores `step` onto the shardings of `args.state`, or of the
    constructor's abstract_state. Called by: every process. Blocks on the
    inventory exchange, this process's ramdisk read, and a peer transfer
    or persistent read only where a slice lost its copy.

    Args:
      step: the step; None: the newest restorable one.
      args: Composite(state=PyTreeRestore(item=..., restore_args=...)), or
        None for the constructor's abstract_state.

    Returns:
      Composite(state=tree), as Orbax's does.

    Raises:
      NoRestorableCheckpointError: nothing is restorable.
      StepNotRestorableError: `step` is not restorable.
      StateMismatchError: the target does not match the saved step, or a
        leaf has no sharding.
      InvalidOptionsError: `args` has items other than `state`.
    """
    item = only_state(args, "restore")
    if item is None:
      abstract = abstract_for_restore(self._abstract_state, None)
    else:
      target = getattr(item, "item", None)
      abstract = abstract_for_restore(
        self._abstract_state if target is None else target, getattr(item, "restore_args", None)
      )
    result = self._manager.restore(prng_keys.abstract_data(abstract), step)
    self.last_restore = result
    self._newest = max(result.step, self._newest if self._newest is not None else result.step)
    return ocp.args.Composite(state=prng_keys.from_data(result.state, abstract))

  def item_metadata(self, step: int) -> Any:
    """Not available (nor in Orbax's class).

    Args:
      step: the step (unused).

    Raises:
      NotImplementedError: always.
    """
    raise NotImplementedError("item_metadata() is not implemented (nor is it in Orbax's class).")

  def metadata(self, step: int | None = None) -> Any:
    """emergency_ckpt's StepMetadata of `step` (tiers, bytes, topology).
    Called by: every process. Blocks on one exchange.

    Args:
      step: the step (required: there is no root metadata).

    Returns:
      Its StepMetadata.

    Raises:
      NotImplementedError: `step` is None.
      StepError: no tier has it.
    """
    if step is None:
      raise NotImplementedError("metadata() needs a step: the manager keeps no root metadata.")
    return self._manager.metadata(step)

  def metrics(self, step: int) -> Any:
    """Not available (nor in Orbax's class).

    Args:
      step: the step (unused).

    Raises:
      NotImplementedError: always.
    """
    raise NotImplementedError("metrics() is not implemented (nor is it in Orbax's class).")

  def wait_until_finished(self) -> None:
    """Blocks until every started save is durable. Called by: every process.

    Raises:
      EmergencyCheckpointError: the first error of background work.
    """
    self._manager.wait_until_finished()

  def check_for_errors(self) -> Health:
    """Unlike Orbax's, reports a sick tier (logged, returned), never raises
    it: training goes on. Called by: any process. Blocks on nothing.

    Returns:
      The manager's health() (per tier: newest durable step, work in
      flight, failures, skipped steps).

    Raises:
      EmergencyCheckpointError: a background error that is the caller's to
        fix (emergency_ckpt.errors.CALLER_ERRORS), once.
    """
    return self._manager.check_for_errors()

  def close(self) -> None:
    """Waits for the last saves, then releases everything. Called by:
    every process.

    Raises:
      EmergencyCheckpointError: background work failed while waiting.
    """
    self._manager.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


# Trainers choose their emergency path with isinstance(m, orbax's class).
orbax_emergency.CheckpointManager.register(CheckpointManager)
