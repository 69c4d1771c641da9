"""The job launcher's timeout path: a hung job leaves every thread's stack in
its log, and the benchmark's one-line summary names who hung where."""

from __future__ import annotations

import argparse
import os
import signal
import time

from emergency_ckpt.bench import run as bench_run
from emergency_ckpt.bench.run import _summarize
from emergency_ckpt.testing.launcher import JobResult, run_job


def _stuck_in_a_named_function(seconds: float) -> None:
  time.sleep(seconds)


def hang(args: dict) -> str:
  """Job target: reports progress, then sleeps far past the job's timeout."""
  print("BENCH about to hang", flush=True)
  _stuck_in_a_named_function(args["seconds"])
  return "never"


def test_a_timed_out_job_leaves_its_stacks_in_the_log(tmp_path):
  res = run_job(
    "tests.test_launcher:hang",
    1,
    {"seconds": 600},
    devices_per_process=1,
    timeout_s=15,
    out_dir=str(tmp_path),
  )
  assert res.timed_out and res.returncodes == [-signal.SIGKILL]
  log = res.logs[0]
  assert "BENCH about to hang" in log, log[-3000:]
  # faulthandler's dump: the frame the main thread hung in, by name
  assert "most recent call first" in log and "_stuck_in_a_named_function" in log, log[-3000:]
  assert "0 last at 'about to hang'" in _summarize(res, [0])


def _result(returncodes, logs, errors, timed_out) -> JobResult:
  n = len(returncodes)
  return JobResult(list(returncodes), [None] * n, list(errors), list(logs), timed_out, 242.4)


def test_summary_of_a_timeout_names_the_first_failure_and_where_the_rest_hung():
  kill = -signal.SIGKILL
  res = _result(
    [kill, 1, kill, 0],
    ["BENCH saves\nBENCH restore lose_slice (1/1)\n", "", "no progress yet\n", ""],
    [None, "Traceback ...\nValueError: bad shard", None, None],
    timed_out=True,
  )
  line = _summarize(res, [0, 1, 2])
  assert line.startswith("process 1 rc=1: ValueError: bad shard; "), line
  assert "timed out after 242s with processes [0, 2] still running" in line, line
  assert "0 last at 'restore lose_slice (1/1)'" in line and "2 last at" not in line, line


def test_summary_without_a_timeout_names_the_failed_process():
  res = _result([0, 2], ["", "log tail line\n"], [None, None], timed_out=False)
  assert _summarize(res, [1]) == "process 1 rc=2: log tail line"
  missing = _result([0, 0], ["ok\n", "last words\n"], [None, None], timed_out=False)
  assert _summarize(missing, []) == "process 0 rc=0: ok"


def hang_once(args: dict) -> dict:
  """Job target: the first attempt hangs (it leaves a marker), the next returns."""
  if not os.path.exists(args["marker"]):
    open(args["marker"], "w").close()
    _stuck_in_a_named_function(600)
  return {"ok": True}


def _runner(tmp_path, monkeypatch) -> bench_run.Runner:
  monkeypatch.setattr(bench_run, "PROCESSES", 1)
  monkeypatch.setattr(bench_run, "DEVICES_PER_PROCESS", 1)
  args = argparse.Namespace(out=str(tmp_path / "out"))
  return bench_run.Runner(args, str(tmp_path / "shm"), str(tmp_path / "disk"))


def test_a_hung_orbax_job_is_retried_once_and_recorded(tmp_path, monkeypatch):
  runner = _runner(tmp_path, monkeypatch)
  cleared = []
  args = {"marker": str(tmp_path / "marker")}
  got, error = runner.job(
    "orbax_p2p-main", "tests.test_launcher:hang_once", args, 12, retry=lambda: cleared.append(1)
  )
  assert error is None and got == [{"ok": True}], error
  assert cleared == [1] and runner.errors == {}
  assert list(runner.retried) == ["orbax_p2p-main"], runner.retried
  assert runner.retried["orbax_p2p-main"].startswith("timed out after"), runner.retried
  kept = (tmp_path / "out" / "logs" / "attempt1_orbax_p2p-main_process_0.txt").read_text()
  assert "_stuck_in_a_named_function" in kept, kept[-3000:]


def test_a_hung_job_without_retry_fails(tmp_path, monkeypatch):
  runner = _runner(tmp_path, monkeypatch)
  args = {"marker": str(tmp_path / "marker")}
  got, error = runner.job("emergency_ckpt-main", "tests.test_launcher:hang_once", args, 12)
  assert got is None and error.startswith("timed out after"), error
  assert runner.errors == {"emergency_ckpt-main": error} and runner.retried == {}
