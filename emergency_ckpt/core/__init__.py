"""Pure building blocks shared by every tier: the on-disk names, shard layouts, resharding plans, XOR parity arithmetic, compatibility checks, storage paths and structured events."""
