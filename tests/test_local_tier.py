"""Unit tests of the local (ramdisk) tier: single process, 2 CPU devices."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=2"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import mmap  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import stat  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from emergency_ckpt.cluster.topology import topology_from_mesh  # noqa: E402
from emergency_ckpt.core import placement  # noqa: E402
from emergency_ckpt.core import shards as shards_lib  # noqa: E402
from emergency_ckpt.errors import (  # noqa: E402
  CorruptCheckpointError,
  StateMismatchError,
  TopologyMismatchError,
  UnsafeDirectoryError,
)
from emergency_ckpt.local.format import decode_manifest, encode_manifest, map_file  # noqa: E402
from emergency_ckpt.local.owner import secure_makedirs  # noqa: E402
from emergency_ckpt.local.tier import LocalTier  # noqa: E402
from emergency_ckpt.options import LocalTierOptions  # noqa: E402
from emergency_ckpt.runtime import background as background_lib  # noqa: E402
from emergency_ckpt.runtime import buffers as buffers_lib  # noqa: E402
from emergency_ckpt.runtime.background import Background  # noqa: E402
from emergency_ckpt.runtime.buffers import BufferPool, aligned_empty  # noqa: E402
from emergency_ckpt.runtime.staging import StagingArea  # noqa: E402
from tests.helpers import abstract_of  # noqa: E402

RUN_ID = "r"


def _bits(values, dtype, view):
  return np.array(values, dtype=dtype).view(view)


# name -> (host value with awkward bit patterns, partition spec)
HOST = {
  "f32": (
    _bits(
      [
        0x80000000,  # -0.0
        0x00000001,  # smallest denormal
        0x007FFFFF,  # largest denormal
        0x7FC12345,  # quiet NaN with a payload
        0xFFC00001,  # negative NaN with a payload
        0x7F800001,  # signalling NaN
        0x7F800000,  # +inf
        0x3F800000,  # 1.0
      ],
      np.uint32,
      np.float32,
    ),
    P("data"),
  ),
  "w": (
    (np.arange(24, dtype=np.float32).reshape(4, 6) * np.float32(1e-40)).astype(np.float32),
    P(None, "data"),  # 12-byte shards: padded to 64, so shards.bin has slack bytes
  ),
  "bf16": (
    _bits([0x8000, 0x0001, 0x7FC1, 0xFF81, 0x0080, 0x3F80], np.uint16, ml_dtypes.bfloat16),
    P("data"),
  ),
  "i32": (
    np.array([-(2**31), 2**31 - 1, -1, 0, 1, 123456789], dtype=np.int32),
    P("data"),
  ),
  "mask": (np.array([True, False, False, True], dtype=np.bool_), P("data")),
  "scalar": (_bits(0x7FA00005, np.uint32, np.float32).reshape(()), P()),
  "rep": (np.array([7, -8, 127], dtype=np.int8), P()),
}


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
  """A nested train state of jax arrays built from HOST."""

  def put(name):
    value, spec = HOST[name]
    arr = jax.device_put(value, NamedSharding(mesh, spec))
    assert np.asarray(arr).tobytes() == value.tobytes()  # the bits survived device_put
    return arr

  return {
    "params": {"w": put("w"), "f32": put("f32"), "bf16": put("bf16")},
    "opt": [put("i32"), put("mask")],
    "step": put("scalar"),
    "rep": put("rep"),
  }


_STAGING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_tier(directory, topo, **kw):
  """A LocalTier and (staging_of(tier)) the staging area its saves copy into."""
  background = Background()
  tier = LocalTier(
    LocalTierOptions(directory=directory, **kw), run_id=RUN_ID, topology=topo, background=background
  )
  _STAGING[tier] = StagingArea(
    buffers=tier._options.staging_buffers,
    job=None,
    preparer=background.lane("prepare", low_priority=True),
  )
  return tier


def staging_of(tier) -> StagingArea:
  return _STAGING[tier]


@pytest.fixture
def tier(shm_dir, topo):
  t = make_tier(shm_dir + "/x", topo)
  yield t
  t.close()


def save(tier, step, tree):
  paths, leaves, _ = shards_lib.leaf_paths(tree)
  staged = staging_of(tier).stage(step, paths, leaves)
  results = []
  fut = tier.write_async(staged, on_done=results.append)
  tier.wait()
  result = fut.result()
  assert result.ok, result.error
  assert results == [result]
  assert result.step == step and result.nbytes == staged.layout.nbytes
  return result


def restore(tier, step, abstract_tree):
  """Reads `step` and assembles global jax arrays, as the manager does."""
  paths, abstract, treedef = shards_lib.leaf_paths(abstract_tree)
  local = tier.read(step, paths, abstract)
  arrays = [placement.assemble(a, by) for a, by in zip(abstract, local.arrays)]
  return jax.tree_util.tree_unflatten(treedef, arrays)


def same_bits(a_tree, b_tree) -> bool:
  a_flat, a_def = jax.tree_util.tree_flatten(a_tree)
  b_flat, b_def = jax.tree_util.tree_flatten(b_tree)
  if a_def != b_def:
    return False
  for a, b in zip(a_flat, b_flat):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
      return False
  return True


def edit_manifest(tier, step, edit):
  path = os.path.join(tier.step_dir(step), "manifest.json")
  with open(path, "rb") as f:
    body = decode_manifest(f.read(), path)
  edit(body)
  with open(path, "wb") as f:
    f.write(encode_manifest(body))


# ---- save / read round trip ---------------------------------------------------


def test_round_trip_is_bit_exact(tier, state):
  save(tier, 3, state)
  got = restore(tier, 3, abstract_of(state))
  assert same_bits(got, state)
  for name, arr in [
    ("w", got["params"]["w"]),
    ("f32", got["params"]["f32"]),
    ("bf16", got["params"]["bf16"]),
    ("i32", got["opt"][0]),
    ("mask", got["opt"][1]),
    ("scalar", got["step"]),
    ("rep", got["rep"]),
  ]:
    value, spec = HOST[name]
    assert arr.dtype == value.dtype, name
    assert arr.shape == value.shape, name
    assert arr.sharding == NamedSharding(state["rep"].sharding.mesh, spec), name
    assert np.asarray(arr).tobytes() == value.tobytes(), name
  f32 = np.asarray(got["params"]["f32"]).view(np.uint32)
  assert f32[0] == 0x80000000 and f32[3] == 0x7FC12345 and f32[5] == 0x7F800001


def test_read_returns_this_process_shards(tier, state):
  save(tier, 1, state)
  paths, abstract, _ = shards_lib.leaf_paths(abstract_of(state))
  local = tier.read(1, paths, abstract)
  assert local.step == 1
  assert local.manifest["run_id"] == RUN_ID
  assert local.manifest["topology"] == {
    **tier._topology.fingerprint(),
    "slice_grid": list(tier._topology.slice_grid),
  }
  by_path = dict(zip(paths, local.arrays))
  w = by_path["['params']['w']"]
  assert sorted(w) == [((0, 4), (0, 3)), ((0, 4), (3, 6))]  # two column shards
  np.testing.assert_array_equal(w[((0, 4), (3, 6))], HOST["w"][0][:, 3:])
  assert list(by_path["['step']"]) == [()]  # replicated scalar: one shard


def test_resave_same_step_replaces_it(tier, state, mesh):
  save(tier, 4, state)
  other = jax.tree_util.tree_map(lambda x: x, state)
  other["opt"][0] = jax.device_put(np.arange(6, dtype=np.int32), NamedSharding(mesh, P("data")))
  save(tier, 4, other)
  got = restore(tier, 4, abstract_of(state))
  assert same_bits(got, other)
  assert not same_bits(got, state)
  assert tier.steps() == [4]


# ---- listing --------------------------------------------------------------------


def test_steps_lists_only_committed(tier, state):
  assert tier.steps() == []
  save(tier, 1, state)
  save(tier, 20, state)
  d = tier.directory
  tmp = os.path.join(d, ".tmp-step_30-deadbeef")
  shutil.copytree(tier.step_dir(1), tmp)  # complete but never renamed
  os.mkdir(os.path.join(d, "step_40"))  # no manifest
  shutil.copy(os.path.join(tier.step_dir(1), "shards.bin"), os.path.join(d, "step_40"))
  os.mkdir(os.path.join(d, "step_x"))
  with open(os.path.join(d, "step_50"), "w") as f:  # a file, not a folder
    f.write("junk")
  assert tier.steps() == [1, 20]
  assert tier.usable_steps() == ([1, 20], {})


def test_leftover_tmp_dirs_removed_on_construction(shm_dir, topo, state):
  t = make_tier(shm_dir + "/x", topo)
  save(t, 2, state)
  leftovers = [
    os.path.join(t.directory, ".tmp-step_9-0badf00d"),
    os.path.join(t.directory, ".tmp-delete-1-12345678"),
  ]
  shutil.copytree(t.step_dir(2), leftovers[0])
  os.mkdir(leftovers[1])
  assert t.steps() == [2]
  t.close()
  t2 = make_tier(shm_dir + "/x", topo)
  try:
    assert not any(os.path.exists(p) for p in leftovers)
    assert sorted(os.listdir(t2.directory)) == [".owner", "step_2"]  # the owner lock stays
    assert t2.steps() == [2]
    assert same_bits(restore(t2, 2, abstract_of(state)), state)
  finally:
    t2.close()


def _set_topology(body):
  body["topology"]["mesh_shape"] = [2, 1]


def _set_process_count(body):
  body["topology"]["process_count"] = 2
  body["topology"]["slice_processes"] = [[0], [1]]


def _set_run_id(body):
  body["run_id"] = "another-run"


def test_usable_steps_accepts_a_copy_from_another_slice_count(tier, state):
  """A copy written as process 0 of a 2-slice job holds what process 0 of
  this 1-slice job needs (same mesh inside a slice, same slice position)."""
  save(tier, 1, state)
  edit_manifest(tier, 1, _set_process_count)
  assert tier.usable_steps() == ([1], {})
  assert same_bits(restore(tier, 1, abstract_of(state)), state)


@pytest.mark.parametrize("edit", [_set_topology, _set_run_id], ids=["mesh", "run_id"])
def test_usable_steps_rejects_foreign_manifest(tier, state, edit):
  save(tier, 1, state)
  save(tier, 2, state)
  edit_manifest(tier, 2, edit)
  good, bad = tier.usable_steps()
  assert good == [1]
  assert list(bad) == [2]
  assert "saved with topology" in bad[2]
  assert tier.steps() == [1, 2]  # listed, but not usable


def test_usable_steps_rejects_other_job_topology(tier, state, topo, shm_dir):
  save(tier, 5, state)
  other = dataclasses.replace(topo, mesh_shape=(2, 1))
  t2 = LocalTier(LocalTierOptions(directory=shm_dir + "/x"), run_id=RUN_ID, topology=other)
  try:
    good, bad = t2.usable_steps()
    assert good == []
    assert "[1, 2]" in bad[5] and "[2, 1]" in bad[5]
  finally:
    t2.close()


@pytest.mark.parametrize(
  "damage,reason",
  [
    (lambda raw: raw[:-10], "unreadable manifest"),
    (lambda raw: raw.replace(b'"nbytes":', b'"nbytes":1'), "checksum mismatch"),
    (lambda raw: b"", "unreadable manifest"),
  ],
  ids=["torn", "edited", "empty"],
)
def test_usable_steps_rejects_corrupt_manifest(tier, state, damage, reason):
  save(tier, 1, state)
  save(tier, 2, state)
  path = os.path.join(tier.step_dir(1), "manifest.json")
  with open(path, "rb") as f:
    raw = f.read()
  with open(path, "wb") as f:
    f.write(damage(raw))
  good, bad = tier.usable_steps()
  assert good == [2]
  assert reason in bad[1]


def test_manifest_with_unknown_format_is_corrupt(tier, state):
  save(tier, 1, state)
  edit_manifest(tier, 1, lambda body: body.update(format="emergency_ckpt.local/99"))
  with pytest.raises(CorruptCheckpointError, match="unknown format"):
    tier.manifest(1)


# ---- read errors ------------------------------------------------------------------


def _wrong_dtype(a):
  a["params"]["f32"] = jax.ShapeDtypeStruct((8,), np.float16, sharding=a["params"]["f32"].sharding)


def _wrong_dtype_bf16(a):
  a["params"]["bf16"] = jax.ShapeDtypeStruct(
    (6,), np.float16, sharding=a["params"]["bf16"].sharding
  )


def _wrong_shape(a):
  a["params"]["w"] = jax.ShapeDtypeStruct((4, 8), np.float32, sharding=a["params"]["w"].sharding)


def _wrong_rank(a):
  a["opt"][0] = jax.ShapeDtypeStruct((2, 3), np.int32, sharding=a["rep"].sharding)


def _missing_leaf(a):
  del a["rep"]


def _extra_leaf(a):
  a["extra"] = a["rep"]


def _renamed_leaf(a):
  a["params"]["W"] = a["params"].pop("w")


@pytest.mark.parametrize(
  "edit,match",
  [
    (_wrong_dtype, "float16"),
    (_wrong_dtype_bf16, "bfloat16"),
    (_wrong_shape, r"\['params'\]\['w'\]"),
    (_wrong_rank, r"\['opt'\]\[0\]"),
    (_missing_leaf, "Saved but not asked for: \\[\"\\['rep'\\]\"\\]"),
    (_extra_leaf, "asked for but not saved: \\[\"\\['extra'\\]\"\\]"),
    (_renamed_leaf, "does not match the saved tree"),
  ],
  ids=["dtype", "dtype_bf16", "shape", "rank", "missing_leaf", "extra_leaf", "renamed_leaf"],
)
def test_read_state_mismatch(tier, state, edit, match):
  save(tier, 1, state)
  abstract = abstract_of(state)
  edit(abstract)
  with pytest.raises(StateMismatchError, match=match):
    restore(tier, 1, abstract)


def test_read_other_sharding_is_topology_mismatch(tier, state, mesh):
  save(tier, 1, state)
  abstract = abstract_of(state)
  abstract["params"]["f32"] = jax.ShapeDtypeStruct(
    (8,), np.float32, sharding=NamedSharding(mesh, P())
  )
  with pytest.raises(TopologyMismatchError, match="no shard"):
    restore(tier, 1, abstract)


def _shards_path(tier, step):
  return os.path.join(tier.step_dir(step), "shards.bin")


def test_read_truncated_shards_bin(tier, state):
  save(tier, 1, state)
  path = _shards_path(tier, 1)
  size = os.path.getsize(path)
  os.truncate(path, size - 1)
  with pytest.raises(CorruptCheckpointError, match="wrong size"):
    restore(tier, 1, abstract_of(state))


def test_read_extended_shards_bin(tier, state):
  save(tier, 1, state)
  with open(_shards_path(tier, 1), "ab") as f:
    f.write(b"\0")
  with pytest.raises(CorruptCheckpointError, match="wrong size"):
    restore(tier, 1, abstract_of(state))


@pytest.mark.parametrize("leaf", ["['params']['bf16']", "['step']", "['opt'][1]"])
def test_read_flipped_byte(tier, state, leaf):
  save(tier, 1, state)
  rec = {x["path"]: x for x in tier.manifest(1)["leaves"]}[leaf]
  shard = rec["shards"][-1]
  pos = shard["offset"] + shard["nbytes"] - 1
  with open(_shards_path(tier, 1), "r+b") as f:
    f.seek(pos)
    byte = f.read(1)[0]
    f.seek(pos)
    f.write(bytes([byte ^ 0x10]))
  with pytest.raises(CorruptCheckpointError, match="fails its checksum") as info:
    restore(tier, 1, abstract_of(state))
  assert leaf in str(info.value)


def test_read_missing_shards_bin(tier, state):
  save(tier, 1, state)
  os.remove(_shards_path(tier, 1))
  with pytest.raises(OSError):
    restore(tier, 1, abstract_of(state))


# ---- retention and directories ----------------------------------------------------


def test_apply_retention(tier, state):
  for step in (10, 20, 30, 40):
    save(tier, step, state)
  assert tier.apply_retention({20, 40, 99}) == [10, 30]
  assert tier.steps() == [20, 40]
  left = sorted(
    n for n in os.listdir(tier.directory) if not n.startswith(".tmp-spare-") and n != ".owner"
  )
  assert left == ["step_20", "step_40"]  # no .tmp-delete left (.tmp-spare-: a retired file)
  assert tier.apply_retention({20, 40}) == []
  assert tier.apply_retention(set()) == [20, 40]
  assert tier.steps() == []


def test_directories_created_0700(shm_dir, topo):
  base = os.path.join(shm_dir, "deep", "x")
  t = make_tier(base, topo)
  try:
    assert t.directory == os.path.join(base, RUN_ID, "process_0")
    for p in (base, os.path.join(base, RUN_ID), t.directory):
      st = os.lstat(p)
      assert stat.S_ISDIR(st.st_mode)
      assert stat.S_IMODE(st.st_mode) == 0o700, (p, oct(st.st_mode))
  finally:
    t.close()


def test_saved_files_are_private(tier, state):
  save(tier, 1, state)
  d = tier.step_dir(1)
  assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
  assert stat.S_IMODE(os.stat(os.path.join(d, "shards.bin")).st_mode) & 0o077 == 0


def test_secure_makedirs_refuses_symlink(shm_dir):
  target = os.path.join(shm_dir, "real")
  os.mkdir(target, 0o700)
  link = os.path.join(shm_dir, "link")
  os.symlink(target, link)
  with pytest.raises(UnsafeDirectoryError, match="symlink"):
    secure_makedirs(link)


def test_local_tier_refuses_symlinked_directory(shm_dir, topo):
  target = os.path.join(shm_dir, "real")
  os.mkdir(target, 0o700)
  os.symlink(target, os.path.join(shm_dir, "x"))
  with pytest.raises(UnsafeDirectoryError):
    make_tier(os.path.join(shm_dir, "x"), topo)


def test_secure_makedirs_refuses_open_mode(shm_dir):
  path = os.path.join(shm_dir, "open")
  os.mkdir(path)
  os.chmod(path, 0o755)
  with pytest.raises(UnsafeDirectoryError, match="chmod 700") as info:
    secure_makedirs(path)
  assert path in str(info.value)
  assert "0o755" in str(info.value)
  os.chmod(path, 0o700)
  secure_makedirs(path)  # fixed: accepted


def test_secure_makedirs_refuses_foreign_owner(shm_dir):
  if os.geteuid() != 0:
    # Without root we cannot chown; a dir we own must be accepted instead.
    path = os.path.join(shm_dir, "mine")
    secure_makedirs(path)
    assert os.stat(path).st_uid == os.geteuid()
    return
  path = os.path.join(shm_dir, "theirs")
  os.mkdir(path, 0o700)
  os.chown(path, 4242, 4242)
  with pytest.raises(UnsafeDirectoryError, match="uid 4242"):
    secure_makedirs(path)


def test_secure_makedirs_creates_parents_0700(shm_dir):
  path = os.path.join(shm_dir, "a", "b")
  secure_makedirs(path)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


# ---- random bit flips ---------------------------------------------------------------


def test_random_bit_flips_are_never_silent(tier, state, shm_dir):
  """Flip one random bit of a saved step; read() must detect it or be unaffected."""
  t0 = time.perf_counter()
  save(tier, 1, state)
  abstract = abstract_of(state)
  original = jax.tree_util.tree_map(np.asarray, state)
  pristine = os.path.join(shm_dir, "pristine")
  shutil.copytree(tier.step_dir(1), pristine)
  files = sorted(os.listdir(pristine))
  assert files == ["manifest.json", "shards.bin"]
  sizes = {name: os.path.getsize(os.path.join(pristine, name)) for name in files}
  data_bytes = set()  # offsets of shards.bin covered by a shard (the rest is padding)
  for leaf in tier.manifest(1)["leaves"]:
    for s in leaf["shards"]:
      data_bytes.update(range(s["offset"], s["offset"] + s["nbytes"]))
  assert 0 < len(data_bytes) < sizes["shards.bin"]

  rng = random.Random(20240917)
  trials = 1000
  counts = {"detected": 0, "harmless": 0, "silent": 0}
  per_file = {name: dict.fromkeys(counts, 0) for name in files}
  silent, other, undetected_data = [], [], []
  for trial in range(trials):
    target = tier.step_dir(1)
    shutil.rmtree(target)
    shutil.copytree(pristine, target)
    name = rng.choice(files)
    offset = rng.randrange(sizes[name])
    bit = rng.randrange(8)
    path = os.path.join(target, name)
    with open(path, "r+b") as f:
      f.seek(offset)
      byte = f.read(1)[0]
      f.seek(offset)
      f.write(bytes([byte ^ (1 << bit)]))
    try:
      got = restore(tier, 1, abstract)
    except (CorruptCheckpointError, StateMismatchError, TopologyMismatchError):
      outcome = "detected"
    except Exception as e:  # noqa: BLE001 - any other error is a bug worth seeing
      other.append((trial, name, offset, bit, repr(e)))
      continue
    else:
      outcome = "harmless" if same_bits(got, original) else "silent"
      if outcome == "silent":
        silent.append((trial, name, offset, bit))
      if name == "shards.bin" and offset in data_bytes:
        undetected_data.append((trial, offset, bit))  # CRC32 catches every 1-bit error
    counts[outcome] += 1
    per_file[name][outcome] += 1

  elapsed = time.perf_counter() - t0
  print(
    f"\nbit-flip trials={trials} {counts} per file={per_file} other={len(other)} ({elapsed:.2f}s)"
  )
  assert other == [], other[:5]
  assert silent == [], silent[:5]
  assert undetected_data == [], undetected_data[:5]
  assert counts["silent"] == 0
  assert sum(counts.values()) == trials
  assert per_file["shards.bin"]["detected"] > 0
  assert per_file["manifest.json"]["detected"] > 0
  # The pristine copy itself still reads back exactly.
  shutil.rmtree(tier.step_dir(1))
  shutil.copytree(pristine, tier.step_dir(1))
  assert same_bits(restore(tier, 1, abstract), original)


def test_manifest_json_is_self_describing(tier, state):
  save(tier, 7, state)
  with open(os.path.join(tier.step_dir(7), "manifest.json"), "rb") as f:
    doc = json.loads(f.read())
  body = doc["body"]
  assert body["step"] == 7 and body["process_index"] == 0 and body["slice_index"] == 0
  assert body["nbytes"] == os.path.getsize(_shards_path(tier, 7))
  dtypes = {leaf["path"]: leaf["dtype"] for leaf in body["leaves"]}
  assert dtypes["['params']['bf16']"] == "bfloat16"
  assert dtypes["['opt'][1]"] == "bool"
  for leaf in body["leaves"]:
    for s in leaf["shards"]:
      assert s["offset"] % shards_lib.ALIGN == 0


# ---- checksums, mapped reads, buffer lifetimes -------------------------------------


def test_manifest_of_an_older_version_with_crc32_still_verifies(tier, state):
  """Manifests written before CRC32C carry zlib CRC32s: still read, still checked."""
  save(tier, 1, state)
  with open(_shards_path(tier, 1), "rb") as f:
    data = f.read()

  def to_crc32(body):
    for leaf in body["leaves"]:
      for s in leaf["shards"]:
        del s["crc32c"]
        s["crc32"] = zlib.crc32(data[s["offset"] : s["offset"] + s["nbytes"]])

  edit_manifest(tier, 1, to_crc32)
  assert same_bits(restore(tier, 1, abstract_of(state)), state)
  edit_manifest(tier, 1, lambda body: body["leaves"][0]["shards"][0].update(crc32=1))
  with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
    restore(tier, 1, abstract_of(state))


def test_shard_without_any_checksum_is_corrupt(tier, state):
  save(tier, 1, state)
  edit_manifest(tier, 1, lambda body: body["leaves"][0]["shards"][0].pop("crc32c"))
  with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
    restore(tier, 1, abstract_of(state))


def test_restored_arrays_do_not_write_through_to_the_file(tier, state):
  """read() maps shards.bin privately: writes to the returned host arrays
  (what the restored CPU arrays alias) never reach the saved file."""
  save(tier, 1, state)
  with open(_shards_path(tier, 1), "rb") as f:
    before = f.read()
  paths, abstract, _ = shards_lib.leaf_paths(abstract_of(state))
  local = tier.read(1, paths, abstract)
  for by_index in local.arrays:
    for arr in by_index.values():
      arr.reshape(-1).view(np.uint8)[...] = 0xAB
  with open(_shards_path(tier, 1), "rb") as f:
    assert f.read() == before
  assert same_bits(restore(tier, 1, abstract_of(state)), state)


def test_restore_survives_deletion_of_the_step(tier, state):
  """Restored arrays may alias the mapped file; deleting the step (retention)
  must not change or invalidate them."""
  save(tier, 1, state)
  got = restore(tier, 1, abstract_of(state))
  tier.delete(1)
  assert tier.steps() == []
  assert same_bits(got, state)


def test_map_file_size_mismatch_is_corrupt(tmp_path):
  path = tmp_path / "shards.bin"
  path.write_bytes(b"x" * 10)
  with pytest.raises(CorruptCheckpointError, match="wrong size"):
    map_file(str(path), 11, str(tmp_path))
  assert map_file(str(path), 10, str(tmp_path)).tobytes() == b"x" * 10


def test_staging_buffers_are_page_aligned():
  for n in (1, 4097, 1 << 20):
    buf = aligned_empty(n)
    assert buf.nbytes == n and buf.ctypes.data % mmap.PAGESIZE == 0


def test_held_buffer_is_not_reused_until_released():
  """A buffer a background reader holds (the persistent upload) never goes
  to the next save while held, but comes back once released."""
  pool = BufferPool(1)
  a = pool.acquire(64)
  pool.hold(a)
  pool.release(a)  # the local write finished; the reader still holds `a`
  b = pool.acquire(64)
  assert b is not a
  pool.release(b)
  pool.unhold(a)
  got = {id(pool.acquire(64))}
  assert got <= {id(a), id(b)}


def test_acquire_blocks_only_on_writes_not_on_readers():
  pool = BufferPool(1)
  a = pool.acquire(8)
  pool.hold(a)
  pool.release(a)
  done = threading.Event()
  threading.Thread(target=lambda: (pool.acquire(8), done.set()), daemon=True).start()
  assert done.wait(5), "acquire blocked on a buffer only a reader holds"


def _vma_rss_kib(addr: int) -> int:
  """Rss (KiB) of this process's mapping that contains address `addr`."""
  inside = False
  with open("/proc/self/smaps") as f:
    for line in f:
      head = line.split()
      if len(head) >= 5 and "-" in head[0] and not line.startswith(("Rss", "Size")):
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        inside = lo <= addr < hi
      elif inside and line.startswith("Rss:"):
        return int(head[1])
  raise AssertionError(f"no mapping contains {addr:#x}")


