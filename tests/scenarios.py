"""Code that runs inside multi-process test jobs (see emergency_ckpt/demo/launcher.py)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt.cluster.topology import topology_from_mesh
from tests.helpers import barrier

SPECS = {
  "w": ((8, 16), np.float32, P(None, "data")),
  "b": ((16,), ml_dtypes.bfloat16, P("data")),
  "ids": ((4, 8), np.int32, P(None, "data")),
  "count": ((), np.int32, P()),
  "mask": ((8,), np.bool_, P("data")),
}


def pid() -> int:
  return jax.process_index()


def mesh_for(slices: int, order: list[int] | None = None) -> Mesh:
  """(replica=slices, data) over every device, processes in `order` (default:
  by index): a restart may place processes at other mesh coordinates."""
  devices = sorted(
    jax.devices(),
    key=lambda d: ((order or []).index(d.process_index) if order else d.process_index, d.id),
  )
  return Mesh(np.array(devices).reshape(slices, -1), ("replica", "data"))


def expected(step: int) -> dict[str, np.ndarray]:
  """Global values for `step`, with bit patterns that lossy paths break."""
  w = (np.arange(128, dtype=np.float32).reshape(8, 16) * 0.5 + step).astype(np.float32)
  wb = w.view(np.uint32)
  wb[0, 0] = 0x80000000  # -0.0
  wb[0, 1] = 0x00000001  # smallest denormal
  wb[0, 2] = 0x7FC00000 | (step + 1)  # NaN with a payload
  wb[0, 3] = 0x7F800000  # +inf
  wb[1, 5] = 0x807FFFFF  # negative denormal
  b = (np.arange(16, dtype=np.float32) - 3 + step).astype(ml_dtypes.bfloat16)
  bb = b.view(np.uint16)
  bb[0] = 0x8000  # -0.0
  bb[1] = 0x7FC1  # NaN payload
  bb[2] = 0x0001  # denormal
  ids = (np.arange(32, dtype=np.int32).reshape(4, 8) * (step + 7) - 50).astype(np.int32)
  count = np.asarray(step * 3 - 1, dtype=np.int32)
  mask = (np.arange(8) + step) % 3 == 0
  return {"w": w, "b": b, "ids": ids, "count": count, "mask": mask}


def make_state(mesh: Mesh, step: int) -> dict[str, jax.Array]:
  values = expected(step)
  out = {}
  for name, (shape, _dtype, spec) in SPECS.items():
    v = values[name]
    out[name] = jax.make_array_from_callback(
      shape, NamedSharding(mesh, spec), lambda idx, v=v: v[idx]
    )
  return out


def abstract_state(mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
  return {
    name: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))
    for name, (shape, dtype, spec) in SPECS.items()
  }


def bits(a: np.ndarray) -> np.ndarray:
  a = np.asarray(a)
  if a.dtype == np.bool_:
    return a.view(np.uint8)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def mismatches(state: dict[str, jax.Array], step: int) -> list[str]:
  """Leaves whose addressable shards differ bit-for-bit from expected(step)."""
  want = expected(step)
  bad = []
  for name, arr in state.items():
    if arr.dtype != want[name].dtype or arr.shape != want[name].shape:
      bad.append(f"{name}: {arr.dtype}{arr.shape} != {want[name].dtype}{want[name].shape}")
      continue
    for shard in arr.addressable_shards:
      if not np.array_equal(bits(np.asarray(shard.data)), bits(want[name][shard.index])):
        bad.append(f"{name}{shard.index}")
  return bad


def data_state(step: int) -> dict[str, Any]:
  return {"pos": step * 1000 + pid(), "seed": [pid(), step], "tag": f"p{pid()}-s{step}"}


def host_dir(args: dict) -> str:
  return os.path.join(args["local_root"], f"host_{pid()}")


def options(args: dict) -> ec.CheckpointManagerOptions:
  return ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(
      directory=host_dir(args),
      save_interval_steps=args.get("local_interval", 1),
      max_to_keep=args.get("local_keep", 2),
      redundancy=args.get("redundancy", "none"),
      redundancy_overlap=args.get("redundancy_overlap"),
    ),
    persistent=ec.PersistentTierOptions(
      directory=args["persistent"],
      save_interval_steps=args.get("persistent_interval", 2),
      when_busy=args.get("persistent_when_busy", "wait"),
      max_to_keep=args.get("persistent_keep", 3),
    ),
    replica_axis=args.get("replica_axis", "replica"),
    run_id=args.get("run_id", "test-run"),
    collective_timeout_s=args.get("collective_timeout_s", 60),
    peer=ec.PeerOptions(
      transport=args.get("peer_transport", "stream"), ports=args.get("peer_ports")
    ),
    state_commit_timeout_s=args.get("state_commit_timeout_s", 30),
    event_log=args.get("event_log"),
    # a machine of its own per process (these jobs share one machine)
    **({"host_id": f"sim-host-{pid()}"} if args.get("sim_hosts") else {}),
  )


def save_steps(args: dict) -> dict:
  """Saves args['steps'] (each a state distinct by step), then waits.
  args['orbax_distributed_ids']: set Orbax's experimental flag that makes it
  translate process indices first. args['upload_memory_kind']: the memory
  kind of the persistent upload's arrays on CPU (upload_memory's test
  seam: "pinned_host" runs the accelerators' path)."""
  if args.get("upload_memory_kind"):
    from emergency_ckpt.persistent import upload_memory  # noqa: PLC0415

    upload_memory.CPU_UPLOAD_MEMORY_KIND = args["upload_memory_kind"]
  if args.get("orbax_distributed_ids"):
    from absl import flags  # noqa: PLC0415
    from orbax.checkpoint._src.multihost import multihost  # noqa: F401, PLC0415 - defines it

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_process_id = True
  mesh = mesh_for(args["slices"])
  saved = []
  with ec.CheckpointManager(options(args), mesh=mesh) as mngr:
    for step in args["steps"]:
      if mngr.save(step, make_state(mesh, step), data_state=data_state(step)):
        saved.append(step)
      if args.get("wait_each"):
        mngr.wait_until_finished()
    mngr.wait_until_finished()
    topo = mngr.topology
    return {
      "saved": saved,
      "slice": topo.slice_index,
      "local_dir": mngr.local_directory,
      "orbax_all_gathers": _orbax_all_gathers(),
      "upload": [mngr._saves._upload_snapshots, mngr._saves._upload_memory_kind],  # noqa: SLF001
      # XOR chunks sent from the snapshot during the local write
      "overlap": getattr(mngr._redundancy, "overlap", None),  # noqa: SLF001
    }


