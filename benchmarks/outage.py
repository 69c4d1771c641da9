"""The save() stall while the bucket is sick, against the local-only stall of the same job.

`python -m benchmarks.outage [--kinds hang,refuse,503,crawl] [--runs 3] [--out F]`

Each run is a real 2 slices x 2 processes job on this machine (gs:// on
fake-gcs-server behind the fault-injecting proxy): 0.5 s per step, a local
save every step (8 MiB per slice plus a small tree), a persistent save
every 3rd step, persistent.when_busy="skip"; the bucket goes wrong for 20 s
from step 12 (tests/outage_scenarios.py). Per run it reports, over every
process: the worst save() of a step with a persistent save, the worst
save() of a local-only step (the baseline of the same job), their ratio,
and the steps trained during the outage against the pace before it. A
run with no outage (kind "none") gives the same figures for a healthy
bucket. Target: worst save() <= 1.5x the worst local-only save, in every
run.
"""

from __future__ import annotations

import os

from tests.harness.gcs_server import CLIENT_ENV

for _key, _value in {**CLIENT_ENV, "JAX_PLATFORMS": "cpu", "EC_LAUNCHER_START": "fork"}.items():
  os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from emergency_ckpt.demo.launcher import run_job  # noqa: E402
from tests.harness.gcs_proxy import GcsProxy  # noqa: E402
from tests.harness.gcs_server import GcsServer  # noqa: E402

STEPS, OUTAGE_AT, OUTAGE_S, STEP_S, EVERY = 70, 12, 20.0, 0.5, 3


def one_run(server: GcsServer, kind: str) -> dict:
  """One job; returns its figures."""
  bucket = f"gs://{server.create_bucket()}"
  root = tempfile.mkdtemp(
    prefix="ec-outage-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
  )
  proxy = GcsProxy(server.url).start()
  try:
    args = {
      "slices": 2,
      "local_root": root,
      "persistent": f"{bucket}/run",
      "local_interval": 1,
      "local_keep": 2,
      "persistent_interval": EVERY,
      "persistent_keep": 2,
      "steps": STEPS,
      "step_s": STEP_S,
      "outage": "hang" if kind == "none" else kind,
      "outage_at": OUTAGE_AT if kind != "none" else STEPS + 1,
      "outage_s": OUTAGE_S if kind != "none" else 0.0,
      "big_mib": 8,
      "persistent_when_busy": "skip",
      "collective_timeout_s": 60,
      "state_commit_timeout_s": 60,
    }
    results = run_job(
      "tests.outage_scenarios:train_through_outage",
      4,
      args,
      env={i: proxy.env for i in range(4)},
      timeout_s=400,
    ).check()
  finally:
    proxy.stop()
    shutil.rmtree(root, ignore_errors=True)
  worst_p, worst_l, kept = [], [], []
  window = results[0]["window"]
  for r in results:
    steps = [s for s in r["steps"] if s["step"] > 2]  # the first saves fault memory in
    worst_p.append(max(s["save_s"] for s in steps if s["persistent"]))
    worst_l.append(max(s["save_s"] for s in steps if not s["persistent"]))
    if window.get("end"):
      before = [s for s in steps if s["step"] < OUTAGE_AT]
      pace = (len(before) - 1) / (before[-1]["end"] - before[0]["end"])
      during = sum(1 for s in r["steps"] if window["start"] <= s["end"] < window["end"])
      kept.append(during / (pace * (window["end"] - window["start"])))
  return {
    "kind": kind,
    "worst_persistent_step_save_ms": round(max(worst_p) * 1e3, 1),
    "worst_local_only_save_ms": round(max(worst_l) * 1e3, 1),
    "ratio": round(max(worst_p) / max(worst_l), 2),
    "pace_kept_min": round(min(kept), 3) if kept else None,
  }


def main() -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.outage", description=__doc__)
  p.add_argument("--kinds", default="none,hang", help="comma-separated: none,hang,refuse,503,crawl")
  p.add_argument("--runs", type=int, default=3)
  p.add_argument("--out", help="write the rows as JSON here")
  a = p.parse_args()
  server = GcsServer(log_dir=tempfile.mkdtemp(prefix="ec-fakegcs-")).start()
  rows = []
  try:
    for run in range(a.runs):  # kinds alternate within a run: drift hits each alike
      for kind in a.kinds.split(","):
        t0 = time.monotonic()
        row = {"run": run + 1, **one_run(server, kind), "wall_s": round(time.monotonic() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
  finally:
    server.stop()
  print("\nkind    runs  worst save / worst local-only (each run)   median  pace kept (min)")
  for kind in a.kinds.split(","):
    mine = [r for r in rows if r["kind"] == kind]
    ratios = [r["ratio"] for r in mine]
    kept = [r["pace_kept_min"] for r in mine if r["pace_kept_min"] is not None]
    print(
      f"{kind:7} {len(mine):4}  {', '.join(f'{x:.2f}' for x in ratios):40}"
      f" {statistics.median(ratios):6.2f}  {min(kept) if kept else '-'}"
    )
  if a.out:
    with open(a.out, "w") as f:
      json.dump({"machine": platform.node(), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
