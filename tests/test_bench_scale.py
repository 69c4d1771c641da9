"""The scale benchmark (`python -m benchmarks.scale`) at a tiny size.

One subprocess run: the library's exchange against a real coordination
service with 4 and 16 simulated processes in 2 worker processes (the old
algorithm too), and the restore planner at 64 and 256 processes. Checks the
output's shape, that the inventory exchange makes 4 to 8 calls to the service
per process whatever K (the all-gather 3, the old one K + 1), and the
planner's answer. Then the exchange in one interpreter (--exchange-workers 1)
and a worker's error reaching the parent, in this process. No timing
assertions: the machine is shared.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import scale_exchange

STEPS = 50
NEWEST = 100 * STEPS  # the planner's steps are 100, 200, ... 100 * STEPS


def test_scale_benchmark_tiny(tmp_path):
  out = tmp_path / "scale"
  cmd = [sys.executable, "-m", "benchmarks.scale", "--ks", "4,16", "--reps", "1"]
  cmd += ["--exchange-workers", "2"]  # whatever this machine's CPU count
  cmd += ["--planner-processes", "64,256", "--planner-reps", "1", "--timeout", "60"]
  cmd += ["--real-processes", "none", "--commit-ks", "8"]  # real jobs: test_scale_job.py
  cmd += ["--out", str(out)]
  proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-6000:]
  assert "[scale" in proc.stderr  # progress lines
  assert "growth exponent" in proc.stdout

  doc = json.loads((out / "scale.json").read_text())
  stages = doc["stages"]
  assert set(stages) == {"exchange", "exchange_allgather", "exchange_old", "planner"}
  for stage in stages.values():
    assert stage["points"] and "fit" in stage and stage["label"]

  assert doc["config"]["exchange_workers"] == 2
  tree = stages["exchange"]["points"]
  assert [p["k"] for p in tree] == [4, 16]
  for name in ("exchange", "exchange_allgather", "exchange_old"):
    for p in stages[name]["points"]:  # clients in 2 worker processes, the service here
      assert p["workers"] == 2 and "2 worker processes" in p["mode"], p
      assert p["service_cpu_s"] > 0 and p["cpu_total_s_per_process"] > 0, p
  for p in tree:  # the library's inventory exchange: a gather_tree
    # a plain process: set, slice barrier, one blocking get; the primary at
    # most 10 (it also reads its slice, sets its summary, counts, may raise
    # the flag, waits on it, reads the summaries, sets the job's, deletes)
    assert p["calls_per_process_min"] == 3 and p["calls_per_process_max"] <= 10, p
    assert p["wall_s"] > 0 and len(p["wall_s_reps"]) == 1
    assert 150 <= p["payload_bytes_mean"] <= 400
  assert stages["exchange"]["calls_constant"]
  every = stages["exchange_allgather"]["points"]
  for p in every:  # every process receives every process's inventory
    # 3 calls; the primary also deletes the previous round's keys
    assert p["calls_per_process_min"] == 3 and p["calls_per_process_max"] <= 4, p
    assert p["bytes_received_per_process"] >= p["k"] * p["payload_bytes_mean"]
  # at 16 processes the tree's median process receives less than a quarter of that
  assert tree[-1]["bytes_received_per_process"] * 4 < every[-1]["bytes_received_per_process"]
  old = stages["exchange_old"]["points"]
  assert [p["k"] for p in old] == [4, 16]
  for p in old:  # the algorithm before: set + one blocking get per process
    assert p["calls_per_process_min"] == p["calls_per_process_max"] == p["k"] + 1, p

  commit = doc["commit"]["points"]
  assert [p["k"] for p in commit] == [8] and commit[0]["ok"], commit
  assert commit[0]["objects_written"] == 9 and commit[0]["commit_listing_pages"] == 1
  assert "State-store commit" in (out / "scale.md").read_text()

  planner = stages["planner"]["points"]
  assert [p["k"] for p in planner] == [64, 256]
  for p in planner:
    assert p["correct"], p
    assert p["slices"] == 64 and p["steps"] == STEPS
    got = p["result"]
    assert got["newest_step"] == NEWEST and got["candidates"] == STEPS
    # slices 5, 21, 37, 53 lost the newest steps on one process: a peer sends them
    assert got["peer_slices"] == 4 and got["local_slices"] == 60 and got["peer_source"] == 0
    assert p["tracemalloc_peak_bytes"] > 0 and p["peak_bytes_per_process"] > 0
  assert stages["planner"]["fit"]["exponent"] is not None  # 64 and 256 are both >= 64

  md = (out / "scale.md").read_text()
  assert "| K |" in md and "Restore planner" in md and "OLD algorithm" in md
  assert "Mode: 2 worker processes" in md
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    assert "no scale.png" in proc.stdout
  else:
    assert (out / "scale.png").stat().st_size > 0


def test_exchange_one_interpreter():
  """--exchange-workers 1: every client a thread of this program; the same
  answers and counts as in worker mode."""
  got = scale_exchange.measure_exchange(4, 1, True, 60.0, True, workers=1)
  assert set(got) == {"exchange", "exchange_allgather", "exchange_old"}
  tree = got["exchange"]
  assert tree["workers"] == 1 and "one interpreter" in tree["mode"]
  assert tree["service_cpu_s"] is None and tree["cpu_total_s_per_process"] > 0
  assert tree["calls_per_process_min"] == 3 and tree["calls_per_process_max"] <= 10
  assert got["exchange_old"]["calls_per_process_min"] == 5


def test_xor_setup_rounds_assign_and_all_gather():
  """The XOR set-up rounds (benchmarks/results/redundancy-xor.md):
  every process gets a group of 8; with assign a plain process makes 3
  calls and the assigner K + 2, the all-gather 3 each (the primary more)."""
  sim = scale_exchange.Simulation(16, 60.0, workers=2)
  try:
    assign = scale_exchange._rounds(sim, "xor set-up", 1)  # noqa: SLF001
    gather = scale_exchange._rounds(sim, "xor set-up (all-gather)", 1)  # noqa: SLF001
  finally:
    sim.close()
  for rnd in assign:
    assert (rnd["calls_min"], rnd["calls_max"]) == (3, 18), rnd
    assert rnd["bytes_received_max"] < 1000, rnd  # the assigner reads 16 labels
  for rnd in gather:
    assert rnd["calls_min"] == 3 and rnd["bytes_received"] > 16 * 8, rnd


def test_exchange_worker_error_reaches_parent():
  """A worker's error is raised here, naming the round; the workers are
  stopped and the service shut down."""
  sim = scale_exchange.Simulation(4, 30.0, workers=2)
  try:
    with pytest.raises(RuntimeError, match="no-such-round"):
      sim.round("no-such-round", 0)
  finally:
    sim.close()
  assert not sim._procs  # noqa: SLF001 - killed and joined
