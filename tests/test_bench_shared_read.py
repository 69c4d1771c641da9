"""Smoke test of the shared-read benchmark (benchmarks.shared_read):
1 MiB per replica, 1 round, end to end (real multi-process jax.distributed
jobs on fake-gcs-server behind the byte-counting proxy: one save job, one
restore job running every mode).

Checks every row exists, every restore came bit-exact from the persistent
tier without a fallback, and the bytes: the per-process read about 2x the
model, the shared modes about 1x. No timing assertions: the machine is
shared.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import shared_read


def test_shared_read_benchmark_reports_every_mode(tmp_path):
  out = tmp_path / "shared"
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.shared_read", "--mib-per-replica", "1"]
    + ["--reps", "1", "--out", str(out)],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-6000:]
  doc = json.loads((out / "results.json").read_text())
  assert doc["errors"] == {}, doc["errors"]
  assert list(doc["rows"]) == ["per_process", "readers_2", "readers_1"]
  for name, row in doc["rows"].items():
    assert row["bit_exact"] and row["shards_checked"] > 0, (name, row)
    assert row["sources"] == ["persistent"] and row["steps"] == [shared_read.STEP], (name, row)
    assert row["fell_back"] == 0, (name, row)
    assert row["restore_s"]["median"] > 0, (name, row)
  vs_model = {name: row["bytes_vs_model"]["median"] for name, row in doc["rows"].items()}
  assert vs_model["per_process"] >= 2.0, vs_model
  # 1 MiB: metadata, state files and listings add a few percent per slice
  assert vs_model["readers_2"] < 1.3 and vs_model["readers_1"] < 1.3, vs_model
  assert doc["load_before"] and doc["load_after"]
  assert (out / "results.md").read_text().count("| `") == 3
