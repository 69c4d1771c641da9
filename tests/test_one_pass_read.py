"""The local read checks a step's manifest in the same pass that reads it
(read._read_common, issue 35 item 4): for any manifest, forged field by field
with its checksums recomputed, that pass must end where the long way
(schema.check_manifest, then the tree, the layout and each shard's CRC32C)
ends: the same arrays, or the same error. It may hand a record it does not
vouch for to the long way, never accept one the long way refuses.

Single process, 2 CPU devices: a leaf split over both has two slots.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=2"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import copy  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import emergency_ckpt as ec  # noqa: E402
from emergency_ckpt.core import shards as shards_lib  # noqa: E402
from emergency_ckpt.errors import EmergencyCheckpointError  # noqa: E402
from emergency_ckpt.local import format as local_format  # noqa: E402
from emergency_ckpt.local import read as local_read  # noqa: E402
from tests.test_decoders_fuzz import _mutate  # noqa: E402


def _tree(mesh) -> dict:
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  return {
    "a": jax.device_put(np.arange(6, dtype=np.float32), rep),
    "b": jax.device_put(np.arange(8, dtype=np.int32).reshape(4, 2), rep),
    "split": jax.device_put(np.arange(16, dtype=np.float32), split),
    "c": jax.device_put(jnp.asarray(1.5, jnp.bfloat16), rep),
    "d": jax.device_put(np.arange(3, dtype=np.float32) + 7, rep),
    "e": jax.device_put(np.ones((1,), np.float32), rep),
  }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(the step folder, its manifest body, the saved tree's paths and
  abstract leaves, the saved tree)."""
  base = "/dev/shm" if os.path.isdir("/dev/shm") else None
  root = str(tmp_path_factory.mktemp("one-pass")) if base is None else None
  if root is None:
    import tempfile  # noqa: PLC0415

    root = tempfile.mkdtemp(prefix="ec-one-pass-", dir=base)
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("replica", "data"))
  opts = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=os.path.join(root, "local"), save_interval_steps=1),
    persistent=ec.PersistentTierOptions(
      directory=os.path.join(root, "persistent"), save_interval_steps=10**6
    ),
    run_id="one-pass",
  )
  tree = _tree(mesh)
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    mngr.save(1, tree)
    mngr.wait_until_finished()
  where = next(
    d for d, _, files in os.walk(root) if local_format.MANIFEST in files and "step_1" in d
  )
  abstract_tree = jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )
  paths, abstract, _ = shards_lib.leaf_paths(abstract_tree)
  with open(os.path.join(where, local_format.MANIFEST), "rb") as f:
    original = f.read()
  yield where, local_format.decode_manifest(original, "saved"), paths, abstract, tree
  import shutil  # noqa: PLC0415

  shutil.rmtree(root, ignore_errors=True)


def _write(where: str, body) -> None:
  with open(os.path.join(where, local_format.MANIFEST), "wb") as f:
    f.write(local_format.encode_manifest(body))


def _outcome(where, paths, abstract, one_pass: bool, monkeypatch):
  """("ok", the arrays' bytes) or ("error", its type) of read_step, by the
  one pass (where it vouches) or by the long way alone."""
  with monkeypatch.context() as m:
    if not one_pass:
      m.setattr(local_read, "_read_common", lambda *a: None)
    try:
      step = local_read.read_step(where, abstract=abstract, paths=paths)
    except (EmergencyCheckpointError, OSError) as e:
      return ("error", type(e))
  return ("ok", [{k: np.asarray(v).tobytes() for k, v in leaf.items()} for leaf in step.arrays])


def test_the_common_case_takes_the_one_pass_and_reads_every_slot(saved, monkeypatch):
  where, body, paths, abstract, tree = saved
  _write(where, body)
  calls = []
  real = local_read._read_common  # noqa: SLF001

  def spy(*a):
    calls.append(real(*a))
    return calls[-1]

  monkeypatch.setattr(local_read, "_read_common", spy)
  step = local_read.read_step(where, abstract=abstract, paths=paths)
  assert calls and calls[0] is not None  # vouched for every record
  split = step.arrays[paths.index("['split']")]
  assert sorted(split) == [((0, 8),), ((8, 16),)]  # two slots, one per device
  for path, leaf in zip(paths, step.arrays):
    value = np.asarray(tree[path[2:-2]])
    for index, got in leaf.items():
      np.testing.assert_array_equal(got, value[tuple(slice(a, b) for a, b in index)])
  assert _outcome(where, paths, abstract, True, monkeypatch) == _outcome(
    where, paths, abstract, False, monkeypatch
  )