def _inode(path: str) -> int:
  return os.stat(path).st_ino


def _spares(tier) -> list[str]:
  return sorted(n for n in os.listdir(tier.directory) if n.startswith(".tmp-spare-"))


def _scaled(tree, k: int):
  """`tree` with every leaf's bits changed (so an overwrite is visible)."""

  def change(x):
    raw = np.asarray(x).copy()
    raw.reshape(-1).view(np.uint8)[...] ^= np.uint8(k)
    return jax.device_put(raw, x.sharding)

  return jax.tree_util.tree_map(change, tree)


def test_retention_recycles_a_retired_file_for_the_next_save(tier, state):
  """A step that retention drops keeps its shards.bin as a spare, and the
  next save writes into that very file (no fresh tmpfs pages): the new
  step reads back bit-exactly, its checksums over the overwritten bytes."""
  save(tier, 1, state)
  save(tier, 2, state)
  old = _inode(_shards_path(tier, 1))
  assert tier.apply_retention({2}) == [1]
  (spare,) = _spares(tier)
  assert _inode(os.path.join(tier.directory, spare, "shards.bin")) == old
  assert os.listdir(os.path.join(tier.directory, spare)) == ["shards.bin"]
  other = _scaled(state, 0x5A)
  save(tier, 3, other)
  assert _inode(_shards_path(tier, 3)) == old
  assert _spares(tier) == []
  assert same_bits(restore(tier, 3, abstract_of(state)), other)
  assert same_bits(restore(tier, 2, abstract_of(state)), state)


