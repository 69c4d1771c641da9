"""`python -m tests.soak --seed N --rounds R [...]`: runs a soak, prints its
summary (faults by kind, restores by source, rounds, lost, regressed,
silent, failures) and writes it as JSON with --out. Exit status 1 if any
invariant broke."""

from __future__ import annotations

import os

from tests.harness.gcs_server import CLIENT_ENV

# Before anything imports gcsfs or jax (here or in the job processes' fork server).
for _key, _value in {**CLIENT_ENV, "JAX_PLATFORMS": "cpu", "EC_LAUNCHER_START": "fork"}.items():
  os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from tests.soak.runner import Config, run_soak  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
  a = _parser().parse_args(argv)
  config = Config(
    redundancy=a.redundancy,
    slices=a.slices,
    processes=a.processes,
    gcs=a.gcs,
    local_keep=a.local_keep,
    persistent_keep=a.persistent_keep,
  )
  base = "/dev/shm" if os.path.isdir("/dev/shm") else None
  root = a.root or tempfile.mkdtemp(prefix="ecsoak-", dir=base)
  os.makedirs(root, exist_ok=True)
  with _gcs(a.gcs, root) as gcs:
    summary = run_soak(config, a.seed, a.rounds, root, gcs=gcs, keep_going=a.keep_going)
  brief = {k: v for k, v in summary.items() if k != "per_round"}
  print(json.dumps(brief, indent=1))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(summary, f, indent=1)
  if summary["ok"] and not a.keep and not a.root:
    shutil.rmtree(root, ignore_errors=True)
  else:
    print(f"soak: working folder kept: {root}", file=sys.stderr)
  return 0 if summary["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
