"""The per-structure caches and batched paths of a many-leaf save and restore
(issue 35 item 4): cached leaf paths and layouts must follow a changed tree,
shape, dtype or sharding; the batched copies and placements give the bytes
the per-leaf ones gave; a checked manifest is checked again once it changes."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from emergency_ckpt.core import placement
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import schema
from emergency_ckpt.runtime import device_copy


def _put(mesh, x, spec=None):
  return jax.device_put(x, NamedSharding(mesh, P() if spec is None else spec))


def test_leaf_paths_follow_a_changed_structure(mesh):
  a = {"x": _put(mesh, jnp.ones(2)), "y": _put(mesh, jnp.ones(3))}
  b = {"u": _put(mesh, jnp.ones(2)), "v": _put(mesh, jnp.ones(3))}  # same count, other keys
  paths_a, leaves_a, _ = shards_lib.leaf_paths(a)
  assert paths_a == ["['x']", "['y']"] and leaves_a[1] is a["y"]
  assert shards_lib.leaf_paths(a)[0] == paths_a  # cached: the same answer
  assert shards_lib.leaf_paths(b)[0] == ["['u']", "['v']"]
  nested = {"x": {"k": _put(mesh, jnp.ones(2))}, "y": _put(mesh, jnp.ones(3))}
  assert shards_lib.leaf_paths(nested)[0] == ["['x']['k']", "['y']"]
  paths_a.append("mutated")  # a caller's list is its own
  assert shards_lib.leaf_paths(a)[0] == ["['x']", "['y']"]


def test_leaf_paths_match_the_uncached_answer_for_many_structures(mesh):
  for n in range(1, 40):  # more structures than the cache keeps
    tree = {f"k{i}": _put(mesh, jnp.ones(1)) for i in range(n)}
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    assert shards_lib.leaf_paths(tree)[0] == [jax.tree_util.keystr(p) for p, _ in flat]


def test_leaf_paths_are_jax_keystr_for_every_kind_of_node_cold_and_warm(mesh):
  """Every key kind (dict keys of both types, sequence indices, named
  tuple and dataclass attributes), as a restarted process (nothing cached)
  and a warm one get them."""
  import collections  # noqa: PLC0415
  import dataclasses  # noqa: PLC0415

  @dataclasses.dataclass
  class Node:
    a: object
    b: object

  jax.tree_util.register_dataclass(Node, data_fields=["a", "b"], meta_fields=[])
  pair = collections.namedtuple("pair", "x y")
  one = _put(mesh, jnp.ones(1))
  tree = {
    "a": [one, (one, {"k": one})],
    "5": pair(one, one),
    "c": Node(one, {"z": one, "y": [one]}),
    "f": {1: one, 3: one},
    "e": {},
  }
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  want = [jax.tree_util.keystr(p) for p, _ in flat]
  shards_lib._PATHS.clear()  # noqa: SLF001 - a restarted process
  assert shards_lib.leaf_paths(tree)[0] == want
  assert shards_lib.leaf_paths(tree)[0] == want  # warm


def test_layout_follows_a_changed_shape_dtype_or_sharding(mesh):
  base = [_put(mesh, jnp.ones((4, 2), jnp.float32))]
  lay = shards_lib.layout_for(["w"], base)
  assert lay.state_nbytes == 32 and lay.whole == (True,) and lay.on_cpu
  assert shards_lib.layout_for(["w"], base) is lay  # cached
  shape = shards_lib.layout_for(["w"], [_put(mesh, jnp.ones((4, 4), jnp.float32))])
  dtype = shards_lib.layout_for(["w"], [_put(mesh, jnp.ones((4, 2), jnp.bfloat16))])
  split = shards_lib.layout_for(["w"], [_put(mesh, jnp.ones((4, 2), jnp.float32), P("data"))])
  assert shape.state_nbytes == 64 and shape.leaves[0].shape == (4, 4)
  assert dtype.state_nbytes == 16 and dtype.leaves[0].dtype == jnp.bfloat16
  assert lay.leaves[0].spec == [None, None]
  assert split.leaves[0].spec == [["data"], None]  # not the replicated plan
  assert shards_lib.layout_for(["v"], base).leaves[0].path == "v"


def _tree(mesh):
  big = placement.SMALL_LEAF // 4 + 16  # past the batched-copy size: aliased on CPU
  return [
    _put(mesh, jnp.arange(12, dtype=jnp.float32).reshape(3, 4)),
    _put(mesh, jnp.asarray(7, jnp.int32)),  # 0-d
    _put(mesh, jnp.zeros((0, 3), jnp.float32)),  # empty
    _put(mesh, jnp.arange(5, dtype=jnp.bfloat16)),
    _put(mesh, (jnp.arange(8) % 2).astype(jnp.bool_)),
    _put(mesh, jnp.arange(big, dtype=jnp.float32)),
    _put(mesh, jnp.arange(16, dtype=jnp.float32).reshape(8, 2), P("data")),
  ]


def test_cpu_fill_writes_the_bytes_of_the_per_shard_fill(mesh):
  leaves = _tree(mesh)
  paths = [f"[{i}]" for i in range(len(leaves))]
  layout = shards_lib.layout_for(paths, leaves)
  assert layout.on_cpu
  fast = np.full(layout.nbytes, 0xAB, np.uint8)
  slow = np.full(layout.nbytes, 0xAB, np.uint8)
  device_copy.fill_from_cpu(leaves, layout, fast)
  hosts = device_copy.to_host(device_copy.slot_shards(leaves, layout))
  for per_leaf, leaf in zip(hosts, layout.leaves):  # the per-view copy, as before
    for x, slot in zip(per_leaf, leaf.slots):
      np.copyto(shards_lib.view(slow, leaf, slot), x, casting="no")
  np.testing.assert_array_equal(fast, slow)
  for x, got in zip(leaves, placement.assemble_buffer(leaves, layout, fast)):
    assert got.sharding == x.sharding and got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


def test_assemble_many_matches_assemble(mesh):
  leaves = _tree(mesh)
  paths = [f"[{i}]" for i in range(len(leaves))]
  layout = shards_lib.layout_for(paths, leaves)
  buf = np.zeros(layout.nbytes, np.uint8)
  device_copy.fill_from_cpu(leaves, layout, buf)
  by_index = [
    {s.index: shards_lib.view(buf, leaf, s) for s in leaf.slots} for leaf in layout.leaves
  ]
  many = placement.assemble_many(leaves, by_index)
  one = [placement.assemble(a, d) for a, d in zip(leaves, by_index)]
  for a, b in zip(many, one):
    assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  small = many[0]  # a small replicated leaf is a copy: the buffer may be reused
  buf[:] = 0
  np.testing.assert_array_equal(np.asarray(small), np.arange(12, dtype=np.float32).reshape(3, 4))


def test_a_changed_manifest_is_checked_again(shm_dir):
  raw = local_format.encode_manifest(_body())
  first = local_format.decode_manifest(raw, "m")
  second = local_format.decode_manifest(raw, "m")  # the checked bytes again
  assert first == second and first is not second  # each caller its own body
  first["leaves"].clear()
  assert local_format.decode_manifest(raw, "m")["leaves"]
  torn = raw.replace(b'"nbytes":16', b'"nbytes":17', 1)
  assert torn != raw
  with pytest.raises(CorruptCheckpointError):
    local_format.decode_manifest(torn, "m")
  # a body that passes the CRC but not the schema, after the good one was seen
  doc = json.loads(raw)
  doc["body"]["leaves"][0]["shards"][0]["offset"] = 10**9
  bad = local_format.encode_manifest(doc["body"])
  with pytest.raises(CorruptCheckpointError, match="past the end"):
    local_format.decode_manifest(bad, "m")
  path = os.path.join(shm_dir, local_format.MANIFEST)
  with open(path, "wb") as f:
    f.write(raw)
  assert local_format.read_manifest(shm_dir) == second


def _body() -> dict:
  return {
    "format": local_format.FORMAT,
    "step": 3,
    "nbytes": 64,
    "leaves": [
      {
        "path": "['w']",
        "shape": [4],
        "dtype": "float32",
        "shards": [{"index": [[0, 4]], "offset": 0, "nbytes": 16, "crc32c": 0}],
      }
    ],
  }


@pytest.mark.parametrize(
  "change",
  [
    lambda leaf: leaf.update(path=3),
    lambda leaf: leaf.update(shape=[4.0]),
    lambda leaf: leaf.update(shape=[-4]),
    lambda leaf: leaf.update(shape=[True]),
    lambda leaf: leaf.update(dtype="float99"),
    lambda leaf: leaf.update(spec=None),
    lambda leaf: leaf.update(spec=[["data"], None]),
    lambda leaf: leaf.update(spec=[[1]]),
    lambda leaf: leaf["shards"][0].update(index=[[0, 5]]),
    lambda leaf: leaf["shards"][0].update(index=[[1, 0]]),
    lambda leaf: leaf["shards"][0].update(index=[[0, 4, 4]]),
    lambda leaf: leaf["shards"][0].update(index=[[0, 2]]),
    lambda leaf: leaf["shards"][0].update(offset=60),
    lambda leaf: leaf["shards"][0].update(offset=-1),
    lambda leaf: leaf["shards"][0].update(nbytes=True),
    lambda leaf: leaf["shards"][0].update(crc32c="x"),
    lambda leaf: leaf["shards"][0].update(crc32=1.5),
    lambda leaf: leaf["shards"][0].pop("offset"),
    lambda leaf: leaf["shards"].append([]),
  ],
)
def test_the_fast_manifest_check_is_never_looser(change):
  body = _body()
  schema.check_manifest(body, "m")  # the unchanged body passes
  assert schema._leaf_ok(body["leaves"][0], body["nbytes"])  # noqa: SLF001
  change(body["leaves"][0])
  assert not schema._leaf_ok(body["leaves"][0], body["nbytes"])  # noqa: SLF001
  with pytest.raises(CorruptCheckpointError):
    schema.check_manifest(body, "m")


def test_a_cold_layout_is_the_layout_its_dataclasses_would_build(mesh):
  """_layout_cached builds its slots and leaves without their dataclasses'
  __init__: every field set, equal (and hashing alike) to what the
  constructors build, and still frozen."""
  import dataclasses  # noqa: PLC0415

  tree = [_put(mesh, jnp.ones(4)), _put(mesh, jnp.ones((2, 3), jnp.bfloat16))]
  got = shards_lib.layout_for(["['a']", "['b']"], tree)
  for leaf in got.leaves:
    for slot in leaf.slots:
      built = shards_lib.ShardSlot(slot.index, slot.offset, slot.nbytes, slot.devices)
      assert slot == built and hash(slot) == hash(built)
      assert set(vars(slot)) == {f.name for f in dataclasses.fields(shards_lib.ShardSlot)}
    kwargs = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(shards_lib.LeafLayout)}
    assert leaf == shards_lib.LeafLayout(**kwargs)
    assert set(vars(leaf)) == set(kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
      leaf.path = "other"


class _Node:
  """A tracked object (an instance with a __dict__)."""


def test_a_promoting_pause_moves_what_it_leaves_alive_to_the_oldest_generation():
  """gc_pause.paused(promote=True): what the block leaves alive is in the
  oldest generation afterwards, unscanned, the young count reset; a plain
  pause leaves it to the young generations; a process that froze objects itself keeps them
  frozen (nothing promoted); the collector's state is restored."""
  import gc  # noqa: PLC0415

  from emergency_ckpt.core import gc_pause  # noqa: PLC0415

  def young(objs) -> int:
    ids = {id(o) for o in gc.get_objects(generation=0)}
    return sum(id(o) in ids for o in objs)

  def oldest(objs) -> int:
    ids = {id(o) for o in gc.get_objects(generation=2)}
    return sum(id(o) in ids for o in objs)

  assert gc.isenabled()
  with gc_pause.paused():
    kept = [_Node() for _ in range(1000)]
    assert not gc.isenabled()
  assert gc.isenabled() and oldest(kept) == 0  # in the young generations: scanned as usual
  with gc_pause.paused(promote=True):
    with gc_pause.paused():  # nested: the outermost pause promotes
      kept = [_Node() for _ in range(1000)]
  assert gc.isenabled()
  assert oldest(kept) == len(kept) and young(kept) == 0 and gc.get_count()[0] < 100
  gc.freeze()  # the process's own frozen objects stay frozen
  try:
    frozen = gc.get_freeze_count()
    assert frozen > gc_pause._STARTUP_FROZEN  # noqa: SLF001
    with gc_pause.paused(promote=True):
      more = [_Node() for _ in range(1000)]
    assert gc.get_freeze_count() == frozen and oldest(more) == 0
  finally:
    gc.unfreeze()
  gc.disable()  # a process that runs without the collector keeps it off
  try:
    with gc_pause.paused(promote=True):
      pass
    assert not gc.isenabled()
  finally:
    gc.enable()
