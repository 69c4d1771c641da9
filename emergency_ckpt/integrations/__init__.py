"""Integrations with trainers that already use Orbax's emergency checkpointing.

- `orbax_emergency`: `CheckpointManager`, a stand-in for Orbax's
  `orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager`
  (same constructor and methods) that runs emergency_ckpt underneath.
- `maxtext`: `install()`, one call that makes MaxText build that stand-in.
- `orbax_args`, `prng_keys`, `replica_axis`: what the stand-in translates
  (Orbax's options and args, typed PRNG keys, the mesh axis of the slices).

Each imports Orbax (and `maxtext` MaxText) when imported; the package itself
imports nothing.
"""
