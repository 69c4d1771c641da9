"""Slices and process identity: who this process is, which slice it belongs
to, which machine and job it runs in, and where peers reach it.

Slices come from the mesh's replica axis: the processes owning the devices
at one replica-axis entry form a slice. Pure given the mesh, except the
machine's boot id and the coordinator's address (read through
jax_runtime.py).

Called by: the manager (once, at start), the tiers and the transfers (their
Topology); no collective.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import socket
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from emergency_ckpt.cluster import jax_runtime
from emergency_ckpt.errors import TopologyError

logger = logging.getLogger("emergency_ckpt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
  """Who this process is, and how processes group into slices."""

  process_index: int
  process_count: int
  slice_index: int
  slice_processes: tuple[tuple[int, ...], ...]
  """slice_processes[s] = sorted process indices of slice s."""
  replica_axis_index: int
  replica_axis_name: str
  mesh_shape: tuple[int, ...]
  mesh_axis_names: tuple[str, ...]
  slice_grid: tuple[int, ...] | None = None
  """The slice position of the process owning each device of this process's
  slice, row-major over the mesh without the replica axis (recorded with
  local copies, so another mesh can reshard them: core/reshard.py)."""
  process_origin: tuple[int, ...] | None = None
  """process_origin[p]: the flat mesh index of process p's first device:
  where its data shard sits (a restart that moves processes across mesh
  coordinates maps each saved data state to the process now there)."""

  @property
  def num_slices(self) -> int:
    """How many slices the job has."""
    return len(self.slice_processes)

  @property
  def is_primary_slice(self) -> bool:
    """This process belongs to slice 0."""
    return self.slice_index == 0

  @property
  def primary_process(self) -> int:
    """The process that writes markers: the first process of slice 0."""
    return self.slice_processes[0][0]

  @property
  def is_primary_process(self) -> bool:
    """This process is the primary process (see primary_process)."""
    return self.process_index == self.primary_process

  @functools.cached_property
  def slice_of(self) -> dict[int, int]:
    """{process: its slice} (built once, on first use)."""
    return {p: s for s, procs in enumerate(self.slice_processes) for p in procs}

  def fingerprint(self) -> dict[str, Any]:
    """What a local-tier step must match to be read back by this job.

    Returns:
      A fresh dict each call (its O(processes) lists are built once: every
      save records it): process count, slice processes, mesh shape and axis
      names, replica axis, and the process origins when known.
    """
    return dict(self._fingerprint)

  @functools.cached_property
  def _fingerprint(self) -> dict[str, Any]:
    return {
      "process_count": self.process_count,
      "slice_processes": [list(p) for p in self.slice_processes],
      "mesh_shape": list(self.mesh_shape),
      "mesh_axis_names": list(self.mesh_axis_names),
      "replica_axis": self.replica_axis_name,
      **({} if self.process_origin is None else {"process_origin": list(self.process_origin)}),
    }

  def log_prefix(self) -> str:
    """The prefix of this process's log lines.

    Returns:
      "[process=<i>][slice=<s>]".
    """
    return f"[process={self.process_index}][slice={self.slice_index}]"

  @property
  def slice_position(self) -> int:
    """This process's place among its slice's processes (0 = the first)."""
    return list(self.slice_processes[self.slice_index]).index(self.process_index)


def slice_shape(fingerprint: dict[str, Any]) -> tuple | None:
  """What one slice of a topology looks like. Two topologies with the same
  slice shape place the same shards on the process at the same slice
  position, whatever the slice count or the process indices: a local copy
  written by one serves the other.

  Args:
    fingerprint: a Topology.fingerprint(), as a local copy recorded it.

  Returns:
    (the mesh shape without the replica axis, its axis names, the sorted
    distinct process counts per slice), or None if the fingerprint is
    malformed.
  """
  try:
    names = list(fingerprint["mesh_axis_names"])
    replica = names.index(fingerprint["replica_axis"])
    shape = [int(d) for i, d in enumerate(fingerprint["mesh_shape"]) if i != replica]
    per_slice = sorted({len(p) for p in fingerprint["slice_processes"]})
    return (tuple(shape), tuple(n for i, n in enumerate(names) if i != replica), tuple(per_slice))
  except (KeyError, TypeError, ValueError):
    return None


def slice_position_of(fingerprint: dict[str, Any], process: int) -> int | None:
  """Where `process` sits among its slice's processes in a topology.

  Args:
    fingerprint: a Topology.fingerprint().
    process: a process index of that topology.

  Returns:
    Its slice position (0 = the slice's first process), or None if no
    slice of the fingerprint lists it.
  """
  for procs in fingerprint.get("slice_processes", []):
    if process in procs:
      return list(procs).index(process)
  return None


def resolve_replica_axis(mesh: jax.sharding.Mesh, replica_axis: str | int) -> int:
  """The index of the mesh's replica axis (the axis whose entries are slices).

  Args:
    mesh: the job's mesh.
    replica_axis: the axis, by name or by index.

  Returns:
    Its index among the mesh's axes.

  Raises:
    TopologyError: an index out of range, or a name the mesh does not have.
  """
  names = tuple(mesh.axis_names)
  if isinstance(replica_axis, int):
    if not 0 <= replica_axis < len(names):
      raise TopologyError(
        f"replica_axis={replica_axis} is out of range for a mesh with axes"
        f" {names}; pass one of {list(names)} or an index below {len(names)}."
      )
    return replica_axis
  if replica_axis not in names:
    raise TopologyError(
      f"replica_axis={replica_axis!r} is not an axis of the mesh {names};"
      " set CheckpointManagerOptions(replica_axis=...) to the axis whose"
      " entries are slices (data-parallel replicas)."
    )
  return names.index(replica_axis)


def topology_from_mesh(mesh: jax.sharding.Mesh, replica_axis: str | int) -> Topology:
  """Splits processes into slices along the replica axis (pure given the mesh).

  Called by: every process, once per manager; no collective.

  Args:
    mesh: the job's mesh, spanning every process.
    replica_axis: the axis whose entries are slices, by name or index.

  Returns:
    This process's Topology.

  Raises:
    TopologyError: a bad replica axis, a process owning devices of two
      slices, or a process owning no device of the mesh.
  """
  axis = resolve_replica_axis(mesh, replica_axis)
  devices = np.asarray(mesh.devices)
  slices: list[tuple[int, ...]] = []
  owner: dict[int, int] = {}
  for s in range(devices.shape[axis]):
    procs = sorted({d.process_index for d in devices.take(s, axis=axis).flat})
    for p in procs:
      if p in owner:
        raise TopologyError(
          f"process {p} owns devices in slices {owner[p]} and {s} of replica"
          f" axis {mesh.axis_names[axis]!r}; every process must belong to"
          " exactly one slice. Put whole hosts on each replica-axis entry."
        )
      owner[p] = s
    slices.append(tuple(procs))
  me = jax.process_index()
  count = jax.process_count()
  origin: dict[int, int] = {}
  for flat, d in enumerate(devices.flat):
    origin.setdefault(int(d.process_index), flat)
  if sorted(owner) != list(range(count)):
    missing = sorted(set(range(count)) - set(owner))
    raise TopologyError(
      f"processes {missing} own no device of the mesh; the mesh must span every process of the job."
    )
  return Topology(
    process_index=me,
    process_count=count,
    slice_index=owner[me],
    slice_processes=tuple(slices),
    replica_axis_index=axis,
    replica_axis_name=str(mesh.axis_names[axis]),
    mesh_shape=tuple(devices.shape),
    mesh_axis_names=tuple(str(n) for n in mesh.axis_names),
    slice_grid=tuple(_slice_grid(devices.take(owner[me], axis=axis), slices[owner[me]])),
    process_origin=tuple(origin[p] for p in range(count)),
  )


def _slice_grid(slice_devices: np.ndarray, slice_processes: Sequence[int]) -> list[int]:
  """The slice positions of the processes owning each device of one slice
  (the mesh's devices at that slice's replica coordinate), row-major over
  the mesh without the replica axis."""
  position = {p: i for i, p in enumerate(slice_processes)}
  return [position[int(d.process_index)] for d in np.asarray(slice_devices).flat]


def peer_host(override: str | None) -> str | None:
  """The address peer slices reach this process at. Called by: any process.

  Args:
    override: the configured address (peer.host), or None to find it.

  Returns:
    `override` if set; else the address of the interface that routes to
    the JAX coordinator (a UDP "connect" sends nothing); "127.0.0.1" in a
    single-process job; None if no interface routes there (logged).
  """
  if override:
    return override
  coordinator = jax_runtime.coordinator_address()
  if not coordinator:
    return "127.0.0.1"  # a single-process job: nobody else to serve
  host = coordinator.rsplit(":", 1)[0].strip("[]")
  try:
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
      s.connect(addr)
      return s.getsockname()[0]
  except OSError as e:
    logger.warning("cannot find the address that routes to %s (%s); set peer.host", host, e)
    return None


def host_identity(override: str | None = None) -> str:
  """The machine this process runs on. Called by: any process.

  Args:
    override: the configured host id (host_id), or None to find it.

  Returns:
    `override` if set; else "boot:<the kernel's boot id>" (shared by every
    process and container on one machine, whatever their hostnames; new at
    each boot); else the hostname.
  """
  if override:
    return override
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot_id = f.read().strip()
    if boot_id:
      return f"boot:{boot_id}"  # whole: thousands of hosts must not collide
  except OSError:
    pass
  return socket.gethostname()


def job_key() -> str | None:
  """A short id shared by the processes of this job and no other. Called
  by: any process.

  Returns:
    A digest of the coordinator's address and the process count (16 hex
    digits), or None in a single-process job.
  """
  coordinator = jax_runtime.coordinator_address()
  if not coordinator or jax.process_count() == 1:
    return None
  raw = f"{coordinator}/{jax.process_count()}".encode()
  return hashlib.sha256(raw).hexdigest()[:16]
