"""Where the persistent upload's arrays come from (upload_memory.upload_memory_kind):
on CPU, arrays aliasing the staged snapshot; on accelerators with pinned host
memory, arrays in that memory built from the snapshot, so Orbax's
device-to-host copy never touches the device (save() then stalls for the
staging alone); elsewhere, Orbax copying from the device inline. The
accelerators' path runs here on CPU devices (they have pinned host memory
too), forced by upload_memory.CPU_UPLOAD_MEMORY_KIND."""

from __future__ import annotations

import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt.core import layout
from emergency_ckpt.persistent import tier as persistent_tier
from emergency_ckpt.persistent import upload_memory


class _Memory:
  def __init__(self, kind):
    self.kind = kind


class _Device:
  """A device as upload_memory_kind sees it (platform, memories)."""

  platform = "gpu"

  def __init__(self, *kinds):
    self._memories = [_Memory(k) for k in kinds]

  def addressable_memories(self):
    return self._memories


def test_cpu_uploads_alias_the_snapshot_and_accelerators_use_pinned_host(monkeypatch):
  assert upload_memory.upload_memory_kind(jax.local_devices()) == (True, None)
  monkeypatch.setattr(upload_memory, "CPU_UPLOAD_MEMORY_KIND", "pinned_host")
  assert upload_memory.upload_memory_kind(jax.local_devices()) == (True, "pinned_host")
  # a device without pinned host memory: Orbax copies inline
  assert upload_memory.upload_memory_kind([_Device("device")]) == (False, None)
  assert upload_memory.upload_memory_kind([]) == (False, None)


def test_a_failing_probe_transfer_falls_back_to_the_inline_copy(monkeypatch, caplog):
  def refuse(*args, **kwargs):
    raise RuntimeError("no pinned memory today")

  monkeypatch.setattr(upload_memory, "CPU_UPLOAD_MEMORY_KIND", "pinned_host")
  monkeypatch.setattr(jax, "device_put", refuse)
  got = upload_memory.upload_memory_kind(jax.local_devices())
  assert got == (False, None)
  assert "no pinned memory today" in caplog.text and "inside save()" in caplog.text


@pytest.mark.parametrize("kind", [None, "pinned_host"], ids=["cpu-alias", "pinned-host"])
def test_the_upload_hands_orbax_the_snapshot_in_its_memory_kind(options, mesh, monkeypatch, kind):
  """The arrays Orbax saves are in `kind` memory and hold the state at save
  time, although the trainer donates its arrays right after save(); the
  step restores bit-exactly through the manager and through plain Orbax,
  onto the devices' default memory. Orbax is never called inline."""
  monkeypatch.setattr(upload_memory, "CPU_UPLOAD_MEMORY_KIND", kind)
  seen, inline = [], []
  start = persistent_tier.PersistentTier._start  # noqa: SLF001

  def spy(self, step, tree):
    seen.append([x.sharding.memory_kind for x in jax.tree_util.tree_leaves(tree)])
    return start(self, step, tree)

  monkeypatch.setattr(persistent_tier.PersistentTier, "_start", spy)
  monkeypatch.setattr(
    persistent_tier.PersistentTier, "save", lambda *a, **k: inline.append(a) or 1 / 0
  )
  sharding = NamedSharding(mesh, P(None, "data"))
  x = jax.device_put(jnp.arange(64 * 256, dtype=jnp.float32).reshape(64, 256) - 0.5, sharding)
  want = np.asarray(x).copy()
  step_fn = jax.jit(lambda s: {"w": s["w"] * 3 + 1}, donate_argnums=0)
  state = {"w": x}
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    assert mngr.save(4, state)  # both tiers
    state = step_fn(state)  # donates the saved arrays
    mngr.save(5, state)
    mngr.wait_until_finished()
  default = jax.local_devices()[0].default_memory().kind
  assert seen == [[kind or default]] and not inline, (seen, inline)

  abstract = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
  shutil.rmtree(options.local.directory)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    r = mngr.restore(abstract, step=4)
  assert r.source == "persistent" and r.state["w"].sharding.memory_kind == default
  assert np.asarray(r.state["w"]).tobytes() == want.tobytes()

  import orbax.checkpoint as ocp  # noqa: PLC0415

  with ocp.CheckpointManager(layout.tensors_dir(options.persistent.directory)) as plain:
    got = plain.restore(4, args=ocp.args.PyTreeRestore(item=abstract))
  assert np.asarray(got["w"]).tobytes() == want.tobytes()


def test_the_upload_never_moves_the_trainers_preemption_counter(options, mesh, monkeypatch):
  """JAX's preemption sync service agrees on the step after every process's
  last reached_preemption_sync_point(step) call; Orbax's manager would call
  it from the upload threads with the upload's step, so the trainer's own
  reached_preemption() could miss the agreed step on the primary slice.
  Only the trainer's calls reach the service."""
  from jax.experimental import multihost_utils  # noqa: PLC0415

  calls = []
  monkeypatch.setattr(
    multihost_utils,
    "reached_preemption_sync_point",
    lambda step: calls.append((step, threading.current_thread().name)) or False,
  )
  sharding = NamedSharding(mesh, P(None, "data"))
  state = {"w": jax.device_put(jnp.ones((64, 256), jnp.float32), sharding)}
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    for step in (4, 5, 8):
      assert not mngr.reached_preemption(step)
      mngr.save(step, state)
    mngr.wait_until_finished()
    assert 8 in mngr.all_steps()
  main = threading.main_thread().name
  assert calls == [(4, main), (5, main), (8, main)], calls
