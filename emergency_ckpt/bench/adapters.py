"""One interface over the three managers under test.

Each adapter is made fresh on every process (a collective for all three),
and offers save / wait_local / wait_all / restore / close. Where a manager
has no public hook for a figure, the adapter uses the narrowest private one
and says so in `notes`.
"""

from __future__ import annotations

import abc
import os
import socket
from typing import Any

import jax

from emergency_ckpt.bench.state import Layout
from emergency_ckpt.cluster import jax_runtime

OURS = "emergency_ckpt"
ORBAX_MS = "orbax_multislice"
ORBAX_P2P = "orbax_p2p"
MANAGERS = (OURS, ORBAX_MS, ORBAX_P2P)


def orbax_prerequisites() -> None:
  """What Orbax's emergency code needs outside absl.app.run, after
  jax.distributed.initialize (see the multiprocess-jax-cpu notes)."""
  from absl import flags  # noqa: PLC0415

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  if jax.process_count() > 1:
    jax_runtime.init_orbax_id_tables()


def patch_p2p_loopback() -> None:
  """Makes Orbax's P2P peer server bind and advertise 127.0.0.1.

  p2p/service.py binds ('0.0.0.0', 0) (or ('::', 0)) in P2PNode.__init__ and
  advertises _get_primary_ip(); neither is an option. Benchmark only: every
  process runs on this machine, so loopback is enough and nothing is exposed.
  """
  from orbax.checkpoint.experimental.emergency.p2p import service  # noqa: PLC0415

  base = service._ThreadingTCPServer  # noqa: SLF001
  if getattr(base, "bench_loopback", False):
    return

  class LoopbackServer(base):
    bench_loopback = True
    address_family = socket.AF_INET

    def __init__(self, server_address, *args, **kwargs):
      super().__init__(("127.0.0.1", server_address[1]), *args, **kwargs)

  service._ThreadingTCPServer = LoopbackServer  # noqa: SLF001
  service._get_primary_ip = lambda: (socket.AF_INET, "127.0.0.1")  # noqa: SLF001


class Adapter(abc.ABC):
  name = ""
  notes: dict[str, str] = {}

  @abc.abstractmethod
  def save(self, step: int, state: Any) -> bool:
    """Implemented per manager."""

  def prepare(self) -> None:
    """Prepares for the first save while the trainer would initialize, where
    the manager has such a call (the documented flow); a no-op otherwise."""
    return None

  @abc.abstractmethod
  def wait_local(self) -> None:
    """Blocks until this process's local-tier copy of the last save is durable."""

  @abc.abstractmethod
  def wait_all(self) -> None:
    """Blocks until every tier this process writes is durable."""

  @abc.abstractmethod
  def restore(self) -> tuple[Any, int, str]:
    """(state, step, source) of the newest step."""

  def latest_step(self) -> int | None:
    """The manager's newest step, None if it has none (before a first restore)."""
    return self._m.latest_step()

  @abc.abstractmethod
  def close(self) -> None:
    """Implemented per manager."""


class Ours(Adapter):
  name = OURS
  notes = {
    "wait_local": "private LocalTier.wait(): the ramdisk files are fsynced and"
    " renamed into place (the state JSON/COMMIT and the persistent copy are"
    " then still pending; wait_until_finished covers them)",
  }

  def __init__(
    self,
    layout: Layout,
    local_dir: str,
    persistent_dir: str,
    host_id: str | None = None,
    peer_integrity: str = "mac",
  ):
    """`host_id`: the simulated host (elastic.py runs several per machine);
    None keeps the library's default (the machine's boot id).
    `peer_integrity`: peer.integrity (the library's default "mac")."""
    import emergency_ckpt as ec  # noqa: PLC0415

    options = ec.CheckpointManagerOptions(
      local=ec.LocalTierOptions(directory=local_dir),
      persistent=ec.PersistentTierOptions(directory=persistent_dir),
      peer=ec.PeerOptions(integrity=peer_integrity),
      host_id=host_id,
    )
    self._layout = layout
    self._m = ec.CheckpointManager(options, mesh=layout.mesh)

  def save(self, step, state):
    return self._m.save(step, state, data_state={"step": step})

  def prepare(self):
    self._m.prepare(self._layout.abstract)

  def wait_local(self):
    # The manager has no public "local tier only" wait: its parts' local tier
    # is the private hook (never a silent fallback to the full wait, which
    # would time the persistent upload as the local write).
    self._m._parts.local.wait()  # noqa: SLF001

  def wait_all(self):
    self._m.wait_until_finished()

  def restore(self):
    r = self._m.restore(self._layout.abstract)
    self.phases = dict(r.phases)  # where the restore's time went (the results' JSON)
    return r.state, r.step, r.source

  def close(self):
    self._m.close()