def _leaf(body: dict, name: str) -> dict:
  return next(leaf for leaf in body["leaves"] if leaf["path"] == f"['{name}']")


def _shard(body: dict, name: str) -> dict:
  return _leaf(body, name)["shards"][0]


EDITS = {
  # JSON's true equals 1: a shape or index of ones must still be ints
  "bool-shape": lambda b: _leaf(b, "e").update(shape=[True]),
  "bool-index": lambda b: _shard(b, "e").update(index=[[False, 1]]),
  "float-offset": lambda b: _shard(b, "b").update(offset=float(_shard(b, "b")["offset"])),
  "string-crc": lambda b: _shard(b, "b").update(crc32c="1"),
  "bool-old-crc": lambda b: _shard(b, "b").update(crc32=True),
  "crc-plus-1": lambda b: _shard(b, "b").update(crc32c=_shard(b, "b")["crc32c"] + 1),
  "bad-spec": lambda b: _leaf(b, "b").update(spec=[["data"], "x"]),
  "extra-shard-outside": lambda b: _leaf(b, "b")["shards"].append(
    {"index": [[0, 9], [0, 2]], "offset": 0, "nbytes": 72}
  ),
  "size-plus-8": lambda b: _shard(b, "b").update(nbytes=_shard(b, "b")["nbytes"] + 8),
  "past-the-end": lambda b: _shard(b, "b").update(offset=b["nbytes"]),
  "other-dtype": lambda b: _leaf(b, "b").update(dtype="float32"),
  "other-shape": lambda b: (
    _leaf(b, "d").update(shape=[2]) or _shard(b, "d").update(index=[[0, 2]], nbytes=8)
  ),
  "other-path": lambda b: _leaf(b, "b").update(path="['x']"),
  "split-slot-missing": lambda b: _leaf(b, "split")["shards"].pop(),
  "leaf-twice": lambda b: b["leaves"].append(copy.deepcopy(b["leaves"][0])),
  "leaf-missing": lambda b: b["leaves"].pop(0),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_forged_record_is_refused_as_the_long_way_refuses_it(saved, monkeypatch, edit):
  where, body, paths, abstract, _ = saved
  forged = copy.deepcopy(body)
  EDITS[edit](forged)
  _write(where, forged)
  one, long = (_outcome(where, paths, abstract, p, monkeypatch) for p in (True, False))
  assert long[0] == "error", f"the long way accepted the edit: {long}"
  assert one == long


@settings(
  max_examples=300,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
  database=None,
)
@given(data=st.data())
def test_any_forged_manifest_ends_as_the_long_way_ends(saved, monkeypatch, data):
  where, body, paths, abstract, _ = saved
  _write(where, _mutate(body, data))
  assert _outcome(where, paths, abstract, True, monkeypatch) == _outcome(
    where, paths, abstract, False, monkeypatch
  )


@pytest.mark.parametrize(
  "leaf",
  [
    lambda a: np.zeros(a.shape, a.dtype),
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
    lambda a: jax.ShapeDtypeStruct((*a.shape, 1), a.dtype, sharding=a.sharding),
    lambda a: jax.ShapeDtypeStruct(a.shape, np.int8, sharding=a.sharding),
  ],
  ids=["numpy-array", "no-sharding", "other-shape", "other-dtype"],
)
def test_a_caller_leaf_that_does_not_fit_is_named_as_the_long_way_names_it(
  saved, monkeypatch, leaf
):
  """The caller's side, too: a leaf that is no abstract array with a
  sharding, or asks for another shape or dtype, gets the long way's error
  (StateMismatchError naming the leaf), never an AttributeError."""
  where, body, paths, _, _ = saved
  _write(where, body)
  _, abstract, _ = shards_lib.leaf_paths(
    jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), saved[4]
    )
  )
  abstract = list(abstract)
  abstract[1] = leaf(abstract[1])
  one, long = (_outcome(where, paths, abstract, p, monkeypatch) for p in (True, False))
  assert one == long == ("error", ec.StateMismatchError)
