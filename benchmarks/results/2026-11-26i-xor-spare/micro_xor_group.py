"""XOR group of 4 in one process: every member sends its step to the others
(the redundancy lane's xor.send), STEPS steps; wall and CPU per step.

Run from a checkout: `python micro_xor_group.py MIB STEPS` (this session:
128 12, with PYTHONPATH at the old or the new tree)."""

import concurrent.futures
import inspect
import json
import os
import shutil
import sys
import tempfile
import time

import crc32c
import numpy as np
from emergency_ckpt.peer import xor

from emergency_ckpt import local_format

MIB = 1 << 20
K, SIZE, STEPS = 4, int(sys.argv[1]) * MIB, int(sys.argv[2])


def make(folder: str, process: int, step: int, seed: int) -> str:
  data = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
  where = os.path.join(folder, f"process_{process}", f"step_{step}")
  os.makedirs(where)
  data.tofile(os.path.join(where, local_format.SHARDS))
  n = SIZE // 4
  shard = {"index": [[0, n]], "offset": 0, "nbytes": SIZE, "crc32c": crc32c.crc32c(data)}
  body = {
    "format": local_format.FORMAT,
    "step": step,
    "run_id": "r",
    "process_index": process,
    "nbytes": SIZE,
    "leaves": [{"path": "['w']", "shape": [n], "dtype": "float32", "shards": [shard]}],
  }
  with open(os.path.join(where, local_format.MANIFEST), "wb") as f:
    f.write(local_format.encode_manifest(body))
  return where


def renumber(where: str, step: int) -> str:
  new = os.path.join(os.path.dirname(where), f"step_{step}")
  os.rename(where, new)
  path = os.path.join(new, local_format.MANIFEST)
  with open(path, "rb") as f:
    body = local_format.decode_manifest(f.read(), new)
  body["step"] = step
  with open(path, "wb") as f:
    f.write(local_format.encode_manifest(body))
  return new


def main() -> None:
  root = tempfile.mkdtemp(dir="/dev/shm", prefix="xormicro-")
  srcs = [make(os.path.join(root, "src"), i, 7, i) for i in range(K)]
  kw = {}
  if "mapped" in inspect.signature(xor.ParityReceiver.__init__).parameters:
    kw["mapped"] = None
  recv = [
    xor.ParityReceiver(
      os.path.join(root, f"host_{i}", f"process_{i}"),
      "127.0.0.1",
      member=i,
      group=list(range(K)),
      keep=3,
      timeout_s=60,
      log_prefix="",
      **kw,
    )
    for i in range(K)
  ]
  offers = {i: r.offer() for i, r in enumerate(recv)}
  walls, cpus, c_all = [], [], 0.0
  with concurrent.futures.ThreadPoolExecutor(K) as pool:
    for s in range(STEPS):
      srcs = [renumber(w, s + 10) for w in srcs]
      time.sleep(0.3)  # the retire of the previous step happens off the path
      if s == 2:
        c_all = time.process_time()
      t, c = time.perf_counter(), time.process_time()
      sends = [(offers, list(range(K)), i, srcs[i]) for i in range(K)]
      list(pool.map(lambda a: xor.send(*a, timeout_s=60), sends))
      walls.append(time.perf_counter() - t)
      cpus.append(time.process_time() - c)
  for r in recv:
    r.close()
  c_all = (time.process_time() - c_all) / (STEPS - 2)
  shutil.rmtree(root)
  w, c = sorted(walls[2:]), sorted(cpus[2:])
  print(
    json.dumps(
      {
        "file": xor.__file__,
        "wall_med_ms": round(1e3 * w[len(w) // 2], 1),
        "wall_min_ms": round(1e3 * w[0], 1),
        "cpu_med_ms": round(1e3 * c[len(c) // 2], 1),
        "cpu_all_per_step_ms": round(1e3 * c_all, 1),
      }
    )
  )


if __name__ == "__main__":
  main()