def test_a_file_this_process_restored_from_is_never_recycled(tier, state):
  """Restored arrays alias the step's file through a private mapping, which
  would see an overwrite: once read() mapped a file, retiring its step
  unlinks it, and later saves never change the restored values."""
  save(tier, 1, state)
  got = restore(tier, 1, abstract_of(state))
  save(tier, 2, state)
  assert tier.apply_retention({2}) == [1]
  assert _spares(tier) == []
  save(tier, 3, _scaled(state, 0x33))
  assert same_bits(got, state)


def test_spares_are_bounded_and_removed_on_close(shm_dir, topo, state):
  """At most `staging_buffers` spares are kept; the rest are unlinked, and
  close() removes what is left."""
  t = make_tier(shm_dir + "/x", topo)
  for step in (1, 2, 3):
    save(t, step, state)
  assert t.apply_retention({3}) == [1, 2]
  assert len(_spares(t)) == 1
  assert not [n for n in os.listdir(t.directory) if n.startswith(".tmp-delete-")]
  t.close()
  assert not [n for n in os.listdir(t.directory) if n.startswith(".tmp-")]


def test_a_spare_of_another_size_is_dropped(tier, state, mesh):
  """A layout change makes the spare useless: the save writes a new file and
  the old spare is gone."""
  save(tier, 1, state)
  save(tier, 2, state)
  tier.apply_retention({2})
  (spare,) = _spares(tier)
  small = {"x": jax.device_put(np.arange(6, dtype=np.int32), NamedSharding(mesh, P("data")))}
  save(tier, 3, small)
  assert not os.path.exists(os.path.join(tier.directory, spare))
  assert same_bits(restore(tier, 3, abstract_of(small)), small)


