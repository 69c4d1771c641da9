"""Moving a restored step from slices that hold it to slices that lost it.

Two transports, bit-exact for every dtype: `stream` (stream.py, the default:
authenticated TCP streams between hosts, straight into the arrays' buffer;
its wire protocol, shared with the redundancy schemes: protocol.py) and
`collective` (collective.py: one XLA collective permute over the replica
axis, for networks where hosts cannot open ports to each other). routing.py
decides who serves whom for both.

Called by: every process of the job (a collective); blocks until every lost
slice has its shards, or raises PeerTransferError on every process alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from emergency_ckpt.cluster.topology import peer_host
from emergency_ckpt.local.format import LocalStep
from emergency_ckpt.transport import collective, protocol, stream
from emergency_ckpt.transport.routing import check_peer_compatible

__all__ = ["check_peer_compatible", "transfer"]


def transfer(
  step: int,
  abstract: Sequence[Any],
  paths: Sequence[str],
  mine: LocalStep | None,
  *,
  options,
  mesh,
  topology,
  collectives,
  intact: Sequence[int],
  lost: Sequence[int],
  timeout_s: float,
) -> list:
  """Moves a step to the slices that lost it, over the transport `options`
  names. Called by: every process.

  Args:
    step: the step.
    abstract: abstract arrays with shardings, one per leaf.
    paths: their keystr paths.
    mine: this process's verified shards (intact slices), else None.
    options: the manager's PeerOptions.
    mesh: the job's mesh.
    topology: this process's Topology.
    collectives: the job's Collectives.
    intact: slices that serve, the planned source first.
    lost: slices that receive.
    timeout_s: the transfer's timeout.

  Returns:
    The step's arrays (per leaf of `abstract`) on every process: intact
    slices keep `mine`, slices in `lost` receive theirs.

  Raises:
    PeerTransferError: on every process alike, if any receiver failed.
  """
  if options.transport == "stream":
    return stream.transfer(
      step,
      abstract,
      paths,
      mine,
      mesh=mesh,
      topology=topology,
      collectives=collectives,
      intact=intact,
      lost=lost,
      host=peer_host(options.host) if mine is not None else None,
      timeout_s=timeout_s,
      ports=options.port_range,
      security=protocol.Security.of(options),
    )
  return collective.transfer(
    abstract,
    None if mine is None else mine.arrays,
    mesh=mesh,
    replica_axis=topology.replica_axis_name,
    intact=intact,
    lost=lost,
  )
