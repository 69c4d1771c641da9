"""A run that restarts below persistent steps it left behind: the steps it saves
again reach the bucket, with the new run's values, never the old run's.

A crash between a persistent step's finalize and its state COMMIT leaves
finalized tensors that no restore can use. Training resumes below them and
saves those step numbers again; Orbax skips any step not newer than the
newest in its folder, and refuses one that exists. Real Orbax on a real
tmpfs, one process.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt.errors import StepAlreadyExistsError
from emergency_ckpt.persistent.layout import list_steps


def _tree(mesh, value: float) -> dict:
  return {
    "w": jax.device_put(jnp.arange(64.0) + value, NamedSharding(mesh, P("data"))),
    "b": jax.device_put(jnp.full((3,), value), NamedSharding(mesh, P())),
  }


def _abstract(tree):
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


def _remove_commit(options, step: int) -> None:
  """The crash: the step's tensors finalized, its state never committed."""
  root = os.fspath(options.persistent.directory)
  found = [
    os.path.join(d, "COMMIT")
    for d, _, files in os.walk(root)
    if "COMMIT" in files and os.path.basename(d) == str(step) and "state" in d
  ]
  assert len(found) == 1, found
  os.remove(found[0])


def _tensors(options):
  return os.path.join(os.fspath(options.persistent.directory), "tensors")


def test_restore_below_left_over_persistent_steps_lets_them_be_saved_again(options, mesh):
  old = _tree(mesh, 1.0)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    for step in (2, 4, 6, 8):
      mngr.save(step, old)
      mngr.wait_until_finished()  # no persistent step skipped behind an upload
  assert list_steps(_tensors(options)) == [4, 8]
  _remove_commit(options, 8)

  new = _tree(mesh, 100.0)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    got = mngr.restore(_abstract(old))
    assert got.step == 6, (got.step, got.source)
    # not restorable, and the new run saves step 8 again: gone before it does
    assert list_steps(_tensors(options)) == [4]
    mngr.save(8, new)
    mngr.wait_until_finished()
    assert mngr.health()["persistent"].ok, mngr.health()["persistent"].problems()
  assert list_steps(_tensors(options)) == [4, 8]

  # the ramdisk lost: step 8 comes from the bucket, with the new run's values
  shutil.rmtree(options.local.directory)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    got = mngr.restore(_abstract(new))
  assert (got.step, got.source) == (8, "persistent")
  for k in new:
    np.testing.assert_array_equal(np.asarray(got.state[k]), np.asarray(new[k]))


def test_a_step_already_in_the_bucket_is_refused_by_name(options, mesh):
  """Without a restore (a fresh start over an old run's bucket), a step that
  exists is not overwritten and never silently skipped: the upload fails
  with a typed error naming the step, and training goes on."""
  tree = _tree(mesh, 1.0)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr.save(4, tree)
    mngr.wait_until_finished()
  _remove_commit(options, 4)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr.save(4, _tree(mesh, 2.0))  # returns: a sick tier never stops training
    with pytest.raises(StepAlreadyExistsError, match="step 4 is already in the persistent"):
      mngr.wait_until_finished()


def test_a_restart_applies_persistent_retention_a_killed_run_left_undone(options, mesh):
  """A run killed before its last retention passes leaves more persistent
  steps than the rules keep; the restart's restore queues a pass, so they
  go without waiting for the next upload (the soak's "persistent
  retention" finding after killed rounds)."""
  keep_all = dataclasses.replace(
    options, persistent=dataclasses.replace(options.persistent, max_to_keep=None)
  )
  tree = _tree(mesh, 1.0)
  with ec.CheckpointManager(keep_all, mesh=mesh) as mngr:
    for step in (4, 8, 12):
      mngr.save(step, tree)
      mngr.wait_until_finished()
  assert list_steps(_tensors(options)) == [4, 8, 12]
  keep_one = dataclasses.replace(
    options, persistent=dataclasses.replace(options.persistent, max_to_keep=1)
  )
  with ec.CheckpointManager(keep_one, mesh=mesh) as mngr:
    assert mngr.restore(_abstract(tree)).step == 12
    mngr.wait_until_finished()
    assert list_steps(_tensors(options)) == [12]


def test_a_step_deleted_while_the_upload_opens_does_not_fail_it(options, mesh, monkeypatch):
  """A restart's restore queues a retention pass that may delete an old
  persistent step while the first upload opens Orbax's manager, which lists
  the steps. A step gone between that listing and a read of its metadata
  (on GCS its folder's stat then fails) must not fail the upload: on a
  multi-process slice that failure is one process's alone, and the others
  wait for it in Orbax's barriers (the soak's hang, xor-1x4-gcs seed 12).
  The deletion is simulated by the read failing as it then does."""
  from orbax.checkpoint._src.path import step as orbax_step  # noqa: PLC0415

  keep_all = dataclasses.replace(
    options, persistent=dataclasses.replace(options.persistent, max_to_keep=None)
  )
  tree = _tree(mesh, 1.0)
  with ec.CheckpointManager(keep_all, mesh=mesh) as mngr:
    for step in (4, 8):
      mngr.save(step, tree)
      mngr.wait_until_finished()

  def gone(self):
    raise FileNotFoundError(f"{self.path}: deleted by retention meanwhile")

  monkeypatch.setattr(orbax_step.Metadata, "commit_timestamp", property(gone))
  with ec.CheckpointManager(keep_all, mesh=mesh) as mngr:
    assert mngr.restore(_abstract(tree)).step == 8
    mngr.save(12, _tree(mesh, 2.0))
    mngr.wait_until_finished()
    assert mngr.health()["persistent"].ok, mngr.health()["persistent"].problems()
  assert list_steps(_tensors(options)) == [4, 8, 12]