def test_an_explicit_delete_frees_the_file(tier, state):
  """delete() (the user's, not retention's) gives the ramdisk space back."""
  save(tier, 1, state)
  tier.delete(1)
  assert os.listdir(tier.directory) == [".owner"]


def test_prepare_preallocates_the_staging_buffer_faulted_in(tier, mesh):
  """prepare() allocates the staging buffer of the layout in the background
  with every page resident, and the next save copies into that buffer (no
  page fault inside the stall)."""
  value = np.arange(4 << 20, dtype=np.uint32)  # 16 MiB
  big = {"x": jax.device_put(value, NamedSharding(mesh, P("data")))}
  paths, leaves, _ = shards_lib.leaf_paths(big)
  staging_of(tier).prepare(paths, leaves)
  staging_of(tier).wait_prepared()
  (prepared,) = staging_of(tier)._pool._free
  assert prepared.nbytes == value.nbytes
  assert _vma_rss_kib(prepared.ctypes.data) >= value.nbytes // 1024
  staged = staging_of(tier).stage(1, paths, leaves)
  assert staged.buffer is prepared
  tier.write_async(staged).result()
  assert same_bits(restore(tier, 1, abstract_of(big)), big)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_staging_buffer_is_prepared_at_the_lowest_cpu_priority(tier, state, monkeypatch):
  """Preparing only serves a later save: it runs niced, so it does not
  compete with the trainer (or the tail of a restore) for CPU. The trainer's
  own thread keeps its priority."""
  before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
  nice = {}
  real = buffers_lib._fault_in

  def fault_in(buf):  # runs on the preparing thread
    nice[threading.current_thread().name] = os.getpriority(
      os.PRIO_PROCESS, threading.get_native_id()
    )
    real(buf)

  monkeypatch.setattr(buffers_lib, "_fault_in", fault_in)
  paths, leaves, _ = shards_lib.leaf_paths(state)
  staging_of(tier).prepare(paths, leaves)
  staging_of(tier).wait_prepared()
  ((name, value),) = nice.items()
  assert name.startswith("ec-prepare"), name
  assert value == background_lib.BACKGROUND_NICE
  assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_failed_write_lists_nothing_and_frees_its_buffer(tier, state, monkeypatch):
  """An OS error while writing (ENOSPC here) fails that save only: no step
  is listed, no .tmp folder stays, and the staging buffer serves the next
  save, which succeeds."""
  real = os.pwrite
  calls = []

  def full(fd, data, offset):
    calls.append(offset)
    if len(calls) == 2:
      raise OSError(28, "No space left on device")
    return real(fd, data, offset)

  monkeypatch.setattr(os, "pwrite", full)
  paths, leaves, _ = shards_lib.leaf_paths(state)
  staged = staging_of(tier).stage(1, paths, leaves)
  result = tier.write_async(staged).result()
  assert not result.ok and "No space left" in result.error
  assert os.listdir(tier.directory) == [".owner"]
  staged2 = staging_of(tier).stage(2, paths, leaves)
  assert staged2.buffer is staged.buffer
  assert tier.write_async(staged2).result().ok
  assert same_bits(restore(tier, 2, abstract_of(state)), state)


