"""The goodput study (benchmarks/goodput.py): the failure schedule and the
accounting (pure), the "auto" guard, and a smoke run end to end: real
2-process jax.distributed jobs killed and restarted at seeded times (about
a minute). No timing assertions: the machine is shared."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest

from benchmarks import goodput
from benchmarks import goodput_account as acct


# ---- the failure schedule ----------------------------------------------------
def test_failure_times_are_seeded_sorted_and_inside_the_run():
  a = acct.failure_times(1, 45.0, 180.0)
  assert a == acct.failure_times(1, 45.0, 180.0)
  assert a != acct.failure_times(2, 45.0, 180.0)
  assert a == sorted(a) and all(0 <= t < 180.0 for t in a)
  assert acct.failure_times(3, 45.0, 0.0) == []


def test_failure_times_are_exponential_with_the_given_mean():
  mtbf = 45.0
  times = acct.failure_times(7, mtbf, mtbf * 20000)
  gaps = [b - a for a, b in zip([0.0, *times], times)]
  assert 19000 < len(gaps) < 21000
  assert statistics.fmean(gaps) == pytest.approx(mtbf, rel=0.03)
  assert statistics.pstdev(gaps) == pytest.approx(mtbf, rel=0.05)  # exponential: sd = mean
  for k in (0.5, 1.0, 2.0):  # survival function e^-k
    share = sum(g > k * mtbf for g in gaps) / len(gaps)
    assert share == pytest.approx(math.exp(-k), abs=0.015), k


@pytest.mark.parametrize("mtbf, duration", [(0.0, 10.0), (-1.0, 10.0), (5.0, -1.0)])
def test_failure_times_refuse_impossible_settings(mtbf, duration):
  with pytest.raises(ValueError):
    acct.failure_times(1, mtbf, duration)


# ---- the accounting -------------------------------------------------------------
def test_goodput_pct_is_final_step_times_step_time_over_wall():
  assert acct.goodput_pct(900, 0.2, 180.0) == pytest.approx(100.0)
  assert acct.goodput_pct(450, 0.2, 180.0) == pytest.approx(50.0)
  assert acct.goodput_pct(0, 0.2, 180.0) == 0.0
  assert acct.goodput_pct(10, 0.2, 0.0) is None


def _steps(inc: int, first: int, last: int, t: float, step_s=1.0, save_s=0.1) -> list[dict]:
  """Train steps first..last from time t, each followed by its save()."""
  out = []
  for step in range(first, last + 1):
    out.append({"inc": inc, "ev": "step", "step": step, "t0": t, "t1": t + step_s})
    t += step_s
    out.append({"inc": inc, "ev": "save", "step": step, "t0": t, "t1": t + save_s})
    t += save_s
  return out


def _restored(inc: int, step: int, t0: float, t1: float) -> dict:
  return {"inc": inc, "ev": "restored", "step": step, "t0": t0, "t1": t1, "ok": True}


def test_account_splits_two_incarnations():
  # Incarnation 0 starts fresh, trains steps 1-7, is killed 0.8 s into step 8.
  # Incarnation 1 restores step 5, trains 6-11 by the deadline (12 is cut off).
  records = [
    _restored(0, 0, 1001.0, 1002.0),
    *_steps(0, 1, 8, 1002.0),
    _restored(1, 5, 1012.0, 1013.0),
    *_steps(1, 6, 12, 1013.0),
  ]
  windows = [
    {"inc": 0, "begin": 1000.0, "end": 1010.5, "killed": True},
    {"inc": 1, "begin": 1010.5, "end": 1020.0, "killed": False},
  ]
  final = acct.final_step([records], 1, 1020.0)
  assert final == 11
  a = acct.account_process(records, windows, final)
  assert a["wall_s"] == pytest.approx(20.0)
  assert a["productive_s"] == pytest.approx(5.0 + 6.0)  # steps 1-5, then 6-11
  assert a["redone_s"] == pytest.approx(2.0 + 0.8)  # steps 6-7 of incarnation 0, and step 8's start
  assert a["stall_s"] == pytest.approx(0.7 + 0.6)
  assert a["restore_startup_s"] == pytest.approx(2.0 + 2.5)  # kill (or start) to first step
  assert a["restore_s"] == pytest.approx(2.0)
  assert a["other_s"] == pytest.approx(0.4)  # step 12, cut off by the deadline
  assert sum(a[p] for p in acct.PARTS) == pytest.approx(a["wall_s"])
  assert a["kept_steps"] == final and a["redone_steps"] == 2
  assert [i["kept_up_to"] for i in a["incarnations"]] == [5, 11]
  assert acct.goodput_pct(final, 1.0, a["wall_s"]) == pytest.approx(55.0)


def test_account_kill_inside_save_and_kill_before_restore():
  # 0: trains 1-4, killed 0.05 s into step 4's save. 1: killed while starting
  # (no restore: it bounds nothing). 2: restores step 2 and trains 3-4.
  records = [
    _restored(0, 0, 100.5, 101.0),
    *[r for r in _steps(0, 1, 4, 101.0) if not (r["ev"] == "save" and r["step"] == 4)],
    _restored(2, 2, 110.0, 111.0),
    *_steps(2, 3, 4, 111.0),
  ]
  windows = [
    {"inc": 0, "begin": 100.0, "end": 105.35, "killed": True},
    {"inc": 1, "begin": 105.35, "end": 108.0, "killed": True},
    {"inc": 2, "begin": 108.0, "end": 113.5, "killed": False},
  ]
  final = acct.final_step([records], 2, 113.5)
  assert final == 4
  a = acct.account_process(records, windows, final)
  inc0, inc1, inc2 = a["incarnations"]
  assert inc0["kept_up_to"] == 2 and inc0["kept_steps"] == 2 and inc0["redone_steps"] == 2
  assert inc0["stall_s"] == pytest.approx(0.3 + 0.05)  # three saves, then the one cut off
  assert inc0["redone_s"] == pytest.approx(2.0)  # steps 3-4
  assert inc0["restore_startup_s"] == pytest.approx(1.0) and inc0["other_s"] == pytest.approx(0)
  assert inc1["restore_startup_s"] == pytest.approx(2.65) and inc1["restored_step"] is None
  assert inc2["productive_s"] == pytest.approx(2.0) and inc2["kept_steps"] == 2
  assert inc2["restore_startup_s"] == pytest.approx(3.0) and inc2["other_s"] == pytest.approx(0.3)
  assert a["kept_steps"] == final
  assert sum(a[p] for p in acct.PARTS) == pytest.approx(13.5)


def test_final_step_is_the_newest_every_process_holds():
  fast = [_restored(1, 3, 0.0, 1.0), *_steps(1, 4, 9, 1.0)]
  slow = [_restored(1, 3, 0.0, 1.0), *_steps(1, 4, 9, 1.0, step_s=1.2)]
  starting = [{"inc": 1, "ev": "ready", "t": 0.5}]
  assert acct.final_step([fast], 1, 5.5) == 7  # step 7 ended at 5.3, step 8 at 6.4
  assert acct.final_step([fast, slow], 1, 5.5) == 6  # the slow one's step 7 ends at 6.1
  assert acct.final_step([fast], 1, 0.5) == 3  # restored, nothing trained yet
  assert acct.final_step([fast, starting], 1, 5.0) == 0


def _row(config: str, seed: int, goodput_pct: float, **extra) -> dict:
  b = dict.fromkeys((*acct.PARTS, "restore_s"), 1.0)
  b["stall_s"] = goodput_pct / 10
  return {
    "config": config,
    "seed": seed,
    "available": True,
    "error": None,
    "goodput_pct": goodput_pct,
    "check_goodput_pct": goodput_pct + 0.5,
    "failures": seed,
    "breakdown": b,
    "report": {"productive_pct_of_run_wall": goodput_pct - 1},
    **extra,
  }


def test_summary_is_the_median_over_seeds_and_leaves_errors_out():
  rows = [
    _row("ours/1", 1, 80.0),
    _row("ours/1", 2, 60.0),
    _row("ours/1", 3, 70.0),
    _row("orbax/1", 1, 50.0),
    {**_row("orbax/1", 2, 0.0), "error": "incarnation 0: boom"},
    {"config": "ours/auto", "seed": 1, "available": False, "reason": "x", "error": None},
  ]
  s = {e["config"]: e for e in acct.summarize(rows)}
  assert list(s) == ["ours/1", "orbax/1", "ours/auto"]
  assert s["ours/1"]["goodput_pct"] == 70.0 and s["ours/1"]["runs"] == 3
  assert s["ours/1"]["stall_s"] == pytest.approx(7.0) and s["ours/1"]["failures"] == 2
  assert s["ours/1"]["check_goodput_pct"] == 70.5 and s["ours/1"]["report_pct"] == 69.0
  assert s["orbax/1"]["goodput_pct"] == 50.0 and (s["orbax/1"]["runs"], s["orbax/1"]["errors"]) == (
    1,
    1,
  )
  assert not s["ours/auto"]["available"] and "goodput_pct" not in s["ours/auto"]
  text = acct.table([acct.summary_cells(e) for e in s.values()])
  lines = text.splitlines()
  assert lines[0].split()[:3] == ["configuration", "goodput", "%"] and len(lines) == 5
  assert lines[2].split() == ["ours/1", "70.0", "7.0", "1.0", "1.0", "2", "70.5", "69.0"]
  assert lines[4].split() == ["ours/auto", "not", "available"]
  cells = [acct.row_cells(r) for r in rows]
  assert cells[0] == ["80.0", "8.0", "1.0", "1.0", "1", "80.5", "79.0"]
  assert cells[4][0] == "error" and cells[5][0] == "not available"
  assert len({len(c) for c in cells}) == 1


# ---- the "auto" guard ------------------------------------------------------------
def test_auto_refused_by_the_options_is_reported_not_run(monkeypatch, tmp_path):
  import emergency_ckpt as ec

  class Refuses:
    def __init__(self, **kwargs):
      raise ec.InvalidOptionsError("local.save_interval_steps must be an integer >= 1")

  monkeypatch.setattr(ec, "LocalTierOptions", Refuses)
  assert "InvalidOptionsError" in goodput.auto_unavailable()
  out = tmp_path / "goodput.json"
  argv = ["--seeds", "1,2", "--intervals", "", "--auto", "--duration-s", "5", "--out", str(out)]
  assert goodput.main(argv) == 0  # no job runs: the only configuration is unavailable
  doc = json.loads(out.read_text())
  assert [(r["config"], r["seed"], r["available"]) for r in doc["rows"]] == [
    ("ours/auto", 1, False),
    ("ours/auto", 2, False),
  ]
  assert "InvalidOptionsError" in doc["rows"][0]["reason"]
  assert doc["summary"] == [
    {"config": "ours/auto", "runs": 0, "errors": 0, "available": False},
  ]


# ---- the smoke run ------------------------------------------------------------------
SEED, DURATION_S, MTBF_S, STEP_S = 2, 20.0, 8.0, 0.2


def test_goodput_smoke_run_kills_restarts_and_accounts(tmp_path):
  failures = acct.failure_times(SEED, MTBF_S, DURATION_S)
  assert failures and failures[-1] < DURATION_S - 3  # the seed's schedule: the run then trains
  out = tmp_path / "goodput.json"
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.goodput", "--seeds", str(SEED), "--intervals", "1,5"]
    + ["--duration-s", str(DURATION_S), "--mtbf-s", str(MTBF_S), "--step-s", str(STEP_S)]
    + ["--start", "fork", "--out", str(out)],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=150,
  )
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
  assert "median over 1 seed(s)" in proc.stdout and "goodput %" in proc.stdout
  doc = json.loads(out.read_text())
  assert doc["cpus"] >= 1 and doc["machine"] and doc["date"].endswith("UTC")
  assert doc["settings"]["duration_s"] == DURATION_S
  assert doc["failure_times_s"] == {str(SEED): failures}
  assert [r["config"] for r in doc["rows"]] == ["ours/1", "ours/5"]
  for row in doc["rows"]:
    name = row["config"]
    assert row["error"] is None and row["available"], (name, row.get("error"))
    assert row["failures"] == len(failures) >= 1, name
    assert len(row["incarnations"]) == len(failures) + 1, name
    assert 0 < row["goodput_pct"] <= 100, (name, row["goodput_pct"])
    assert row["final_step"] > 0 and row["restores_ok"], name
    # the ramdisk survived the kills: some restart resumed from it
    sources = [r["source"] for i in row["incarnations"] for r in i["restored"] if r]
    assert "local" in sources, (name, sources)
    b = row["breakdown"]
    assert set(b) == {*acct.PARTS, "restore_s"}, name
    assert b["restore_startup_s"] > 0 and b["stall_s"] > 0, (name, b)
    assert all(v >= -1e-6 for v in b.values()), (name, b)
    for p in row["per_process"]:
      assert sum(p[k] for k in acct.PARTS) == pytest.approx(row["wall_s"]), name
      assert p["kept_steps"] == row["final_step"], (name, p["kept_steps"], row["final_step"])
    # each kept step took at least the step time: measured >= final step x step time
    assert row["goodput_pct"] - 0.01 <= row["check_goodput_pct"] <= 100, name
    assert 0 < row["report"]["goodput_pct"] <= 100, (name, row["report"])
  summary = {s["config"]: s for s in doc["summary"]}
  assert set(summary) == {"ours/1", "ours/5"}
  for row in doc["rows"]:
    assert summary[row["config"]]["goodput_pct"] == pytest.approx(row["goodput_pct"])
