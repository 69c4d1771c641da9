"""Save stall and restore on one accelerator, with real device-to-host copies.

One process, one device (the first of jax.devices()), a train state of
`--mib` MiB (float32 leaves, random values made on the device) and a jitted
train step that donates the state and runs `--matmuls` bf16 matrix products
(so background work competes with real device work and host threads). Per
manager, `--reps` timed saves after one warm-up, each between train steps:

  stall        seconds inside save() (the trainer's thread is blocked)
  durable      save() start to the local copy being durable (wait_until_finished)
  step_after   median train-step time of the `--steps-after` steps right after
               save() returned (background work in flight), over the median
               idle step time measured just before the save
  restore      a fresh manager's restore of the newest step until the arrays
               are ready on the device, bit-exact against the saved state

Managers: `ours-host` (local.device_snapshot False: save() copies to the
host), `ours-device` (device_snapshot True), `orbax` (a plain
ocp.CheckpointManager, async, on the same ramdisk): each saves every step
to the ramdisk only; `ours-device-both-tiers` and `ours-host-both-tiers`
save every step to both tiers (the persistent one on local disk). Bounds, same state:
`jax.device_get` into fresh host memory, device_copy.fill into a reused
faulted-in buffer, the device-side copy alone, a device_put of host arrays,
and where the device has pinned host memory (accelerators) a device_put
into it (`d2h_pinned`) and from it back to the device (`h2d_pinned`). The
save's bound is the faster device-to-host copy (`d2h_bound`: device_get or
d2h_pinned), the restore's the faster host-to-device copy (`h2d_bound`:
device_put or h2d_pinned); each is printed with its GB/s. Nothing here
asserts a time: it prints and writes JSON; tests run it at a tiny size on CPU.

Usage: python -m benchmarks.device_stall --out DIR [--mib 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

LEAVES = 8
_T0 = time.monotonic()


def progress(msg: str) -> None:
  print(f"[device-stall {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("replica", "data"))


def make_state(mesh: Mesh, mib: int) -> dict[str, jax.Array]:
  rows = max(1, mib * 2**20 // 4 // LEAVES // 1024)
  sharding = NamedSharding(mesh, P("data", None))
  keys = jax.random.split(jax.random.key(20261126), LEAVES)
  make = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sharding)
  return jax.block_until_ready({f"layer_{i}": make(keys[i]) for i in range(LEAVES)})


def make_step(matmuls: int, size: int):
  """A donating train step: every leaf changes, plus `matmuls` products."""

  def step(state, a):
    def body(_, x):
      return jnp.tanh(x @ a)

    y = jax.lax.fori_loop(0, matmuls, body, a)
    bump = jnp.mean(y).astype(jnp.float32) * 1e-6
    return jax.tree.map(lambda x: x * 0.999 + bump, state)

  a = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16) / np.sqrt(size)
  return jax.jit(step, donate_argnums=0), a


def _abstract(state):
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


def _equal(a: dict, b: dict) -> bool:
  return all(bool(jnp.array_equal(a[k].view(jnp.uint32), b[k].view(jnp.uint32))) for k in b)


class Trainer:
  def __init__(self, state, step_fn, a):
    self.state, self._fn, self._a = state, step_fn, a
    self.step = 0

  def run(self, n: int) -> list[float]:
    times = []
    for _ in range(n):
      t0 = time.perf_counter()
      self.state = jax.block_until_ready(self._fn(self.state, self._a))
      times.append(time.perf_counter() - t0)
      self.step += 1
    return times


# ---- managers ----------------------------------------------------------------------------------
class Ours:
  both_tiers = False

  def __init__(self, mesh, local_dir, persistent_dir, device_snapshot: bool):
    import emergency_ckpt as ec  # noqa: PLC0415

    self._ec, self._mesh = ec, mesh
    self._options = ec.CheckpointManagerOptions(
      local=ec.LocalTierOptions(
        directory=local_dir, save_interval_steps=1, device_snapshot=device_snapshot
      ),
      persistent=ec.PersistentTierOptions(
        directory=persistent_dir, save_interval_steps=1_000_000_000
      ),
      run_id="device-stall",
    )
    self.m = ec.CheckpointManager(self._options, mesh=mesh)

  def prepare(self, abstract):
    self.m.prepare(abstract)
    self.m.wait_until_finished()

  def save(self, step, state):
    self.m.save(step, state, force=self.both_tiers)  # local every step; force: both tiers

  def wait(self):
    self.m.wait_until_finished()

  def restore(self, abstract):
    self.m.close()
    self.m = self._ec.CheckpointManager(self._options, mesh=self._mesh)
    r = self.m.restore(abstract)
    return r.step, jax.block_until_ready(r.state)

  def close(self):
    self.m.close()


class OursBothTiers(Ours):
  """Every save to both tiers (a persistent step: where the devices have
  pinned host memory the upload reads the staged snapshot, else Orbax
  copies to the host inside save())."""

  both_tiers = True


class Orbax:
  def __init__(self, mesh, local_dir, persistent_dir, device_snapshot: bool):
    import orbax.checkpoint as ocp  # noqa: PLC0415

    self._ocp, self._dir = ocp, local_dir
    self.m = self._make()

  def _make(self):
    ocp = self._ocp
    return ocp.CheckpointManager(
      self._dir,
      options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True),
    )

  def prepare(self, abstract):
    return None

  def save(self, step, state):
    self.m.save(step, args=self._ocp.args.StandardSave(state))

  def wait(self):
    self.m.wait_until_finished()

  def restore(self, abstract):
    self.m.close()
    self.m = self._make()
    step = self.m.latest_step()
    got = self.m.restore(step, args=self._ocp.args.StandardRestore(abstract))
    return step, jax.block_until_ready(got)

  def close(self):
    self.m.close()


MANAGERS = {
  "ours-host": (Ours, False),
  "ours-device": (Ours, True),
  "orbax": (Orbax, False),
  "ours-device-both-tiers": (OursBothTiers, True),
  "ours-host-both-tiers": (OursBothTiers, False),
}


def measure_manager(name, trainer: Trainer, mesh, root, args) -> dict[str, Any]:
  cls, device_snapshot = MANAGERS[name]
  local = os.path.join(root, f"{name}-local")
  persistent = os.path.join(args.persistent_root, f"{name}-persistent")
  for d in (local, persistent):
    shutil.rmtree(d, ignore_errors=True)
  mgr = cls(mesh, local, persistent, device_snapshot)
  abstract = _abstract(trainer.state)
  mgr.prepare(abstract)
  rows = []
  saved = None
  for rep in range(args.reps + 1):
    idle = trainer.run(args.steps_before)
    saved = jax.tree.map(jnp.copy, trainer.state)  # the state at save time, on the device
    step = trainer.step
    t0 = time.perf_counter()
    mgr.save(step, trainer.state)
    stall = time.perf_counter() - t0
    after = trainer.run(args.steps_after)
    mgr.wait()
    durable = time.perf_counter() - t0
    row = {
      "step": step,
      "stall_s": stall,
      "durable_s": durable,
      "idle_step_s": statistics.median(idle),
      "after_step_s": statistics.median(after),
      "after_steps_s": after,
    }
    progress(
      f"{name} {'warm-up' if rep == 0 else f'rep {rep}'}: stall {stall * 1e3:.1f} ms, durable"
      f" {durable:.3f} s, step {row['idle_step_s'] * 1e3:.1f} -> {row['after_step_s'] * 1e3:.1f} ms"
    )
    if rep:
      rows.append(row)
  t0 = time.perf_counter()
  step, restored = mgr.restore(abstract)
  restore_s = time.perf_counter() - t0
  exact = step == rows[-1]["step"] and _equal(restored, saved)
  progress(f"{name}: restore of step {step} {restore_s:.3f} s, bit-exact {exact}")
  del restored, saved
  mgr.close()
  for d in (local, persistent):
    shutil.rmtree(d, ignore_errors=True)
  med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
  return {
    "stall_s": med("stall_s"),
    "durable_s": med("durable_s"),
    "idle_step_s": med("idle_step_s"),
    "after_step_s": med("after_step_s"),
    "step_slowdown": med("after_step_s") / med("idle_step_s"),
    "restore_s": restore_s,
    "restore_bit_exact": exact,
    "reps": rows,
  }


def _pinned(sharding) -> Any:
  """`sharding` in its devices' pinned host memory, or None on CPU devices
  and where a device has none (what device_copy checks before staging)."""
  devices = list(sharding.device_set)
  if any(d.platform == "cpu" for d in devices):
    return None
  try:
    if not all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices):
      return None
  except Exception:  # noqa: BLE001 - a backend without memory spaces
    return None
  return sharding.with_memory_kind("pinned_host")


def best_bounds(med: dict[str, float], nbytes: int) -> dict[str, Any]:
  """The save's and the restore's bounds from the medians of measure_bounds:
  the faster device-to-host copy (device_get into fresh pageable memory, or
  d2h_pinned into pinned host memory where it was timed) and the faster
  host-to-device copy (device_put, or h2d_pinned), with which was faster and
  every timed copy's GB/s (bytes / seconds / 1e9; not of a dispatch)."""
  out: dict[str, Any] = {}
  for bound, ways in (
    ("d2h", ("device_get_s", "d2h_pinned_s")),
    ("h2d", ("device_put_s", "h2d_pinned_s")),
  ):
    have = {k: med[k] for k in ways if med.get(k) is not None}
    if not have:
      continue
    best = min(have, key=have.__getitem__)
    out[f"{bound}_bound_s"] = have[best]
    out[f"{bound}_bound_from"] = best.removesuffix("_s")
  out["gb_per_s"] = {
    k.removesuffix("_s"): nbytes / v / 1e9
    for k, v in {**med, **out}.items()
    if k.endswith("_s") and "dispatch" not in k and isinstance(v, (int, float)) and v > 0
  }
  return out


