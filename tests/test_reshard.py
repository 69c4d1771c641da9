"""Pure logic of restoring ramdisk copies onto another mesh (reshard.py) and
its place in restore planning (restore_plan: copies, candidates, decide)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from emergency_ckpt.core import reshard
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.restore import plan as restore_plan
from emergency_ckpt.restore import summary as restore_summary


def test_block_index_follows_the_spec_first_axis_slowest():
  sizes = {"a": 2, "b": 3, "data": 4}
  assert shards_lib.block_index((8, 16), [None, ["data"]], sizes, {"data": 1}) == ((0, 8), (4, 8))
  assert shards_lib.block_index((12,), [["a", "b"]], sizes, {"a": 1, "b": 2}) == ((10, 12),)
  assert shards_lib.block_index((), [], sizes, {}) == ()
  assert shards_lib.block_index((10,), [["data"]], sizes, {"data": 0}) is None  # uneven


def test_recorded_spec_matches_what_jax_places(mesh):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  n = mesh.shape["data"]
  leaves = [
    jax.ShapeDtypeStruct((4, 2 * n), jnp.float32, sharding=NamedSharding(mesh, P(None, "data"))),
    jax.ShapeDtypeStruct((3,), jnp.int32, sharding=NamedSharding(mesh, P())),
    jax.ShapeDtypeStruct((2,), jnp.int32, sharding=SingleDeviceSharding(jax.devices()[0])),
  ]
  layout = shards_lib.layout_for(["a", "b", "c"], leaves)
  assert [leaf.spec for leaf in layout.leaves] == [[None, ["data"]], [None], None]


def _saved_2x2() -> reshard.SavedLayout:
  """2 processes x 2 devices per slice on a data axis of 4 (scenarios.SPECS' w, count)."""
  body = {
    "topology": {
      "mesh_axis_names": ["replica", "data"],
      "mesh_shape": [2, 4],
      "replica_axis": "replica",
      "slice_processes": [[0, 1], [2, 3]],
      "slice_grid": [0, 0, 1, 1],
    },
    "leaves": [
      {"path": "w", "shape": [8, 16], "dtype": "float32", "spec": [None, ["data"]]},
      {"path": "count", "shape": [], "dtype": "int32", "spec": []},
    ],
  }
  saved = reshard.SavedLayout.from_manifest(body)
  assert saved is not None
  assert reshard.SavedLayout.from_json(saved.to_json()) == saved
  return saved


def _layout(slots: dict[str, list[shards_lib.Index]], dtypes=None) -> shards_lib.Layout:
  leaves = []
  for path, indices in slots.items():
    dtype = np.dtype((dtypes or {}).get(path, np.float32))
    shape = tuple(b for _, b in indices[0]) if indices[0] else ()
    leaves.append(
      shards_lib.LeafLayout(
        path, shape, dtype, tuple(shards_lib.ShardSlot(i, 0, 0, ()) for i in indices)
      )
    )
  return shards_lib.Layout(tuple(leaves), 0)


def test_saved_layout_tells_who_holds_each_shard():
  saved = _saved_2x2()
  assert saved.holders("w") == {
    ((0, 8), (0, 4)): [0],
    ((0, 8), (4, 8)): [0],
    ((0, 8), (8, 12)): [1],
    ((0, 8), (12, 16)): [1],
  }
  assert saved.holders("count") == {(): [0, 1]}
  assert saved.shards_at("w", 1) == [((0, 8), (8, 12)), ((0, 8), (12, 16))]
  assert saved.problem(["w", "count"], [(8, 16), ()], ["float32", "int32"]) is None
  assert "saved as float32" in saved.problem(["w"], [(8, 16)], ["bfloat16"])
  assert "was not saved" in saved.problem(["x"], [(1,)], ["float32"])


def test_pieces_prefer_this_hosts_copy_and_tile_every_new_shard():
  saved = _saved_2x2()
  sources = [[0, 1], [2, 3]]
  # New process at data position 1 of 4 (1 device): columns 4-8 of w.
  layout = _layout({"w": [((0, 8), (4, 8))], "count": [()]}, {"count": np.int32})
  pieces = reshard.plan_pieces(layout, saved, sources, held={3}, rank=1)
  assert reshard.covered(layout, pieces) is None
  w = [p for p in pieces if p.leaf == 0]
  # columns 4-8 sit with slice position 0: saved process 0 or 2 (not held)
  assert [(p.index, p.box, p.local) for p in w] == [(((0, 8), (4, 8)), ((0, 8), (4, 8)), False)]
  assert w[0].saved_process in (0, 2)
  count = [p for p in pieces if p.leaf == 1]
  assert [(p.saved_process, p.local) for p in count] == [(3, True)]  # replicated: the held copy

  # A new shard spanning two saved ones (2 positions' worth) is cut in two.
  wide = _layout({"w": [((0, 8), (6, 10))]})
  pieces = reshard.plan_pieces(wide, saved, sources, held={0}, rank=0)
  assert reshard.covered(wide, pieces) is None
  assert sorted((p.box, p.local) for p in pieces) == [
    (((0, 8), (6, 8)), True),
    (((0, 8), (8, 10)), False),
  ]


def test_covered_names_a_gap():
  layout = _layout({"w": [((0, 8), (0, 4))]})
  gap = reshard.covered(layout, [])
  assert gap and "w" in gap and "0 of 32" in gap


def _inv(process, slice_, copies) -> restore_summary.Inventory:
  return restore_summary.Inventory(
    process=process,
    slice=slice_,
    local_steps=(),
    persistent_steps=(3,) if process == 0 else None,
    state_steps=(3, 5) if process == 0 else None,
    copies=copies,
  )


def test_a_step_whose_saved_slice_is_complete_somewhere_is_a_reshard_candidate():
  # 8 processes, 2 slices; saved by 4 processes in 2 slices, held by processes 0-3.
  copies = {p: {5: [["t", p, p // 2, p % 2, 2]]} for p in range(4)}
  invs = [_inv(p, p // 4, copies.get(p, {})) for p in range(8)]
  slices = [[0, 1, 2, 3], [4, 5, 6, 7]]
  job = restore_summary.summarize(invs, slices)
  assert job.reshard[5]["topology"] == "t" and job.reshard[5]["slices"] == [0, 1]
  assert job.reshard[5]["partner_only"] == {} == job.reshard[5]["parity_only"]
  cands = restore_plan.candidates(job)
  assert [(c.step, c.reshard, c.in_persistent) for c in cands] == [
    (5, (0, 1), False),
    (3, (), True),
  ]
  ok = restore_plan.Status(None, True)
  plan = restore_plan.decide(cands[0], {0: ok}, slices)
  assert plan.sources == (restore_plan.RESHARD,) * 2 and plan.reshard_slices == (0, 1)
  # a damaged copy of saved slice 0 (on process 0): slice 1 serves
  bad0 = restore_plan.Status(None, True, reshard_bad=(0,))
  assert bad0.to_json()["reshard_bad"] == (0,)
  assert restore_plan.Status.from_json(bad0.to_json()) == bad0
  assert restore_plan.decide(cands[0], {0: bad0}, slices).reshard_slices == (1,)
  bad1 = restore_plan.Status(None, True, reshard_bad=(1,))
  assert restore_plan.decide(cands[0], {0: bad0, 3: bad1}, slices) is None  # not in persistent


def test_a_saved_slice_missing_a_position_serves_nothing():
  copies = {0: {5: [["t", 0, 0, 0, 2]]}, 1: {5: [["t", 2, 1, 0, 2]]}}
  invs = [_inv(p, 0, copies.get(p, {})) for p in range(2)]
  job = restore_summary.summarize(invs, [[0, 1]])
  assert job.reshard == {}
  assert [c.step for c in restore_plan.candidates(job)] == [3]


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_relative_cuts_the_box_out_of_its_shard(dtype):
  shard = np.arange(32, dtype=dtype).reshape(4, 8)
  index = ((4, 8), (8, 16))
  part = shard[reshard.relative(((5, 7), (10, 12)), index)]
  assert part.tolist() == shard[1:3, 2:4].tolist()


def test_positions_only_partner_copies_hold_are_named():
  # one slice of 4 (hosts 0-3); host 1 lost: process 1's step lives only in
  # its partner's (process 2's) folder
  copies = {
    0: {5: [["t", 0, 0, 0, 4, 0]]},
    2: {5: [["t", 2, 0, 2, 4, 0], ["t", 1, 0, 1, 4, 1]]},
    3: {5: [["t", 3, 0, 3, 4, 0], ["t", 2, 0, 2, 4, 1]]},
  }
  invs = [_inv(p, 0, copies.get(p, {})) for p in range(4)]
  job = restore_summary.summarize(invs, [[0, 1, 2, 3]])
  assert (job.reshard[5]["slices"], job.reshard[5]["partner_only"]) == ([0], {"0": [1]})
  cand = restore_plan.candidates(job)[0]
  plan = restore_plan.decide(cand, {}, [[0, 1, 2, 3]])
  assert (plan.reshard_slices, plan.reshard_partner) == ((0,), ((1,),))


def test_a_partner_is_the_next_process_of_the_slice_on_another_machine():
  from emergency_ckpt.redundancy.partner import choose_partner  # noqa: PLC0415

  assert choose_partner(0, [0, 1, 2, 3], {0: "a"}) == 1
  assert choose_partner(3, [0, 1, 2, 3], {3: "d"}) == 0  # wraps
  assert choose_partner(0, [0, 1, 2, 3], {0: "a", 1: "a"}) == 2  # 2 per machine
  assert choose_partner(1, [0, 1, 2, 3], {0: "a", 1: "a"}) == 2
  assert choose_partner(0, [0, 1], {0: "a", 1: "a"}) is None  # one machine


def test_a_position_its_xor_group_can_rebuild_completes_the_slice():
  # one slice of 4 in one group; host 1 lost: 0, 2, 3 hold their own copy and parity block
  group = [0, 1, 2, 3]
  copies = {p: {5: [["t", p, 0, p, 4, 0]]} for p in (0, 2, 3)}
  parity = {p: {5: [["t", p, 0, p, 4, group]]} for p in (0, 2, 3)}
  invs = [
    restore_summary.Inventory(
      process=p,
      slice=0,
      local_steps=(),
      state_steps=(5,) if p == 0 else None,
      persistent_steps=() if p == 0 else None,
      copies=copies.get(p, {}),
      parity=parity.get(p, {}),
    )
    for p in range(4)
  ]
  job = restore_summary.summarize(invs, [[0, 1, 2, 3]])
  assert job.reshard[5]["parity_only"] == {"0": [1]}
  plan = restore_plan.decide(restore_plan.candidates(job)[0], {}, [[0, 1, 2, 3]])
  assert (plan.reshard_slices, plan.reshard_parity, plan.reshard_groups) == (
    (0,),
    ((1,),),
    ((tuple(group),),),
  )
  # a second loss in the group: nothing to rebuild from
  del parity[2]
  invs[2] = dataclasses.replace(invs[2], parity={})
  assert restore_summary.summarize(invs, [[0, 1, 2, 3]]).reshard == {}
