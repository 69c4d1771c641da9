"""Issue 14: the local tier writes and reads through Orbax's checkpointer API.

Single process, 2 CPU devices, except the last test: a real 2-process job in
which one process saves more local copies than the other, and the
persistent tier (Orbax, barriers over both processes) must not notice.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=2"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import crc32c  # noqa: E402
import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from orbax.checkpoint._src.futures import synchronization  # noqa: E402

from emergency_ckpt.cluster.topology import topology_from_mesh  # noqa: E402
from emergency_ckpt.core import placement  # noqa: E402
from emergency_ckpt.core import shards as shards_lib  # noqa: E402
from emergency_ckpt.demo.launcher import run_job  # noqa: E402
from emergency_ckpt.errors import CorruptCheckpointError  # noqa: E402
from emergency_ckpt.local import format as local_format  # noqa: E402
from emergency_ckpt.local.checkpointer import LocalCheckpointer, LocalTemporaryPath  # noqa: E402
from emergency_ckpt.local.handler import (  # noqa: E402
  LocalShardsHandler,
  LocalShardsRestore,
  LocalShardsSave,
)
from emergency_ckpt.local.tier import LocalTier  # noqa: E402
from emergency_ckpt.options import LocalTierOptions  # noqa: E402
from emergency_ckpt.runtime.background import Background  # noqa: E402
from emergency_ckpt.runtime.staging import StagingArea  # noqa: E402

RUN_ID = "h"


@pytest.fixture(scope="module")
def mesh():
  devices = jax.devices()
  assert len(devices) >= 2, f"need 2 CPU devices, got {devices} (XLA_FLAGS set too late?)"
  return Mesh(np.array(devices[:2]).reshape(1, 2), ("replica", "data"))


@pytest.fixture(scope="module")
def topo(mesh):
  return topology_from_mesh(mesh, "replica")


@pytest.fixture(scope="module")
def state(mesh):
  """Leaves with bit patterns a lossy path would break; one of 12-byte
  shards (padded to 64 in shards.bin), one replicated."""
  f32 = np.array(
    [0x80000000, 0x00000001, 0x7FC12345, 0xFF800000, 0x3F800000, 0x00000000, 1, 2], np.uint32
  ).view(np.float32)
  bf16 = np.array([0x8000, 0x0001, 0x7FC1, 0x3F80], np.uint16).view(ml_dtypes.bfloat16)
  w = (np.arange(24, dtype=np.float32).reshape(4, 6) * np.float32(1e-40)).astype(np.float32)

  def put(value, spec):
    return jax.device_put(value, NamedSharding(mesh, spec))

  return {
    "params": {"f32": put(f32, P("data")), "w": put(w, P(None, "data"))},
    "bf16": put(bf16, P("data")),
    "rep": put(np.array([7, -8, 127], np.int8), P()),
    "step": put(np.array(5, np.int32), P()),
  }


def abstract_of(tree):
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


def bits_equal(a_tree, b_tree) -> bool:
  a_flat, a_def = jax.tree_util.tree_flatten(a_tree)
  b_flat, b_def = jax.tree_util.tree_flatten(b_tree)
  return a_def == b_def and all(
    np.asarray(a).dtype == np.asarray(b).dtype
    and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    for a, b in zip(a_flat, b_flat)
  )


class Tier:
  """A LocalTier with the staging area its saves copy into."""

  def __init__(self, directory: str, topo):
    background = Background()
    self.tier = LocalTier(
      LocalTierOptions(directory=directory), run_id=RUN_ID, topology=topo, background=background
    )
    self.area = StagingArea(buffers=1, job=None, preparer=background.lane("prepare"))

  def stage(self, step: int, tree):
    paths, leaves, _ = shards_lib.leaf_paths(tree)
    return self.area.stage(step, paths, leaves)

  def save(self, step: int, tree):
    result = self.tier.write_async(self.stage(step, tree)).result()
    assert result.ok, result.error
    return result

  def close(self):
    self.tier.close()


@pytest.fixture
def tier(shm_dir, topo):
  t = Tier(os.path.join(shm_dir, "local"), topo)
  yield t
  t.close()


def assemble(abstract_tree, local: local_format.LocalStep):
  paths, abstract, treedef = shards_lib.leaf_paths(abstract_tree)
  arrays = [placement.assemble(a, by) for a, by in zip(abstract, local.arrays)]
  return jax.tree_util.tree_unflatten(treedef, arrays)


# ---- (a) a local copy opens with plain Orbax ----------------------------------------


def test_registered_with_orbax():
  save_cls, restore_cls = ocp.args.get_registered_args_cls(LocalShardsHandler)
  assert (save_cls, restore_cls) == (LocalShardsSave, LocalShardsRestore)
  assert ocp.args.get_registered_handler_cls(LocalShardsRestore) is LocalShardsHandler


def test_a_tier_copy_restores_bit_exact_through_plain_orbax(tier, state):
  """What the tier wrote opens with a plain ocp.Checkpointer and our
  handler: with an abstract state (this process's shards, assembled into
  the same arrays, bit for bit), without arguments (every saved shard,
  verified) and as metadata (the manifest)."""
  tier.save(3, state)
  where = tier.tier.step_dir(3)
  with ocp.Checkpointer(LocalShardsHandler()) as ckptr:
    local = ckptr.restore(where, args=LocalShardsRestore(abstract=abstract_of(state)))
    assert isinstance(local, local_format.LocalStep) and local.step == 3
    assert bits_equal(assemble(abstract_of(state), local), state)

    every = ckptr.restore(where)  # no args: Orbax builds LocalShardsRestore()
    paths, leaves, _ = shards_lib.leaf_paths(state)
    assert [leaf["path"] for leaf in every.manifest["leaves"]] == paths
    for leaf, by_index in zip(leaves, every.arrays):
      indices = {shards_lib.normalize_index(s.index, leaf.shape) for s in leaf.addressable_shards}
      assert set(by_index) == indices
      for shard in leaf.addressable_shards:
        index = shards_lib.normalize_index(shard.index, leaf.shape)
        assert by_index[index].tobytes() == np.asarray(shard.data).tobytes()
        assert by_index[index].dtype == leaf.dtype

    meta = ckptr.metadata(where)
    assert meta.item_metadata == local_format.read_manifest(where)
  # The tier's own read goes through the same restore and agrees.
  paths, abstract, _ = shards_lib.leaf_paths(abstract_of(state))
  mine = tier.tier.read(3, paths, abstract)
  assert mine.manifest == local.manifest


def test_plain_orbax_restore_detects_a_flipped_byte(tier, state):
  tier.save(1, state)
  path = os.path.join(tier.tier.step_dir(1), local_format.SHARDS)
  with open(path, "r+b") as f:
    f.seek(1)
    byte = f.read(1)
    f.seek(1)
    f.write(bytes([byte[0] ^ 0x10]))
  with ocp.Checkpointer(LocalShardsHandler()) as ckptr:
    with pytest.raises(CorruptCheckpointError, match="checksum"):
      ckptr.restore(tier.tier.step_dir(1))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
      ckptr.restore(tier.tier.step_dir(1), args=LocalShardsRestore(abstract=abstract_of(state)))


def test_a_copy_saved_by_plain_orbax_reads_back(shm_dir, tier, state):
  """The handler also works under Orbax's default checkpointer settings
  (which add Orbax's own metadata files beside ours)."""
  staged = tier.stage(7, state)
  where = os.path.join(shm_dir, "plain", "step_7")
  os.makedirs(os.path.dirname(where))
  topo = tier.tier._topology
  with ocp.Checkpointer(LocalShardsHandler()) as ckptr:
    ckptr.save(
      where,
      args=LocalShardsSave(
        staged,
        run_id=RUN_ID,
        process_index=topo.process_index,
        slice_index=topo.slice_index,
        topology=topo.fingerprint(),
      ),
    )
    local = ckptr.restore(where, args=LocalShardsRestore(abstract=abstract_of(state)))
  staged.release()
  assert bits_equal(assemble(abstract_of(state), local), state)
  assert local_format.verify_step_dir(where)[1] == []


# ---- (b) the files are local_format's, byte for byte -----------------------------------


def test_files_are_exactly_local_format(tier, state):
  """A step folder holds shards.bin and manifest.json only (no Orbax
  metadata, no commit file), 0700/0600; the manifest decodes and equals the
  one local_format builds for this layout and these CRC32Cs; shards.bin
  holds each shard's bytes at its offset, zeros between; verify_step_dir
  (the offline check) passes."""
  staged = tier.stage(2, state)
  buffer = staged.buffer.copy()
  layout = staged.layout
  assert tier.tier.write_async(staged).result().ok
  where = tier.tier.step_dir(2)
  assert sorted(os.listdir(where)) == [local_format.MANIFEST, local_format.SHARDS]
  assert stat.S_IMODE(os.stat(where).st_mode) == 0o700
  assert stat.S_IMODE(os.stat(os.path.join(where, local_format.SHARDS)).st_mode) == 0o600

  with open(os.path.join(where, local_format.MANIFEST), "rb") as f:
    raw = f.read()
  body = local_format.decode_manifest(raw, where)
  expected_file = np.zeros(layout.nbytes, np.uint8)
  crcs = []
  for leaf in layout.leaves:
    crcs.append([crc32c.crc32c(buffer[s.offset : s.offset + s.nbytes]) for s in leaf.slots])
    for s in leaf.slots:
      expected_file[s.offset : s.offset + s.nbytes] = buffer[s.offset : s.offset + s.nbytes]
  topo = tier.tier._topology
  want = local_format.manifest_body(
    layout,
    crcs,
    step=2,
    run_id=RUN_ID,
    process_index=topo.process_index,
    slice_index=topo.slice_index,
    topology=tier.tier._recorded_topology(),
  )
  want["saved_at"] = body["saved_at"]
  assert body == want
  assert raw == local_format.encode_manifest(want)  # same bytes, same key order
  assert list(body) == list(want)
  with open(os.path.join(where, local_format.SHARDS), "rb") as f:
    assert f.read() == expected_file.tobytes()
  assert local_format.verify_step_dir(where) == (body, [])


def test_the_file_holds_the_staged_buffer_byte_for_byte(tier, state):
  """The padding between shards is written from the staged buffer too, so
  the file equals the bytes XOR parity sent from the buffer during the
  write (local.redundancy_overlap) even when a reused buffer's padding is
  not zero (here: scribbled over after staging)."""
  staged = tier.stage(3, state)
  layout = staged.layout
  shard_bytes = np.zeros(layout.nbytes, bool)
  for leaf in layout.leaves:
    for slot in leaf.slots:
      shard_bytes[slot.offset : slot.offset + slot.nbytes] = True
  assert not shard_bytes.all(), "this state's layout has padding"
  staged.buffer[: layout.nbytes][~shard_bytes] = 0xA5
  want = staged.buffer[: layout.nbytes].tobytes()
  assert tier.tier.write_async(staged).result().ok
  with open(os.path.join(tier.tier.step_dir(3), local_format.SHARDS), "rb") as f:
    assert f.read() == want
  assert local_format.verify_step_dir(tier.tier.step_dir(3))[1] == []


def test_a_recycled_spare_is_written_in_place(tier, state):
  """Retention keeps a retired step's shards.bin as a spare; the next save's
  handler moves that very file (same inode) into Orbax's temporary folder
  and overwrites it; the spare folder is gone afterwards."""
  tier.save(1, state)
  tier.save(2, state)
  inode = os.stat(os.path.join(tier.tier.step_dir(1), local_format.SHARDS)).st_ino
  assert tier.tier.apply_retention({2}) == [1]
  spares = [n for n in os.listdir(tier.tier.directory) if n.startswith(".tmp-spare-")]
  assert len(spares) == 1
  other = jax.tree_util.tree_map(
    lambda x: jax.device_put(np.asarray(x)[::-1].copy(), x.sharding) if x.ndim == 1 else x, state
  )
  tier.save(3, other)
  assert os.stat(os.path.join(tier.tier.step_dir(3), local_format.SHARDS)).st_ino == inode
  assert sorted(os.listdir(tier.tier.directory)) == [".owner", "step_2", "step_3"]
  paths, abstract, _ = shards_lib.leaf_paths(abstract_of(state))
  assert bits_equal(assemble(abstract_of(state), tier.tier.read(3, paths, abstract)), other)
  assert local_format.verify_step_dir(tier.tier.step_dir(3))[1] == []


# ---- what the checkpointer must not do -------------------------------------------------


def test_a_save_leaves_orbax_operation_id_and_threads_alone(tier, state):
  """A local save neither moves Orbax's process-wide operation id (the
  persistent tier's barrier keys carry it) nor starts a thread."""
  assert tier.tier._checkpointer is None  # opened by the first write, not before
  tier.save(1, state)  # the writer lane's thread exists from now on
  ckptr = tier.tier._checkpointer
  assert isinstance(ckptr, LocalCheckpointer) and isinstance(ckptr, ocp.Checkpointer)
  before_id = synchronization.OperationIdGenerator.get_current_operation_id()
  before_threads = {t.ident for t in threading.enumerate()}
  for step in (2, 3, 4):
    tier.save(step, state)
  assert synchronization.OperationIdGenerator.get_current_operation_id() == before_id
  assert {t.ident for t in threading.enumerate()} <= before_threads


def test_a_failed_save_leaves_no_temporary_folder(tier, state, monkeypatch):
  """An OSError inside the handler fails the save (WriteResult not ok,
  nothing listed), and LocalCheckpointer removes Orbax's temporary folder."""
  real = os.pwrite

  def full(fd, data, offset):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "pwrite", full)
  result = tier.tier.write_async(tier.stage(1, state)).result()
  assert not result.ok and "No space left" in result.error
  assert os.listdir(tier.tier.directory) == [".owner"]  # the folder's lock (local_tier)
  monkeypatch.setattr(os, "pwrite", real)
  tier.save(2, state)
  assert tier.tier.steps() == [2]


