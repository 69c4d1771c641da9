"""The persistent tier's reader (persistent_read): Orbax's format, read into
one aligned host buffer. Single process, 2 CPU devices; steps written by
Orbax itself with each of its storage layouts."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=2"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import shutil  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from etils import epath  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from emergency_ckpt.core import placement, shards  # noqa: E402
from emergency_ckpt.errors import CorruptCheckpointError, StateMismatchError  # noqa: E402
from emergency_ckpt.persistent import checksums  # noqa: E402
from emergency_ckpt.persistent import read as persistent_read  # noqa: E402
from emergency_ckpt.persistent.orbax_loader import orbax as _ocp  # noqa: E402
from emergency_ckpt.state import shard_records  # noqa: E402
from tests.helpers import abstract_of as _abstract  # noqa: E402


def _mesh() -> Mesh:
  devices = jax.devices()
  assert len(devices) >= 2, f"need 2 CPU devices, got {devices} (XLA_FLAGS set too late?)"
  return Mesh(np.array(devices[:2]).reshape(1, 2), ("replica", "data"))


def _host_tree() -> dict:
  f32 = np.array(
    [0x80000000, 0x00000001, 0x7FC12345, 0xFFC00001, 0x7F800000, 0x3F800000, 7, 8],
    np.uint32,
  ).view(np.float32)
  bf16 = np.array([0x8000, 0x0001, 0x7FC1, 0xFF81, 0x0080, 0x3F80], np.uint16).view(
    ml_dtypes.bfloat16
  )
  return {
    "params": {
      "f32": (f32.reshape(4, 2), P("data")),
      "bf16": (bf16.reshape(2, 3), P(None)),  # replicated: both devices need it
    },
    "step": (np.array(41, np.int32), P()),  # a scalar
    "i8": (np.arange(-6, 6, dtype=np.int8).reshape(2, 6), P(None, "data")),
  }


def _state(mesh: Mesh):
  def place(leaf):
    value, spec = leaf
    return jax.device_put(value, NamedSharding(mesh, spec))

  return jax.tree_util.tree_map(place, _host_tree(), is_leaf=lambda x: isinstance(x, tuple))


def _save(path: str, state, **handler_options) -> epath.Path:
  ocp = _ocp()
  handler = ocp.PyTreeCheckpointHandler(**handler_options)
  with ocp.Checkpointer(handler) as ckptr:
    ckptr.save(path, args=ocp.args.PyTreeSave(state))
  return epath.Path(path)


def _saved(tmp_path, layout: str):
  """(the state on a fresh 1x2 mesh, the Orbax item Orbax saved it to)."""
  state = _state(_mesh())
  return state, _save(str(tmp_path / "item"), state, **LAYOUTS[layout])


def _expected(state, step: int = 0) -> shard_records.Expected:
  """The shard checksums a primary-slice process (process 0: it holds every
  shard) records for `state` at a persistent step (checksums.py)."""
  paths, leaves, _ = shards.leaf_paths(state)
  abstract = jax.tree_util.tree_leaves(_abstract(state))
  doc = checksums.shard_table(step, paths, abstract, [0])
  table = shard_records.parse_table(doc, step, "test")
  crcs = {}
  for path, leaf in zip(paths, leaves):
    host = np.asarray(leaf)
    crcs[path] = [
      [
        [list(b) for b in s.index],
        checksums.crc32c.crc32c(np.ascontiguousarray(host[_sl(s.index)])),
      ]
      for s in table.shards[path]
    ]
  parsed = shard_records.parse_crcs(crcs, "test")
  return shard_records.Expected(step, table, lambda procs: {p: parsed for p in procs}, "test")


def _sl(index) -> tuple:
  return tuple(slice(a, b) for a, b in index)


def _read(item, abstract, state):
  return persistent_read.read(item, abstract, _ocp(), _expected(state))


def _bits(a) -> np.ndarray:
  host = np.asarray(a)
  return host.view(np.dtype(f"u{host.dtype.itemsize}")) if host.dtype.itemsize <= 8 else host


LAYOUTS = {
  "ocdbt-zarr2": {"use_ocdbt": True, "use_zarr3": False, "use_compression": False},
  "ocdbt-zarr2-zstd": {"use_ocdbt": True, "use_zarr3": False, "use_compression": True},
  "ocdbt-zarr3": {"use_ocdbt": True, "use_zarr3": True, "use_compression": True},
  "plain-zarr2": {"use_ocdbt": False, "use_zarr3": False, "use_compression": False},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reads_every_orbax_layout_bit_exactly_onto_the_requested_shardings(tmp_path, layout):
  state, item = _saved(tmp_path, layout)
  got = _read(item, _abstract(state), state)
  for (path, want), got_leaf in zip(
    jax.tree_util.tree_flatten_with_path(state)[0], jax.tree_util.tree_leaves(got)
  ):
    assert got_leaf.sharding == want.sharding, path
    assert got_leaf.dtype == want.dtype and got_leaf.shape == want.shape, path
    np.testing.assert_array_equal(_bits(got_leaf), _bits(want), err_msg=str(path))
    for shard in got_leaf.addressable_shards:  # each device holds its own index
      np.testing.assert_array_equal(_bits(shard.data), _bits(want)[shard.index])


def test_arrays_alias_one_aligned_host_buffer_on_cpu(tmp_path):
  """One copy from storage: the restored shards are 64-byte aligned views
  of one buffer laid out like the local tier's file, not fresh copies;
  small replicated leaves excepted (copied by design: placement.SMALL_LEAF)."""
  state, item = _saved(tmp_path, "ocdbt-zarr2")
  abstract = _abstract(state)
  got = _read(item, abstract, state)
  paths, leaves, _ = shards.leaf_paths(abstract)
  layout = shards.layout_for(paths, leaves)
  base, checked = None, 0
  for leaf_layout, arr in zip(layout.leaves, jax.tree_util.tree_leaves(got)):
    by_device = {s.device: s for s in arr.addressable_shards}
    replicated = len(leaf_layout.slots) == 1
    if replicated and leaf_layout.slots[0].nbytes <= placement.SMALL_LEAF:
      continue
    checked += 1
    for slot in leaf_layout.slots:
      for device in slot.devices:
        ptr = by_device[device].data.unsafe_buffer_pointer()
        assert ptr % shards.ALIGN == 0
        if base is None:
          base = ptr - slot.offset
        assert ptr - slot.offset == base, (leaf_layout.path, slot.index)
  assert checked >= 2, checked  # the sharded leaves


def test_missing_data_is_a_corrupt_checkpoint_error_naming_the_leaf(tmp_path):
  state, item = _saved(tmp_path, "plain-zarr2")
  shutil.rmtree(item / "i8")  # the array's zarr metadata and chunks
  with pytest.raises(CorruptCheckpointError, match="i8"):
    _read(item, _abstract(state), state)


def test_lost_ocdbt_data_files_raise_instead_of_reading_zeros(tmp_path):
  state, item = _saved(tmp_path, "ocdbt-zarr2")
  removed = 0
  for dirpath, _, files in os.walk(item):
    if os.path.basename(dirpath) == "d":  # OCDBT's data files (root and per process)
      for name in files:
        os.remove(os.path.join(dirpath, name))
        removed += 1
  assert removed
  with pytest.raises(CorruptCheckpointError, match="damaged"):
    _read(item, _abstract(state), state)


def test_unreadable_metadata_and_mismatched_dtype_are_typed_errors(tmp_path):
  state, item = _saved(tmp_path, "ocdbt-zarr2")
  abstract = _abstract(state)
  wrong = dict(abstract, i8=jax.ShapeDtypeStruct((2, 6), np.int16, sharding=state["i8"].sharding))
  with pytest.raises(StateMismatchError, match="i8"):
    _read(item, wrong, state)
  (item / "_METADATA").write_text("{not json")
  with pytest.raises(CorruptCheckpointError, match="_METADATA"):
    _read(item, abstract, state)


def test_filesystem_listing_follows_orbaxs_finalization_rule(tmp_path):
  """persistent_tier.list_steps lists a filesystem tier itself (no thread
  pool per call) and agrees with Orbax's checkpoint_steps on what this
  tier's Orbax manager writes: a step is final once renamed to its number."""
  from emergency_ckpt.persistent.tier import list_steps  # noqa: PLC0415

  tensors = tmp_path / "tensors"
  for name in ("7", "12", "30.orbax-checkpoint-tmp-1700000000", ".deleting-5", "notes"):
    (tensors / name).mkdir(parents=True)
  (tensors / "40").write_text("a file, not a step")
  assert list_steps(str(tensors)) == [7, 12]
  assert sorted(_ocp().path.step.checkpoint_steps(str(tensors))) == [7, 12]
  assert list_steps(str(tmp_path / "absent")) == []


