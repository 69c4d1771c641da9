"""Smoke test of the redundancy benchmark (issue 18):
`python -m benchmarks.redundancy` end to end at a tiny size
(0.25 MiB per process, 1 rep): a real 4-process job, one slice, each
process a simulated machine. Checks that every row exists for `none` and
every redundancy scheme the library has, that every restore returned the
saved step bit for bit, and that the lost host was rebuilt from its
redundancy (not the persistent tier). No timing assertions: the machine is
shared.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import redundancy


def _positive(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def test_tiny_redundancy_benchmark_reports_every_row(tmp_path):
  out = tmp_path / "bench"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.redundancy",
      "--out",
      str(out),
      "--mib-per-process",
      "0.25",
      "--reps",
      "1",
      "--fg-iters",
      "1",
      "--overlap",
      "on",  # XOR from the snapshot beside the write (auto: off on few cores)
    ],
    capture_output=True,
    text=True,
    timeout=180,
  )
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  doc = json.loads((out / "results.json").read_text())
  reduced = doc["reduced"]
  schemes, _ = redundancy.supported_schemes()
  assert "partner" in schemes
  assert reduced["schemes"] == schemes
  rows = reduced["rows"]
  for s in ["none", *schemes]:
    for row in ("stall_s", "finished_s", "local_durable_s", "fg_s", "ramdisk_own_bytes"):
      assert _positive(rows[f"{row}/{s}"]["median"]), (row, s, rows.get(f"{row}/{s}"))
  assert _positive(rows["fg_s/idle"]["median"])
  for s in schemes:
    for row in (
      "stall_ratio",
      "redundant_durable_s",
      "durable_ratio",
      "durable_vs_none_ratio",
      "state_durable_s",
      "ramdisk_extra_bytes",
      "ramdisk_extra_ratio",
      "restore_s/{}/intact",
      "restore_s/{}/lost_host",
      "restore_s/{}/persistent_cold",
      "restore_s/{}/persistent_warm",
      "restore_ratio/{}/persistent_cold",
      "restore_ratio/{}/persistent_warm",
    ):
      key = row.format(s) if "{}" in row else f"{row}/{s}"
      assert _positive(rows[key]["median"]), (key, rows.get(key))
    assert reduced["failed_durable"][s] == 0
  checks = reduced["restore_checks"]
  assert "errors" not in checks, checks
  assert (checks["bad_shards"], checks["wrong_step"]) == (0, 0), checks
  for s in schemes:
    # the wiped host was rebuilt from the scheme's data (e.g. "partner",
    # "parity"), the others read their own copy
    kept, wiped = checks["sources"][f"{s}/lost_host"]
    assert kept == "kept:local", checks
    assert wiped.startswith("wiped:") and wiped[6:] not in ("local", "peer", "persistent", "None")
    assert checks["sources"][f"{s}/persistent_cold"] == [
      "kept:persistent",
      "wiped:persistent",
    ], checks
    assert checks["sources"][f"{s}/intact"] == ["kept:local"], checks
  per_process = [r for p in doc["processes"] for r in p["restores"]]
  assert per_process and all(r["mismatched_shards"] == 0 for r in per_process)
  assert doc["config"]["xor_overlap"] == [True]
  md = (out / "results.md").read_text()
  for s in schemes:
    assert f"## {s}" in md
