"""`emergency-ckpt bench`: run the benchmark (emergency_ckpt.bench.run) with a
numbered progress line per job; with --scale, the scale benchmark
(emergency_ckpt.bench.scale) instead; with --elastic, the restore onto fewer
slices (emergency_ckpt.bench.elastic); with --shared-read, the persistent read
shared between slices (emergency_ckpt.bench.shared_read)."""

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


def add_scale_arguments(parser) -> None:
  """The `bench` subcommand's --scale options (build_parser calls this)."""
  parser.add_argument(
    "--scale",
    action="store_true",
    help="run the scale benchmark instead (emergency_ckpt.bench.scale): the exchange against a"
    " real coordination service with K simulated processes, and the restore planner at"
    " 16,384 processes; writes OUT/scale.json, scale.md, scale.png (--reps: timed exchanges"
    " per K; --quick: K up to 64, planner at 1,024 processes)",
  )
  parser.add_argument(
    "--max-k", type=int, metavar="K", help="--scale: largest simulated process count (2048)"
  )
  parser.add_argument(
    "--elastic",
    action="store_true",
    help="run the elastic benchmark instead (emergency_ckpt.bench.elastic): 2 slices save,"
    " slice 1 is lost for good, restarts on 1 slice (same slice shape, another one, persistent),"
    " ours against Orbax P2P; writes OUT/results.json and results.md (--reps: rounds, default"
    " 3; --mib-per-replica default 256; --quick: 1 MiB, 1 round)",
  )
  parser.add_argument(
    "--shared-read",
    action="store_true",
    help="run the shared-read benchmark instead (emergency_ckpt.bench.shared_read): 2 slices x 2"
    " processes restore from a persistent tier on fake-gcs-server behind a byte-counting proxy,"
    " per-process read against the slices splitting the read and one slice reading all,"
    " interleaved; writes OUT/results.json and results.md (--reps: rounds, default 3;"
    " --mib-per-replica default 64; --quick: 1 MiB, 1 round)",
  )


def scale_argv(a) -> list[str]:
  """`python -m emergency_ckpt.bench.scale` arguments for `emergency-ckpt bench --scale`."""
  argv = ["--out", a.out]
  if getattr(a, "max_k", None) is not None:
    argv += ["--max-k", str(a.max_k)]
  if a.reps is not None:
    argv += ["--reps", str(a.reps)]
  if a.quick:
    argv += ["--ks", "4,16,64", "--planner-processes", "256,1024"]
  return argv


def cmd_bench_scale(a) -> int:
  from emergency_ckpt.bench import scale  # noqa: PLC0415 - pulls in JAX

  os.makedirs(a.out, exist_ok=True)
  return scale.main(scale_argv(a))


def job_bench_argv(a) -> list[str]:
  """The arguments of a one-job benchmark driver (`python -m
  emergency_ckpt.bench.elastic` or `.shared_read`) for `emergency-ckpt bench
  --elastic` / `--shared-read`: --quick means 1 MiB, 1 rep."""
  argv = ["--out", a.out]
  mib, reps = a.mib_per_replica, a.reps
  if a.quick:
    mib, reps = mib or 1, reps or 1
  for flag, value in (
    ("--mib-per-replica", mib),
    ("--reps", reps),
    ("--job-timeout", a.job_timeout),
  ):
    if value is not None:
      argv += [flag, str(value)]
  if a.keep:
    argv.append("--keep")
  return argv


elastic_argv = shared_read_argv = job_bench_argv


def cmd_bench_elastic(a) -> int:
  from emergency_ckpt.bench import elastic  # noqa: PLC0415 - pulls in JAX

  os.makedirs(a.out, exist_ok=True)
  return elastic.main(elastic_argv(a))


def cmd_bench_shared_read(a) -> int:
  from emergency_ckpt.bench import shared_read  # noqa: PLC0415 - pulls in the GCS test server

  os.makedirs(a.out, exist_ok=True)
  return shared_read.main(shared_read_argv(a))


def cmd_bench(a) -> int:
  if getattr(a, "scale", False):
    return cmd_bench_scale(a)
  if getattr(a, "elastic", False):
    return cmd_bench_elastic(a)
  if getattr(a, "shared_read", False):
    return cmd_bench_shared_read(a)
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
