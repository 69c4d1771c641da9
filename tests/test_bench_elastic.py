"""Smoke test of the elastic benchmark (benchmarks.elastic): every
row at 1 MiB per replica, 1 round, end to end (real multi-process
jax.distributed jobs: 2 save jobs, 7 restart jobs).

Checks the rows exist, every job restored the newest saved step bit for bit,
and each row's sources are the ones its scenario implies. No timing
assertions: the machine is shared.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import elastic


def test_elastic_benchmark_reports_every_row_bit_exact(tmp_path):
  out = tmp_path / "elastic"
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.elastic", "--mib-per-replica", "1"]
    + ["--reps", "1", "--out", str(out)],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-6000:]
  doc = json.loads((out / "results.json").read_text())
  assert doc["errors"] == {}, doc["errors"]
  assert set(doc["rows"]) == set(elastic.ROWS)
  for name, row in doc["rows"].items():
    assert not row.get("error"), (name, row)
    assert row["bit_exact"] and row["mismatched_shards"] == 0, (name, row)
    assert row["shards_checked"] > 0, (name, row)
    assert row["newest_step"] and row["steps"] == [doc["config"]["expected_step"]], (name, row)
    for key in elastic.METRICS:
      assert row[key]["median"] > 0, (name, key, row[key])
  assert (out / "results.md").read_text().count("| `") == len(elastic.ROWS)

  def sources(name: str) -> set[str]:
    return {s.split(" (")[0] for job in doc["rows"][name]["sources"] for s in job}

  assert sources("ours_same") == {"local"}
  assert sources("ours_reshard") <= {"local", "peer"} and "local" in sources("ours_reshard")
  assert sources("ours_persistent") == sources("ours_persistent_4x1") == {"persistent"}
  assert sources("p2p_same") == {"local"}
  assert sources("p2p_persistent") == {"persistent"}
  # Orbax P2P finds no complete copy for the new slice shape: its persistent tier
  p2p = doc["per_rep"]["p2p_reshard"]["0"]
  assert sources("p2p_reshard") == {"persistent"}, p2p
  assert all(p["detail"]["registry_complete_step"] is None for p in p2p), p2p
