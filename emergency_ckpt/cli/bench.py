"""`emergency-ckpt bench`: run the benchmark (emergency_ckpt.bench.run) with a
numbered progress line per job. The research studies (scale, elastic restarts,
the shared read, redundancy, device transfers) live in the repository's
benchmarks/ folder, not in the wheel."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

from emergency_ckpt.cli._output import Progress


def _bench_module():
  """emergency_ckpt.bench.run, imported only for this command (it pulls in JAX)."""
  from emergency_ckpt.bench import run  # noqa: PLC0415

  return run


def _phase(label: str, reps: int) -> str:
  if label == "raw":
    return "raw bounds (memcpy, ramdisk, persistent disk)"
  m = re.fullmatch(r"(.+)-restart-(\d+)", label)
  if m:
    return f"{m.group(1)} restart rep {int(m.group(2)) + 1}/{reps} (spawn to restored)"
  m = re.fullmatch(r"(.+)-main", label)
  if m:
    return f"{m.group(1)} main job (saves, restores intact / lost slice / persistent)"
  return label


class _LogSink:
  """The benchmark's detailed stderr: to a file, the last line kept for display."""

  def __init__(self, f):
    self._f = f
    self.last = ""

  def write(self, text: str) -> int:
    self._f.write(text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines:
      self.last = lines[-1].strip()
    return len(text)

  def flush(self) -> None:
    self._f.flush()


class _BenchProgress:
  """emergency_ckpt.bench.run's on_job hook: one numbered line per job."""

  def __init__(self, total: int, reps: int, progress: Progress, sink: _LogSink | None):
    self.total, self.reps, self.index = total, reps, 0
    self.progress, self.sink = progress, sink
    self.current: tuple[str, float] | None = None
    self.failed: list[str] = []

  def __call__(self, label: str, status: str, wall_s: float | None, error: str | None) -> None:
    phase = _phase(label, self.reps)
    if status == "start":
      self.index += 1
      self.current = (f"[{self.index}/{self.total}] {phase}", time.monotonic())
      if not self.progress.tty:
        self.progress.line(f"{self.current[0]} ...")
      return
    head = f"[{self.index}/{self.total}] {phase}"
    self.current = None
    if status == "done":
      self.progress.line(f"{head} done in {wall_s:.1f}s")
    else:
      self.failed.append(label)
      self.progress.line(f"{head} FAILED after {wall_s or 0:.1f}s: {error}")
      if label.endswith("-main"):  # its restart jobs are skipped
        self.total -= self.reps

  def tick(self) -> None:
    if self.current is not None:
      text, t = self.current
      detail = f" | {self.sink.last}" if self.sink is not None and self.sink.last else ""
      self.progress.status(f"{text} ... {time.monotonic() - t:.0f}s{detail}")


def cmd_bench(a) -> int:
  """`emergency-ckpt bench`: runs the benchmark with a numbered progress line per job.

  Args:
    a: the parsed arguments (quick, mib_per_replica, reps, out, managers,
      job_timeout, keep, verbose).

  Returns:
    The benchmark's exit status.
  """
  run = _bench_module()
  argv = ["--out", a.out]
  if a.quick:
    argv.append("--quick")
  for flag, value in (
    ("--mib-per-replica", a.mib_per_replica),
    ("--reps", a.reps),
    ("--managers", a.managers),
    ("--job-timeout", a.job_timeout),
  ):
    if value is not None:
      argv += [flag, str(value)]
  if a.keep:
    argv.append("--keep")
  args = run.parse_args(argv)  # defaults and validation, as the benchmark applies them
  total = 1 + len(args.managers) * (1 + args.reps)
  progress = Progress()
  os.makedirs(a.out, exist_ok=True)
  log_path = os.path.join(a.out, "bench.log")
  progress.line(
    f"bench: {args.mib_per_replica} MiB per replica, {args.reps} rep(s), managers"
    f" {', '.join(args.managers)}: {total} jobs"
    + ("" if a.verbose else f"; detailed log in {log_path}")
  )
  t0 = time.monotonic()
  with contextlib.ExitStack() as stack:
    sink = None
    if not a.verbose:
      sink = _LogSink(stack.enter_context(open(log_path, "w", encoding="utf-8")))
      stack.enter_context(contextlib.redirect_stderr(sink))
    tracker = _BenchProgress(total, args.reps, progress, sink)
    stop = threading.Event()
    if progress.tty:

      def tick():
        while not stop.wait(1.0):
          tracker.tick()

      ticker = threading.Thread(target=tick, name="ec-bench-progress", daemon=True)
      ticker.start()
      stack.callback(ticker.join)
    stack.callback(stop.set)
    rc = run.main(argv, on_job=tracker)
  progress.clear()
  out = os.path.join(a.out, "results")
  progress.line(
    f"bench: finished in {time.monotonic() - t0:.0f}s, exit {rc}; results in {out}.md and"
    f" {out}.json" + ("" if a.verbose else f"; log {log_path}")
  )
  if tracker.failed:
    progress.line(f"bench: failed jobs: {', '.join(tracker.failed)}")
  return rc
