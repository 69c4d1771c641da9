"""Job functions for test_persistent_verify: bit flips in the persistent
tier's data files, restored with every ramdisk lost (run by run_job)."""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from tests import scenarios as sc
from tests.helpers import barrier

# Chunks above 1 KiB: OCDBT keeps smaller values inline in its b-tree nodes,
# which carry their own CRC-32C; larger ones sit unchecked in data files.
SPECS = {
  "w": ((64, 64), np.float32, P(None, "data")),
  "e": ((128, 32), jnp.bfloat16, P("data")),
  "ids": ((512,), np.int32, P("data")),
}


# 4 MiB in 6 leaves, for counting the bytes a restore reads from the bucket.
BIG_SPECS = {
  f"layer{i}": ((256, 512), np.float32 if i % 2 else jnp.bfloat16, P(None, "data"))
  for i in range(6)
}
_SPECS = {"small": SPECS, "big": BIG_SPECS}


def expected(step: int, specs: str = "small") -> dict[str, np.ndarray]:
  rng = np.random.default_rng(step)
  return {
    name: rng.integers(0, 2**16, size=shape).astype(np.uint32).astype(dtype)
    if name == "ids"
    else rng.standard_normal(shape).astype(dtype)
    for name, (shape, dtype, _) in _SPECS[specs].items()
  }


def make_state(mesh, step: int, specs: str = "small") -> dict[str, jax.Array]:
  values = expected(step, specs)
  return {
    name: jax.make_array_from_callback(
      shape, NamedSharding(mesh, spec), lambda idx, v=values[name]: v[idx]
    )
    for name, (shape, _, spec) in _SPECS[specs].items()
  }


def abstract_state(mesh, specs: str = "small") -> dict[str, jax.ShapeDtypeStruct]:
  return {
    name: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))
    for name, (shape, dtype, spec) in _SPECS[specs].items()
  }


def mismatches(state: dict[str, jax.Array], step: int, specs: str = "small") -> list[str]:
  want = expected(step, specs)
  return [
    f"{name}{s.index}"
    for name, arr in state.items()
    for s in arr.addressable_shards
    if not np.array_equal(sc.bits(np.asarray(s.data)), sc.bits(want[name][s.index]))
  ]


def save(args: dict) -> list[int]:
  """Saves args['steps'] of this module's state (persistent every
  args['persistent_interval'])."""
  mesh = sc.mesh_for(args["slices"])
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in args["steps"]:
      mngr.save(
        step, make_state(mesh, step, args.get("specs", "small")), data_state=sc.data_state(step)
      )
    mngr.wait_until_finished()
    return mngr.all_steps()


def restore_once(args: dict) -> dict[str, Any]:
  """With every ramdisk lost: one restore (persistent.shared_read as
  args['shared_read'], shared_read_slices as args.get('shared_read_slices')):
  step, source, mismatches and wall time."""
  import dataclasses  # noqa: PLC0415
  import time  # noqa: PLC0415

  mesh = sc.mesh_for(args["slices"])
  shutil.rmtree(sc.host_dir(args), ignore_errors=True)
  opts = sc.options(args)
  opts = dataclasses.replace(
    opts,
    persistent=dataclasses.replace(
      opts.persistent,
      shared_read=args["shared_read"],
      shared_read_slices=args.get("shared_read_slices"),
    ),
  )
  specs = args.get("specs", "small")
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    barrier("ready")
    t0 = time.monotonic()
    r = mngr.restore(abstract_state(mesh, specs))
    took = time.monotonic() - t0
    return {
      "step": r.step,
      "source": r.source,
      "bad": mismatches(r.state, r.step, specs),
      "data_state_ok": r.data_state == sc.data_state(r.step),
      "restore_s": took,
    }


def data_files(persistent: str, step: int) -> list[str]:
  """The OCDBT data files of a persistent step (what holds its tensor bytes)."""
  root = os.path.join(persistent, "tensors", str(step))
  out = []
  for dirpath, _, files in os.walk(root):
    if os.path.basename(dirpath) == "d":
      out.extend(os.path.join(dirpath, f) for f in files)
  return sorted(out)


def _flip(path: str, offset: int, mask: int) -> None:
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ mask]))