def test_a_symlinked_step_folder_is_refused(tier, state):
  """The tier never reads through a planted symlink (Orbax's finalized-path
  check, with our temporary-path class, rejects it)."""
  tier.save(1, state)
  os.rename(tier.tier.step_dir(1), os.path.join(tier.tier.directory, "elsewhere"))
  os.symlink("elsewhere", tier.tier.step_dir(1))
  paths, abstract, _ = shards_lib.leaf_paths(abstract_of(state))
  with pytest.raises(CorruptCheckpointError, match="symlink"):
    tier.tier.read(1, paths, abstract)


def test_temporary_path_names(shm_dir):
  final = os.path.join(shm_dir, "step_12")
  tmp = LocalTemporaryPath.from_final(final)
  assert tmp.get().name.startswith(".tmp-step_12-") and str(tmp.get_final()) == final
  back = LocalTemporaryPath.from_temporary(tmp.get())
  assert str(back.get_final()) == final


def test_local_format_imports_neither_orbax_nor_jax():
  """Offline tools read local copies through local_format: importing it
  (and layout) loads neither JAX nor Orbax."""
  code = (
    "import json, sys, emergency_ckpt.local.format, emergency_ckpt.core.layout;"
    " print(json.dumps(sorted(m for m in ('jax', 'orbax', 'tensorstore') if m in sys.modules)))"
  )
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo)
  assert out.returncode == 0, out.stderr
  assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ---- (d) crash leftovers ---------------------------------------------------------------