def _flip_chunk_byte(item: epath.Path, array: str) -> str:
  """Flips one byte of the first data chunk of `array` in a plain zarr2 item
  (uncompressed: tensorstore reads the flipped value without complaint)."""
  folder = item / array
  chunks = sorted(n for n in os.listdir(folder) if not n.startswith("."))
  assert chunks, os.listdir(folder)
  path = folder / chunks[0]
  raw = bytearray(path.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  path.write_bytes(bytes(raw))
  return chunks[0]


def test_a_flipped_data_byte_fails_its_crc32c_naming_the_leaf(tmp_path):
  """Orbax's own read returns the flipped value silently; ours refuses it."""
  state, item = _saved(tmp_path, "plain-zarr2")
  _flip_chunk_byte(item, "params.f32")
  ocp = _ocp()
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:  # the silent baseline
    plain = ckptr.restore(str(item), args=ocp.args.PyTreeRestore(_abstract(state)))
  assert not np.array_equal(_bits(plain["params"]["f32"]), _bits(state["params"]["f32"]))
  with pytest.raises(CorruptCheckpointError, match=r"\['params'\]\['f32'\].*CRC32C"):
    _read(item, _abstract(state), state)


def _other_sharding(state, mesh: Mesh):
  """abstract_state on `mesh` with every leaf sharded differently from the save."""
  specs = {"params": {"f32": P(None, "data"), "bf16": P("data")}, "step": P(), "i8": P("data")}
  return jax.tree_util.tree_map(
    lambda leaf, spec: jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec)
    ),
    state,
    specs,
  )


