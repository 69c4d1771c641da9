"""Orbax P2P onto another slice shape when every saved host survives (not a
benchmark row; evidence for README.md here).

Saves with elastic.save_job (2 slices x 2 processes x 2 devices, Orbax P2P,
1 MiB per replica), then restarts as 1 slice x 4 processes x 1 device with
ALL four saved local directories present, process p on the directory saved
by process p. Prints each process's outcome.

  PYTHONPATH=benchmarks/results/2026-11-25-elastic .venv/bin/python \\
    benchmarks/results/2026-11-25-elastic/p2p_all_hosts_probe.py
"""

import json
import os
import shutil
import tempfile
import time
import traceback

from emergency_ckpt.testing.launcher import run_job


def probe(args):
  """Runs in each process of the restart job."""
  import jax  # noqa: PLC0415

  from emergency_ckpt.bench import adapters, elastic  # noqa: PLC0415
  from emergency_ckpt.bench import state as st  # noqa: PLC0415

  me = jax.process_index()
  layout = elastic._layout("1x4x1", args["mib"])
  a = adapters.make(
    "orbax_p2p",
    layout,
    elastic.local_dir(args["shm_root"], "orbax_p2p", me, 0),
    os.path.join(args["disk_root"], "orbax_p2p", "persistent"),
  )
  try:
    restored, step, source = a.restore()
    jax.block_until_ready(restored)
    out = {
      "pid": me,
      "step": int(step),
      "source": source,
      "mismatched_shards": st.mismatched_shards(restored, layout),
    }
  except Exception as e:  # noqa: BLE001 - the outcome is what this probe reports
    out = {"pid": me, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    out["raised_at"] = traceback.format_exc().strip().splitlines()[-4:]
  out["detail"] = elastic._p2p_detail(a)
  return out


if __name__ == "__main__":
  from emergency_ckpt.bench.workers import SPAWN_ENV

  shm = tempfile.mkdtemp(dir="/dev/shm", prefix="p2pprobe-")
  disk = tempfile.mkdtemp(prefix="p2pprobe-")
  args = {"mib": 1, "shm_root": shm, "disk_root": disk, "manager": "orbax_p2p"}
  try:
    env = {i: {SPAWN_ENV: repr(time.time())} for i in range(4)}
    r = run_job("emergency_ckpt.bench.elastic:save_job", 4, args, devices_per_process=2, env=env)
    print("save job return codes", r.returncodes)
    r = run_job("p2p_all_hosts_probe:probe", 4, args, devices_per_process=1, timeout_s=120)
    print("restart job return codes", r.returncodes, "timed out", r.timed_out)
    for x in r.results:
      print(json.dumps(x, indent=1))
  finally:
    shutil.rmtree(shm)
    shutil.rmtree(disk)
