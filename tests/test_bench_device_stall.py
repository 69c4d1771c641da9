"""Smoke test of the one-accelerator save-stall benchmark
(benchmarks.device_stall) at a tiny size on CPU: every manager
row exists and every restore was bit-exact. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys


def test_device_stall_benchmark_reports_every_manager(tmp_path, shm_dir):
  out = tmp_path / "ds"
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.device_stall", "--out", str(out)]
    + ["--mib", "8", "--reps", "1", "--steps-before", "1", "--steps-after", "1"]
    + ["--matmuls", "1", "--matmul-size", "64", "--ramdisk", shm_dir]
    + ["--persistent-root", str(tmp_path / "p")],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-6000:]
  doc = json.loads((out / "device_stall.json").read_text())
  assert set(doc["managers"]) == {
    "ours-host",
    "ours-device",
    "orbax",
    "ours-device-both-tiers",
    "ours-host-both-tiers",
  }
  for name, m in doc["managers"].items():
    assert m["restore_bit_exact"] is True, name
    assert len(m["reps"]) == 1 and m["stall_s"] > 0, name
  assert doc["state_bytes"] == 8 * 2**20
  assert "| ours-device |" in (out / "device_stall.md").read_text()