def _flip_16_each(persistent: str, step: int, *, largest_only: bool = False) -> None:
  """16 bytes flipped in the middle of every data file of `step` (the
  issue's measured case), or of its largest (tensor chunks, not b-tree)."""
  files = data_files(persistent, step)
  if largest_only:
    files = [max(files, key=os.path.getsize)]
  for path in files:
    size = os.path.getsize(path)
    for k in range(16):
      _flip(path, (size // 2 + k) % size, 0xFF)


def plain_read_wrong(item: str, step: int) -> bool | None:
  """What Orbax's own reader (tensorstore, Orbax's specs, no checksums)
  returns for the step's arrays: True if wrong values come back without an
  error, False if right, None if it raises."""
  import tensorstore as ts  # noqa: PLC0415

  from emergency_ckpt.persistent.orbax_loader import orbax as _ocp  # noqa: PLC0415

  ocp = _ocp()
  want = expected(step)
  try:
    for name in SPECS:
      info = ocp.type_handlers.ParamInfo(
        name=name, parent_dir=ec_path(item), is_ocdbt_checkpoint=True, use_zarr3=False
      )
      spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)
      got = ts.open(spec, context=ocp.type_handlers.get_ts_context(use_ocdbt=True)).result()
      if not np.array_equal(sc.bits(got.read().result()), sc.bits(want[name])):
        return True
  except ValueError:
    return None
  return False


def ec_path(path: str):
  from etils import epath  # noqa: PLC0415

  return epath.Path(path)


def _restore(mngr, mesh) -> dict[str, Any]:
  try:
    r = mngr.restore(abstract_state(mesh))
    return {"step": r.step, "source": r.source, "bad": mismatches(r.state, r.step)}
  except ec.EmergencyCheckpointError as e:
    return {"error": type(e).__name__, "message": str(e)[:2000]}


def _put_back(args: dict, step: int, path: str, offset: int, mask: int) -> None:
  """The pristine step again: unflipped where it stays (the restore read it
  whole or never reached the flip), else copied back from the saved job's
  copy (a restore that skipped the step deleted it: training saves it
  again)."""
  if os.path.exists(path):
    _flip(path, offset, mask)
    return
  where = os.path.join("tensors", str(step))
  shutil.copytree(os.path.join(args["clean"], where), os.path.join(args["persistent"], where))


def flips(args: dict) -> dict[str, Any]:
  """After save() saved args['steps'] (persistent every
  args['persistent_interval']) in another job: loses every ramdisk, then args['flips'] times: process 0 flips one random
  bit in a random data file of the newest persistent step, every process
  restores, process 0 flips it back. Then the issue's case (16 bytes
  flipped in each data file of the newest step), then every persistent step
  damaged so."""
  mesh = sc.mesh_for(args["slices"])
  me = sc.pid()
  shutil.rmtree(sc.host_dir(args))  # every ramdisk lost
  persistent = args["persistent"]
  newest, older = args["persistent_steps"]
  out: dict[str, Any] = {"flips": [], "files": len(data_files(persistent, newest))}
  rng = random.Random(args["seed"])
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    out["clean"] = _restore(mngr, mesh)
    for i in range(args["flips"]):
      files = data_files(persistent, newest)
      sizes = [os.path.getsize(f) for f in files]
      offset = rng.randrange(sum(sizes))
      k = 0
      while offset >= sizes[k]:
        offset -= sizes[k]
        k += 1
      mask = 1 << rng.randrange(8)
      if me == 0:
        _flip(files[k], offset, mask)
      plain_wrong = None
      if me == 0:
        plain_wrong = plain_read_wrong(
          os.path.join(persistent, "tensors", str(newest), "default"), newest
        )
      barrier(f"flipped-{i}")
      rec = _restore(mngr, mesh)
      rec["plain_wrong"] = plain_wrong
      rec["where"] = f"{os.path.relpath(files[k], persistent)}@{offset}^{mask}"
      out["flips"].append(rec)
      barrier(f"restored-{i}")
      if me == 0:
        _put_back(args, newest, files[k], offset, mask)
      barrier(f"unflipped-{i}")
    if me == 0:
      _flip_16_each(persistent, newest)
    barrier("issue-case")
    out["issue_case"] = _restore(mngr, mesh)
    barrier("issue-case-done")
    if me == 0:  # the tensor bytes of the older step, this time
      _flip_16_each(persistent, older, largest_only=True)
    barrier("all-damaged")
    out["all_damaged"] = _restore(mngr, mesh)
  return out
