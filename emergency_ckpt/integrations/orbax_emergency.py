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
inherited or run; every public method Orbax's class has is defined here.

Every method is called by every process, with the same arguments, like
Orbax's; see each docstring for what it blocks on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as orbax_emergency

from emergency_ckpt.config import apply_overrides, options_from_dict
from emergency_ckpt.errors import InvalidOptionsError, StateMismatchError
from emergency_ckpt.integrations import prng_keys
from emergency_ckpt.integrations.replica_axis import find_replica_axis
from emergency_ckpt.manager import CheckpointManager as _Manager
from emergency_ckpt.options import CheckpointManagerOptions
from emergency_ckpt.restore.restorer import RestoreResult

_log = logging.getLogger(__name__)

OrbaxOptions = orbax_emergency.CheckpointManagerOptions
LocalCheckpointOptions = orbax_emergency.LocalCheckpointOptions
PersistentCheckpointOptions = orbax_emergency.PersistentCheckpointOptions

# Orbax options this facade cannot honour: set, they raise InvalidOptionsError.
_UNSUPPORTED = ("should_save_fn", "save_decision_policy", "preservation_policy")


def _check_supported(options: OrbaxOptions) -> None:
  for tier in ("local", "persistent"):
    for field in _UNSUPPORTED:
      if getattr(getattr(options, tier), field, None) is not None:
        raise InvalidOptionsError(
          f"options.{tier}.{field} is set, but the emergency_ckpt facade saves by"
          f" save_interval_steps only; unset {tier}.{field} and use"
          f" {tier}.save_interval_steps (and max_to_keep / keep_period)."
        )


def to_options(
  local_directory: Any,
  persistent_directory: Any,
  options: OrbaxOptions,
  replica_axis: str,
  overrides: Iterable[str] = (),
) -> CheckpointManagerOptions:
  """emergency_ckpt options equivalent to Orbax's `options`; `overrides`
  ("key.sub=value", as in emergency_ckpt configs) set anything else, e.g.
  "event_log=/var/log/ckpt/events_{process}.jsonl" or "peer.ports=50000-50099"."""
  _check_supported(options)
  local: dict[str, Any] = {
    "directory": str(local_directory),
    "save_interval_steps": options.local.save_interval_steps,
  }
  if options.local.max_to_keep is not None:  # Orbax: None keeps its default (1-2 steps)
    local["max_to_keep"] = options.local.max_to_keep
  persistent: dict[str, Any] = {
    "directory": str(persistent_directory),
    "save_interval_steps": options.persistent.save_interval_steps,
    "max_to_keep": options.persistent.max_to_keep,  # None: keep every step, as Orbax
    "keep_period": options.persistent.keep_period,
  }
  data = {"local": local, "persistent": persistent, "replica_axis": replica_axis}
  return options_from_dict(apply_overrides(data, overrides))


def _abstract_for_restore(item: Any, restore_args: Any) -> Any:
  """Orbax's (item, restore_args) -> a tree of ShapeDtypeStruct with the
  sharding to restore onto (restore_args' sharding first, else the item's)."""

  def one(leaf, args=None):
    sharding = getattr(args, "sharding", None) or getattr(leaf, "sharding", None)
    if sharding is None or not hasattr(leaf, "shape"):
      raise StateMismatchError(
        f"restore item leaf {leaf!r} has no sharding: pass jax.ShapeDtypeStruct leaves"
        " with sharding=..., or ocp.ArrayRestoreArgs(sharding=...) in restore_args."
      )
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

  if restore_args is None:
    return jax.tree_util.tree_map(one, item)
  return jax.tree_util.tree_map(one, item, restore_args)


def _only_state(args: Any, method: str) -> Any:
  """The `state` entry of a Composite; anything else is refused by name."""
  if args is None:
    return None
  keys = set(args.keys())
  if keys - {"state"}:
    raise InvalidOptionsError(
      f"{method}(args=Composite(...)) has items {sorted(keys - {'state'})}: the"
      " emergency_ckpt facade handles `state` only (Orbax's `dataset` item needs"
      " persistent_non_replicated_directory, which this facade does not support)."
    )
  return args.state if "state" in keys else None


