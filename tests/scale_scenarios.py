"""Code that runs inside the large real jobs of tests/test_scale_job.py (issue 15).

The job functions reuse tests/scenarios.py's state (bit patterns that lossy
paths break), options and directories: one CPU device per process, a mesh
(replica=slices, data=processes per slice), the local tier on a tmpfs folder
per simulated host, the persistent tier on disk.
"""

from __future__ import annotations

import os
import shutil
import time

import jax

import emergency_ckpt as ec
from emergency_ckpt.cluster.topology import topology_from_mesh
from tests import scenarios as sc
from tests.helpers import barrier


def save_job(args: dict) -> dict:
  """Saves args['steps'] (local every step, persistent per args), then
  waits; reports what was saved and this process's slice."""
  t0 = time.monotonic()
  mesh = sc.mesh_for(args["slices"])
  saved, keys = [], []
  client = jax._src.distributed.global_state.client  # noqa: SLF001
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in args["steps"]:
      if mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step)):
        saved.append(step)
      mngr.wait_until_finished()
      mngr.all_steps()
      barrier(f"scale-keys-{step}")
      # what the job left in the coordination service after this step
      keys.append(len(client.key_value_dir_get("emergency_ckpt/")))
      barrier(f"scale-counted-{step}")
    slice_index = mngr.topology.slice_index
  return {
    "saved": saved,
    "slice": slice_index,
    "service_keys": keys,
    "elapsed_s": round(time.monotonic() - t0, 2),
  }


def restart_job(args: dict) -> dict:
  """The restart: processes of args['wipe_slices'] come up with an empty
  ramdisk (their host folder removed before any manager exists), then every
  process asks latest_step() and restores with its data state; reports the
  step, source, data state and every shard that differs bit-for-bit from
  what was saved."""
  t0 = time.monotonic()
  mesh = sc.mesh_for(args["slices"])
  slice_index = topology_from_mesh(mesh, "replica").slice_index
  if slice_index in args["wipe_slices"]:
    shutil.rmtree(sc.host_dir(args), ignore_errors=True)  # a replaced host
  barrier("scale-wiped")
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    latest = mngr.latest_step()
    r = mngr.restore(sc.abstract_state(mesh))
    record = {
      "slice": slice_index,
      "latest": latest,
      "step": r.step,
      "source": r.source,
      "data_state": r.data_state,
      "expected_data_state": sc.data_state(r.step),
      "mismatches": sc.mismatches(r.state, r.step),
      "shards": sum(len(a.addressable_shards) for a in r.state.values()),
      "local_entries": sorted(os.listdir(mngr.local_directory)),
    }
  record["elapsed_s"] = round(time.monotonic() - t0, 2)
  record["process"] = jax.process_index()
  return record
