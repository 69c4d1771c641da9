"""The manager in one process (a 1-slice job): API errors and a round trip."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from tests.helpers import abstract as _abstract
from tests.single_slice import state as _state


def test_nothing_restorable_names_directories(options, mesh):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    assert mngr.latest_step() is None
    with pytest.raises(FileNotFoundError) as e:
      mngr.restore(_abstract(mesh))
  assert isinstance(e.value, ec.NoRestorableCheckpointError)
  assert options.persistent.directory in str(e.value)
  assert "local" in str(e.value)


def test_round_trip_intervals_and_step_errors(options, mesh):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    assert mngr.save(1, _state(mesh, 1.0)) is False  # no interval hit
    assert mngr.save(2, _state(mesh, 2.0), data_state={"pos": 2}) is True  # local
    assert mngr.save(4, _state(mesh, 4.0), data_state={"pos": 4}) is True  # both tiers
    with pytest.raises(ec.StepAlreadyExistsError):
      mngr.save(4, _state(mesh, 4.0))
    with pytest.raises(ec.StepError):
      mngr.save(3, _state(mesh, 3.0))
    with pytest.raises(ec.StepError):
      mngr.save(-1, _state(mesh, 3.0))
    with pytest.raises(ec.DataStateError, match=r"\['rng'\]"):
      mngr.save(6, _state(mesh, 6.0), data_state={"rng": np.uint32(7)})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 4]
    r = mngr.restore(_abstract(mesh))
    assert (r.step, r.source, r.data_state) == (4, "local", {"pos": 4})
    np.testing.assert_array_equal(np.asarray(r.state["w"]), np.full((4, 2), 4.0, np.float32))
    r2 = mngr.restore(_abstract(mesh), step=2)
    assert r2.step == 2 and r2.data_state == {"pos": 2}
    with pytest.raises(ec.StepNotRestorableError):
      mngr.restore(_abstract(mesh), step=3)


def test_abstract_state_mismatch_is_a_clear_error(options, mesh):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr.save(2, _state(mesh, 2.0), force=True)
    mngr.wait_until_finished()
    with pytest.raises(ec.StateMismatchError, match="float32"):
      mngr.restore(_abstract(mesh, dtype=jnp.int32))
    with pytest.raises(ec.StateMismatchError, match="abstract_state"):
      mngr.restore({"v": _abstract(mesh)["w"]})


def test_wrong_replica_axis_is_named(options, mesh):
  import dataclasses  # noqa: PLC0415

  bad = dataclasses.replace(options, replica_axis="slices")
  with pytest.raises(ec.TopologyError, match="'slices'"):
    ec.CheckpointManager(bad, mesh=mesh)


def test_local_dir_is_0700(options, mesh):
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mode = os.stat(mngr.local_directory).st_mode & 0o777
  assert mode == 0o700


def test_persistent_copy_is_the_state_at_save_time(options, mesh):
  """save() returns before the persistent upload ends (on CPU it uploads the
  staged snapshot in the background). Donating the arrays to the next train
  step and reusing the staging buffer for the next local saves must not
  change what lands in the persistent tier."""
  sharding = NamedSharding(mesh, P())
  x = jax.device_put(jnp.arange(1 << 20, dtype=jnp.float32), sharding)
  step_fn = jax.jit(lambda s: {"w": s["w"] * 3 + 1}, donate_argnums=0)
  want = np.asarray(x).copy()
  state = {"w": x}
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    assert mngr.save(4, state)
    for step in (5, 6, 7):  # 6: a local save into the staging buffer
      state = step_fn(state)
      mngr.save(step, state)
    mngr.wait_until_finished()
    abstract = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
  shutil.rmtree(options.local.directory)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    r = mngr.restore(abstract, step=4)
  assert r.source == "persistent"
  assert np.asarray(r.state["w"]).tobytes() == want.tobytes()


@pytest.mark.parametrize("how", ["restore", "prepare"])
def test_restore_prepares_the_first_saves_staging_buffer(options, mesh, how):
  """restore() (here: nothing to restore) or prepare() allocates the host
  staging buffer of the state's layout in the background; the first save
  copies into it instead of faulting in fresh memory inside save()."""
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    if how == "restore":
      with pytest.raises(ec.NoRestorableCheckpointError):
        mngr.restore(_abstract(mesh))
    else:
      mngr.prepare(_abstract(mesh))
    mngr.wait_until_finished()  # includes background preparation
    pool = mngr._staging._pool
    (prepared,) = pool._free
    assert prepared.nbytes >= 4 * 2 * 4  # the (4, 2) float32 leaf (slots aligned)
    assert mngr.save(2, _state(mesh, 2.0)) is True
    mngr.wait_until_finished()
    assert len(pool._free) == 1 and pool._free[0] is prepared  # taken by the save, given back
    assert mngr.latest_step() == 2


def test_a_restore_starts_its_background_work_only_as_it_returns(options, mesh, monkeypatch):
  """The next save's staging buffer (its layout: milliseconds of Python per
  thousand leaves) is prepared once the restore's own work is done, the
  data state included: a thread running Python beside the restore would
  halve its pace. A restored step prepares it too."""
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr.save(2, _state(mesh, 2.0))
    mngr.wait_until_finished()
  order = []
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    parts = mngr._parts
    for obj, name in ((parts.restorer, "with_data_state"), (parts.staging, "prepare")):
      real = getattr(obj, name)
      monkeypatch.setattr(
        obj, name, lambda *a, _real=real, _name=name, **k: order.append(_name) or _real(*a, **k)
      )
    r = mngr.restore(_abstract(mesh))
    assert order == ["with_data_state", "prepare"]
    mngr.wait_until_finished()
    assert r.step == 2 and len(mngr._staging._pool._free) == 1


def test_background_work_waits_for_a_colocated_save(options, mesh, monkeypatch):
  """While another process of this job on this machine is inside save(),
  this process's save() returns at once, but its ramdisk write and its
  persistent upload start only when that save ends (colocated.py)."""
  import collections  # noqa: PLC0415
  import fcntl  # noqa: PLC0415
  import threading  # noqa: PLC0415
  import time  # noqa: PLC0415
  import types  # noqa: PLC0415

  from emergency_ckpt.cluster import colocated  # noqa: PLC0415
  from emergency_ckpt.cluster.colocated import StagingWindow  # noqa: PLC0415
  from emergency_ckpt.manager import parts as manager_lib  # noqa: PLC0415

  job = f"test-job-{os.getpid()}"  # as if a process of a multi-process job
  monkeypatch.setattr(manager_lib, "job_key", lambda: job)
  other = StagingWindow(job)
  assert other.enabled
  inside, leave = threading.Event(), threading.Event()

  def colocated_save():
    with other.staging():
      inside.set()
      leave.wait(10)

  # The save's background work (the ramdisk write, the upload: one thread
  # each) waits in wait_closed, polling the window's lock. Seen here: each
  # time a poll finds the window held, and whether the colocated save had
  # ended when each wait returned. The wait's cap (1 s + 4x the copy) is
  # raised: a slow machine must not reach it before this test ends that save.
  real_flock, real_wait_closed = fcntl.flock, StagingWindow.wait_closed
  polls_refused, seen = collections.Counter(), threading.Condition()
  ended_after_leave = []

  def flock(fd, op):
    try:
      return real_flock(fd, op)
    except BlockingIOError:
      if op & fcntl.LOCK_EX:
        with seen:
          polls_refused[threading.get_ident()] += 1
          seen.notify_all()
      raise

  def both_polling():
    return len(polls_refused) == 2 and min(polls_refused.values()) >= 2

  def wait_closed(self, timeout_s):
    waited = real_wait_closed(self, max(timeout_s, 60.0))
    ended_after_leave.append(leave.is_set())
    return waited

  locks = {k: getattr(fcntl, k) for k in ("LOCK_SH", "LOCK_EX", "LOCK_NB", "LOCK_UN")}
  monkeypatch.setattr(colocated, "fcntl", types.SimpleNamespace(flock=flock, **locks))
  monkeypatch.setattr(StagingWindow, "wait_closed", wait_closed)
  t = threading.Thread(target=colocated_save, daemon=True)
  t.start()
  assert inside.wait(5)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    t0 = time.monotonic()
    assert mngr.save(4, _state(mesh, 4.0)) is True  # both tiers
    assert time.monotonic() - t0 < 0.5
    with seen:  # both found the window held, and polled again: they wait for it
      assert seen.wait_for(both_polling, timeout=10), polls_refused
    local_step = os.path.join(mngr.local_directory, "step_4")
    persistent_step = os.path.join(options.persistent.directory, "tensors", "4")
    assert not os.path.exists(local_step) and not os.path.exists(persistent_step)
    leave.set()
    mngr.wait_until_finished()
    assert ended_after_leave == [True, True]
    assert os.path.isdir(local_step) and os.path.isdir(persistent_step)
    assert mngr.all_steps() == [4]
  t.join(5)
  other.close()


def test_back_to_back_saves_never_wait_out_the_staging_window(options, mesh, monkeypatch):
  """save() takes its staging buffer and waits for the previous upload
  before it opens the staging window: its own background work (which waits
  for the window to close) is never what it waits for inside the window, so
  no wait for the window ends by its cap."""
  from emergency_ckpt.cluster import colocated  # noqa: PLC0415
  from emergency_ckpt.manager import parts as manager_lib  # noqa: PLC0415

  monkeypatch.setattr(manager_lib, "job_key", lambda: f"test-job-{os.getpid()}")
  waits = []
  real = colocated.StagingWindow.wait_closed

  def wait_closed(self, timeout_s):
    waited = real(self, timeout_s)
    waits.append((waited, timeout_s))
    return waited

  monkeypatch.setattr(colocated.StagingWindow, "wait_closed", wait_closed)
  opts = dataclasses.replace(
    options,
    local=dataclasses.replace(options.local, save_interval_steps=1),
    persistent=dataclasses.replace(options.persistent, save_interval_steps=2),
  )
  with ec.CheckpointManager(opts, mesh=mesh) as mngr:
    for step in range(1, 9):  # no wait between saves: writes and uploads overlap them
      assert mngr.save(step, _state(mesh, float(step)))
    mngr.wait_until_finished()
    assert mngr.latest_step() == 8
  assert waits and all(w < t for w, t in waits), waits


@pytest.mark.parametrize("inline", [False, True], ids=["snapshot-upload", "orbax-inline"])
def test_a_persistent_only_step_records_its_shard_checksums(options, mesh, inline):
  """A persistent step with no local write still stages a snapshot: the
  shard CRC32Cs are summed from it (on accelerators Orbax is called inline,
  `inline` forces that path here), recorded before COMMIT, and the restore
  from the persistent tier checks every shard against them."""
  options = dataclasses.replace(
    options, local=dataclasses.replace(options.local, save_interval_steps=3)
  )
  sharding = NamedSharding(mesh, P("data"))
  x = jax.device_put(jnp.arange(1 << 16, dtype=jnp.float32) * 0.5, sharding)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr._saves._upload_snapshots = not inline  # noqa: SLF001 - the accelerator path
    assert mngr.save(4, {"w": x})  # persistent only (4 % 3 != 0)
    mngr.wait_until_finished()
  state_dir = os.path.join(options.persistent.directory, "state", "4")
  assert sorted(os.listdir(state_dir)) == ["COMMIT", "SHARDS", "process_0-of-1.json"]
  with open(os.path.join(state_dir, "process_0-of-1.json")) as f:
    assert len(json.load(f)["shard_crc32c"]["['w']"]) == len(jax.devices())
  abstract = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    r = mngr.restore(abstract)
  assert (r.step, r.source) == (4, "persistent")
  assert np.asarray(r.state["w"]).tobytes() == np.asarray(x).tobytes()


def test_a_vanished_local_folder_is_made_again(options, mesh, caplog):
  """The ramdisk folder deleted while the job runs (a /dev/shm clean-up, an
  operator's rm): the next local save makes it again (0700, its owner lock
  taken anew) with one warning, and the local tier works on; a symlink put
  in its place instead is refused (the write fails with a warning, nothing
  is written through it), and training goes on."""
  from emergency_ckpt.local import owner  # noqa: PLC0415

  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr.save(2, _state(mesh, 2.0), force=True)
    mngr.wait_until_finished()
    folder = mngr.local_directory
    shutil.rmtree(options.local.directory)
    with caplog.at_level("WARNING", logger="emergency_ckpt"):
      for step in (3, 4):
        assert mngr.save(step, _state(mesh, float(step)), force=True)
        mngr.wait_until_finished()
    assert sum("vanished while the job ran" in r.getMessage() for r in caplog.records) == 1
    assert sorted(os.listdir(folder)) == [".owner", "step_3", "step_4"]
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert owner.held(folder)  # the lock on the new owner file
    local = mngr.health()["local"]
    assert (local.newest_durable_step, local.consecutive_failures) == (4, 0)
    r = mngr.restore(_abstract(mesh))
    assert (r.step, r.source) == (4, "local")
    np.testing.assert_array_equal(np.asarray(r.state["w"]), np.full((4, 2), 4.0, np.float32))

    elsewhere = os.path.join(os.path.dirname(options.local.directory), "elsewhere")
    os.makedirs(elsewhere, mode=0o700)
    shutil.rmtree(folder)
    os.symlink(elsewhere, folder)
    caplog.clear()
    with caplog.at_level("WARNING", logger="emergency_ckpt"):
      assert mngr.save(5, _state(mesh, 5.0), force=True)  # training goes on
      mngr.wait_until_finished()
    assert any("symlink" in r.getMessage() for r in caplog.records), caplog.text
    assert os.listdir(elsewhere) == []  # nothing written through the symlink
    assert mngr.health()["local"].consecutive_failures == 1


@pytest.mark.parametrize("inline", [False, True], ids=["snapshot-upload", "orbax-inline"])
def test_a_finalize_failing_after_its_callback_never_holds_the_commit_lane(
  options, mesh, monkeypatch, inline
):
  """Orbax reports a persistent step finalized before its rename; if the
  finalization then fails (a full disk writing its metadata, seen in the
  full-disk runs) the commit lane once polled for the step's folder until
  collective_timeout_s (60 s here), holding every later COMMIT. It now stops
  once the upload failed: step 4 fails promptly (named in health), step 8
  commits and restores."""
  from emergency_ckpt.core import failpoints  # noqa: PLC0415

  monkeypatch.setattr(failpoints, "_ARMED", {("persistent.finalize_callback", 4): "raise"})
  options = dataclasses.replace(options, collective_timeout_s=60)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    mngr._saves._upload_snapshots = not inline  # noqa: SLF001 - the accelerator path
    t0 = time.monotonic()
    assert mngr.save(4, _state(mesh, 4.0))
    with pytest.raises(ec.StorageError, match="failpoint persistent.finalize_callback@4"):
      mngr.wait_until_finished()
    assert mngr.save(8, _state(mesh, 8.0))
    mngr.wait_until_finished()
    waited = time.monotonic() - t0
    assert mngr.health()["persistent"].newest_durable_step == 8
  assert waited < 30, f"steps 4 and 8 took {waited:.1f}s: the lane waited for step 4's folder"
  tensors = os.listdir(os.path.join(options.persistent.directory, "tensors"))
  assert "8" in tensors and "4" not in tensors, tensors
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    shutil.rmtree(mngr.local_directory)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    r = mngr.restore(_abstract(mesh))
  assert (r.step, r.source) == (8, "persistent")
  np.testing.assert_array_equal(np.asarray(r.state["w"]), np.full((4, 2), 8.0, np.float32))


@pytest.mark.parametrize(
  ("tier", "where"), [("local", "file"), ("persistent", "file"), ("persistent", "under_a_file")]
)
def test_an_unusable_directory_is_named_with_its_option_and_fix(options, mesh, tier, where):
  """A tier's folder that cannot be made (a file in its place, or under
  one): StorageError naming the option, the path, the OS error and the fix
  at construction, not a raw OSError from deep inside (was: FileExistsError
  from the local tier's makedirs, NotADirectoryError from a listing)."""
  base = os.path.dirname(options.local.directory)
  blocker = os.path.join(base, "a-file")
  with open(blocker, "w") as f:
    f.write("not a folder")
  path = blocker if where == "file" else os.path.join(blocker, "sub")
  tier_options = dataclasses.replace(getattr(options, tier), directory=path)
  options = dataclasses.replace(options, **{tier: tier_options})
  with pytest.raises(ec.StorageError) as e:
    ec.CheckpointManager(options, mesh=mesh)
  text = str(e.value)
  assert f"{tier}.directory" in text and repr(path) in text, text
  assert "Errno" in text and "Fix: point" in text, text
  assert isinstance(e.value.__cause__, OSError)
  assert os.path.isfile(blocker)  # nothing written over it
