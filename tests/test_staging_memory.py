"""local.keep_staging_buffer: the staging buffer kept between saves (the
default) or let go once the step's last reader is done, its pages back to
the system at once; either way saves and restores stay bit-exact.
benchmarks/results/memory.md measures what each costs."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import mmap
import shutil
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt.runtime import buffers as buffers_lib
from emergency_ckpt.runtime.background import Background
from emergency_ckpt.runtime.buffers import BufferPool
from emergency_ckpt.runtime.staging import StagingArea

_NBYTES = 8 << 20
linux_only = pytest.mark.skipif(
  not sys.platform.startswith("linux") or buffers_lib._MADVISE is None,  # noqa: SLF001
  reason="needs Linux madvise and mincore",
)


def _resident_pages(buf: np.ndarray) -> int:
  """How many of `buf`'s whole pages are resident now (mincore)."""
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
  pages = buf.nbytes // mmap.PAGESIZE
  vec = (ctypes.c_ubyte * pages)()
  libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
  assert libc.mincore(ctypes.c_void_p(buf.ctypes.data), pages * mmap.PAGESIZE, vec) == 0
  return sum(v & 1 for v in vec)


def _filled(pool: BufferPool) -> np.ndarray:
  buf = pool.acquire(_NBYTES)
  buf[:] = 0xA5
  return buf


@linux_only
def test_a_kept_buffer_stays_faulted_in_and_is_reused():
  pool = BufferPool(1)
  a = _filled(pool)
  pool.release(a)
  assert pool.free_count() == 1
  assert _resident_pages(a) == _NBYTES // mmap.PAGESIZE
  assert pool.acquire(_NBYTES) is a


@linux_only
def test_a_released_buffer_gives_its_pages_back_when_its_write_ends():
  pool = BufferPool(1, keep=False)
  a = _filled(pool)
  assert _resident_pages(a) == _NBYTES // mmap.PAGESIZE
  pool.release(a)
  assert pool.free_count() == 0
  assert _resident_pages(a) == 0  # even though `a` is still referenced here
  b = pool.acquire(_NBYTES)
  assert b is not a and not b.any()  # a fresh, zeroed buffer
  pool.release(b)


@linux_only
def test_a_reader_keeps_the_pages_until_it_lets_go():
  """The persistent upload holds the buffer past the local write: its bytes
  stay until the last reader lets go, whichever of the two ends last."""
  pool = BufferPool(1, keep=False)
  a = _filled(pool)
  pool.hold(a)
  pool.hold(a)
  pool.release(a)  # the local write is done; two readers remain
  pool.unhold(a)
  assert _resident_pages(a) == _NBYTES // mmap.PAGESIZE
  assert (a == 0xA5).all()
  pool.unhold(a)
  assert _resident_pages(a) == 0 and pool.free_count() == 0


def test_prepare_allocates_nothing_where_buffers_are_not_kept(mesh):
  pool = BufferPool(1, keep=False)
  pool.preallocate(_NBYTES)
  assert pool.free_count() == 0 and pool.allocated == 0
  background = Background()
  area = StagingArea(buffers=1, job=None, preparer=background.lane("prepare"), keep_buffers=False)
  try:
    state = _state(mesh, 1.0)
    area.prepare(["w"], [state["w"]])
    area.wait_prepared()
    assert area._pool.allocated == 0  # noqa: SLF001
  finally:
    area.close()
    background.close()


@pytest.mark.parametrize("bad", [0, "no", None])
def test_keep_staging_buffer_must_be_a_bool(bad):
  with pytest.raises(
    ec.InvalidOptionsError, match="local.keep_staging_buffer must be true or false"
  ):
    ec.LocalTierOptions(directory="/dev/shm/x", keep_staging_buffer=bad)


def test_keep_staging_buffer_defaults_on_and_loads_from_yaml():
  assert ec.LocalTierOptions(directory="/dev/shm/x").keep_staging_buffer is True
  opts = ec.options_from_dict(
    {
      "local": {"directory": "/dev/shm/x", "keep_staging_buffer": False},
      "persistent": {"directory": "/tmp/p"},
    }
  )
  assert opts.local.keep_staging_buffer is False


def _state(mesh, scale: float) -> dict:
  """Leaves with awkward bits (-0.0, a denormal, random fractions)."""
  rng = np.random.default_rng(int(scale * 1000))
  w = rng.random((64, 1024), dtype=np.float32) * scale
  w.view(np.uint32)[0, :2] = (0x80000000, 0x00000001)
  b = np.arange(24, dtype=np.int32) * int(scale)
  return {
    "w": jax.device_put(w, NamedSharding(mesh, P("data"))),
    "b": jax.device_put(b, NamedSharding(mesh, P())),
  }


def _abstract(state: dict) -> dict:
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


def _same_bits(got: dict, want: dict) -> bool:
  return all(np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes() for k in want)


@pytest.mark.parametrize("keep", [True, False])
def test_saves_and_restores_stay_bit_exact(options, mesh, keep):
  """Local steps 2 and 6, local + persistent step 4 (options fixture): the
  newest comes back exactly from the ramdisk, step 4 from the persistent
  tier, and with keep off the manager's pool keeps no buffer after a save."""
  options = dataclasses.replace(
    options, local=dataclasses.replace(options.local, keep_staging_buffer=keep)
  )
  states = {s: _state(mesh, float(s)) for s in (2, 4, 6)}
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    pool = mngr._parts.staging._pool  # noqa: SLF001
    assert pool.keep is keep
    for step, state in states.items():
      assert mngr.save(step, state, data_state={"step": step})
      mngr.wait_until_finished()
      assert pool.free_count() == (1 if keep else 0)
    r = mngr.restore(_abstract(states[6]))
    assert (r.step, r.source) == (6, "local") and _same_bits(r.state, states[6])
  shutil.rmtree(options.local.directory)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    r = mngr.restore(_abstract(states[4]))
    assert (r.step, r.source) == (4, "persistent")
    assert _same_bits(r.state, states[4]) and r.data_state == {"step": 4}
