"""The job-process side of `launcher.run_job`: what runs inside each process.

Each process writes its OS pid to <out>/pid_<i>, runs the target after
jax.distributed.initialize, writes its result to <out>/result_<i>.json, and
exits only after its siblings wrote theirs or died (process 0 last: it hosts
the coordination service). A job function finds its folder with
`job_output_dir()` and a sibling's pid with `read_pid`.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

COORD_ENV = "EC_JOB_COORD"
NPROC_ENV = "EC_JOB_NPROC"
PID_ENV = "EC_JOB_PID"
OUT_ENV = "EC_JOB_OUT"
EXIT_WAIT_ENV = "EC_LAUNCHER_EXIT_WAIT_S"
STACKS_SIGNAL = signal.SIGUSR1  # a child dumps every thread's stack to its log


def job_output_dir() -> str:
  """The output folder of the job this process belongs to (logs, pids,
  results); a job function may put its own files there. Called by: a process
  started by run_job."""
  try:
    return os.environ[OUT_ENV]
  except KeyError:
    raise RuntimeError(f"not a process of a run_job job ({OUT_ENV} is not set)") from None


def in_job() -> bool:
  """True in a process started by run_job."""
  return OUT_ENV in os.environ


def read_pid(out_dir: str, process: int) -> int | None:
  """The OS pid that process `process` of the job in `out_dir` reported."""
  try:
    with open(os.path.join(out_dir, f"pid_{process}")) as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def process_gone(pid: int) -> bool:
  """True if `pid` has exited (reaped, or a zombie waiting for its parent)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      state = f.read().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    try:
      os.kill(pid, 0)  # no /proc (not Linux): exists unless this raises
    except ProcessLookupError:
      return True
    except OSError:
      return False
    return False
  return state in ("Z", "X")


def wait_for_siblings(
  out_dir: str, me: int, n: int, timeout_s: float, *, until_gone: bool = False
) -> list[int]:
  """Blocks until every other process of the job wrote its result file or
  exited (`until_gone`: exited), or `timeout_s` passed; returns the processes
  still running then."""
  deadline = time.monotonic() + timeout_s
  pending = [i for i in range(n) if i != me]
  while True:
    still = []
    for i in pending:
      if not until_gone and os.path.exists(os.path.join(out_dir, f"result_{i}.json")):
        continue
      pid = read_pid(out_dir, i)
      if pid is not None and process_gone(pid):
        continue
      still.append(i)
    pending = still
    if not pending or time.monotonic() >= deadline:
      return pending
    time.sleep(0.05)


def main() -> None:
  """Runs one job process: `python -m emergency_ckpt.demo.job_process TARGET ARGS`."""
  target, raw_args = sys.argv[1], sys.argv[2]
  pid = int(os.environ[PID_ENV])
  n = int(os.environ[NPROC_ENV])
  out_dir = job_output_dir()
  out = os.path.join(out_dir, f"result_{pid}.json")
  faulthandler.register(STACKS_SIGNAL, all_threads=True)  # run_job's timeout asks
  with open(os.path.join(out_dir, f"pid_{pid}.tmp"), "w") as f:
    f.write(str(os.getpid()))
  os.replace(os.path.join(out_dir, f"pid_{pid}.tmp"), os.path.join(out_dir, f"pid_{pid}"))
  code = 1
  doc: dict[str, Any] = {}
  try:
    import jax  # noqa: PLC0415

    if n > 1:
      jax.distributed.initialize(
        coordinator_address=os.environ[COORD_ENV],
        num_processes=n,
        process_id=pid,
        initialization_timeout=120,
      )
    module, fn = target.split(":")
    result = getattr(importlib.import_module(module), fn)(json.loads(raw_args))
    doc = {"result": result}
    code = 0
  except BaseException:  # noqa: BLE001 - report everything, then exit hard
    doc = {"error": traceback.format_exc()}
    print(doc["error"], file=sys.stderr)
  with open(out + ".tmp", "w") as f:
    json.dump(doc, f)
  os.replace(out + ".tmp", out)
  if n > 1:
    # Exiting now would close this process's collective sockets under
    # siblings still using them. Process 0 hosts the coordination service:
    # it leaves last, once the others are gone (a client that loses the
    # service aborts, even after writing its result).
    left = wait_for_siblings(
      out_dir, pid, n, float(os.environ.get(EXIT_WAIT_ENV, "60")), until_gone=pid == 0
    )
    if left:
      print(f"launcher: exiting while processes {left} still run", file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # never hang in jax.distributed shutdown


if __name__ == "__main__":
  main()