def test_crash_leftovers_are_removed_at_start_up_and_never_listed(shm_dir, topo, state):
  """What a process killed inside a save leaves: our checkpointer's
  `.tmp-step_<N>-<hex>` folder holding a complete copy (killed before the
  rename), and Orbax's default `step_<N>.orbax-checkpoint-tmp*` folders (a
  plain Orbax save into the folder). None is ever a step; the next tier
  removes them all when it starts."""
  t = Tier(os.path.join(shm_dir, "local"), topo)
  t.save(2, state)
  d = t.tier.directory
  # Exactly what LocalCheckpointer leaves when killed before its rename.
  staged = t.stage(3, state)
  tmp = LocalTemporaryPath.from_final(os.path.join(d, "step_3"))
  os.mkdir(tmp.get(), 0o700)
  topo_fp = topo.fingerprint()
  LocalShardsHandler().save(
    tmp.get(),
    LocalShardsSave(staged, run_id=RUN_ID, process_index=0, slice_index=0, topology=topo_fp),
  )
  staged.release()
  orbax_tmp = [
    os.path.join(d, "step_4.orbax-checkpoint-tmp"),
    os.path.join(d, "step_5.orbax-checkpoint-tmp-1700000000"),
  ]
  for p in orbax_tmp:
    os.mkdir(p, 0o700)
    for name in os.listdir(t.tier.step_dir(2)):
      os.link(os.path.join(t.tier.step_dir(2), name), os.path.join(p, name))
  assert local_format.verify_step_dir(str(tmp.get()))[1] == []  # complete, yet not a step
  assert t.tier.steps() == [2] and t.tier.usable_steps() == ([2], {})
  t.close()

  t2 = Tier(os.path.join(shm_dir, "local"), topo)
  try:
    assert sorted(os.listdir(d)) == [".owner", "step_2"]
    assert t2.tier.steps() == [2]
    t2.save(3, state)
    assert t2.tier.steps() == [2, 3]
  finally:
    t2.close()


