"""Read once per job: the slices split a persistent step's shards between them.

When every slice restores the same step from the persistent tier (no ramdisk
holds it), each slice reading the whole model costs S x its bytes in bucket
egress, bill and bandwidth. Here each process reads from storage only the
slots routing.plan_split gives its slice (about 1/S of its shards, each
checked against its recorded CRC32C like any persistent read), serves them
over the stream transport (peer/stream.py: authenticated TCP, the sender's
CRC32C checked on arrival), and pulls the rest from the processes at its
mesh coordinates in the other slices: the model leaves the bucket once per
restore, and the slices read their parts side by side.

Not yet pipelined: a process serves once its own part is read and checked
(a shard is not forwarded the moment it lands).

Agreement: one sparse exchange of failures after the bytes. A damaged shard
on any process raises CorruptCheckpointError on every process (the restorer
then skips the step, as for any persistent read); any other failure
(address, connection, a shard damaged on the wire) makes every process read
all its own shards from storage instead (read_shared returns None): the
per-process read stays the fallback.

Called by: every process (restorer), when every slice's source is the
persistent tier, there are several slices, the state is replicated over the
replica axis and peer.transport is "stream". Coordination: each process
publishes one offer and reads its senders' (exchange_some), then one
gather_sparse.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np

from emergency_ckpt import shards as shards_lib
from emergency_ckpt.errors import (
  CollectiveTimeoutError,
  CorruptCheckpointError,
  PeerTransferError,
  StateMismatchError,
)
from emergency_ckpt.local_format import LocalStep
from emergency_ckpt.peer import routing, stream

logger = logging.getLogger("emergency_ckpt")


def _served(
  step: int, layout: shards_lib.Layout, paths: Sequence[str], buffer: np.ndarray, mine: set
) -> LocalStep:
  """The slots this process read (and checked), as stream.Server serves a
  local step: views of `buffer`, each with the CRC32C of its bytes."""
  leaves, arrays = [], []
  for leaf_no, (path, leaf) in enumerate(zip(paths, layout.leaves)):
    records, by_index = [], {}
    for slot in leaf.slots:
      if (leaf_no, slot.index) not in mine:
        continue
      raw = buffer[slot.offset : slot.offset + slot.nbytes]
      records.append(
        {
          "index": [list(b) for b in slot.index],
          "nbytes": slot.nbytes,
          "crc32c": crc32c.crc32c(raw),
        }
      )
      by_index[slot.index] = shards_lib.view(buffer, leaf, slot)
    leaves.append({"path": path, "shards": records})
    arrays.append(by_index)
  return LocalStep(step, {"leaves": leaves}, arrays)


def read_shared(
  step: int,
  abstract_tree: Any,
  *,
  persistent,
  expected,
  mesh,
  topology,
  collectives,
  host: str | None,
  timeout_s: float,
  ports: tuple[int, int] | None = None,
) -> list | None:
  """This process's arrays of persistent step `step` (per leaf of
  abstract_tree), read in part here and in part by the other slices; None
  if the transfer failed on some process (then every process returns None:
  read the step per process). Raises CorruptCheckpointError on every
  process if a shard failed its checksum anywhere, StateMismatchError (on
  every process alike) if abstract_tree does not fit the step."""
  paths, abstract, _ = shards_lib.leaf_paths(abstract_tree)
  layout = shards_lib.layout_for(paths, abstract)
  mine, pulls = routing.plan_split(
    layout,
    np.asarray(mesh.devices),
    topology.replica_axis_index,
    topology.num_slices,
    topology.slice_index,
  )
  me = topology.process_index
  failure: dict | None = None
  buffer = None
  try:
    _, buffer = persistent.read_into(
      step, abstract_tree, expected, select=lambda n, slot: (n, slot.index) in mine
    )
  except StateMismatchError:
    raise  # the caller's tree: every process finds the same, before any exchange
  except CorruptCheckpointError as e:
    failure = {"corrupt": True, "error": f"process {me}: {e}"}
  except Exception as e:  # noqa: BLE001 - reported to every process below
    failure = {"corrupt": False, "error": f"process {me} ({type(e).__name__}): {e}"}
  server, offer = None, None
  if failure is not None:
    offer = {"error": failure["error"]}
  else:
    try:
      if host is None:
        raise OSError("no address: set peer.host (see PeerOptions)")
      server = stream.Server(
        host,
        _served(step, layout, paths, buffer, mine),
        paths,
        timeout_s=timeout_s,
        log_prefix=topology.log_prefix(),
        ports=ports,
      )
      offer = server.offer()
    except OSError as e:
      offer = {"error": f"cannot listen on {host!r}: {e}"}
  try:
    try:
      offers = collectives.exchange_some(
        f"persistent_offer_{step}", offer, wanted=sorted(pulls), timeout_s=timeout_s
      )
    except CollectiveTimeoutError as e:
      offers = {}
      failure = failure or {"corrupt": False, "error": f"process {me}: no senders' address ({e})"}
    if failure is None and pulls:
      try:
        stream.receive(offers, layout, paths, pulls, step=step, timeout_s=timeout_s, buffer=buffer)
      except (OSError, PeerTransferError) as e:  # a shard damaged on the wire too
        failure = {"corrupt": False, "error": f"process {me} ({type(e).__name__}): {e}"}
    outcome = collectives.gather_sparse(f"persistent_shared_{step}", failure)
  finally:
    if server is not None:
      server.close()
  corrupt = [f["error"] for _, f in sorted(outcome.items()) if f["corrupt"]]
  if corrupt:
    raise CorruptCheckpointError(corrupt[0])
  if outcome:
    logger.warning(
      "%s the shared read of persistent step %d failed (%s); every process reads its own"
      " shards from storage instead",
      topology.log_prefix(),
      step,
      "; ".join(f["error"] for _, f in sorted(outcome.items())),
    )
    return None
  return [
    shards_lib.assemble(a, {s.index: shards_lib.view(buffer, leaf, s) for s in leaf.slots})
    for a, leaf in zip(abstract, layout.leaves)
  ]