def test_retention_never_deletes_a_step_written_after_its_listing(tier, state):
  """Local retention runs beside the next write: a step renamed into place
  after the listing that `keep` came from is not in `keep`, yet must stay."""
  save(tier, 1, state)
  listing = tier.steps()
  save(tier, 2, state)  # lands between the listing and the deletion
  assert tier.apply_retention({1}, among=listing) == []
  assert tier.steps() == [1, 2]
  assert tier.apply_retention(set(), among=listing) == [1]
  assert tier.steps() == [2]


def test_an_upload_holding_the_buffer_keeps_it_from_the_next_save(tier, state):
  """A background reader (the persistent upload) of a staged buffer keeps it
  unchanged until it lets go, even when the next save comes first; then the
  buffer serves saves again."""
  paths, leaves, _ = shards_lib.leaf_paths(state)
  staged = staging_of(tier).stage(1, paths, leaves)
  snapshot = bytes(staged.buffer)
  release = staged.hold()
  tier.write_async(staged).result()
  _, other, _ = shards_lib.leaf_paths(_scaled(state, 0x77))
  staged2 = staging_of(tier).stage(2, paths, other)
  assert staged2.buffer is not staged.buffer
  assert bytes(staged.buffer) == snapshot
  tier.write_async(staged2).result()
  release()
  staged3 = staging_of(tier).stage(3, paths, leaves)
  assert staged3.buffer is staged.buffer or staged3.buffer is staged2.buffer
  tier.write_async(staged3).result()


