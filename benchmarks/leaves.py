"""What the number of leaves costs: save() stall, local durability and restore
of one state split into N leaves, ours beside Orbax's own CheckpointManager.

  python -m benchmarks.leaves [--leaves 1,100,1000,5000] [--mib 64] [--runs 3] [--out F]

Each run is one process on CPU (JAX_PLATFORMS=cpu). Per N, the state is N
float32 leaves totalling --mib MiB (a dict of (k,) arrays, replicated on a
1 x devices mesh). Ours: the local tier on /dev/shm every step, the
persistent tier far away (interval 10**6, so only local saves happen); one
warm-up save, then SAVES saves of distinct steps, each timed alone:

- stall: the save() call (the trainer's wait), median;
- durable: save() plus wait_until_finished() (the step is on the ramdisk),
  median;
- restore: a fresh manager restoring the newest step (source "local"),
  median of RESTORES; the restore() call and block_until_ready of its
  state (the manager is opened first), with this process's per-structure
  caches emptied and the earlier restore's state released before each
  (a restarted process has neither).

Orbax: orbax.checkpoint.CheckpointManager on its own /dev/shm folder, a
StandardSave of the same tree (async, its default): its save() call, save()
plus wait_until_finished(), and a fresh manager's StandardRestore.

Ratios are taken inside one run (ours at N against ours at one leaf, ours
against Orbax at the same N), since the machine is noisy.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import emergency_ckpt as ec  # noqa: E402

SAVES, RESTORES = 5, 3


def _tree(mesh, n: int, mib: int, value: float) -> dict:
  """N float32 leaves of (mib MiB / N) each, replicated on `mesh`."""
  k = max(1, (mib << 20) // 4 // n)
  sharding = NamedSharding(mesh, P())
  host = [np.full((k,), value + i, np.float32) for i in range(n)]
  leaves = jax.device_put(host, [sharding] * n)
  return {f"l{i:05d}": a for i, a in enumerate(leaves)}


def _abstract(tree) -> dict:
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


def _ours(root: str, mesh, n: int, mib: int) -> dict:
  opts = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=os.path.join(root, "local"), save_interval_steps=1),
    persistent=ec.PersistentTierOptions(
      directory=os.path.join(root, "persistent"), save_interval_steps=10**6
    ),
    run_id="leaves",
  )
  trees = [_tree(mesh, n, mib, float(s)) for s in range(2)]
  stall, durable = [], []
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    mngr.save(1, trees[0])  # warm-up
    mngr.wait_until_finished()
    for step in range(2, 2 + SAVES):
      t0 = time.perf_counter()
      mngr.save(step, trees[step % 2])
      t1 = time.perf_counter()
      mngr.wait_until_finished()
      t2 = time.perf_counter()
      stall.append(t1 - t0)
      durable.append(t2 - t0)
  abstract = _abstract(trees[0])
  last = 1 + SAVES
  restore, r = [], None
  for _ in range(RESTORES):
    r = None  # a restarted process holds no earlier state: its release is not timed
    _cold()
    with ec.CheckpointManager(opts, mesh=mesh) as mngr:
      t0 = time.perf_counter()
      r = mngr.restore(abstract)
      jax.block_until_ready(r.state)
      restore.append(time.perf_counter() - t0)
      assert (r.step, r.source) == (last, "local"), (r.step, r.source)
  got = r.state["l00000"]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(trees[last % 2]["l00000"]))
  return {"stall": stall, "durable": durable, "restore": restore}


def _cold() -> None:
  """Empties this process's per-structure caches (leaf paths, layouts,
  checked manifests), where they exist: a restore is timed as a restarted
  process meets it, not warmed by this process's saves."""
  from emergency_ckpt.core import shards  # noqa: PLC0415
  from emergency_ckpt.local import format as local_format  # noqa: PLC0415

  getattr(shards, "_PATHS", {}).clear()
  getattr(shards, "_LAST", {}).clear()
  shards._layout_cached.cache_clear()  # noqa: SLF001
  getattr(local_format, "_CHECKED", {}).clear()