def _orbax_all_gathers() -> list[str]:
  """Which of Orbax's start-up all-gathers of every process ran in this job
  (its id tables built, or their keys on the coordination service)."""
  from orbax.checkpoint._src.multihost import multihost  # noqa: PLC0415

  ran = []
  if multihost.is_runtime_to_distributed_ids_initialized():
    ran.append("runtime_to_distributed_ids")
  if multihost.is_distributed_to_device_ids_initialized():
    ran.append("distributed_to_device_ids")
  client = jax._src.distributed.global_state.client  # noqa: SLF001
  if client is not None:
    for folder in ("jax/process_id/", "orbax/distributed_to_device_ids/"):
      if client.key_value_dir_get(folder):
        ran.append(folder)
  return ran


def _wipe(args: dict) -> None:
  shutil.rmtree(host_dir(args), ignore_errors=True)


def restore_variants(args: dict) -> list[dict]:
  """For each variant: set the disks up as it says, restore with a fresh
  manager, report step, source, data_state and bit mismatches."""
  mesh = mesh_for(args["slices"])
  me = pid()
  backup = host_dir(args) + ".backup"
  shutil.copytree(host_dir(args), backup, symlinks=True)
  out = []
  for i, variant in enumerate(args["variants"]):
    shutil.rmtree(host_dir(args), ignore_errors=True)
    shutil.copytree(backup, host_dir(args), symlinks=True)
    slice_index = topology_from_mesh(mesh, "replica").slice_index
    if slice_index in variant.get("wipe_slices", ()):
      _wipe(args)  # this host was replaced: its ramdisk is empty
    with ec.CheckpointManager(options({**args, **variant.get("args", {})}), mesh=mesh) as mngr:
      for target_pid, step in variant.get("delete_json", ()):
        if target_pid == me:
          n = jax.process_count()
          os.remove(
            os.path.join(args["persistent"], "state", str(step), f"process_{me}-of-{n}.json")
          )
      barrier(f"variant-{i}-ready")
      record: dict[str, Any] = {"name": variant["name"], "slice": slice_index}
      try:
        latest = mngr.latest_step()
        steps = mngr.all_steps()
        r = mngr.restore(abstract_state(mesh))
        record.update(
          step=r.step,
          source=r.source,
          data_state=r.data_state,
          latest=latest,
          all_steps=steps,
          mismatches=mismatches(r.state, r.step),
          expected_data_state=data_state(r.step),
          local_entries=sorted(os.listdir(mngr.local_directory)),
        )
      except ec.EmergencyCheckpointError as e:
        record.update(error=type(e).__name__, message=str(e))
    barrier(f"variant-{i}-done")
    out.append(record)
  return out


