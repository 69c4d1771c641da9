"""Host-device transfer paths on one accelerator, for choosing the save and
restore paths (device_stall.py measures the manager): `--mib` MiB in 8
float32 leaves, median of `--reps` after one warm-up, every row on fresh
device arrays (jax caches a host copy per array after the first transfer).

  d2h_pageable      np.asarray of each leaf (jax allocates fresh host memory)
  d2h_pinned        device_put to the device's "pinned_host" memory, then
                    np.asarray (where that memory kind exists)
  d2h_pinned_into   d2h_pinned, then a copy into a reused faulted-in buffer
  fault_in          faulting in a fresh host buffer of the same size
  memcpy_reused     one copy between two faulted-in buffers
  h2d_<how>         a tmpfs file of the leaves to the device: mapped private
                    (what the local restore does), mapped shared with
                    MAP_POPULATE, or read() into a reused buffer; each with a
                    CRC32C pass over the bytes first, as the restore verifies

Usage: python -m benchmarks.device_transfers --out DIR [--mib 4096]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time

import crc32c
import jax
import jax.numpy as jnp
import numpy as np

LEAVES = 8


def _timed(fn, reps: int) -> dict:
  times = []
  for _ in range(reps + 1):
    t = fn()
    times.append(t)
  return {"median_s": statistics.median(times[1:]), "reps_s": times}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", required=True)
  p.add_argument("--mib", type=int, default=4096)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--ramdisk", default="/dev/shm")
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0]
  n = args.mib * 2**20 // 4 // LEAVES
  base = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(LEAVES)]
  base = jax.block_until_ready([jax.device_put(x, dev) for x in base])
  nbytes = sum(x.nbytes for x in base)
  rows: dict[str, dict] = {}

  def fresh():
    return jax.block_until_ready([jnp.copy(x) for x in base])

  def d2h_pageable():
    xs = fresh()
    t0 = time.perf_counter()
    for x in xs:
      x.copy_to_host_async()
    _ = [np.asarray(x) for x in xs]
    return time.perf_counter() - t0

  rows["d2h_pageable"] = _timed(d2h_pageable, args.reps)
  buf = np.empty(nbytes, np.uint8)
  buf[::4096] = 0
  try:
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")

    def d2h_pinned(into=False):
      xs = fresh()
      t0 = time.perf_counter()
      hs = jax.block_until_ready([jax.device_put(x, pinned) for x in xs])
      arrs = [np.asarray(h) for h in hs]
      if into:
        pos = 0
        for a in arrs:
          buf[pos : pos + a.nbytes] = a.view(np.uint8)
          pos += a.nbytes
      return time.perf_counter() - t0

    rows["d2h_pinned"] = _timed(d2h_pinned, args.reps)
    rows["d2h_pinned_into"] = _timed(lambda: d2h_pinned(True), args.reps)
  except Exception as e:  # noqa: BLE001 - not every backend has pinned host memory
    rows["d2h_pinned"] = {"error": repr(e)}

  def fault_in():
    t0 = time.perf_counter()
    b = np.empty(nbytes, np.uint8)
    b[::4096] = 0
    return time.perf_counter() - t0

  rows["fault_in"] = _timed(fault_in, args.reps)
  other = np.empty(nbytes, np.uint8)
  other[::4096] = 1

  def memcpy(src=other):
    t0 = time.perf_counter()
    np.copyto(buf, src)
    return time.perf_counter() - t0

  rows["memcpy_reused"] = _timed(memcpy, args.reps)
  del memcpy, other
  host = np.concatenate([np.asarray(x).view(np.uint8) for x in base])
  fd, path = tempfile.mkstemp(dir=args.ramdisk)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(host.data)
    del host

    def h2d(how: str):
      t0 = time.perf_counter()
      with open(path, "rb") as f:
        if how == "private":
          m = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
          a = np.frombuffer(m, np.uint8)
        elif how == "shared_populate":
          flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0x8000)
          m = mmap.mmap(f.fileno(), nbytes, flags=flags, prot=mmap.PROT_READ)
          a = np.frombuffer(m, np.uint8)
        else:
          a = buf
          f.readinto(memoryview(buf))
      crc32c.crc32c(a)
      step = nbytes // LEAVES
      xs = [
        jax.device_put(a[i * step : (i + 1) * step].view(np.float32), dev) for i in range(LEAVES)
      ]
      jax.block_until_ready(xs)
      return time.perf_counter() - t0

    for how in ("private", "shared_populate", "read_reused"):
      rows[f"h2d_{how}"] = _timed(lambda how=how: h2d(how), args.reps)
  finally:
    os.unlink(path)
  result = {"device": f"{dev.platform} {dev.device_kind}", "bytes": nbytes, "rows": rows}
  with open(os.path.join(args.out, "device_transfers.json"), "w") as f:
    json.dump(result, f, indent=1)
  for k, v in rows.items():
    line = (
      v.get("error") or f"{v['median_s'] * 1e3:.1f} ms ({nbytes / v['median_s'] / 1e9:.1f} GB/s)"
    )
    print(f"{k:20s} {line}", file=sys.stderr)
  return result


if __name__ == "__main__":
  main()
