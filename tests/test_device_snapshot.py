"""local.device_snapshot: save() copies on the device and returns; the
device-to-host copy runs in the background. On CPU devices the same code
path runs (the device copy is a host memcpy), so these tests prove its
ordering and failure handling; bench/device_stall.py measures it on an
accelerator."""

from __future__ import annotations

import dataclasses
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.runtime import device_copy as device_copy_lib


def _device_options(options, **local):
  return dataclasses.replace(
    options, local=dataclasses.replace(options.local, device_snapshot=True, **local)
  )


def _state(mesh, scale: float) -> dict:
  sharding = NamedSharding(mesh, P("data"))
  w = jax.device_put(jnp.arange(1 << 16, dtype=jnp.float32) * scale, sharding)
  b = jax.device_put(jnp.full((8,), scale, jnp.bfloat16), NamedSharding(mesh, P()))
  return {"w": w, "b": b}


def _abstract(state: dict) -> dict:
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


def _host(state: dict) -> dict:
  return {k: np.asarray(v).copy() for k, v in state.items()}


def _same(restored: dict, want: dict) -> bool:
  return all(np.asarray(restored[k]).tobytes() == want[k].tobytes() for k in want)


def _hold(monkeypatch, name: str) -> tuple[threading.Event, threading.Event]:
  """Holds every call of device_copy_lib.<name> until `gate` is set; `started`
  is set when one arrives."""
  gate, started = threading.Event(), threading.Event()
  real = getattr(device_copy_lib, name)

  def held(*args):
    started.set()
    assert gate.wait(30)
    return real(*args)

  monkeypatch.setattr(device_copy_lib, name, held)
  return gate, started


def test_device_copies_are_new_buffers_with_the_same_bytes(mesh):
  state = _state(mesh, 3.0)
  paths, leaves, _ = shards_lib.leaf_paths(state)
  layout = shards_lib.layout_for(paths, leaves)
  originals = device_copy_lib.slot_shards(leaves, layout)
  copies = device_copy_lib.device_copies(originals)
  for got, orig in zip(copies, originals):
    assert len(got) == len(orig)
    for c, o in zip(got, orig):
      assert c.device == o.device
      assert c.unsafe_buffer_pointer() != o.unsafe_buffer_pointer()
      assert np.asarray(c).tobytes() == np.asarray(o).tobytes()


def test_save_returns_before_the_host_copy_and_the_donated_state_is_what_lands(
  options, mesh, monkeypatch
):
  """The background fill is held until the trainer has donated the saved
  arrays to two more steps: the local and the persistent copy (step 4 is
  both) still hold the state at save() time, bit for bit."""
  gate, started = _hold(monkeypatch, "fill")
  step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)
  state = _state(mesh, 0.5)
  want, abstract = _host(state), _abstract(state)
  with ec.CheckpointManager(_device_options(options), mesh=mesh) as mngr:
    assert mngr.save(4, state)
    assert started.wait(30)  # save() returned with the fill still held
    saved = state
    state = step_fn(step_fn(state))
    assert saved["w"].is_deleted()  # donated: the saved arrays' buffers are gone
    gate.set()
    mngr.wait_until_finished()
    assert mngr.all_steps() == [4]
    r = mngr.restore(abstract)
    assert (r.step, r.source) == (4, "local") and _same(r.state, want)
  options_no_local = dataclasses.replace(
    options, local=dataclasses.replace(options.local, directory=options.local.directory + "-new")
  )
  with ec.CheckpointManager(options_no_local, mesh=mesh) as mngr:
    r = mngr.restore(abstract)
  assert (r.step, r.source) == (4, "persistent") and _same(r.state, want)


def test_a_failed_host_copy_fails_that_local_save_only(options, mesh, monkeypatch, caplog):
  """The background device-to-host copy of step 2 fails: its local save is
  discarded (logged, never committed locally), step 6 saves as usual."""
  fill = device_copy_lib.fill
  calls = []

  def failing_once(*args):
    calls.append(1)
    if len(calls) == 1:
      raise RuntimeError("injected transfer failure")
    return fill(*args)

  monkeypatch.setattr(device_copy_lib, "fill", failing_once)
  with ec.CheckpointManager(_device_options(options), mesh=mesh) as mngr:
    with caplog.at_level(logging.WARNING, logger="emergency_ckpt"):
      assert mngr.save(2, _state(mesh, 2.0))
      mngr.wait_until_finished()
    assert "device-to-host copy of step 2 failed" in caplog.text
    assert "injected transfer failure" in caplog.text
    assert mngr.all_steps() == []
    state = _state(mesh, 6.0)
    assert mngr.save(6, state)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [6]
    r = mngr.restore(_abstract(state))
  assert r.step == 6 and _same(r.state, _host(state))


def test_no_device_memory_for_the_copy_stages_on_the_host(options, mesh, monkeypatch, caplog):
  def no_memory(*args):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 1 bytes")

  monkeypatch.setattr(device_copy_lib, "device_copies", no_memory)
  state = _state(mesh, 5.0)
  with ec.CheckpointManager(_device_options(options), mesh=mesh) as mngr:
    with caplog.at_level(logging.WARNING, logger="emergency_ckpt"):
      assert mngr.save(2, state)
    assert "no device memory for a device snapshot" in caplog.text
    mngr.wait_until_finished()
    r = mngr.restore(_abstract(state))
  assert r.step == 2 and _same(r.state, _host(state))


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_device_snapshot_must_be_a_bool(bad):
  with pytest.raises(ec.InvalidOptionsError, match="local.device_snapshot"):
    ec.LocalTierOptions(directory="/dev/shm/x", device_snapshot=bad)


def test_device_snapshot_from_yaml():
  opts = ec.options_from_dict(
    {
      "local": {"directory": "/dev/shm/x", "device_snapshot": True},
      "persistent": {"directory": "/tmp/p"},
    }
  )
  assert opts.local.device_snapshot is True


def test_host_snapshot_from_an_accelerator_copies_into_the_buffer_in_the_background(
  options, mesh, monkeypatch
):
  """device_snapshot off, shards off the host (faked: on CPU the host copy
  would be a view of the arrays, so the real code copies inline there):
  save() blocks on the device-to-host copy only; the copy into the staging
  buffer runs after it returns, and the step lands bit-exact."""
  monkeypatch.setattr(device_copy_lib, "off_host", lambda shards: True)
  gate, started = _hold(monkeypatch, "copy_into")
  state = _state(mesh, 7.0)
  want = _host(state)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    assert mngr.save(2, state)
    assert started.wait(30)  # save() returned; the copy into the buffer waits
    gate.set()
    mngr.wait_until_finished()
    r = mngr.restore(_abstract(state))
  assert r.step == 2 and _same(r.state, want)


def test_cpu_shards_are_copied_inside_save(options, mesh, monkeypatch):
  """On CPU the host copy is a view of the arrays: it must be copied before
  save() returns (the trainer may donate them), so nothing is left to the
  background."""
  threads = []
  copy_into = device_copy_lib.copy_into

  def spy(*args):
    threads.append(threading.current_thread())
    return copy_into(*args)

  monkeypatch.setattr(device_copy_lib, "copy_into", spy)
  state = _state(mesh, 8.0)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    assert mngr.save(2, state)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2]
  assert threads == [threading.main_thread()]
