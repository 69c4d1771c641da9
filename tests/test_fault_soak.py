"""Issue "A failing tier never stops training", part 4: a seeded fault soak.

One training run per configuration, restarted round after round: each
round a real multi-process jax.distributed job restores (checking every
bit and data_state), trains, and is SIGKILLed at a seeded moment; then
ramdisks are wiped, local files flipped, truncated or removed, hosts
shuffled, the newest persistent step damaged, the bucket hung or failing
(tests/soak/runner.py lists the invariants checked every round).

Fixed seeds here; EC_SOAK_SEED / EC_SOAK_ROUNDS run others or more rounds
(`python -m tests.soak --seed N --rounds R ...` replays one configuration
from the shell). Every round's problems are collected (keep_going), so one
failure does not hide another.
"""

from __future__ import annotations

import os

import pytest

from tests.soak import Config, run_soak

ROUNDS = 4
SEED_ENV, ROUNDS_ENV = "EC_SOAK_SEED", "EC_SOAK_ROUNDS"


# (configuration, fixed seed)
CASES = [
  (Config(redundancy="partner", slices=1, processes=4), 11),
  (Config(redundancy="xor", slices=1, processes=4, gcs=True), 12),
  (Config(redundancy="none", slices=2, processes=4, gcs=True), 13),
  (Config(redundancy="partner", slices=2, processes=4), 14),
]


@pytest.mark.parametrize(("config", "seed"), CASES, ids=[c.name for c, _ in CASES])
def test_fault_soak(config, seed, shm_dir, request, fault_matrix):
  seed = int(os.environ.get(SEED_ENV, seed))
  rounds = int(os.environ.get(ROUNDS_ENV, ROUNDS))
  gcs = None
  if config.gcs:
    gcs = (request.getfixturevalue("gcs_server"), request.getfixturevalue("gcs_proxy"))
  summary = run_soak(config, seed, rounds, shm_dir, gcs=gcs, keep_going=True)
  assert summary["rounds"] == rounds and summary["restores"] >= 1, summary
  if summary["ok"]:
    fault_matrix.check(
      f"soak.{config.name}",
      f"seed {seed}, {rounds} rounds: faults {summary['faults']}; restores by source"
      f" {summary['restores_by_source']}; lost {summary['lost']}, regressed {summary['regressed']},"
      f" silent {summary['silent']}",
      summary["lost"] == summary["regressed"] == summary["silent"] == 0,
    )
    return
  report = "\n\n".join(f["text"] for f in summary["failures"])
  kinds = {k for f in summary["failures"] for k in f["kinds"]}
  fault_matrix.record(f"soak.{config.name}", f"seed {seed}: {sorted(kinds)}", False)
  raise AssertionError(f"soak failed ({sorted(kinds)}), seed {seed}:\n{report}")
