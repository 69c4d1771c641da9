"""Smoke test of the one-accelerator save-stall benchmark
(benchmarks.device_stall) at a tiny size on CPU: every manager
row exists and every restore was bit-exact. No timing assertions. Its
bounds' arithmetic and report on hand-made figures (the pinned copies run
on accelerators only)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest


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


def test_device_bounds_are_the_faster_copy_each_way_with_gb_per_s():
  """The save's bound is the faster device-to-host copy, pinned or pageable,
  the restore's the faster host-to-device one; the report divides by them
  and prints every bound's GB/s. Pure: hand-made medians, no device."""
  from benchmarks import device_stall  # noqa: PLC0415

  nbytes = 4 << 30
  med = {
    "device_get_s": 2.2,
    "d2h_pinned_s": 0.08,
    "device_put_s": 0.15,
    "h2d_pinned_s": 0.20,
    "stage_reused_s": 0.45,
  }
  got = device_stall.best_bounds(med, nbytes)
  assert got["d2h_bound_s"] == 0.08 and got["d2h_bound_from"] == "d2h_pinned"
  assert got["h2d_bound_s"] == 0.15 and got["h2d_bound_from"] == "device_put"
  assert got["gb_per_s"]["d2h_pinned"] == pytest.approx(nbytes / 0.08 / 1e9)
  assert got["gb_per_s"]["d2h_bound"] == pytest.approx(nbytes / 0.08 / 1e9)
  # without pinned host memory (CPU devices): the pageable copies
  cpu = device_stall.best_bounds({"device_get_s": 0.3, "device_put_s": 0.2}, nbytes)
  assert cpu["d2h_bound_s"] == 0.3 and cpu["h2d_bound_s"] == 0.2

  manager = {
    "stall_s": 0.08,
    "durable_s": 2.0,
    "step_slowdown": 1.01,
    "idle_step_s": 0.2,
    "after_step_s": 0.202,
    "restore_s": 0.9,
    "restore_bit_exact": True,
  }
  doc = {
    "device": "gpu H200",
    "jax": "0",
    "state_bytes": nbytes,
    "bounds": {**med, **got, "reps": {}},
    "managers": {"ours-host": manager},
  }
  text = device_stall.report(doc)
  assert "| ours-host | 80.0 ms | 1.000x |" in text  # 0.08 s over the pinned 0.08 s
  assert "| 0.900 s | 6.00x |" in text  # over device_put's 0.15 s
  assert f"d2h_pinned 80.0 ms ({nbytes / 0.08 / 1e9:.1f} GB/s)" in text
  assert f"device_get 2200.0 ms ({nbytes / 2.2 / 1e9:.1f} GB/s)" in text


def test_pinned_bounds_are_not_timed_on_cpu_devices():
  import jax  # noqa: PLC0415
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  from benchmarks import device_stall  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("replica", "data"))
  assert device_stall._pinned(NamedSharding(mesh, P())) is None
