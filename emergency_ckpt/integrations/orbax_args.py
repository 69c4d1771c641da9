"""Orbax's emergency-manager options and save/restore args, translated for
emergency_ckpt (pure).

The orbax_emergency facade takes what Orbax's emergency CheckpointManager
takes: its CheckpointManagerOptions (intervals, max_to_keep, keep_period)
become emergency_ckpt's options; a Composite of `state` (PyTreeSave /
PyTreeRestore) becomes the tree to save, or the abstract tree to restore
onto. Anything the facade cannot honour is refused by name
(InvalidOptionsError), never ignored.

Called by: the orbax_emergency facade (constructor, save, restore), on
every process. Blocks on nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
from orbax.checkpoint.experimental.emergency import checkpoint_manager as orbax_emergency

from emergency_ckpt.config import apply_overrides, options_from_dict
from emergency_ckpt.errors import InvalidOptionsError, StateMismatchError
from emergency_ckpt.options import CheckpointManagerOptions

# Orbax options this facade cannot honour: set, they raise InvalidOptionsError.
_UNSUPPORTED = ("should_save_fn", "save_decision_policy", "preservation_policy")


def _check_supported(options: orbax_emergency.CheckpointManagerOptions) -> None:
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
  options: orbax_emergency.CheckpointManagerOptions,
  replica_axis: str,
  overrides: Iterable[str] = (),
) -> CheckpointManagerOptions:
  """emergency_ckpt options equivalent to Orbax's.

  Args:
    local_directory: Orbax's local (ramdisk) directory.
    persistent_directory: Orbax's persistent directory.
    options: Orbax's emergency CheckpointManagerOptions.
    replica_axis: the mesh axis whose entries are slices.
    overrides: emergency_ckpt options to set besides ("key.sub=value", as
      in emergency_ckpt configs), e.g.
      "event_log=/var/log/ckpt/events_{process}.jsonl" or
      "peer.ports=50000-50099".

  Returns:
    The options.

  Raises:
    InvalidOptionsError: `options` sets what the facade cannot honour
      (should_save_fn, save_decision_policy, preservation_policy), or an
      override is invalid.
    ConfigError: an override is malformed.
  """
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


def abstract_for_restore(item: Any, restore_args: Any) -> Any:
  """The tree to restore onto, from Orbax's (item, restore_args).

  Args:
    item: a tree of arrays or jax.ShapeDtypeStruct.
    restore_args: a matching tree of ArrayRestoreArgs, or None.

  Returns:
    A tree of jax.ShapeDtypeStruct, each with the sharding to restore onto
    (restore_args' sharding first, else the item's).

  Raises:
    StateMismatchError: a leaf has no sharding either way.
  """

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


def only_state(args: Any, method: str) -> Any:
  """The `state` entry of a Composite; anything else is refused by name.

  Args:
    args: Orbax's Composite args, or None.
    method: the facade method, for the message ("save" or "restore").

  Returns:
    args.state, or None if `args` is None or has no state.

  Raises:
    InvalidOptionsError: `args` has items other than `state`.
  """
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
