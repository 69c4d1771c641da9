"""Start-up (issue 15): a restart's path to restored state never waits for
Orbax to load. Orbax (about 0.5 s of CPU per process, more when a host's
processes load it at once) is needed to save, not to read a local copy: the
manager loads it on a background lane from the end of its construction.
Checked in a fresh interpreter (pytest has Orbax loaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import builtins, json, os, sys, threading
first, importers = {}, set()
real_import = builtins.__import__

def spy(name, *args, **kwargs):
  if name.startswith("orbax"):
    importers.add(threading.current_thread().name)
  return real_import(name, *args, **kwargs)

class Spy:
  def find_spec(self, name, path=None, target=None):
    if name == "orbax.checkpoint" and not first:
      first["thread"] = threading.current_thread().name
    return None

sys.meta_path.insert(0, Spy())
builtins.__import__ = spy
import jax, jax.numpy as jnp
import numpy as np
import emergency_ckpt as ec

root = sys.argv[1]
opts = ec.CheckpointManagerOptions(
  local=ec.LocalTierOptions(directory=os.path.join(root, "local"), save_interval_steps=1),
  persistent=ec.PersistentTierOptions(directory=os.path.join(root, "p"), save_interval_steps=2),
  run_id="startup",
)
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("replica", "data"))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
state = {"w": jax.device_put(jnp.arange(64, dtype=jnp.float32), sharding)}
out = {}
with ec.CheckpointManager(opts, mesh=mesh) as m:
  if sys.argv[2] == "save":
    m.save(1, state, {"i": 1})
    m.save(2, state, {"i": 2})
  else:
    abstract = {"w": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=sharding)}
    r = m.restore(abstract)
    out["step"], out["source"] = r.step, r.source
    out["equal"] = bool((np.asarray(r.state["w"]) == np.arange(64)).all())
    out["restore_path_imported_orbax"] = "MainThread" in importers
    m.save(3, state, {"i": 3})  # saving after the background load
  m.wait_until_finished()
  out["steps"] = m.all_steps()
out["first_import_thread"] = first.get("thread")
print(json.dumps(out))
"""


def _run(root: str, what: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(
    [sys.executable, "-c", SCRIPT, root, what],
    capture_output=True,
    text=True,
    timeout=180,
    env=env,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_restore_from_local_never_loads_orbax_on_the_callers_thread(shm_dir):
  saved = _run(shm_dir, "save")
  assert saved["steps"] == [1, 2]
  assert saved["first_import_thread"].startswith("ec-orbax"), saved
  restored = _run(shm_dir, "restore")
  assert restored["restore_path_imported_orbax"] is False, restored
  assert (restored["step"], restored["source"], restored["equal"]) == (2, "local", True)
  assert restored["first_import_thread"].startswith("ec-orbax"), restored
  assert restored["steps"][-1] == 3  # saved after the background load
