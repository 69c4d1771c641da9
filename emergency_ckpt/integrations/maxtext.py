"""MaxText on emergency_ckpt: one call, `install()`, before MaxText's train main.

MaxText (`enable_emergency_checkpoint=true`) builds Orbax's emergency
CheckpointManager in `maxtext.common.emergency_checkpointing.
create_emergency_checkpoint_manager` (also reachable as
`maxtext.common.checkpointing.create_orbax_emergency_checkpoint_manager`) and
then calls it through `checkpointing.save_checkpoint`, `load_state_if_possible`,
`latest_step`, `all_steps`, `wait_until_finished` and `reached_preemption`,
each of which picks the emergency path with `isinstance(m, orbax's class)`.
`install()` replaces that factory (both names) with one that builds the
`orbax_emergency.CheckpointManager` facade, which passes that check.

Called by: each process, once, before MaxText creates its checkpoint manager
(e.g. before `maxtext.trainers.pre_train.train.main(argv)`). Blocks on nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

_log = logging.getLogger(__name__)

_FACTORY = "create_emergency_checkpoint_manager"
_ALIAS = "create_orbax_emergency_checkpoint_manager"


def make_factory(
  *, replica_axis: str | int | None = None, overrides: Iterable[str] = ()
) -> Callable[..., Any]:
  """A drop-in for MaxText's create_emergency_checkpoint_manager (same
  signature) that returns the orbax_emergency facade. Called by: install()
  (or a caller wiring MaxText by hand). Blocks on nothing.

  Args:
    replica_axis: the mesh axis whose entries are slices (None: found).
    overrides: emergency_ckpt options, "key.sub=value".

  Returns:
    The factory; it builds the facade on every process (a collective).
  """
  overrides = tuple(overrides)

  def create_emergency_checkpoint_manager(
    local_checkpoint_dir: str,
    persistent_checkpoint_dir: str,
    global_mesh: Any,
    abstract_state: Any,
    local_save_interval_steps: int,
    persistent_save_interval_steps: int,
    orbax_logger: Any = None,
  ):
    """Builds emergency_ckpt's Orbax-compatible manager for MaxText.
    Called by: MaxText, on every process (a collective).

    Args:
      local_checkpoint_dir: the ramdisk directory.
      persistent_checkpoint_dir: the persistent directory.
      global_mesh: MaxText's mesh.
      abstract_state: the train state's abstract tree (an NNX state is
        saved in its Linen layout, as MaxText's own factory does).
      local_save_interval_steps: the local tier's interval.
      persistent_save_interval_steps: the persistent tier's interval.
      orbax_logger: accepted, not used.

    Returns:
      The orbax_emergency facade.
    """
    del orbax_logger
    from flax import nnx  # noqa: PLC0415
    from maxtext.common import train_state_nnx  # noqa: PLC0415

    from emergency_ckpt.integrations import orbax_emergency  # noqa: PLC0415

    # As MaxText's own factory: checkpoints hold the Linen layout of an NNX state.
    if isinstance(abstract_state, nnx.State):
      abstract_state = train_state_nnx.to_checkpoint_dict(abstract_state)
    options = orbax_emergency.OrbaxOptions(
      local=orbax_emergency.LocalCheckpointOptions(save_interval_steps=local_save_interval_steps),
      persistent=orbax_emergency.PersistentCheckpointOptions(
        save_interval_steps=persistent_save_interval_steps
      ),
    )
    manager = orbax_emergency.CheckpointManager(
      local_checkpoint_dir,
      persistent_checkpoint_dir,
      global_mesh=global_mesh,
      abstract_state=abstract_state,
      options=options,
      replica_axis=replica_axis,
      overrides=overrides,
    )
    _log.info("emergency_ckpt: MaxText's emergency checkpoint manager is emergency_ckpt's")
    return manager

  return create_emergency_checkpoint_manager


def install(*, replica_axis: str | int | None = None, overrides: Iterable[str] = ()) -> None:
  """Makes MaxText's emergency checkpointing run on emergency_ckpt.

  Idempotent: a second call replaces the first's settings. Called by: each
  process, before MaxText creates its checkpoint manager. Blocks on
  importing MaxText's checkpointing modules.

  Args:
    replica_axis: the mesh axis whose entries are slices; None finds it
      (the first axis of size > 1 made of whole processes over which the
      state is replicated: `data` when `dcn_data_parallelism` > 1, see
      replica_axis.py).
    overrides: emergency_ckpt options, "key.sub=value" (e.g.
      "local.max_to_keep=3", "event_log=/tmp/ckpt_{process}.jsonl").

  Raises:
    ImportError: MaxText is not importable.
  """
  try:
    from maxtext.common import checkpointing, emergency_checkpointing  # noqa: PLC0415
  except ImportError as e:
    raise ImportError(
      f"emergency_ckpt.integrations.maxtext.install() needs MaxText importable ({e});"
      " install it (pip install maxtext) into this environment."
    ) from e
  factory = make_factory(replica_axis=replica_axis, overrides=overrides)
  setattr(emergency_checkpointing, _FACTORY, factory)
  setattr(checkpointing, _ALIAS, factory)


def main() -> None:
  """`python -m emergency_ckpt.integrations.maxtext CONFIG.yml key=value ...`:
  MaxText's own train entry point (`maxtext.trainers.pre_train.train`, same
  arguments, same jax.distributed set-up) with install() done first.
  Called by: every process of the job (the command line). Blocks on the
  whole training run.

  Raises:
    ImportError: MaxText (or absl) is not importable.
  """
  from absl import app  # noqa: PLC0415
  from maxtext.trainers.pre_train import train  # noqa: PLC0415

  install()
  app.run(train.main)


if __name__ == "__main__":
  main()
