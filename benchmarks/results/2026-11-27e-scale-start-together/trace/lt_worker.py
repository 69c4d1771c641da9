"""Trace of the first latest_step(): absolute monotonic times (one machine: one clock)."""

import functools
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
      TRACE.append((label or name, t, time.monotonic(), time.process_time() - c))

  setattr(obj, name, w)


class _Client:
  def __init__(self, inner):
    self._inner = inner

  def __getattr__(self, name):
    fn = getattr(self._inner, name)

    def w(*a, **kw):
      t = time.monotonic()
      try:
        return fn(*a, **kw)
      finally:
        TRACE.append(("rpc:" + name, t, time.monotonic(), 0.0))

    return w


def restart_worker(args):
  from emergency_ckpt import inventory, local_tier, persistent_tier, state_store, topology

  _wrap(topology.Collectives, "group_by")
  _wrap(topology.Collectives, "gather_tree")
  _wrap(inventory.Inventory, "exchange")
  _wrap(local_tier.LocalTier, "usable_steps")
  _wrap(local_tier.LocalTier, "copies")
  _wrap(state_store.StateStore, "listed_steps")
  _wrap(state_store.StateStore, "committed_steps")
  _wrap(persistent_tier.PersistentTier, "steps")
  orig_init = topology.Collectives.__init__

  def init(self, *a, **kw):
    orig_init(self, *a, **kw)
    if self._client is not None:
      self._client = _Client(self._client)

  topology.Collectives.__init__ = init
  from emergency_ckpt import manager
  from emergency_ckpt.bench import scale_real

  inner = manager.CheckpointManager.latest_step
  calls = [0]

  def ls(self):
    calls[0] += 1
    if calls[0] == 1:
      TRACE.clear()
      t = time.monotonic()
      try:
        return inner(self)
      finally:
        TRACE.append(("LATEST", t, time.monotonic(), 0.0))
        ls.trace = list(TRACE)
    return inner(self)

  manager.CheckpointManager.latest_step = ls
  from emergency_ckpt.peer import stream

  from emergency_ckpt import restorer

  _wrap(topology.Collectives, "gather_sparse")
  _wrap(topology.Collectives, "exchange_some")
  _wrap(restorer.Restorer, "_try_load")
  _wrap(restorer.Restorer, "_execute")
  _wrap(stream, "receive")
  from emergency_ckpt import background as bg
  from emergency_ckpt import local_tier as lt2
  from emergency_ckpt import persistent_tier as pt
  from emergency_ckpt import staging as stg

  _wrap(manager.CheckpointManager, "_wait_saves")
  _wrap(manager.CheckpointManager, "_wait_idle")
  _wrap(bg.Background, "drain")
  _wrap(bg.Background, "wait", "bg.wait")
  _wrap(pt.PersistentTier, "wait_until_finished", "pt.wait_until_finished")
  _wrap(stg.StagingArea, "wait_prepared")
  _wrap(lt2.LocalTier, "wait", "local.wait")
  _wrap(stream.Server, "close", "server.close")
  _wrap(stream.Server, "__init__", "server.init")
  inner_r = manager.CheckpointManager.restore

  def rs(self, *a, **kw):
    TRACE.clear()
    t = time.monotonic()
    try:
      return inner_r(self, *a, **kw)
    finally:
      TRACE.append(("RESTORE", t, time.monotonic(), 0.0))
      rs.trace = list(TRACE)

  manager.CheckpointManager.restore = rs
  out = scale_real.restart_worker(args)
  out["trace"] = ls.trace
  out["rtrace"] = rs.trace
  return out


def save_worker(args):
  from emergency_ckpt.bench import scale_real

  return scale_real.save_worker(args)