def _orbax(root: str, mesh, n: int, mib: int) -> dict:
  import orbax.checkpoint as ocp  # noqa: PLC0415

  path = os.path.join(root, "orbax")
  trees = [_tree(mesh, n, mib, float(s)) for s in range(2)]
  stall, durable = [], []
  with ocp.CheckpointManager(path) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(trees[0]))
    mngr.wait_until_finished()
    for step in range(2, 2 + SAVES):
      t0 = time.perf_counter()
      mngr.save(step, args=ocp.args.StandardSave(trees[step % 2]))
      t1 = time.perf_counter()
      mngr.wait_until_finished()
      t2 = time.perf_counter()
      stall.append(t1 - t0)
      durable.append(t2 - t0)
  abstract = _abstract(trees[0])
  restore, got = [], None
  for _ in range(RESTORES):
    got = None  # as for ours: the earlier restore's release is not timed
    with ocp.CheckpointManager(path) as mngr:
      t0 = time.perf_counter()
      got = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
      jax.block_until_ready(got)
      restore.append(time.perf_counter() - t0)
  return {"stall": stall, "durable": durable, "restore": restore}


def _ms(xs: list[float]) -> float:
  return round(statistics.median(xs) * 1e3, 1)


def one_run(run: int, counts: list[int], mib: int, orbax: bool = True) -> list[dict]:
  """One run: every N, ours then Orbax, each in a fresh /dev/shm folder."""
  mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("replica", "data"))
  base = "/dev/shm" if os.path.isdir("/dev/shm") else None
  rows, one = [], None
  for n in counts:
    got = {}
    for name, fn in (("ours", _ours), ("orbax", _orbax))[: 2 if orbax else 1]:
      root = tempfile.mkdtemp(prefix="ec-leaves-", dir=base)
      try:
        got[name] = fn(root, mesh, n, mib)
      finally:
        shutil.rmtree(root, ignore_errors=True)
    row = {"run": run, "leaves": n, "mib": mib}
    for name in got:
      for k in ("stall", "durable", "restore"):
        row[f"{name}_{k}_ms"] = _ms(got[name][k])
    if n == 1 or one is None:
      one = row
    for k in ("stall", "durable", "restore"):
      row[f"{k}_vs_one_leaf"] = round(row[f"ours_{k}_ms"] / max(one[f"ours_{k}_ms"], 1e-3), 1)
      if orbax:
        row[f"{k}_vs_orbax"] = round(row[f"ours_{k}_ms"] / max(row[f"orbax_{k}_ms"], 1e-3), 2)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main() -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.leaves", description=__doc__)
  p.add_argument("--leaves", default="1,100,1000,5000", help="comma-separated leaf counts")
  p.add_argument("--mib", type=int, default=64, help="total state size in MiB")
  p.add_argument("--runs", type=int, default=3)
  p.add_argument("--out", help="write the rows as JSON here")
  p.add_argument("--no-orbax", action="store_true", help="ours only (e.g. a before/after A/B)")
  a = p.parse_args()
  counts = [int(x) for x in a.leaves.split(",")]
  rows = []
  for run in range(1, a.runs + 1):
    rows.extend(one_run(run, counts, a.mib, orbax=not a.no_orbax))
  print("\nrun  leaves  stall ms (orbax)   durable ms (orbax)   restore ms (orbax)")
  for r in rows:
    print(
      f"{r['run']:>3} {r['leaves']:>7}  "
      + "   ".join(
        f"{r[f'ours_{k}_ms']:>7.1f} ({r.get(f'orbax_{k}_ms', float('nan')):>7.1f})"
        for k in ("stall", "durable", "restore")
      )
    )
  if a.out:
    with open(a.out, "w") as f:
      json.dump({"mib": a.mib, "saves": SAVES, "restores": RESTORES, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