def measure_bounds(trainer: Trainer, reps: int) -> dict[str, Any]:
  from emergency_ckpt.core import shards as shards_lib  # noqa: PLC0415
  from emergency_ckpt.runtime import buffers, device_copy  # noqa: PLC0415

  state = trainer.state
  paths, leaves, _ = shards_lib.leaf_paths(state)
  layout = shards_lib.layout_for(paths, leaves)
  buffer = buffers.aligned_empty(layout.nbytes)
  buffer[::4096] = 0
  out: dict[str, list[float]] = {"device_get": [], "stage_reused": [], "device_copy": []}
  out.update({"device_copy_dispatch": [], "device_put": []})
  sharding = next(iter(state.values())).sharding
  pinned = _pinned(sharding)
  pinned_error = None
  if pinned is not None:
    out.update({"d2h_pinned": [], "h2d_pinned": []})
  host = None
  for _ in range(reps + 1):
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # no cached host value
    t0 = time.perf_counter()
    host = jax.device_get(fresh)
    del fresh
    out["device_get"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    device_copy.fill(device_copy.slot_shards(leaves, layout), layout, buffer)
    out["stage_reused"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    copies = device_copy.device_copies(device_copy.slot_shards(leaves, layout))
    out["device_copy_dispatch"].append(time.perf_counter() - t0)
    jax.block_until_ready(copies)
    out["device_copy"].append(time.perf_counter() - t0)
    del copies
    t0 = time.perf_counter()
    jax.block_until_ready({k: jax.device_put(v, sharding) for k, v in host.items()})
    out["device_put"].append(time.perf_counter() - t0)
    if pinned is not None and pinned_error is None:
      try:  # DMA into page-locked host memory and back: the accelerator's best
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        t0 = time.perf_counter()
        on_host = jax.block_until_ready({k: jax.device_put(v, pinned) for k, v in fresh.items()})
        out["d2h_pinned"].append(time.perf_counter() - t0)
        del fresh
        t0 = time.perf_counter()
        jax.block_until_ready({k: jax.device_put(v, sharding) for k, v in on_host.items()})
        out["h2d_pinned"].append(time.perf_counter() - t0)
        del on_host
      except Exception as e:  # noqa: BLE001 - reported, the pageable bounds stand
        pinned_error = repr(e)
        del out["d2h_pinned"], out["h2d_pinned"]
  med = {f"{k}_s": statistics.median(v[1:]) for k, v in out.items()}
  nbytes = int(sum(v.nbytes for v in state.values()))
  best = best_bounds(med, nbytes)
  progress(
    "bounds: " + ", ".join(f"{k.removesuffix('_s')} {_bound_cell({**med, **best}, k)}" for k in med)
  )
  extra = {"pinned_error": pinned_error} if pinned_error else {}
  return {**med, **best, **extra, "reps": out}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--mib", type=int, default=4096, help="train state size")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--steps-before", type=int, default=3)
  p.add_argument("--steps-after", type=int, default=5)
  p.add_argument("--matmuls", type=int, default=64)
  p.add_argument("--matmul-size", type=int, default=8192)
  p.add_argument("--managers", default=",".join(MANAGERS))
  p.add_argument("--ramdisk", default="/dev/shm")
  p.add_argument("--persistent-root", default=None)
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  root = tempfile.mkdtemp(prefix="ec-device-stall-", dir=args.ramdisk)
  args.persistent_root = args.persistent_root or tempfile.mkdtemp(prefix="ec-device-stall-p-")
  device = jax.devices()[0]
  mesh = _mesh()
  progress(f"device {device.platform} {device.device_kind}; {args.mib} MiB state")
  step_fn, a = make_step(args.matmuls, args.matmul_size)
  trainer = Trainer(make_state(mesh, args.mib), step_fn, a)
  trainer.run(3)  # compile and warm
  result: dict[str, Any] = {
    "device": f"{device.platform} {device.device_kind}",
    "jax": jax.__version__,
    "state_bytes": int(sum(v.nbytes for v in trainer.state.values())),
    "args": dict(vars(args)),
    "cpu_count": os.cpu_count(),
    "bounds": measure_bounds(trainer, args.reps),
    "managers": {},
  }
  try:
    for name in args.managers.split(","):
      result["managers"][name] = measure_manager(name, trainer, mesh, root, args)
  finally:
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(args.persistent_root, ignore_errors=True)
  with open(os.path.join(args.out, "device_stall.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(args.out, "device_stall.md"), "w") as f:
    f.write(report(result))
  print(report(result))
  return result


def _bound_cell(b: dict[str, Any], key: str) -> str:
  gbps = b.get("gb_per_s", {}).get(key.removesuffix("_s"))
  return f"{b[key] * 1e3:.1f} ms" + (f" ({gbps:.1f} GB/s)" if gbps else "")


def report(r: dict[str, Any]) -> str:
  b = r["bounds"]
  gib = r["state_bytes"] / 2**30
  d2h = "d2h_bound_s" if "d2h_bound_s" in b else "device_get_s"  # results before the pinned bounds
  h2d = "h2d_bound_s" if "h2d_bound_s" in b else "device_put_s"
  timed = [
    k
    for k, v in b.items()
    if k.endswith("_s") and not k.endswith("_bound_s") and isinstance(v, (int, float))
  ]
  lines = [
    f"# Save stall on {r['device']} (jax {r['jax']}), {gib:.2f} GiB state, one process",
    "",
    "Bounds (median; GB/s = state bytes / time / 1e9): "
    + ", ".join(f"{k.removesuffix('_s')} {_bound_cell(b, k)}" for k in timed),
    "",
    f"Save bound (device to host, the faster of device_get and d2h_pinned where timed):"
    f" {b.get('d2h_bound_from', 'device_get')} {_bound_cell(b, d2h)}; restore bound (host to"
    f" device, the faster of device_put and h2d_pinned where timed):"
    f" {b.get('h2d_bound_from', 'device_put')} {_bound_cell(b, h2d)}."
    + (f" Pinned copies failed: {b['pinned_error']}." if b.get("pinned_error") else ""),
    "",
    "| manager | save() stall | stall / D2H bound | durable | step after save / idle |"
    " restore | restore / H2D bound | bit-exact |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for name, m in r["managers"].items():
    lines.append(
      f"| {name} | {m['stall_s'] * 1e3:.1f} ms | {m['stall_s'] / b[d2h]:.3f}x"
      f" | {m['durable_s']:.3f} s | {m['step_slowdown']:.3f}x"
      f" ({m['idle_step_s'] * 1e3:.1f} -> {m['after_step_s'] * 1e3:.1f} ms)"
      f" | {m['restore_s']:.3f} s | {m['restore_s'] / b[h2d]:.2f}x"
      f" | {m['restore_bit_exact']} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