class OrbaxMultislice(Adapter):
  name = ORBAX_MS
  notes = {
    "tiers": "by design slice 0 saves only to persistent and the other slices"
    " only to their ramdisks; every restore broadcasts one slice's copy",
    "wait_local": "no separate hook: wait_until_finished on each process waits"
    " for the one tier that process writes",
  }

  def __init__(
    self,
    layout: Layout,
    local_dir: str,
    persistent_dir: str,
    *,
    local_interval: int | None = None,
    persistent_interval: int | None = None,
  ):
    """`local_interval`, `persistent_interval`: the tiers' save_interval_steps
    (benchmarks/goodput.py); None keeps Orbax's defaults (10 and 1000)."""
    from orbax.checkpoint.experimental.emergency import (  # noqa: PLC0415
      checkpoint_manager as ecm,
    )

    orbax_prerequisites()
    self._layout = layout
    options = None
    if local_interval is not None or persistent_interval is not None:
      defaults = ecm.CheckpointManagerOptions()
      options = ecm.CheckpointManagerOptions(
        local=ecm.LocalCheckpointOptions(
          save_interval_steps=local_interval or defaults.local.save_interval_steps
        ),
        persistent=ecm.PersistentCheckpointOptions(
          save_interval_steps=persistent_interval or defaults.persistent.save_interval_steps
        ),
      )
    self._m = ecm.CheckpointManager(
      local_directory=local_dir,
      persistent_directory=persistent_dir,
      global_mesh=layout.mesh,
      abstract_state=layout.abstract,
      options=options,
    )
    inner = self._m._checkpoint_manager  # noqa: SLF001
    self._source = "unknown"
    self._wrap(inner)

  def _wrap(self, inner) -> None:
    from_local, from_persistent = inner._restore_from_local, inner._restore_from_persistent  # noqa: SLF001

    def local(step, restoring_slice_id, directory=None):
      self._source = f"local copy of slice {restoring_slice_id} + broadcast"
      return from_local(step=step, restoring_slice_id=restoring_slice_id, directory=directory)

    def persistent(step, directory=None):
      self._source = "persistent (slice 0 reads) + broadcast"
      return from_persistent(step=step, directory=directory)

    inner._restore_from_local = local  # noqa: SLF001
    inner._restore_from_persistent = persistent  # noqa: SLF001

  def save(self, step, state):
    import orbax.checkpoint as ocp  # noqa: PLC0415

    return self._m.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))

  def wait_local(self):
    self._m.wait_until_finished()

  def wait_all(self):
    self._m.wait_until_finished()

  def restore(self):
    step = self._m.latest_step()
    restored = self._m.restore(step)
    return restored.state, step, self._source

  def close(self):
    self._m.close()


class OrbaxP2P(Adapter):
  name = ORBAX_P2P
  notes = {
    "options": "local and persistent save_interval_steps = 1, other options default",
    "network": "peer server bound to 127.0.0.1 by a benchmark-only monkeypatch",
    "wait_local": "private _local_manager.wait_until_finished()",
  }

  def __init__(self, layout: Layout, local_dir: str, persistent_dir: str):
    from orbax.checkpoint.experimental.emergency.p2p import (  # noqa: PLC0415
      checkpoint_manager as p2p_cm,
    )
    from orbax.checkpoint.experimental.emergency.p2p import options as p2p_options  # noqa: PLC0415

    orbax_prerequisites()
    patch_p2p_loopback()
    self._layout = layout
    options = p2p_options.CheckpointManagerOptions(
      local=p2p_options.LocalCheckpointOptions(save_interval_steps=1),
      persistent=p2p_options.PersistentCheckpointOptions(save_interval_steps=1),
    )
    self._m = p2p_cm.CheckpointManager(
      layout.mesh, layout.abstract, local_dir, persistent_dir, options=options
    )
    node = self._m._p2p._p2p_node  # noqa: SLF001
    self.bound = f"{node.server.server_address[0]}:{node.port} (advertised {node.ip})"
    if node.server.server_address[0] != "127.0.0.1":
      raise RuntimeError(f"P2P server is not on loopback: {self.bound}")
    self._source = "unknown"
    self._wrap()

  def _wrap(self) -> None:
    m = self._m
    local_or_p2p = m._restore_from_local_or_p2p  # noqa: SLF001
    persistent = m._restore_from_persistent_storage  # noqa: SLF001
    fetch = m._p2p.fetch  # noqa: SLF001

    def wrapped_local_or_p2p(step, args):
      self._source = "local"
      return local_or_p2p(step, args)

    def wrapped_fetch(step):
      self._source = "peer fetch (TCP)"
      return fetch(step)

    def wrapped_persistent(step, args):
      self._source = "persistent (slice 0 reads) + broadcast"
      return persistent(step, args)

    m._restore_from_local_or_p2p = wrapped_local_or_p2p  # noqa: SLF001
    m._restore_from_persistent_storage = wrapped_persistent  # noqa: SLF001
    m._p2p.fetch = wrapped_fetch  # noqa: SLF001

  def save(self, step, state):
    import orbax.checkpoint as ocp  # noqa: PLC0415
    from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args  # noqa: PLC0415

    return self._m.save(step, args=p2p_args.Composite(state=ocp.args.PyTreeSave(state)))

  def wait_local(self):
    self._m._local_manager.wait_until_finished()  # noqa: SLF001

  def wait_all(self):
    self._m.wait_until_finished()

  def restore(self):
    import orbax.checkpoint as ocp  # noqa: PLC0415
    from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args  # noqa: PLC0415

    restored = self._m.restore(
      None, args=p2p_args.Composite(state=ocp.args.PyTreeRestore(item=self._layout.abstract))
    )
    return restored.state, self._m.latest_step(), self._source

  def close(self):
    self._m.close()


ADAPTERS = {OURS: Ours, ORBAX_MS: OrbaxMultislice, ORBAX_P2P: OrbaxP2P}


def make(name: str, layout: Layout, local_dir: str, persistent_dir: str, **kwargs) -> Adapter:
  """Called by workers.py, elastic.py and benchmarks/goodput_job.py on every
  process; `kwargs` go to the adapter (Ours: host_id; OrbaxMultislice:
  local_interval, persistent_interval)."""
  os.makedirs(local_dir, mode=0o700, exist_ok=True)
  os.makedirs(persistent_dir, exist_ok=True)
  return ADAPTERS[name](layout, local_dir, persistent_dir, **kwargs)
