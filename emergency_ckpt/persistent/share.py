"""Read once per job: the slices split a persistent step's shards between them.

When every slice restores the same step from the persistent tier (no ramdisk
holds it), each slice reading the whole model costs S x its bytes in bucket
egress, bill and bandwidth. Here R of the S slices read (routing.reader_slices:
persistent.shared_read_slices, else its rule by model size: one slice for
small models, more as the model grows): each process of slices 0..R-1 reads from
storage only the slots routing.plan_split gives its slice (about 1/R of its
shards, each checked against its recorded CRC32C like any persistent read)
and serves them over the stream transport (transport/stream.py: authenticated
TCP, the sender's CRC32C checked on arrival); every process pulls the rest
from the processes at its mesh coordinates in the reading slices (a slice
that reads nothing pulls everything and serves nothing): the model leaves
the bucket once per restore, and the readers read their parts side by side.

Pipelined: a process serves while it reads. Its server starts before the
read, each shard gated on its own read and check, with the CRC32C recorded
at save as the shard's checksum (receivers check arrivals against the very
value the bytes were saved with), so a shard leaves as soon as it landed
and passed. Onto another sharding (a slot that is not a saved shard, so no
recorded checksum of its own) a process serves once its part is read.

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

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np

from emergency_ckpt.core import compat, placement
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import (
  CollectiveTimeoutError,
  CorruptCheckpointError,
  PeerTransferError,
  StateMismatchError,
)
from emergency_ckpt.local.format import LocalStep
from emergency_ckpt.runtime.buffers import aligned_empty
from emergency_ckpt.transport import pull, routing, stream

logger = logging.getLogger("emergency_ckpt")


def _served(
  step: int,
  layout: shards_lib.Layout,
  paths: Sequence[str],
  buffer: np.ndarray,
  mine: set,
  crcs: dict | None = None,
) -> LocalStep:
  """The slots this process reads, as stream.Server serves a local step:
  views of `buffer`, each with its CRC32C: `crcs[(leaf number, index)]`
  (recorded at save: the bytes may not be there yet), else summed now."""
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
          "crc32c": crcs[(leaf_no, slot.index)] if crcs else crc32c.crc32c(raw),
        }
      )
      by_index[slot.index] = shards_lib.view(buffer, leaf, slot)
    leaves.append({"path": path, "shards": records})
    arrays.append(by_index)
  return LocalStep(step, {"leaves": leaves}, arrays)


def _recorded(expected, layout: shards_lib.Layout, paths: Sequence[str], mine: set) -> dict | None:
  """{(leaf number, index): CRC32C recorded at save} of this process's
  slots, or None unless each is exactly a saved shard with a recorded CRC."""
  slots = [
    (leaf_no, path, slot)
    for leaf_no, (path, leaf) in enumerate(zip(paths, layout.leaves))
    for slot in leaf.slots
    if (leaf_no, slot.index) in mine
  ]
  try:
    saved = [expected.saved(path, slot.index) for _, path, slot in slots]
    if any(len(s) != 1 or s[0].index != slot.index for s, (_, _, slot) in zip(saved, slots)):
      return None
    expected.prefetch(s[0] for s in saved)
    out = {
      (n, slot.index): expected.recorded(path, s[0]) for s, (n, path, slot) in zip(saved, slots)
    }
  except CorruptCheckpointError:
    return None  # the read itself raises it, through the agreement below
  return None if any(v is None for v in out.values()) else out


def _run(fn) -> BaseException | None:
  """fn()'s exception, or None. StateMismatchError propagates: every
  process finds the same, before any exchange."""
  try:
    fn()
  except StateMismatchError:
    raise
  except Exception as e:  # noqa: BLE001 - reported to every process
    return e
  return None


def _failure(me: int, e: BaseException | None) -> dict | None:
  if e is None:
    return None
  if isinstance(e, CorruptCheckpointError):
    return {"corrupt": True, "error": f"process {me}: {e}"}
  return {"corrupt": False, "error": f"process {me} ({type(e).__name__}): {e}"}


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
  readers: int | None = None,
  security=None,
) -> list | None:
  """This process's arrays of a persistent step, read in part here and in part by other slices.

  Args:
    step: the persistent step.
    abstract_tree: the arrays to restore (shape, dtype, sharding per leaf).
    persistent: the persistent tier (its read_into reads this process's part).
    expected: the step's recorded shard checksums (shard_records.Expected).
    mesh: the mesh of abstract_tree's shardings.
    topology: this job's slices and processes.
    collectives: the exchanges between processes (offers, the outcome).
    host: the address this process serves on; None: it cannot serve.
    timeout_s: how long to wait for the other processes and transfers.
    ports: the ports a sender may listen on (peer.ports); None: any.
    readers: how many slices read from storage (routing.reader_slices: None
      is its rule by model size; more than the slices means all).
    security: peer.integrity and peer.encryption (transport Security; None:
      the defaults).

  Returns:
    The arrays, per leaf of abstract_tree; or None if the transfer failed on
    some process (then every process returns None: read the step per
    process).

  Raises:
    CorruptCheckpointError: on every process, if a shard failed its
      checksum anywhere.
    StateMismatchError: on every process alike, if abstract_tree does not
      fit the step.
  """
  paths, abstract, _ = shards_lib.leaf_paths(abstract_tree)
  layout = shards_lib.layout_for(paths, abstract)
  model_bytes = shards_lib.state_nbytes(abstract)
  mine, pulls = routing.plan_split(
    layout,
    np.asarray(mesh.devices),
    topology.replica_axis_index,
    topology.num_slices,
    topology.slice_index,
    routing.reader_slices(topology.num_slices, model_bytes, readers),
  )
  me = topology.process_index
  if not mine:  # a receiving slice: no read, but the same fit check as a reader's
    compat.check_state(
      {p: (shape, shards_lib.dtype_from_name(dt)) for p, (shape, dt) in expected.arrays.items()},
      paths,
      abstract,
      f"persistent step {step}",
      ordered=False,
    )
  select = lambda n, slot: (n, slot.index) in mine  # noqa: E731
  crcs = _recorded(expected, layout, paths, mine)  # None: not every slot is a saved shard
  buffer = aligned_empty(layout.nbytes)
  gates = {key: concurrent.futures.Future() for key in mine} if crcs is not None else {}

  def read() -> None:
    def ready(leaf_no: int, index: Any) -> None:
      gates[(leaf_no, index)].set_result(True)

    try:
      persistent.read_into(
        step, abstract_tree, expected, select, buffer=buffer, on_ready=ready if gates else None
      )
    except BaseException as e:
      for gate in gates.values():
        if not gate.done():
          gate.set_exception(e)
      raise

  failure: dict | None = None
  reading = None
  if not mine:
    pass  # nothing to read or serve; nobody asks this process for an offer
  elif gates:  # pipelined: serve while reading
    pool = concurrent.futures.ThreadPoolExecutor(1, "ec-shared-read")
    reading = pool.submit(read)
    pool.shutdown(wait=False)  # the thread ends with the read
  else:
    failure = _failure(me, _run(read))
  server, offer = None, None
  if failure is not None:
    offer = {"error": failure["error"]}
  elif mine:
    try:
      if host is None:
        raise OSError("no address: set peer.host (see PeerOptions)")
      server = stream.Server(
        host,
        _served(step, layout, paths, buffer, mine, crcs),
        paths,
        timeout_s=timeout_s,
        log_prefix=topology.log_prefix(),
        ports=ports,
        ready=gates,
        security=security,
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
        pull.receive(offers, layout, paths, pulls, step=step, timeout_s=timeout_s, buffer=buffer)
      except (OSError, PeerTransferError) as e:  # a shard damaged on the wire too
        failure = {"corrupt": False, "error": f"process {me} ({type(e).__name__}): {e}"}
    if reading is not None:  # my own part, read while I pulled the rest
      own = _failure(me, _run(reading.result))
      failure = own if own is not None and (failure is None or own["corrupt"]) else failure
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
  return placement.assemble_buffer(abstract, layout, buffer)
