"""Integrations with trainers that already use Orbax's emergency checkpointing.

- `orbax_emergency`: `CheckpointManager`, a stand-in for Orbax's
  `orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager`
  (same constructor and methods) that runs emergency_ckpt underneath.
- `maxtext`: `install()`, one call that makes MaxText build that stand-in.

Each imports Orbax (and `maxtext` MaxText) when imported; the package itself
imports nothing.
"""