def test_a_save_during_prepare_takes_the_prepared_buffer(tier, mesh, monkeypatch):
  """save() arriving while prepare() still faults the staging buffer in
  waits for that buffer rather than allocating a second one."""
  value = np.arange(1 << 20, dtype=np.uint32)
  big = {"x": jax.device_put(value, NamedSharding(mesh, P("data")))}
  paths, leaves, _ = shards_lib.leaf_paths(big)
  started, release, prepared = threading.Event(), threading.Event(), threading.Event()
  real = buffers_lib._fault_in

  def slow_fault_in(buf):
    started.set()
    release.wait(10)
    real(buf)
    prepared.set()

  monkeypatch.setattr(buffers_lib, "_fault_in", slow_fault_in)
  reached = threading.Event()  # the save waits for a prepared buffer, or returned
  pool = staging_of(tier)._pool

  class Ready(threading.Condition):  # the pool's "a prepared buffer landed"
    def wait(self, timeout=None):
      reached.set()
      return super().wait(timeout)

  pool._ready = Ready(pool._lock)
  staging_of(tier).prepare(paths, leaves)
  assert started.wait(10)
  got = {}

  def save():
    staged = staging_of(tier).stage(1, paths, leaves)
    got.update(staged=staged, after_prepare=prepared.is_set())
    reached.set()

  t = threading.Thread(target=save)
  t.start()
  assert reached.wait(10)
  release.set()  # only now may the preparation end
  t.join(10)
  assert got["after_prepare"]  # the save waited for the buffer being prepared
  tier.write_async(got["staged"]).result()
  staging_of(tier).wait_prepared()
  assert (
    len(staging_of(tier)._pool._free) == 1
    and staging_of(tier)._pool._free[0] is got["staged"].buffer
  )