# ---- (c) uneven local saves never disturb the persistent tier ----------------------------


def test_uneven_local_saves_never_disturb_the_persistent_barriers(shm_dir):
  """A real job, one slice of 2 processes: the persistent tier is Orbax with
  barriers over both. Process 0 alone writes 3 extra local copies after each
  of 30 manager saves (90 more local checkpointer saves than process 1,
  while uploads run). Every one of the 15 persistent saves still finalizes,
  with no barrier timeout (collective_timeout_s=20).

  Fails when LocalCheckpointer.synchronize_next_awaitable_signal_operation_id
  is Orbax's own (checked, 17 runs out of 17: the processes' Orbax operation
  ids diverge and a persistent save ends in "Timed out while waiting for
  async_write_complete barrier"; the failure is a race, so with 6 saves
  instead of 30 it failed 3 runs out of 5)."""
  steps = list(range(1, 31))
  args = {
    "slices": 1,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "steps": steps,
    "extra": 3,
    "persistent_keep": len(steps),
    "collective_timeout_s": 20,
  }
  results = run_job("tests.scenarios:uneven_local_saves", 2, args, timeout_s=200).check()
  persistent = sorted(str(s) for s in steps if s % 2 == 0)
  for process, r in enumerate(results):
    assert r["error"] is None, (process, r["error"])
    assert r["persistent"] == persistent, (process, r["persistent"])
    assert r["all_steps"][-2:] == [29, 30], (process, r["all_steps"])
    assert set(r["all_steps"]) >= {int(s) for s in persistent}, (process, r["all_steps"])
  assert len(results[0]["extra"]) == 90 and results[1]["extra"] == []
