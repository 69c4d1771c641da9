"""Non-tensor state: one JSON file per process per step and the COMMIT marker that makes a step restorable."""
