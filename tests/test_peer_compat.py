"""When a peer slice cannot serve a restore (peer.check_peer_compatible), and
what restore() does then: a slice that lost its ramdisk reads the persistent
tier, and so does every other slice (a peer transfer is all or nothing).

Unit tests of the check (one process, 2 CPU devices), then a real 2-slice
job (2 processes of 2 devices each) restoring onto a mesh other than the
manager's."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=2"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import emergency_ckpt as ec  # noqa: E402
from emergency_ckpt import transport as peer  # noqa: E402
from emergency_ckpt.cluster.topology import topology_from_mesh  # noqa: E402
from emergency_ckpt.core import shards as shards_lib  # noqa: E402
from emergency_ckpt.demo.launcher import run_job  # noqa: E402
from tests import scenarios as sc  # noqa: E402

# ---- check_peer_compatible -------------------------------------------------------


@pytest.fixture
def mesh2(mesh):
  """conftest's mesh: here (replica=1, data=2)."""
  assert mesh.devices.shape == (1, 2), f"need 2 CPU devices, got {mesh.devices}"
  return mesh


def _sds(shape, sharding=None):
  return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)


def _problem(tree: dict, mesh, replica_axis: str = "replica") -> str | None:
  """check_peer_compatible as restore() calls it: on a tree's paths and leaves."""
  paths, leaves, _ = shards_lib.leaf_paths(tree)
  return peer.check_peer_compatible(paths, leaves, mesh, replica_axis)


def test_replicated_or_sharded_within_a_slice_is_servable(mesh2):
  """Every leaf a NamedSharding on the manager's mesh (or an equal one),
  split over the other axes only: each slice holds what any slice needs."""
  same = Mesh(np.array(mesh2.devices), mesh2.axis_names)  # another object, equal
  tree = {
    "replicated": _sds((4, 2), NamedSharding(mesh2, P())),
    "data": _sds((4, 2), NamedSharding(mesh2, P("data"))),
    "data_last": _sds((4, 2), NamedSharding(mesh2, P(None, "data"))),
    "short_spec": _sds((4, 2, 2), NamedSharding(mesh2, P("data"))),
    "scalar": _sds((), NamedSharding(mesh2, P())),
    "equal_mesh": _sds((4, 2), NamedSharding(same, P("data"))),
  }
  assert _problem(tree, mesh2) is None
  assert _problem({}, mesh2) is None


@pytest.mark.parametrize(
  "spec",
  [P("replica"), P(None, "replica"), P(("replica", "data")), P(None, ("data", "replica"))],
  ids=["alone", "second_dim", "tuple_first", "tuple_second"],
)
def test_sharded_over_the_replica_axis_is_not_servable(mesh2, spec):
  """A leaf split over the replica axis, alone or with other axes on one
  dimension: each slice holds other shards of it, none holds a lost slice's."""
  tree = {
    "ok": _sds((4, 2), NamedSharding(mesh2, P("data"))),
    "opt": _sds((4, 2), NamedSharding(mesh2, spec)),
  }
  problem = _problem(tree, mesh2)
  assert problem is not None
  assert "leaf ['opt']" in problem and "sharded over the replica axis 'replica'" in problem


def test_the_replica_axis_is_the_one_named(mesh2):
  """The check asks about the job's replica axis, whatever its name."""
  tree = {"x": _sds((4, 2), NamedSharding(mesh2, P("data")))}
  assert _problem(tree, mesh2, replica_axis="replica") is None
  problem = _problem(tree, mesh2, replica_axis="data")
  assert problem is not None and "replica axis 'data'" in problem
  slices = Mesh(np.array(mesh2.devices), ("slice", "data"))
  tree = {"x": _sds((4, 2), NamedSharding(slices, P("slice")))}
  assert _problem(tree, slices, replica_axis="replica") is None  # no such axis in its spec
  assert "replica axis 'slice'" in _problem(tree, slices, replica_axis="slice")


def test_a_leaf_not_on_the_managers_mesh_is_not_servable(mesh2):
  """Shards are matched across slices by mesh position on the manager's
  mesh: a leaf without a NamedSharding on that very mesh has no such match."""
  devices, axes = np.array(mesh2.devices), mesh2.axis_names
  others = {
    "no_sharding": _sds((4, 2)),
    "host_array": np.zeros((4, 2), np.float32),
    "single_device": _sds((4, 2), SingleDeviceSharding(jax.devices()[0])),
    "other_axis_names": _sds((4, 2), NamedSharding(Mesh(devices, ("r", "d")), P())),
    "other_device_order": _sds((4, 2), NamedSharding(Mesh(devices[:, ::-1], axes), P())),
    "other_shape": _sds((4, 2), NamedSharding(Mesh(devices.reshape(2, 1), axes), P())),
  }
  for name, leaf in others.items():
    tree = {"a_ok": _sds((4, 2), NamedSharding(mesh2, P())), name: leaf}
    problem = _problem(tree, mesh2)
    assert problem is not None, name
    assert problem.startswith(f"leaf ['{name}'] "), problem
    assert "NamedSharding on the manager's mesh" in problem, problem


