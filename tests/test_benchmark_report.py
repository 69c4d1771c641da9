"""The benchmark report's arithmetic on hand-made job records (no jobs run)."""

from __future__ import annotations

import pytest

from emergency_ckpt.bench import figures as report
from emergency_ckpt.bench.adapters import MANAGERS
from emergency_ckpt.bench.report import markdown


def _proc(stalls, memcpys, first_stall, first_memcpy, writes=(), cold=()):
  """A process's 2x2 record; the N-thread memcpy is slower here (x2)."""
  saves = [
    {"stall_s": s, "paired_memcpy_1t_s": m, "paired_memcpy_mt_s": 2 * m}
    for s, m in zip(stalls, memcpys)
  ]
  for save, w in zip(saves, writes):
    save["paired_persistent_write_s"] = w
  return {
    "saves": saves,
    "warmup_save": {
      "stall_s": first_stall,
      "paired_memcpy_1t_s": first_memcpy,
      "paired_memcpy_mt_s": 2 * first_memcpy,
    },
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


def _raw_rep(k: float, send: bool, receive: bool) -> dict:
  """One raw-bounds rep of a process; `k` scales every time. One thread
  wins the memcpy and the peer read, N threads the ramdisk write and read,
  N connections the transfer."""
  return {
    "memcpy_1t_s": 0.040 * k,
    "memcpy_mt_s": 0.050 * k,
    "ramdisk_write_1t_s": 0.200 * k,
    "ramdisk_write_mt_s": 0.100 * k,
    "cpu_memcpy_write_s": 0.1,
    "ramdisk_read_1t_s": 0.080 * k,
    "ramdisk_read_mt_s": 0.060 * k,
    "peer_read_1t_s": 0.070 * k if send else None,
    "peer_read_mt_s": 0.090 * k if send else None,
    "peer_transfer_1s_s": 0.300 * k if receive else None,
    "peer_transfer_ns_s": 0.250 * k if receive else None,
    "persistent_write_s": 0.5 * k,
    "persistent_cold_read_s": 0.4 * k,
  }


NBYTES = {"2x2": 256 << 20, "4x1": 512 << 20}


def _raw_job(scales=(1.0, 1.2, 0.9)) -> list[dict]:
  """The raw job's records: 4 processes, 3 reps; process 3 is 10% slower.
  2x2: 0 and 1 send to 2 and 3; 4x1: 0, 1 and 2 send to 3."""
  procs = []
  for pid in range(4):
    slow = 1.1 if pid == 3 else 1.0
    layouts = {}
    for name, senders, receivers in (("2x2", {0, 1}, {2, 3}), ("4x1", {0, 1, 2}, {3})):
      reps = [_raw_rep(k * slow, pid in senders, pid in receivers) for k in scales]
      share = NBYTES[name] // len(senders)
      sends = [(3, pid * share, (pid + 1) * share)] if pid in senders else []
      layouts[name] = {"slice": pid, "bytes": NBYTES[name], "reps": reps, "peer": {"sends": sends}}
    procs.append({"pid": pid, "ready_s": 1.0, "threads": 2, "layouts": layouts})
  return procs


def test_threaded_bounds_are_the_faster_of_one_and_n_threads_with_gb_per_s():
  raw = report.raw_figures(_raw_job())
  # per rep max over processes (process 3's x1.1), median over reps (scale 1.0)
  for key, one, many in (
    ("memcpy_s", 0.040, 0.050),
    ("ramdisk_write_s", 0.200, 0.100),
    ("ramdisk_read_s", 0.080, 0.060),
  ):
    b = raw[key]
    one_key, many_key = report.THREADED[key]
    assert b["parts"][one_key]["value"] == pytest.approx(one * 1.1)
    assert b["parts"][many_key]["value"] == pytest.approx(many * 1.1)
    assert b["parts"][one_key]["threads"] == 1 and b["parts"][many_key]["threads"] == 2
    assert b["value"] == pytest.approx(min(one, many) * 1.1), key
    assert b["chosen"] == (one_key if one < many else many_key)
    assert b["gb_per_s"] == pytest.approx((256 << 20) / b["value"] / 1e9)
  assert raw["ramdisk_read_4x1_s"]["gb_per_s"] == pytest.approx(
    (512 << 20) / raw["ramdisk_read_4x1_s"]["value"] / 1e9
  )
  # the ready + read bound takes the faster read
  assert raw["ready_plus_read_s"]["value"] == pytest.approx(1.0 + 0.060 * 1.1)


def test_peer_bound_is_the_slower_of_the_senders_read_and_the_transfer():
  raw = report.raw_figures(_raw_job())
  b = raw["peer_restore_s"]
  # senders 0 and 1 (not the slow process 3): the faster read, one thread
  assert b["read_s"] == pytest.approx(0.070)
  # receivers 2 and 3: the faster transfer, N connections, process 3's x1.1
  assert b["transfer_s"] == pytest.approx(0.250 * 1.1)
  assert b["value"] == pytest.approx(0.250 * 1.1) and b["limited_by"] == "transfer"
  assert b["gb_per_s"] == pytest.approx((256 << 20) / (0.250 * 1.1) / 1e9)
  assert b["parts"]["peer_transfer_ns_s"]["connections per pair"] == 2
  # 4x1: process 3 is the receiver only; senders 0-2 read at scale 1.0
  b4 = raw["peer_restore_4x1_s"]
  assert b4["read_s"] == pytest.approx(0.070) and b4["transfer_s"] == pytest.approx(0.275)
  # its GB/s: a sender reads a third of the bytes; the receiver gets them all
  assert b4["parts"]["peer_read_1t_s"]["bytes"] == (512 << 20) // 3
  assert b4["parts"]["peer_transfer_ns_s"]["bytes"] == 512 << 20
  # a slow read makes the read the limit
  slow_read = _raw_job()
  for p in slow_read:
    for r in p["layouts"]["2x2"]["reps"]:
      if r["peer_read_1t_s"] is not None:
        r["peer_read_1t_s"] = r["peer_read_mt_s"] = 0.9
  b = report.raw_figures(slow_read)["peer_restore_s"]
  assert b["value"] == pytest.approx(0.9) and b["limited_by"] == "read"
  # the slice-loss rows are judged against the peer bounds
  bounds = {mt.key: mt.bound for mt in report.METRICS}
  assert bounds["restore_lose_slice_s"] == "peer_restore_s"
  assert bounds["restore_lose_slice_4x1_s"] == "peer_restore_4x1_s"


def _paired_proc(one, many, first_one, first_many):
  return {
    "threads": 2,
    "saves": [
      {"stall_s": 0.05, "paired_memcpy_1t_s": a, "paired_memcpy_mt_s": b} for a, b in zip(one, many)
    ],
    "warmup_save": {"paired_memcpy_1t_s": first_one, "paired_memcpy_mt_s": first_many},
  }


def test_same_job_memcpy_is_the_faster_of_one_and_n_threads():
  two = [
    _paired_proc([0.05, 0.07, 0.04], [0.03, 0.09, 0.02], 0.06, 0.08),
    _paired_proc([0.06, 0.03, 0.045], [0.04, 0.02, 0.03], 0.065, 0.07),
  ]
  got = report.paired_memcpy(two)
  # per save max: 1t 0.06, 0.07, 0.045 (median 0.06); Nt 0.04, 0.09, 0.03 (median 0.04)
  assert got["parts"] == pytest.approx({"paired_memcpy_1t_s": 0.06, "paired_memcpy_mt_s": 0.04})
  assert got["value"] == pytest.approx(0.04)
  assert got["per_save"] == pytest.approx([0.04, 0.07, 0.03])
  assert got["first"] == pytest.approx(0.065)  # 1t max 0.065 < Nt max 0.08


def _doc(raw_figs: dict) -> dict:
  results = {name: _results(0.066, 0.060, 0.090, 0.050, 0.300) for name in MANAGERS}
  return {
    "config": {
      "mib_per_replica": 512,
      "reps": 3,
      "bytes_per_process": {"2x2": NBYTES["2x2"], "4x1": NBYTES["4x1"]},
    },
    "raw_bounds": raw_figs,
    "results": results,
    "ratios": report.ratios(raw_figs, results),
  }


def test_report_prints_each_bounds_gb_per_s_beside_it():
  raw = report.raw_figures(_raw_job())
  doc = _doc(raw)
  doc["results"]["emergency_ckpt"]["extras"] = {
    "paired_stall_ratio": {"value": 1.1, "samples": [1.1], "memcpy_s": [0.06]},
    "paired_memcpy": {
      "parts": {"paired_memcpy_1t_s": 0.06, "paired_memcpy_mt_s": 0.08},
      "threads": 2,
    },
  }
  table = markdown(doc)
  gbps = lambda s: f"({(256 << 20) / s / 1e9:.2f} GB/s)"  # noqa: E731
  row = lambda label: next(ln for ln in table.splitlines() if ln.startswith(f"| {label} |"))  # noqa: E731
  # the table's bound column: raw-job bounds and same-job bounds, each with GB/s
  assert f"| {0.060 * 1.1:.3f} s {gbps(0.060 * 1.1)} |" in row("restore, all slices intact")
  assert f"{0.275:.3f} s {gbps(0.275)}" in row("restore, slice 1 ramdisks lost (2x2)")
  assert f"same job: 0.060 s {gbps(0.060)} / 0.060 s {gbps(0.060)}" in row("save() stall")
  assert "GB/s" not in row("CPU-seconds per save, all processes")
  # the same-job memcpy, both ways
  assert (
    f"- emergency_ckpt's memcpy (median over saves): 1 thread 0.06 s {gbps(0.06)},"
    f" 2 threads 0.08 s {gbps(0.08)}"
  ) in table
  # the raw bounds' list: the bound, its GB/s, and each way it was timed
  memcpy = next(ln for ln in table.splitlines() if ln.startswith("- `memcpy_s`"))
  assert f"= {0.044:.4g} s {gbps(0.044)}, the faster of 1 thread" in memcpy
  assert f"2 threads {0.055:.4g} s {gbps(0.055)}" in memcpy
  peer_line = next(ln for ln in table.splitlines() if ln.startswith("- `peer_restore_s`"))
  assert "limited by the transfer" in peer_line and "2 connections" in peer_line
  peer4 = next(ln for ln in table.splitlines() if ln.startswith("- `peer_restore_4x1_s`"))
  third = f"({(512 << 20) // 3 / 0.070 / 1e9:.2f} GB/s)"
  assert f"senders' read: 1 thread {0.070:.4g} s {third}" in peer4
