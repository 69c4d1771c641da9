"""Experiment: scale_real's restart job with a trace of each collective and phase in restore()."""

import functools
import os
import time

TRACE = []


def _wrap(obj, name, label=None):
  fn = getattr(obj, name)

  @functools.wraps(fn)
  def w(*a, **kw):
    t = time.monotonic()
    c = time.process_time()
    try:
      return fn(*a, **kw)
    finally:
      arg = a[1] if len(a) > 1 and isinstance(a[1], str) else ""
      TRACE.append((label or name, arg, t, time.monotonic(), time.process_time() - c))

  setattr(obj, name, w)


def restart_worker(args):
  from emergency_ckpt.peer import stream

  from emergency_ckpt import restorer, topology

  for n in (
    "gather_sparse",
    "exchange_some",
    "exchange_keyed",
    "gather_tree",
    "exchange",
    "barrier",
  ):
    _wrap(topology.Collectives, n)
  from emergency_ckpt import manager

  _wrap(manager.CheckpointManager, "restore", "RESTORE")
  _wrap(restorer.Restorer, "_try_load")
  _wrap(restorer.Restorer, "_execute")
  _wrap(restorer.Restorer, "_discard_newer")
  _wrap(restorer.Restorer, "_record")
  from emergency_ckpt import orbax_loader, staging
  from emergency_ckpt import shards as shards_lib

  _wrap(staging.Staging if hasattr(staging, "Staging") else staging.StagingArea, "prepare")
  _wrap(
    orbax_loader.OrbaxLoader if hasattr(orbax_loader, "OrbaxLoader") else orbax_loader.Orbax,
    "start",
    "orbax_start",
  )
  _wrap(shards_lib, "layout_for")
  _wrap(stream, "transfer", "stream.transfer")
  from emergency_ckpt.bench import scale_real

  if os.environ.get("EXP_POST_BARRIER"):
    from emergency_ckpt.bench.sync import barrier

    inner = manager.CheckpointManager.restore

    def r2(self, *a, **kw):
      try:
        return inner(self, *a, **kw)
      finally:
        barrier("exp-post-restore")

    manager.CheckpointManager.restore = r2
  if os.environ.get("EXP_PROFILE"):
    import cProfile
    import io
    import pstats

    import jax

    inner2 = manager.CheckpointManager.restore

    def r3(self, *a, **kw):
      if jax.process_index() not in (5, 13):
        return inner2(self, *a, **kw)
      pr = cProfile.Profile(time.process_time)
      pr.enable()
      try:
        return inner2(self, *a, **kw)
      finally:
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
        open(f"prof_{jax.process_index()}.txt", "w").write(s.getvalue())

    manager.CheckpointManager.restore = r3
  out = scale_real.restart_worker(args)
  out["trace"] = TRACE
  return out


def save_worker(args):
  from emergency_ckpt.bench import scale_real

  return scale_real.save_worker(args)
