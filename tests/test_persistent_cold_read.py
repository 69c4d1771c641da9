"""The persistent reader's cold path: tensorstore reads through a memory map
(checked_reads.read_context), each shard checked against its CRC32C as it
lands (checked_reads.CheckedReads), on Orbax's default layout (OCDBT).
Single process, 2 CPU devices."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=2"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from emergency_ckpt.core import placement, shards  # noqa: E402
from emergency_ckpt.errors import CorruptCheckpointError  # noqa: E402
from emergency_ckpt.persistent import checked_reads  # noqa: E402
from emergency_ckpt.persistent import read as persistent_read  # noqa: E402
from emergency_ckpt.persistent.orbax_loader import orbax as _ocp  # noqa: E402
from tests.helpers import abstract_of as _abstract  # noqa: E402
from tests.test_persistent_read import (  # noqa: E402
  LAYOUTS,
  _bits,
  _expected,
  _mesh,
  _save,
)


def _saved(tmp_path, layout: str = "ocdbt-zarr2"):
  """(a state of two leaves large enough for OCDBT data files (not inlined
  in its b-tree), the Orbax item Orbax saved it to)."""
  mesh = _mesh()
  rng = np.random.default_rng(7)
  state = {
    "params": {
      "f32": jax.device_put(
        rng.standard_normal((1024, 64), np.float32), NamedSharding(mesh, P("data"))
      ),
      "i32": jax.device_put(
        rng.integers(-9, 9, (64, 512), np.int32), NamedSharding(mesh, P(None, "data"))
      ),
    },
  }
  return state, _save(str(tmp_path / "item"), state, **LAYOUTS[layout])


def _data_files(item) -> list[str]:
  """The OCDBT data files of an item (those under a folder named d)."""
  return [
    os.path.join(d, n) for d, _, files in os.walk(item) if os.path.basename(d) == "d" for n in files
  ]


def _flip_where(item, pattern: bytes) -> str:
  """Flips one byte inside the first occurrence of `pattern` among the item's
  OCDBT data files (uncompressed: the chunk's bytes are stored as they are)."""
  for path in _data_files(item):
    raw = bytearray(open(path, "rb").read())
    at = raw.find(pattern)
    if at >= 0:
      raw[at + len(pattern) // 2] ^= 0x10
      with open(path, "wb") as f:
        f.write(raw)
      return path
  raise AssertionError("pattern not found in any data file")


def test_reads_memory_map_local_files_on_top_of_orbaxs_context():
  ocp = _ocp()
  context = checked_reads.read_context(ocp, use_ocdbt=True)
  assert context["file_io_mode"].to_json() == {"mode": "memmap"}
  want = ocp.type_handlers.get_ts_context(use_ocdbt=True)
  assert context.parent.spec.to_json() == want.spec.to_json()  # Orbax's limits and cache


def test_a_flipped_byte_in_an_ocdbt_data_file_is_caught_and_never_reported_ready(tmp_path):
  state, item = _saved(tmp_path)
  abstract = _abstract(state)
  paths, _, _ = shards.leaf_paths(abstract)
  f32 = paths.index("['params']['f32']")
  first = np.asarray(state["params"]["f32"])[:512]  # its first saved shard
  _flip_where(item, first.tobytes())
  ready = []
  with pytest.raises(CorruptCheckpointError, match=r"\['params'\]\['f32'\].*CRC32C"):
    persistent_read.read_into(
      item, abstract, _ocp(), _expected(state), on_ready=lambda n, i: ready.append((n, i))
    )
  assert (f32, ((0, 512), (0, 64))) not in ready


def test_every_shard_is_reported_ready_once_checked_and_the_values_are_exact(tmp_path):
  state, item = _saved(tmp_path)
  abstract = _abstract(state)
  ready = []
  layout, buffer = persistent_read.read_into(
    item, abstract, _ocp(), _expected(state), on_ready=lambda n, i: ready.append((n, i))
  )
  want = {(n, s.index) for n, leaf in enumerate(layout.leaves) for s in leaf.slots if s.nbytes}
  assert sorted(ready) == sorted(want) and len(ready) == len(want)
  paths, leaves, _ = shards.leaf_paths(abstract)
  got = placement.assemble_buffer(list(leaves), layout, buffer)
  for want_leaf, got_leaf in zip(shards.leaf_paths(state)[1], got):
    np.testing.assert_array_equal(_bits(got_leaf), _bits(want_leaf))


def test_a_truncated_data_file_is_a_corrupt_checkpoint_error_not_a_crash(tmp_path):
  """The memory map covers only what the file holds: a short file is
  tensorstore's OUT_OF_RANGE, never a SIGBUS."""
  state, item = _saved(tmp_path)
  for path in _data_files(item):
    os.truncate(path, os.path.getsize(path) // 2)
  with pytest.raises(CorruptCheckpointError, match="damaged"):
    persistent_read.read(item, _abstract(state), _ocp(), _expected(state))


class _Counting:
  """An Expected stand-in that counts the CRC32C look-ups."""

  step = 0

  def __init__(self):
    self.asked = 0

  def recorded(self, path, shard):
    self.asked += 1
    return 0


def test_checks_wait_for_the_recorded_crcs_and_an_early_error_leaves_nothing_running(tmp_path):
  """No check runs before wait() (the CRC32Cs may not be fetched yet); an
  error before wait() waits for the reads, runs no check and does not hang."""
  import tensorstore as ts  # noqa: PLC0415

  store = ts.array(np.arange(1 << 16, dtype=np.int32))
  target = np.zeros(1 << 16, np.int32)
  expected = _Counting()
  reads = checked_reads.CheckedReads(expected, lambda name, e: CorruptCheckpointError(name))
  with pytest.raises(RuntimeError, match="before wait"), reads:
    read = ts.array(target, copy=False).write(store)
    reads.add("x", "['x']", None, target, read, ("x", 0))
    read.result()
    raise RuntimeError("before wait")
  assert expected.asked == 0
  np.testing.assert_array_equal(target, np.arange(1 << 16, dtype=np.int32))
