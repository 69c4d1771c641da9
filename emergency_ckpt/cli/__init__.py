"""`emergency-ckpt`: inspect, verify and garbage-collect checkpoint folders,
summarise event logs, run the benchmark and the demo.

`inspect`, `verify` and `gc` work on folders only (no JAX job): a local root
(the `local.directory` of one host) or a persistent root (holding tensors/ and
state/). `report` reads the JSON-lines event logs written by
`emergency_ckpt.core.telemetry.EventLog`. Output is a plain table (colored only on a
terminal), or JSON with --json; progress goes to stderr.
"""

from __future__ import annotations

import argparse

from emergency_ckpt.cli.bench import cmd_bench
from emergency_ckpt.cli.gc import cmd_gc, plan_gc
from emergency_ckpt.cli.inspect import cmd_inspect, cmd_verify, collect
from emergency_ckpt.cli.report import cmd_report, summarize_events
from emergency_ckpt.cli.timeline import draw_timeline
from emergency_ckpt.demo import main as demo_main

__all__ = [
  "build_parser",
  "cmd_bench",
  "cmd_demo",
  "cmd_gc",
  "cmd_inspect",
  "cmd_report",
  "cmd_verify",
  "collect",
  "draw_timeline",
  "main",
  "plan_gc",
  "summarize_events",
]


def cmd_demo(a) -> int:
  """`emergency-ckpt demo`: runs the README's main job.

  Args:
    a: the parsed arguments (root, keep, config).

  Returns:
    The demo's exit status.
  """
  return demo_main.run(a.root, keep=a.keep, config=a.config)


# ---- argument parsing ----------------------------------------------------------
_GC_HELP = """\
Apply retention offline (no JAX job needed) to local roots (a host's
local.directory: <dir>/<run_id>/process_<i>/step_<N>) and/or persistent roots
(tensors/<N> Orbax steps, state/<N> JSON + COMMIT).

A step is kept if ANY rule keeps it: the newest N (--keep), every step divisible
by P (--keep-period), the K best by a metric read from each step's COMMIT record
in the state store (--keep-best K --metric NAME --mode min|max). Always kept,
whatever the rules say:
  persistent root: the newest restorable step (finalized tensors + committed
    state) and any newer tensor step (its state commit may be in flight); the
    state of every kept tensor step, of every local step kept in the same call,
    and every state newer than the newest COMMIT. Other state steps (the state
    of local-tier saves) follow the same rules among committed steps;
    uncommitted state older than the newest COMMIT is deleted.
  local root, per process: with a state store (--state ROOT, or a persistent
    root given in DIR... whose run.json names the run), the newest committed
    step held and every newer step; without one, the newest step.
Unfinished saves and spare files (.tmp-* folders, unfinalized Orbax folders)
are left alone: a manager removes them when it starts. Deletion renames a step out of the
listing first, so a crash never leaves a half-deleted step listed.
Run it while no job writes these folders, and start with --dry-run.
"""

_GC_EPILOG = """\
examples:
  emergency-ckpt gc gs://bucket/run --keep 3 --keep-period 1000 --dry-run
  emergency-ckpt gc /dev/shm/ckpt gs://bucket/run --keep 2 \\
      --keep-best 2 --metric eval_loss --mode min
  emergency-ckpt gc /dev/shm/ckpt --state gs://bucket/run --keep 1 --json
exit status: 0, or 1 if a DIR does not exist or a deletion failed.
"""

_REPORT_HELP = """\
Summarise a run from the JSON-lines event logs of emergency_ckpt.core.telemetry.
EventLog (one file per process, or a folder of *.jsonl files; restarts may
append to the same files).

Definitions:
  wall time: from the earliest event (or run_start's wall_start) to the latest
    event over all files, restarts and downtime included.
  checkpoint overhead: the total time save() blocked the training loop
    (the sum of the "save" events' stall_s) of the process with the largest
    total, divided by the wall time, in %. Background writes, uploads,
    restores and redone work are not in it; they are reported separately.
  durable time: from the save() call until the tier holds the step (mean and
    max of save_durable events without error, per tier: local, persistent,
    state).
  lost steps (per restore): the newest step that process saved before the
    restore minus the restored step. Redone steps: the newest train_step the
    process recorded since its previous restore minus the restored step (and
    their duration_s summed: redone s), when the trainer records train_step;
    else the redone work of the incarnation before the restore (below).
  goodput: the share of the wall time that trained the model, of the process
    with the lowest. Per incarnation (a process's life from one run_start to
    its next): productive (the manager's progress events: the time between
    save() calls, less their stalls; else the train_step events' duration_s)
    less redone work; save stalls; restores; start-up; redone work (the
    steps it trained past the step the next incarnation restored, at their
    measured time); other. Per process also down (outside its
    incarnations). An incarnation without a closing progress event ended
    without close(): FAILED when it was restarted, or when the logs record
    start-ups at all.
"""

_BENCH_HELP = """\
Run the benchmark (emergency_ckpt.bench; also `python -m emergency_ckpt.bench`):
emergency_ckpt against Orbax's multislice and P2P emergency checkpoint
managers and the raw bounds of this machine (memcpy, ramdisk, disk), 4
processes x 2 CPU devices.
Jobs: the raw bounds, then per manager a main job (save stall and durable
times, restore intact / after losing a slice / from persistent) and K restart
jobs (spawn to restored state). Shows one numbered line per job (a live status
line on a terminal); the benchmark's detailed log goes to OUT/bench.log
(--verbose: to stderr). Writes OUT/results.json and OUT/results.md and prints
the table. The full size (512 MiB per replica, 3 reps) takes a long time;
--quick (4 MiB, 1 rep) is a smoke run of a few minutes.
"""


