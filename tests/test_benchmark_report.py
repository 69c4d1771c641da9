"""The benchmark report's arithmetic on hand-made job records (no jobs run)."""

from __future__ import annotations

import pytest

from emergency_ckpt.bench import figures as report
from emergency_ckpt.bench.adapters import MANAGERS


def _proc(stalls, memcpys, first_stall, first_memcpy, writes=(), cold=()):
  saves = [{"stall_s": s, "paired_memcpy_s": m} for s, m in zip(stalls, memcpys)]
  for save, w in zip(saves, writes):
    save["paired_persistent_write_s"] = w
  return {
    "saves": saves,
    "warmup_save": {"stall_s": first_stall, "paired_memcpy_s": first_memcpy},
    "restores": {"persistent_cold": [{"paired_cold_read_s": c} for c in cold]},
  }


def test_same_job_bound_is_the_per_save_max_over_processes_then_the_median():
  two = [
    _proc([0.0] * 3, [0.050, 0.070, 0.040], 0.0, 0.060, [0.5, 0.9, 0.4], [0.30, 0.50, 0.20]),
    _proc([0.0] * 3, [0.060, 0.030, 0.045], 0.0, 0.065, [0.6, 0.3, 0.45], [0.35, 0.10, 0.25]),
  ]
  got = report.same_job_bounds(two)
  # per save max: 0.060, 0.070, 0.045 -> median 0.060; first: max(0.060, 0.065)
  assert got["save_stall_s"] == pytest.approx(0.060)
  assert got["first_save_stall_s"] == pytest.approx(0.065)
  # per rep max: writes 0.6, 0.9, 0.45 -> 0.6; cold reads 0.35, 0.50, 0.25 -> 0.35
  assert got["save_durable_persistent_s"] == pytest.approx(0.6)
  assert got["restore_persistent_cold_s"] == pytest.approx(0.35)


def _results(stall, bound, first_stall, first_bound, restore):
  metrics = {mt.key: {"value": 1.0} for mt in report.METRICS}
  metrics["save_stall_s"] = {"value": stall, "bound": bound}
  metrics["first_save_stall_s"] = {"value": first_stall, "bound": first_bound}
  metrics["restore_intact_s"] = {"value": restore}
  return {"metrics": metrics, "extras": {}}


def test_stall_ratios_use_the_managers_own_job_and_keep_the_raw_jobs_reading():
  raw = {key: {"value": 1.0} for key in report.BOUNDS}
  raw["memcpy_s"] = {"value": 0.040}
  raw["ramdisk_read_s"] = {"value": 0.200}
  results = {name: _results(0.066, 0.060, 0.090, 0.050, 0.300) for name in MANAGERS}
  results["orbax_p2p"] = _results(1.2, 0.080, 1.0, 0.100, 1.5)
  got = report.ratios(raw, results)
  ours = got["emergency_ckpt"]
  assert ours["save_stall_s"]["to_raw_bound"] == pytest.approx(0.066 / 0.060)
  assert ours["save_stall_s"]["to_raw_job_bound"] == pytest.approx(0.066 / 0.040)
  assert ours["first_save_stall_s"]["to_raw_bound"] == pytest.approx(0.090 / 0.050)
  assert got["orbax_p2p"]["save_stall_s"]["to_raw_bound"] == pytest.approx(1.2 / 0.080)
  # Other rows keep the raw-bounds job's bound; managers compare figure to figure.
  assert ours["restore_intact_s"]["to_raw_bound"] == pytest.approx(0.300 / 0.200)
  assert "to_raw_job_bound" not in ours["restore_intact_s"]
  assert ours["save_stall_s"]["to_orbax_p2p"] == pytest.approx(0.066 / 1.2)


def test_a_failed_managers_stall_has_no_ratio():
  raw = {key: {"value": 1.0} for key in report.BOUNDS}
  results = {name: _results(0.066, 0.060, 0.090, 0.050, 0.3) for name in MANAGERS}
  results["orbax_multislice"]["metrics"]["save_stall_s"] = {"value": None, "reason": "job failed"}
  got = report.ratios(raw, results)
  assert got["orbax_multislice"]["save_stall_s"]["to_raw_bound"] is None
  assert got["emergency_ckpt"]["save_stall_s"]["to_orbax_multislice"] is None