def test_another_sharding_reads_whole_saved_shards_checked_then_cut(tmp_path):
  """Restoring onto another sharding reads the saved shards that cover each
  region, checks each, and cuts: bit-exact, and a flipped byte is caught
  there too."""
  state, item = _saved(tmp_path, "plain-zarr2")
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2)[:, ::-1], ("replica", "data"))
  abstract = _other_sharding(state, mesh)
  got = _read(item, abstract, state)
  for want, got_leaf, a in zip(
    jax.tree_util.tree_leaves(state),
    jax.tree_util.tree_leaves(got),
    jax.tree_util.tree_leaves(abstract),
  ):
    assert got_leaf.sharding == a.sharding
    np.testing.assert_array_equal(_bits(got_leaf), _bits(want))
  _flip_chunk_byte(item, "params.f32")
  with pytest.raises(CorruptCheckpointError, match=r"\['params'\]\['f32'\].*CRC32C"):
    _read(item, abstract, state)


def test_a_leaf_without_recorded_checksums_is_not_read(tmp_path):
  state, item = _saved(tmp_path, "ocdbt-zarr2")
  expected = _expected(state)
  expected._table = dataclasses.replace(
    expected._table, shards={k: v for k, v in expected._table.shards.items() if "i8" not in k}
  )
  with pytest.raises(CorruptCheckpointError, match="i8.*cannot be verified"):
    persistent_read.read(item, _abstract(state), _ocp(), expected)
  crcs_less = shard_records.Expected(
    0, _expected(state)._table, lambda procs: {p: {} for p in procs}, "t"
  )
  with pytest.raises(CorruptCheckpointError, match="no CRC32C recorded"):
    persistent_read.read(item, _abstract(state), _ocp(), crcs_less)


def test_the_shard_table_is_checked_and_deduplicated():
  state = _state(_mesh())
  paths, _, _ = shards.leaf_paths(state)
  abstract = jax.tree_util.tree_leaves(_abstract(state))
  doc = checksums.shard_table(5, paths, abstract, [0])
  twice = checksums.shard_table(5, ["a", "b"], [abstract[2], abstract[2]], [0])
  assert len(twice["layouts"]) == 1 and twice["leaves"] == {"a": 0, "b": 0}  # shared
  table = shard_records.parse_table(doc, 5, "SHARDS")
  assert [s.index for s in table.shards["['params']['f32']"]] == [
    ((0, 2), (0, 2)),
    ((2, 4), (0, 2)),
  ]
  with pytest.raises(CorruptCheckpointError, match="not this|checksum"):
    shard_records.parse_table(doc, 6, "SHARDS")
  edited = dict(doc, leaves={**doc["leaves"], "['i8']": 3})
  with pytest.raises(CorruptCheckpointError, match="checksum"):
    shard_records.parse_table(edited, 5, "SHARDS")