def _nonneg_int(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def _pos_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def build_parser() -> argparse.ArgumentParser:
  """The `emergency-ckpt` argument parser (the docs' CLI page renders it).

  Returns:
    The parser; each subcommand sets `fn`, the cmd_* function that runs it.
  """
  fmt = argparse.RawDescriptionHelpFormatter
  p = argparse.ArgumentParser(prog="emergency-ckpt", description=__doc__, formatter_class=fmt)
  sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
  dirs_help = "local roots (a host's local.directory) or persistent roots (path or gs://)"

  s = sub.add_parser(
    "inspect",
    help="list steps per tier, markers, sizes, topology, save time",
    description="List every step per tier with its markers, size, slice and save time."
    " Reads folders only.",
  )
  s.add_argument("dirs", nargs="+", metavar="DIR", help=dirs_help)
  s.add_argument("--json", action="store_true", help="print JSON instead of a table")
  s.set_defaults(fn=cmd_inspect)

  s = sub.add_parser(
    "verify",
    help="check markers and checksums; exit 1 if anything is bad",
    description="Check local manifests and every shard's CRC32C, and persistent state"
    " COMMIT markers. Exit status 1 if anything is bad or nothing was found.",
  )
  s.add_argument("dirs", nargs="+", metavar="DIR", help=dirs_help)
  s.add_argument("--step", type=int, help="check this step only")
  s.add_argument("--json", action="store_true", help="print JSON instead of a table")
  s.set_defaults(fn=cmd_verify)

  s = sub.add_parser(
    "gc",
    help="apply retention offline (keep newest N, every P-th, best K); --dry-run",
    description=_GC_HELP,
    epilog=_GC_EPILOG,
    formatter_class=fmt,
  )
  s.add_argument("dirs", nargs="+", metavar="DIR", help=dirs_help)
  s.add_argument(
    "--keep", type=_nonneg_int, required=True, metavar="N", help="keep the newest N steps"
  )
  s.add_argument(
    "--keep-period", type=_pos_int, metavar="P", help="also keep every step divisible by P"
  )
  s.add_argument(
    "--keep-best", type=_pos_int, metavar="K", help="also keep the K best steps by --metric"
  )
  s.add_argument("--metric", metavar="NAME", help="metric of the COMMIT record that ranks steps")
  s.add_argument(
    "--mode",
    choices=("min", "max"),
    default="min",
    help="min: smaller --metric is better (a loss; default); max: larger is better",
  )
  s.add_argument(
    "--state",
    metavar="ROOT",
    help="persistent root whose state store tells local roots which steps are committed"
    " (and their metrics); default: a persistent root in DIR... whose run.json names the run",
  )
  s.add_argument(
    "--dry-run", action="store_true", help="show what would be deleted; delete nothing"
  )
  s.add_argument("--json", action="store_true", help="print JSON instead of a table")
  s.set_defaults(fn=cmd_gc)

  s = sub.add_parser(
    "report",
    help="summarise a run from event logs: overhead, goodput, saves, restores, errors",
    description=_REPORT_HELP,
    formatter_class=fmt,
    epilog="example:\n  emergency-ckpt report logs/events_*.jsonl --png timeline.png",
  )
  s.add_argument(
    "logs", nargs="+", metavar="LOG", help="JSON-lines event files, or folders of *.jsonl"
  )
  s.add_argument("--json", action="store_true", help="print JSON instead of tables")
  s.add_argument(
    "--png",
    metavar="OUT.png",
    help="also draw a timeline (saves, failures, restores per process); needs matplotlib",
  )
  s.set_defaults(fn=cmd_report)

  s = sub.add_parser(
    "bench",
    help="benchmark against Orbax's emergency managers and the raw bounds",
    description=_BENCH_HELP,
    formatter_class=fmt,
    epilog="example:\n  emergency-ckpt bench --quick --out /tmp/bench",
  )
  s.add_argument("--quick", action="store_true", help="4 MiB per replica, 1 rep (smoke run)")
  s.add_argument(
    "--mib-per-replica", type=_pos_int, metavar="N", help="train state size (default 512)"
  )
  s.add_argument("--reps", type=_pos_int, metavar="K", help="restart jobs per manager (default 3)")
  s.add_argument("--out", default="bench_out", metavar="DIR", help="output folder (bench_out)")
  s.add_argument(
    "--managers",
    metavar="A,B",
    help="comma-separated subset of emergency_ckpt,orbax_multislice,orbax_p2p (default: all)",
  )
  s.add_argument("--job-timeout", type=float, metavar="S", help="seconds per job (default scaled)")
  s.add_argument("--keep", action="store_true", help="keep the ramdisk and persistent folders")
  s.add_argument(
    "--verbose", action="store_true", help="the benchmark's detailed log to stderr, not a file"
  )
  s.set_defaults(fn=cmd_bench)

  s = sub.add_parser(
    "demo",
    help="run the README's main job",
    description="The README's main job: a 2-slice CPU training run loses a slice and"
    " resumes from its peer, bit-exactly (emergency_ckpt.demo; also"
    " `python -m emergency_ckpt.demo`). 4 processes x 2 CPU devices; under a minute.",
  )
  demo_main.add_arguments(s)
  s.set_defaults(fn=cmd_demo)
  return p


def main(argv: list[str] | None = None) -> int:
  """The `emergency-ckpt` command.

  Args:
    argv: the arguments; None: sys.argv[1:].

  Returns:
    The subcommand's exit status (argparse exits with 2 on bad arguments).
  """
  p = build_parser()
  a = p.parse_args(argv)
  if a.cmd == "gc":
    if (a.keep_best is None) != (a.metric is None):
      p.error("gc: --keep-best K and --metric NAME go together")
  return a.fn(a)