def uneven_local_saves(args: dict) -> dict:
  """Issue 14: the manager saves args['steps'] (local every step, persistent
  every 2nd); after each save, process 0 alone writes args['extra'] more
  local copies through a second LocalTier (its own folder) while the
  persistent upload runs. Every Orbax checkpointer in a process shares
  Orbax's operation-id counter, which the persistent tier's barrier keys
  carry: the local checkpointer must not move it, or the primary slice's
  barriers diverge and time out. Returns what was saved, what the
  persistent tier finalized, and how long it all took."""
  import time  # noqa: PLC0415

  from emergency_ckpt.core import shards as shards_lib  # noqa: PLC0415
  from emergency_ckpt.local.tier import LocalTier  # noqa: PLC0415
  from emergency_ckpt.runtime.background import Background  # noqa: PLC0415
  from emergency_ckpt.runtime.staging import StagingArea  # noqa: PLC0415

  mesh = mesh_for(args["slices"])
  t0 = time.monotonic()
  extra_ok: list[int] = []
  error = None
  with ec.CheckpointManager(options(args), mesh=mesh) as mngr:
    topo = mngr.topology
    tier = area = None
    if pid() == 0:
      background = Background(topo.log_prefix())
      extra_dir = os.path.join(args["local_root"], f"extra_{pid()}")
      tier = LocalTier(
        ec.LocalTierOptions(directory=extra_dir),
        run_id="extra",
        topology=topo,
        background=background,
      )
      area = StagingArea(buffers=1, job=None, preparer=background.lane("prepare"))
    try:
      for step in args["steps"]:
        state = make_state(mesh, step)
        mngr.save(step, state, data_state=data_state(step))
        if tier is not None:
          paths, leaves, _ = shards_lib.leaf_paths(state)
          for k in range(args.get("extra", 3)):
            extra_step = step * 100 + k
            if tier.write_async(area.stage(extra_step, paths, leaves)).result().ok:
              extra_ok.append(extra_step)
      mngr.wait_until_finished()
    except ec.EmergencyCheckpointError as e:
      error = f"{type(e).__name__}: {e}"
    finally:
      if tier is not None:
        tier.close()
    tensors = os.path.join(args["persistent"], "tensors")
    return {
      "error": error,
      "persistent": sorted(os.listdir(tensors)) if os.path.isdir(tensors) else [],
      "all_steps": mngr.all_steps() if error is None else None,
      "extra": extra_ok,
      "elapsed_s": round(time.monotonic() - t0, 2),
    }
