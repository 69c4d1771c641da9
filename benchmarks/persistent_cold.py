"""Benchmark: one process's persistent cold read (persistent/read.py's
read_step) against a raw cold read of the same number of bytes, in CPU
seconds and wall time (issue 35 item 6).

  python -m benchmarks.persistent_cold --root DIR [--mib 256] [--reps 7]
      [--compare OTHER_READ_PY] [--profile]

One process, 2 CPU devices, the benchmark's state (4 float32 leaves of
(rows, 1024) sharded over 'data': 8 shards), saved once under DIR by Orbax
with the persistent tier's handler options (OCDBT, zarr2, no compression),
with its shard CRC32Cs. Each rep, interleaved: a raw cold read (the file's
pages dropped with POSIX_FADV_DONTNEED, then read() into a pre-faulted
buffer, as the main benchmark's bound), then each variant's read_step with
the step's files evicted, then assembly onto the devices. CPU = this
process's user + system time (every thread: tensorstore's included), from
getrusage; on a shared machine it is steadier than wall time. --compare
loads another copy of read.py (e.g. `git show HEAD:emergency_ckpt/
persistent/read.py > /tmp/before.py`) and interleaves it as "compare".
--profile prints cProfile's top entries for the last rep of ours.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import importlib.util  # noqa: E402
import pstats  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from etils import epath  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from emergency_ckpt.bench import measure  # noqa: E402
from emergency_ckpt.core import (
  placement,
  shards,  # noqa: E402
)
from emergency_ckpt.persistent import checksums  # noqa: E402
from emergency_ckpt.persistent import read as persistent_read  # noqa: E402
from emergency_ckpt.persistent.orbax_loader import orbax  # noqa: E402
from emergency_ckpt.state import shard_records  # noqa: E402

LEAVES, COLS = 4, 1024


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _timed(fn) -> tuple[float, float]:
  c0, w0 = _cpu(), time.perf_counter()
  fn()
  return time.perf_counter() - w0, _cpu() - c0


def _setup(root: str, mib: int):
  """(item dir, abstract tree, Expected factory, raw file) under `root`."""
  ocp = orbax()
  rows = mib * 2**20 // 4 // LEAVES // COLS
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("replica", "data"))
  sharding = NamedSharding(mesh, P("data", None))
  abstract = {
    f"layer_{i}": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sharding)
    for i in range(LEAVES)
  }
  item = epath.Path(root) / f"item_{mib}"
  values = [np.random.default_rng(i).standard_normal((rows, COLS), np.float32) for i in range(4)]
  if not item.exists():
    state = {k: jax.device_put(v, sharding) for k, v in zip(abstract, values)}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as c:
      c.save(str(item), args=ocp.args.PyTreeSave(state))
  paths, leaves, _ = shards.leaf_paths(abstract)
  table = shard_records.parse_table(checksums.shard_table(0, paths, list(leaves), [0]), 0, "b")
  crcs = {
    path: [
      [
        [list(b) for b in s.index],
        checksums.crc32c.crc32c(np.ascontiguousarray(v[tuple(slice(*b) for b in s.index)])),
      ]
      for s in table.shards[path]
    ]
    for path, v in zip(paths, values)
  }
  parsed = shard_records.parse_crcs(crcs, "b")
  expected = lambda: shard_records.Expected(0, table, lambda ps: {p: parsed for p in ps}, "b")  # noqa: E731
  raw = os.path.join(root, f"raw_{mib}.bin")
  if not os.path.exists(raw):
    measure.write_file(raw, [np.full(mib * 2**20, 7, np.uint8)])
  return item, abstract, expected, raw


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--root", required=True, help="a folder on the disk to read from")
  ap.add_argument("--mib", type=int, default=256)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--compare", help="another read.py to interleave")
  ap.add_argument("--profile", action="store_true")
  a = ap.parse_args()
  os.makedirs(a.root, exist_ok=True)
  item, abstract, expected, raw = _setup(a.root, a.mib)
  ocp = orbax()
  _, leaves, _ = shards.leaf_paths(abstract)
  variants = {"ours": persistent_read}
  if a.compare:
    spec = importlib.util.spec_from_file_location("read_compare", a.compare)
    variants["compare"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants["compare"])

  def restore(module) -> None:
    layout, buffer = module.read_step(item, 0, abstract, ocp, expected())
    jax.block_until_ready(placement.assemble_buffer(list(leaves), layout, buffer))

  for module in variants.values():
    restore(module)  # warm: imports, first-use set-up
  readback = np.zeros(a.mib * 2**20, np.uint8)
  out: dict[str, list[tuple[float, float]]] = {"raw": [], **{k: [] for k in variants}}
  for rep in range(a.reps):
    measure.evict_file(raw)
    out["raw"].append(_timed(lambda: measure.read_file(raw, readback)))
    for name, module in variants.items():
      measure.evict_tree(str(item))
      prof = cProfile.Profile() if a.profile and name == "ours" and rep == a.reps - 1 else None
      if prof:
        prof.enable()
      out[name].append(_timed(lambda m=module: restore(m)))
      if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
  raw_wall = statistics.median(w for w, _ in out["raw"])
  print(f"load average {os.getloadavg()}; {a.reps} reps, {a.mib} MiB; medians:")
  for name, runs in out.items():
    wall = statistics.median(w for w, _ in runs)
    cpu = statistics.median(c for _, c in runs)
    print(f"  {name:8s} wall {wall:.3f} s ({wall / raw_wall:.2f}x raw)  CPU {cpu:.3f} s")


if __name__ == "__main__":
  main()
