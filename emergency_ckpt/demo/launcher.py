"""Launches real multi-process jax.distributed jobs on one CPU machine.

Used by the demo, the benchmark and the tests. `run_job("pkg.mod:fn", n, args)`
starts n processes of `python -m emergency_ckpt.demo.job_process`, each running
`fn(args)` after jax.distributed.initialize on 127.0.0.1. The target module is
imported by name, so it must be importable by the children: they run in the
caller's working directory with the caller's interpreter, and the folder the
caller imports the target's top-level package from is put on their PYTHONPATH
(so `tests.scenarios:fn` works from a checkout, `emergency_ckpt.demo.trainer:fn`
from an installed wheel).

Each process returns a JSON-able result, written to <out>/result_<i>.json; each
writes its OS pid to <out>/pid_<i> first (so a process can signal a sibling:
`read_pid(job_output_dir(), i)`). Every process exits only after every other
process wrote its result or died (bounded by EC_LAUNCHER_EXIT_WAIT_S, default
60 s), since its exit closes its collective (Gloo) sockets: leaving at once
could abort a sibling still reading the last collective ("Connection closed
by peer"). Process 0 hosts the coordination service, so it leaves last, once
the others are gone (a client that loses the service aborts). The launcher kills only its own children, by PID,
after a timeout; first it asks each one still running for the Python stacks of
all its threads (SIGUSR1, faulthandler), which land in its log, so a hang
names the line it hung on.

How the children start (`start`, default the environment variable
EC_LAUNCHER_START, else "spawn"): "spawn" runs a fresh interpreter per
process (what the demo and a benchmark's spawn-to-restored row measure);
"fork" forks each from a server process that imported jax, orbax and
tensorstore once (multiprocessing's forkserver), which saves each child
about 1.2 CPU-seconds of imports. The test suite runs with fork
(tests/conftest.py). A forked child is still its own OS process, with its
own jax.distributed client, devices, sockets and log; it gets the same
environment, working directory, import path, session and exit status as a
spawned one. What it cannot change is what jax read from the environment at
import: a JAX_* variable other than JAX_PLATFORMS that differs from the
server's is refused (use start="spawn").

Environment of each child (set by run_job): EC_JOB_COORD (coordinator
address), EC_JOB_NPROC (process count), EC_JOB_PID (this process's index),
EC_JOB_OUT (the job's output folder; `job_output_dir()`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import io
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any

from emergency_ckpt.demo import job_process
from emergency_ckpt.demo.job_process import (
  COORD_ENV,
  NPROC_ENV,
  OUT_ENV,
  PID_ENV,
  STACKS_SIGNAL,
  read_pid,
)

START_ENV = "EC_LAUNCHER_START"
STARTS = ("spawn", "fork")
FORK_PRELOAD = ("numpy", "jax", "tensorstore", "orbax.checkpoint")
STACKS_WAIT_S = 1.0  # how long a timed-out job's children get to dump them


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago (for the coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class JobResult:
  returncodes: list[int]
  results: list[Any]  # per process: the function's result, or None
  errors: list[str | None]  # per process: traceback text, or None
  logs: list[str]
  timed_out: bool
  wall_s: float
  pids: list[int | None] = dataclasses.field(default_factory=list)
  """OS pid of each process (as it reported it), or None."""

  def check(self) -> list[Any]:
    """The per-process results, asserting every process succeeded."""
    bad = [i for i, rc in enumerate(self.returncodes) if rc != 0]
    if bad or self.timed_out:
      detail = "\n".join(
        f"--- process {i} rc={self.returncodes[i]}\n{self.errors[i] or ''}\n{self.logs[i][-4000:]}"
        for i in (bad or range(len(self.returncodes)))
      )
      raise AssertionError(f"job failed (timed_out={self.timed_out}):\n{detail}")
    return self.results


def run_job(
  target: str,
  num_processes: int,
  args: dict,
  *,
  devices_per_process: int = 2,
  timeout_s: float = 240,
  env: dict[int, dict[str, str]] | None = None,
  out_dir: str | None = None,
  start: str | None = None,
) -> JobResult:
  """Runs `target` ("package.module:function") in `num_processes` processes
  of one jax.distributed job, each with `devices_per_process` CPU devices, and
  waits for them (at most `timeout_s`, then kills them). `env` adds variables
  per process index; `out_dir` (default: a fresh temporary folder) gets the
  logs, pids and results; `start` is "spawn" or "fork" (module docstring;
  default $EC_LAUNCHER_START, else "spawn"). Called by: the driver (tests,
  demo, benchmark)."""
  start = start or default_start()
  if start not in STARTS:
    raise ValueError(
      f"run_job: start={start!r} (from the argument or ${START_ENV}) is not one of {STARTS}"
    )
  out_dir = out_dir or tempfile.mkdtemp(prefix="ecjob-")
  os.makedirs(out_dir, exist_ok=True)
  port = free_port()
  root = _import_root(target)
  procs = []
  logs = []
  t0 = time.monotonic()
  for i in range(num_processes):
    e = dict(os.environ)
    e.update(
      {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}",
        COORD_ENV: f"127.0.0.1:{port}",
        NPROC_ENV: str(num_processes),
        PID_ENV: str(i),
        OUT_ENV: out_dir,
        "PYTHONUNBUFFERED": "1",
      }
    )
    if root is not None:
      e["PYTHONPATH"] = os.pathsep.join(p for p in (root, e.get("PYTHONPATH")) if p)
    e.pop("EC_FAILPOINTS", None)
    e.update((env or {}).get(i, {}))
    log_path = os.path.join(out_dir, f"log_{i}.txt")
    logs.append(log_path)
    if start == "fork":
      procs.append(_Forked(target, json.dumps(args), e, log_path, root))
      continue
    with open(log_path, "wb") as log:
      procs.append(
        subprocess.Popen(
          [sys.executable, "-m", "emergency_ckpt.demo.job_process", target, json.dumps(args)],
          stdout=log,
          stderr=subprocess.STDOUT,
          env=e,
          start_new_session=True,
        )
      )
  timed_out = False
  deadline = t0 + timeout_s
  for p in procs:
    try:
      p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      timed_out = True
      break
  if timed_out:
    _dump_stacks(procs)
    for p in procs:
      if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
      p.wait()
  results, errors = [], []
  for i in range(num_processes):
    path = os.path.join(out_dir, f"result_{i}.json")
    if os.path.exists(path):
      with open(path) as f:
        doc = json.load(f)
      results.append(doc.get("result"))
      errors.append(doc.get("error"))
    else:
      results.append(None)
      errors.append(None)
  log_text = []
  for path in logs:
    with open(path, errors="replace") as f:
      log_text.append(f.read())
  return JobResult(
    [p.returncode for p in procs],
    results,
    errors,
    log_text,
    timed_out,
    time.monotonic() - t0,
    [read_pid(out_dir, i) for i in range(num_processes)],
  )


def default_start() -> str:
  """How run_job starts processes when not told: $EC_LAUNCHER_START, else "spawn"."""
  return os.environ.get(START_ENV) or "spawn"


def start_note() -> str | None:
  """For a benchmark's report: a sentence saying its jobs' processes were
  forked ($EC_LAUNCHER_START=fork, the test suite's setting), so its spawn
  rows time a fork; None when they spawn (the default)."""
  if default_start() != "fork":
    return None
  return (
    f"{START_ENV}=fork: the job processes were forked from a server that had imported"
    " jax and Orbax, so rows timed from process spawn time a fork, not a spawn."
  )


@functools.cache
def _fork_server():
  """multiprocessing's forkserver context, its server importing FORK_PRELOAD
  once (started on first use, with this process's environment; it lives until
  this process exits)."""
  ctx = multiprocessing.get_context("forkserver")
  ctx.set_forkserver_preload(list(FORK_PRELOAD))
  return ctx


class _Forked:
  """One job process forked from the fork server, with subprocess.Popen's
  pid / poll() / wait(timeout) / returncode (negative: killed by that signal)."""

  def __init__(self, target: str, raw_args: str, env: dict, log_path: str, root: str | None):
    self._p = _fork_server().Process(
      target=_forked_main,
      args=(target, raw_args, env, log_path, root, os.getcwd()),
      name=f"ec-job-{env.get(PID_ENV)}",
    )
    self._p.start()
    self.pid = self._p.pid

  @property
  def returncode(self) -> int | None:
    return self._p.exitcode

  def poll(self) -> int | None:
    return self._p.exitcode

  def wait(self, timeout: float | None = None) -> int:
    self._p.join(timeout)
    if self._p.exitcode is None:
      raise subprocess.TimeoutExpired(f"job process {self.pid}", timeout)
    return self._p.exitcode


def _forked_main(
  target: str, raw_args: str, env: dict, log_path: str, root: str | None, cwd: str
) -> None:
  """In a child of the fork server: becomes what Popen would have started
  (own session, stdout and stderr to the log, the job's environment, working
  directory and import path), then runs _worker_main, which exits."""
  os.setsid()
  fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)
  sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
  sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
  read_at_import = {k: v for k, v in os.environ.items() if k.startswith("JAX_")}
  os.environ.clear()
  os.environ.update(env)
  os.chdir(cwd)
  if root is not None and root not in sys.path:
    sys.path.insert(0, root)
  wanted = {k: v for k, v in env.items() if k.startswith("JAX_")}
  changed = sorted(
    k for k in read_at_import.keys() | wanted.keys() if read_at_import.get(k) != wanted.get(k)
  )
  import jax  # noqa: PLC0415 - imported by the server already

  if "JAX_PLATFORMS" in changed:
    jax.config.update("jax_platforms", wanted.get("JAX_PLATFORMS"))
    changed.remove("JAX_PLATFORMS")
  if changed:
    print(
      f"launcher: a forked job process cannot change {changed}: jax read them when the"
      f" fork server imported it. Run this job with start='spawn' (or {START_ENV}=spawn).",
      file=sys.stderr,
    )
    os._exit(2)
  sys.argv = [job_process.__file__, target, raw_args]
  job_process.main()


def _dump_stacks(procs: list) -> None:
  """Asks every child still running to write its threads' stacks to its log
  (each registered STACKS_SIGNAL with faulthandler; the handler writes at
  once, from C), then gives them STACKS_WAIT_S to be scheduled."""
  running = [p for p in procs if p.poll() is None]
  for p in running:
    try:
      os.kill(p.pid, STACKS_SIGNAL)
    except ProcessLookupError:
      pass
  if running:
    time.sleep(STACKS_WAIT_S)


def _import_root(target: str) -> str | None:
  """The folder this process imports the target's top-level package from,
  for the children's PYTHONPATH; None if the interpreter's own site-packages
  hold it (the children find it there) or it is not importable here."""
  top = target.split(":")[0].split(".")[0]
  spec = importlib.util.find_spec(top)
  if spec is None:
    return None  # the children's import fails and reports it
  if spec.submodule_search_locations:
    where = os.path.dirname(os.path.abspath(next(iter(spec.submodule_search_locations))))
  elif spec.origin and os.path.exists(spec.origin):
    where = os.path.dirname(os.path.abspath(spec.origin))
  else:
    return None  # built in or frozen
  site = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
  return None if os.path.realpath(where) in site else where
