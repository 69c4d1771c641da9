"""`python -m tests.soak --seed N --rounds R [...]`: runs a soak, prints its
summary (faults by kind, restores by source, rounds, lost, regressed,
silent, failures) and writes it as JSON with --out. Exit status 1 if any
invariant broke.

`--matrix`: one soak of R rounds for each of MATRIX (none, partner and xor,
on 1 and 2 slices, half of them on gs://), seeds N, N+1, ...; the summary
adds them up and keeps each one's (the docs' record is such a run)."""

from __future__ import annotations

import os

from tests.harness.gcs_server import CLIENT_ENV

# Before anything imports gcsfs or jax (here or in the job processes' fork server).
for _key, _value in {**CLIENT_ENV, "JAX_PLATFORMS": "cpu", "EC_LAUNCHER_START": "fork"}.items():
  os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from tests.soak.runner import Config, run_soak  # noqa: E402

MATRIX = [  # (redundancy, slices, gcs): every scheme on 1 and 2 slices, 4 processes
  ("none", 1, True),
  ("partner", 1, False),
  ("xor", 1, True),
  ("none", 2, False),
  ("partner", 2, True),
  ("xor", 2, False),
]


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
  p.add_argument("--seed", type=int, required=True, help="drives every choice of the run")
  p.add_argument("--rounds", type=int, default=10, help="jobs (the last one stops cleanly)")
  p.add_argument("--redundancy", choices=["none", "partner", "xor"], default="partner")
  p.add_argument("--slices", type=int, default=1)
  p.add_argument("--processes", type=int, default=4)
  p.add_argument("--gcs", action="store_true", help="persistent tier on fake-gcs-server")
  p.add_argument("--local-keep", type=int, default=2, help="local.max_to_keep")
  p.add_argument("--persistent-keep", type=int, default=2, help="persistent.max_to_keep")
  p.add_argument("--out", help="also write the summary here, as JSON")
  p.add_argument("--root", help="working folder (default: a fresh one under /dev/shm)")
  p.add_argument("--keep-going", action="store_true", help="do not stop at the first failure")
  p.add_argument("--keep", action="store_true", help="keep the working folder")
  p.add_argument(
    "--matrix",
    action="store_true",
    help="run every configuration of MATRIX for --rounds rounds each (seeds N, N+1, ...)",
  )
  return p


@contextlib.contextmanager
def _gcs(enabled: bool, log_dir: str):
  if not enabled:
    yield None
    return
  from tests.harness.gcs_proxy import GcsProxy  # noqa: PLC0415
  from tests.harness.gcs_server import GcsServer  # noqa: PLC0415

  with GcsServer(log_dir=log_dir) as server, GcsProxy(server.url) as proxy:
    yield server, proxy


def _one(a, config: Config, seed: int) -> dict:
  base = "/dev/shm" if os.path.isdir("/dev/shm") else None
  root = a.root or tempfile.mkdtemp(prefix="ecsoak-", dir=base)
  os.makedirs(root, exist_ok=True)
  with _gcs(config.gcs, root) as gcs:
    summary = run_soak(config, seed, a.rounds, root, gcs=gcs, keep_going=a.keep_going)
  if summary["ok"] and not a.keep and not a.root:
    shutil.rmtree(root, ignore_errors=True)
  else:
    print(f"soak: working folder kept: {root}", file=sys.stderr)
  return summary


def _add_up(summaries: list[tuple[str, int, dict]]) -> dict:
  """The matrix's summary: totals, and each configuration's brief."""
  total: dict = {"configurations": [], "ok": True, "failures": []}
  for key in ("rounds", "restores", "lost", "regressed", "silent", "wall_s"):
    total[key] = round(sum(s.get(key, 0) for _, _, s in summaries), 1)
  for key in ("faults", "restores_by_source"):
    counts: collections.Counter = collections.Counter()
    for _, _, s in summaries:
      counts.update(s.get(key, {}))
    total[key] = dict(sorted(counts.items()))
  for name, seed, s in summaries:
    total["ok"] = total["ok"] and s["ok"]
    total["failures"] += [dict(f, configuration=name, seed=seed) for f in s["failures"]]
    total["configurations"].append(
      {"name": name, "seed": seed, **{k: v for k, v in s.items() if k in _BRIEF}}
    )
  return total


_BRIEF = ("rounds", "restores", "lost", "regressed", "silent", "ok", "wall_s", "faults")


def main(argv: list[str] | None = None) -> int:
  a = _parser().parse_args(argv)
  if a.matrix:
    if a.root:
      raise SystemExit("--matrix makes a fresh folder per configuration: leave out --root")
    shapes = [
      Config(redundancy=r, slices=s, processes=a.processes, gcs=g, local_keep=a.local_keep,
             persistent_keep=a.persistent_keep)
      for r, s, g in MATRIX
    ]  # fmt: skip
  else:
    shapes = [
      Config(
        redundancy=a.redundancy,
        slices=a.slices,
        processes=a.processes,
        gcs=a.gcs,
        local_keep=a.local_keep,
        persistent_keep=a.persistent_keep,
      )
    ]
  done = []
  for i, config in enumerate(shapes):
    summary = _one(a, config, a.seed + i)
    done.append((config.name, a.seed + i, summary))
    brief = {k: v for k, v in summary.items() if k != "per_round"}
    print(json.dumps({"configuration": config.name, "seed": a.seed + i, **brief}, indent=1))
    sys.stdout.flush()
  summary = done[0][2] if not a.matrix else _add_up(done)
  if a.matrix:
    print(json.dumps({k: v for k, v in summary.items() if k != "configurations"}, indent=1))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(summary, f, indent=1)
  return 0 if summary["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