class CheckpointManager:
  """Orbax's emergency CheckpointManager interface over emergency_ckpt.

  Constructor: Orbax's arguments, plus `replica_axis` (the mesh axis whose
  entries are slices; None: `options.replica_axis_index` if that axis has
  more than one entry, else the first axis that can hold slices, see
  replica_axis.find_replica_axis) and `overrides` (emergency_ckpt option
  overrides, "key.sub=value"). Called by: every process (a collective, like
  Orbax's). Blocks on: exchanging process ids; Orbax loads in the background.
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
    """The emergency_ckpt manager underneath."""
    return self._manager

  @property
  def directory(self):
    """The persistent directory (Orbax: the persistent manager's directory)."""
    from etils import epath  # noqa: PLC0415

    return epath.Path(self._options.persistent.directory)

  @property
  def global_mesh(self) -> jax.sharding.Mesh:
    return self._global_mesh

  @property
  def in_primary_slice(self) -> bool:
    """True on the processes of slice 0 (the one that uploads)."""
    return self._manager.topology.slice_index == 0

  def all_steps(self, read: bool | None = None) -> list[int]:
    """Restorable steps, oldest first (same on every process), plus, as in
    Orbax (which lists a save as soon as it starts), the newest step this
    manager saved even while that save is still in flight: callers use it to
    skip saving a step twice. Blocks on one inventory exchange (`read` is
    accepted for Orbax's signature; the answer comes from storage markers)."""
    del read
    steps = self._manager.all_steps()
    if self._newest_saved is not None and self._newest_saved not in steps:
      steps = sorted([*steps, self._newest_saved])
    return steps

  def latest_step(self) -> int | None:
    """The newest of all_steps(), or None. Blocks on one inventory exchange."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """Orbax's emergency manager raises NotImplementedError; so does this
    (no metrics reach it through Orbax's save())."""
    raise NotImplementedError(
      "best_step() needs metrics, which Orbax's save(args=...) does not carry; use"
      " emergency_ckpt.CheckpointManager.save(metrics=...) and best_step() directly."
    )

  def reload(self) -> None:
    """Nothing to reload: every listing reads storage markers. Blocks on nothing."""

  def reached_preemption(self, step: int) -> bool:
    """JAX's preemption sync point (no extra collective)."""
    return self._manager.reached_preemption(step)

  def should_save(self, step: int) -> bool:
    """Whether save(step) would save on any tier (pure; no collective)."""
    from emergency_ckpt.save import policies  # noqa: PLC0415

    return policies.decide_save(
      step,
      local_interval=self._options.local.save_interval_steps,
      persistent_interval=self._options.persistent.save_interval_steps,
      force=False,
    ).any

  def delete(self, step: int) -> None:
    """Deletes `step` from every tier (refuses the only restorable step)."""
    self._manager.delete(step)

  def save(
    self,
    step: int,
    args: Any,
    *,
    force: bool = False,
    custom_metadata: dict[str, Any] | None = None,
  ) -> bool:
    """Saves `args.state` (a PyTreeSave's item: jax.Arrays replicated over the
    replica axis) at `step` on the tiers whose interval it hits (every tier if
    `force`; typed PRNG keys are saved as their key data, see prng_keys.py).
    PyTreeSave's save_args (Orbax chunking) and custom_metadata do
    not apply. Blocks on the host copy of this process's shards only; no
    collective. Returns True if any tier saved. As Orbax's: a step not newer
    than the newest one saved or restored by this manager is not saved
    (False) unless `force`, which raises StepAlreadyExistsError for that
    very step."""
    del custom_metadata
    if not force and self._newest is not None and step <= self._newest:
      _log.info("save(step=%d) skipped: step %d was already saved or restored", step, self._newest)
      return False
    item = _only_state(args, "save")
    state = getattr(item, "item", item)
    if state is None:
      raise StateMismatchError("save(args=Composite(state=PyTreeSave(item=...))) has no item.")
    saved = self._manager.save(step, prng_keys.to_data(state), force=force)
    if saved:
      self._newest = self._newest_saved = step
    return saved

  def restore(self, step: int | None, args: Any = None) -> Any:
    """Restores `step` (None: the newest restorable) onto the shardings of
    `args.state` (PyTreeRestore item + restore_args), or of the constructor's
    abstract_state if args is None. Returns `Composite(state=tree)`, as
    Orbax's does. Blocks on the inventory exchange, this process's ramdisk
    read, and a peer transfer or persistent read only where a slice lost its
    copy."""
    item = _only_state(args, "restore")
    if item is None:
      abstract = _abstract_for_restore(self._abstract_state, None)
    else:
      target = getattr(item, "item", None)
      abstract = _abstract_for_restore(
        self._abstract_state if target is None else target, getattr(item, "restore_args", None)
      )
    result = self._manager.restore(prng_keys.abstract_data(abstract), step)
    self.last_restore = result
    self._newest = max(result.step, self._newest if self._newest is not None else result.step)
    return ocp.args.Composite(state=prng_keys.from_data(result.state, abstract))

  def item_metadata(self, step: int) -> Any:
    raise NotImplementedError("item_metadata() is not implemented (nor is it in Orbax's class).")

  def metadata(self, step: int | None = None) -> Any:
    """emergency_ckpt's StepMetadata of `step` (tiers, bytes, topology)."""
    if step is None:
      raise NotImplementedError("metadata() needs a step: the manager keeps no root metadata.")
    return self._manager.metadata(step)

  def metrics(self, step: int) -> Any:
    raise NotImplementedError("metrics() is not implemented (nor is it in Orbax's class).")

  def wait_until_finished(self) -> None:
    """Blocks until every started save is durable; raises a background error."""
    self._manager.wait_until_finished()

  def check_for_errors(self) -> None:
    """Raises the first error of background work, if any; blocks on nothing."""
    self._manager._background.raise_errors()  # noqa: SLF001

  def close(self) -> None:
    """Waits for the last saves, then releases everything."""
    self._manager.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# Trainers choose their emergency path with isinstance(m, orbax's class).
orbax_emergency.CheckpointManager.register(CheckpointManager)