def test_a_copy_left_by_another_process_is_taken_unless_that_process_is_live(tier, state):
  """A host that ran process 1 of a 2-slice job (slice 1, position 0) now
  runs process 0 of a 1-slice job: process 1's folder holds what it needs.
  Not taken while process 1 is a live process of this machine: named by the
  placement check (set_colocated) or holding the folder's .owner lock."""
  save(tier, 3, state)
  edit_manifest(
    tier, 3, lambda b: b.update(process_index=1, slice_index=1) or _set_process_count(b)
  )
  foreign = os.path.join(os.path.dirname(tier.directory), "process_1")
  os.makedirs(foreign)
  os.rename(tier.step_dir(3), os.path.join(foreign, "step_3"))
  assert tier.steps() == []
  tier.set_colocated({0, 1})
  assert tier.usable_steps() == ([], {})  # process 1 runs here: its folder is live
  tier.set_colocated({0})
  assert tier.usable_steps() == ([3], {})
  assert same_bits(restore(tier, 3, abstract_of(state)), state)
  assert tier.held_steps() == [3] and tier.steps() == []
  fd = os.open(os.path.join(foreign, ".owner"), os.O_RDWR | os.O_CREAT, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live manager holds it
    assert tier.usable_steps() == ([], {})
  finally:
    os.close(fd)
  assert tier.usable_steps() == ([3], {})
  assert tier.apply_retention(set()) == [3]  # retention treats it as this process's own
  assert not os.path.exists(foreign) and tier.held_steps() == []  # emptied: it goes
