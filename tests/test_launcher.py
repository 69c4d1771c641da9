"""The job launcher's timeout path: a hung job leaves every thread's stack in
its log, and the benchmark's one-line summary names who hung where."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import pytest

from emergency_ckpt.bench import run as bench_run
from emergency_ckpt.bench.run import _summarize
from emergency_ckpt.demo import launcher
from emergency_ckpt.demo.launcher import JobResult, run_job


def _hang_timeout_s(start: str | None = None) -> float:
  """How long a job that hangs at once gets: its processes must start and
  reach the hang first (a forked one in well under a second, a spawned one
  imports jax and Orbax first)."""
  return 15 if (start or launcher.default_start()) == "spawn" else 6


def _stuck_in_a_named_function(seconds: float) -> None:
  time.sleep(seconds)


def hang(args: dict) -> str:
  """Job target: reports progress, then sleeps far past the job's timeout."""
  print("BENCH about to hang", flush=True)
  _stuck_in_a_named_function(args["seconds"])
  return "never"


@pytest.mark.parametrize("start", launcher.STARTS)
def test_a_timed_out_job_leaves_its_stacks_in_the_log(tmp_path, start):
  res = run_job(
    "tests.test_launcher:hang",
    1,
    {"seconds": 600},
    devices_per_process=1,
    timeout_s=_hang_timeout_s(start),
    out_dir=str(tmp_path),
    start=start,
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
    "orbax_p2p-main",
    "tests.test_launcher:hang_once",
    args,
    _hang_timeout_s(),
    retry=lambda: cleared.append(1),
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
  got, error = runner.job(
    "emergency_ckpt-main", "tests.test_launcher:hang_once", args, _hang_timeout_s()
  )
  assert got is None and error.startswith("timed out after"), error
  assert runner.errors == {"emergency_ckpt-main": error} and runner.retried == {}


def whoami(args: dict) -> dict:
  """Job target: what a job process sees of itself (both start methods)."""
  import jax  # noqa: PLC0415

  print(f"stdout of process {jax.process_index()}")
  print(f"stderr of process {jax.process_index()}", file=sys.stderr)
  if args.get("fail_on") == jax.process_index():
    raise RuntimeError("this process was asked to fail")
  return {
    "pid": os.getpid(),
    "session_leader": os.getsid(0) == os.getpid(),
    "parent_is_driver": os.getppid() == args["driver"],
    "process": [jax.process_index(), jax.process_count()],
    "devices": [jax.local_device_count(), jax.device_count()],
    "platform": jax.devices()[0].platform,
    "mine": os.environ.get("EC_TEST_MINE"),
    "leaked": os.environ.get("EC_LAUNCHER_START"),
    "cwd": os.getcwd(),
    "root_on_path": os.path.dirname(os.path.dirname(os.path.abspath(__file__))) in sys.path,
    "sum": float(jax.numpy.arange(4.0).sum()),
  }


def test_forked_and_spawned_processes_see_the_same_job(tmp_path, monkeypatch):
  """A forked job process is what a spawned one is: its own OS process and
  session, its index, devices and environment (the driver's, not the fork
  server's: the server started with EC_LAUNCHER_START set), its output in
  its log."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv(launcher.START_ENV, raising=False)
  seen = {}
  for start in launcher.STARTS:
    res = run_job(
      "tests.test_launcher:whoami",
      2,
      {"driver": os.getpid()},
      devices_per_process=3,
      env={1: {"EC_TEST_MINE": "p1"}},
      out_dir=str(tmp_path / start),
      start=start,
    )
    got = res.check()
    assert [g["process"] for g in got] == [[0, 2], [1, 2]], got
    assert all(g["devices"] == [3, 6] and g["platform"] == "cpu" for g in got), got
    assert [g["mine"] for g in got] == [None, "p1"], got
    assert all(g["session_leader"] and g["cwd"] == str(tmp_path) for g in got), got
    assert all(g["root_on_path"] and g["sum"] == 6.0 and g["leaked"] is None for g in got), got
    assert [g["pid"] for g in got] == res.pids and len(set(res.pids)) == 2, (got, res.pids)
    for i in range(2):
      assert f"stdout of process {i}" in res.logs[i] and f"stderr of process {i}" in res.logs[i]
    seen[start] = [g["parent_is_driver"] for g in got]
  # spawned: children of this process; forked: children of the fork server
  assert seen == {"spawn": [True, True], "fork": [False, False]}, seen


@pytest.mark.parametrize("start", launcher.STARTS)
def test_a_failing_process_reports_its_exit_status_and_traceback(tmp_path, start):
  res = run_job(
    "tests.test_launcher:whoami",
    2,
    {"driver": os.getpid(), "fail_on": 1},
    devices_per_process=1,
    out_dir=str(tmp_path),
    start=start,
  )
  assert res.returncodes == [0, 1] and not res.timed_out, res.returncodes
  assert "RuntimeError: this process was asked to fail" in res.errors[1], res.errors[1]
  assert "RuntimeError" in res.logs[1], res.logs[1][-2000:]


def test_a_forked_process_refuses_a_jax_variable_read_at_import(tmp_path):
  res = run_job(
    "tests.test_launcher:whoami",
    1,
    {"driver": os.getpid()},
    devices_per_process=1,
    env={0: {"JAX_ENABLE_X64": "1"}},
    out_dir=str(tmp_path),
    start="fork",
  )
  assert res.returncodes == [2], res.returncodes
  assert "cannot change ['JAX_ENABLE_X64']" in res.logs[0], res.logs[0]
  assert "start='spawn'" in res.logs[0], res.logs[0]


def test_an_unknown_start_method_is_named(monkeypatch):
  with pytest.raises(ValueError, match="start='forked'.*spawn"):
    run_job("tests.test_launcher:whoami", 1, {}, start="forked")
  monkeypatch.setenv(launcher.START_ENV, "exec")
  with pytest.raises(ValueError, match="EC_LAUNCHER_START"):
    run_job("tests.test_launcher:whoami", 1, {})
