"""A seeded fault soak (issue "A failing tier never stops training", part 4).

One training run restarted many times: each round is a real multi-process
jax.distributed job (tests/soak/job.py) that restores, checks every bit,
trains and is SIGKILLed at a seeded moment; then seeded damage is done to
what it left (ramdisks wiped, local files flipped, truncated or removed,
hosts shuffled, the newest persistent step damaged, the bucket hung or
failing). tests/soak/runner.py states the invariants checked every round.

From the shell (one seed replays a run's plan):
  python -m tests.soak --seed 7 --rounds 30 --redundancy xor [--slices 2] [--gcs] [--out F]
From Python: `run_soak(Config(...), seed, rounds, root)`; in CI:
tests/test_fault_soak.py.
"""

from tests.soak.runner import Config, Soak, plan_round, run_soak

__all__ = ["Config", "Soak", "plan_round", "run_soak"]
