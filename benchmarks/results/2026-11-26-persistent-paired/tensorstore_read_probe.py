"""Probe behind README.md here: tensorstore's cold read of a persistent step
against a raw read of the same bytes, under several contexts (one process,
4 CPU devices). Run: python benchmarks/results/2026-11-26-persistent-paired/tensorstore_read_probe.py"""

import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt import persistent_read
from emergency_ckpt.bench import measure as m

mesh = Mesh(np.array(jax.devices()).reshape(1, 4), ("replica", "data"))
sh = NamedSharding(mesh, P("data", None))
MIB = 256
rows = MIB * 2**20 // 4 // 4 // 1024
state = {
  f"l{i}": jax.device_put(np.random.default_rng(i).random((rows, 1024), np.float32), sh)
  for i in range(4)
}
abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in state.items()}
root = tempfile.mkdtemp(dir="/dev/shm")
disk = tempfile.mkdtemp(dir="/var/tmp")
opts = ec.CheckpointManagerOptions(
  local=ec.LocalTierOptions(directory=root + "/l"),
  persistent=ec.PersistentTierOptions(directory=disk + "/p"),
  run_id="prof",
)
with ec.CheckpointManager(opts, mesh=mesh) as mg:
  mg.save(100, state, force=True)
  mg.wait_until_finished()
item = epath.Path(disk + "/p/tensors/100/default")
print(sorted(os.listdir(item)), file=sys.stderr)


class NoCheck:
  def saved(self, path, index):
    class S:
      pass

    s = S()
    s.index = index
    return [s]

  def prefetch(self, it):
    list(it)

  def check(self, *a):
    pass


orig = ocp.type_handlers.get_ts_context
parts = [np.asarray(s.data) for v in state.values() for s in v.addressable_shards]
raw = disk + "/raw.bin"
m.write_file(raw, parts)
buf = np.empty(sum(p.nbytes for p in parts), np.uint8)
buf[::4096] = 0


def run(label, ctx_fn):
  ocp.type_handlers.get_ts_context = ctx_fn
  out = []
  for _rep in range(4):
    m.evict_file(raw)
    t0 = time.perf_counter()
    m.read_file(raw, buf)
    tr = time.perf_counter() - t0
    m.evict_tree(disk + "/p")
    t0 = time.perf_counter()
    persistent_read.read_into(item, abstract, ocp, NoCheck())
    t = time.perf_counter() - t0
    out.append(t / tr)
  print(
    f"{label:30s} ratio median {np.median(out[1:]):.2f} {[f'{x:.2f}' for x in out]}",
    file=sys.stderr,
  )


base = orig(use_ocdbt=True)
print(base.spec.to_json() if hasattr(base, "spec") else base, file=sys.stderr)


def files_read():
  out = []
  for _rep in range(4):
    m.evict_file(raw)
    t0 = time.perf_counter()
    m.read_file(raw, buf)
    tr = time.perf_counter() - t0
    m.evict_tree(disk + "/p")
    t0 = time.perf_counter()
    n = 0
    for dp, _dn, fn in os.walk(str(item)):
      for f in fn:
        with open(os.path.join(dp, f), "rb", buffering=0) as fh:
          while True:
            got = fh.readinto(memoryview(buf)[: 64 << 20])
            if not got:
              break
            n += got
    out.append((time.perf_counter() - t0) / tr)
  print(
    f"plain read of the step files ({n >> 20} MiB) ratio median {np.median(out[1:]):.2f} {[f'{x:.2f}' for x in out]}",
    file=sys.stderr,
  )


files_read()
run("orbax default", orig)
real = persistent_read.read_into


def willneed(item_dir, *a, **k):
  for dp, _dn, fn in os.walk(str(item_dir)):
    for f in fn:
      fd = os.open(os.path.join(dp, f), os.O_RDONLY)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
      os.close(fd)
  return real(item_dir, *a, **k)


persistent_read.read_into = willneed
run("WILLNEED + default", orig)
persistent_read.read_into = real
for lim in ():
  run(
    f"file_io_concurrency {lim}",
    lambda use_ocdbt=True, lim=lim: ts.Context(
      {"file_io_concurrency": {"limit": lim}, "cache_pool#ocdbt": {"total_bytes_limit": 100000000}}
    ),
  )
run(
  "data_copy 8 + io 64",
  lambda use_ocdbt=True: ts.Context(
    {
      "file_io_concurrency": {"limit": 64},
      "data_copy_concurrency": {"limit": 8},
      "cache_pool#ocdbt": {"total_bytes_limit": 100000000},
    }
  ),
)
shutil.rmtree(root, ignore_errors=True)
shutil.rmtree(disk, ignore_errors=True)