def test_the_first_leaf_that_is_not_servable_is_named(mesh2):
  tree = {
    "a": _sds((4, 2), NamedSharding(mesh2, P("data"))),
    "b": _sds((4, 2), NamedSharding(mesh2, P("replica"))),
    "c": _sds((4, 2)),
  }
  assert "leaf ['b']" in _problem(tree, mesh2)
  del tree["b"]
  assert "leaf ['c']" in _problem(tree, mesh2)


# ---- end to end: a 2-slice job -----------------------------------------------------
#
# Saved on the manager's mesh (2 slices x 1 process x 2 devices); restored
# onto the same devices in another order within each slice. Each process then
# still holds, in its local copy, every shard that mesh gives it (its local
# read succeeds), but a peer transfer pairs shards by mesh position on the
# manager's mesh, so a lost slice must not be served by a peer: the
# collective transport would place the received shards on the wrong devices.


def _reordered(mesh: Mesh) -> Mesh:
  """The manager's mesh with each slice's devices in reverse order."""
  return Mesh(np.asarray(mesh.devices)[:, ::-1], mesh.axis_names)


def restore_after_wipe(args: dict) -> list[dict]:
  """Runs inside the job: for each variant, the slices in args["wipe_slices"]
  lose their ramdisk, then a fresh manager restores onto the variant's mesh.
  One record per variant: step, source, data_state, bit mismatches."""
  mesh = sc.mesh_for(args["slices"])
  slice_index = topology_from_mesh(mesh, "replica").slice_index
  out = []
  for i, variant in enumerate(args["variants"]):
    if slice_index in args["wipe_slices"]:
      shutil.rmtree(sc.host_dir(args), ignore_errors=True)  # a replaced host
    sc.barrier(f"peer-compat-{i}-wiped")
    target = _reordered(mesh) if variant["reordered"] else mesh
    record = {"name": variant["name"], "slice": slice_index}
    with ec.CheckpointManager(sc.options({**args, **variant["args"]}), mesh=mesh) as mngr:
      try:
        r = mngr.restore(sc.abstract_state(target))
        record.update(
          step=r.step,
          source=r.source,
          data_state=r.data_state,
          expected_data_state=sc.data_state(r.step),
          mismatches=sc.mismatches(r.state, r.step),
          on_target=all(a.sharding.mesh == target for a in r.state.values()),
        )
      except ec.EmergencyCheckpointError as e:
        record.update(error=type(e).__name__, message=str(e))
    sc.barrier(f"peer-compat-{i}-done")
    out.append(record)
  return out


def test_restore_onto_a_mesh_peers_cannot_serve_reads_persistent(shm_dir):
  """Slice 1 lost its ramdisk; slice 0's copy of step 4 is intact. Restored
  onto the manager's mesh, slice 1 gets it from slice 0 (the control). Onto a
  reordered mesh, with either transport, every process reads step 4 from the
  persistent tier, bit-exact, onto the mesh it asked for."""
  args = {
    "slices": 2,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "steps": [1, 2, 3, 4],  # persistent: 2 and 4
    "collective_timeout_s": 30,
  }
  saved = run_job("tests.scenarios:save_steps", 2, args).check()
  assert [r["saved"] for r in saved] == [[1, 2, 3, 4]] * 2
  args["wipe_slices"] = [1]
  args["variants"] = [
    {"name": "reordered_stream", "reordered": True, "args": {"peer_transport": "stream"}},
    {"name": "reordered_collective", "reordered": True, "args": {"peer_transport": "collective"}},
    {"name": "control", "reordered": False, "args": {}},
  ]
  results = run_job("tests.test_peer_compat:restore_after_wipe", 2, args).check()
  for process, records in enumerate(results):
    assert [r["name"] for r in records] == [v["name"] for v in args["variants"]]
    for rec in records:
      where = f"process {process} (slice {rec['slice']}) {rec['name']}"
      assert "error" not in rec, f"{where}: {rec.get('message')}"
      if rec["name"] == "control":
        want = "peer" if rec["slice"] == 1 else "local"
      else:
        want = "persistent"
      assert (rec["step"], rec["source"]) == (4, want), where
      assert rec["mismatches"] == [], where
      assert rec["on_target"], where
      assert rec["data_state"] == rec["expected_data_state"], where
