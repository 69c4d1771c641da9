"""A restore's peer transfer: moving a step to slices that lost it, over
direct TCP streams between hosts.

Each process of a slice that lost the step pulls every shard it needs from a
process of an intact slice. The state is replicated over the replica axis, so
the device at the same mesh coordinates in another slice holds the same
shard: a receiver finds its senders from the mesh alone (no global device
map), spreading shards round-robin over the intact slices (routing.py).
Bytes go from the sender's verified local file (the pages its own restore
mapped) into one page-aligned buffer of the receiver, laid out like the
local tier's file, and the restored arrays alias it on CPU (one copy on each
side, in the kernel).

Checksums: the receiver checks every shard against the CRC32C of the
sender's manifest as it arrives (pull.py, summed piece by piece while the
next piece moves; several connections per sender on hosts with the cores
to run them); a part of a shard cut for a
reshard is checksummed by the Server as it is sent, after the whole shard
was checked against its record.

The XLA collective permute (collective.py) was slower on CPU hosts (gloo's
TCP) and stays available (peer.transport = "collective") for networks where
hosts cannot open ports to each other.

Security: every process of an intact slice listens during the transfer
only, with a fresh secret published through the coordination service;
both ends prove they hold it (handshake.py), and every header and every
shard carries a MAC under the connection's key (session.py), so a shard
changed on the wire fails even when its CRC32C was fixed too
(CorruptCheckpointError). Nothing received is executed.

Agreement: after the bytes, one exchange (only failures are sent) tells
every process whether every receiver got everything; if not, every process
raises PeerTransferError, so all fall back together (the manager then reads
the persistent tier, or tries an older step).

Called by: every process (transfer); persistent/share.py and the reshard
transfer (Server, request). Coordination: each serving process publishes
its offer (one call), each receiver reads the offers of its own senders
only (one call each), then the agreement (three calls at most). Blocks
until every receiver has its shards, or one failed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from emergency_ckpt.core import failpoints, placement
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CollectiveTimeoutError, PeerTransferError
from emergency_ckpt.local.format import LocalStep, checksum_ok, shard_checksum
from emergency_ckpt.transport import protocol
from emergency_ckpt.transport.pull import receive
from emergency_ckpt.transport.routing import plan_pulls

logger = logging.getLogger("emergency_ckpt")


def _index_key(index) -> tuple[tuple[int, int], ...]:
  return tuple((int(a), int(b)) for a, b in index)


class Server(protocol.Listener):
  """Serves this process's verified shards of one step to receivers that
  prove they hold its secret, until close(). Per process; no collective."""

  _purpose = "restore"

  def __init__(
    self,
    host: str,
    local: LocalStep,
    paths: Sequence[str],
    *,
    timeout_s: float,
    log_prefix: str,
    ports: tuple[int, int] | None = None,
    ready: Mapping[tuple[int, tuple], concurrent.futures.Future] | None = None,
    unverified: set[tuple[int, tuple]] = frozenset(),
    security: protocol.Security | None = None,
  ):
    """Listens at once (Raises OSError if it cannot).

    Args:
      host: the address to listen on.
      local: the verified shards served.
      paths: their leaves' keystr paths.
      timeout_s: the socket timeout.
      log_prefix: this process's log prefix.
      ports: the port range to listen on (None: any).
      ready: {(leaf number, index): future} of shards still being written
        into `local`'s buffer: each is sent once its future is done (a
        failed one drops the connection), so serving starts before they
        all exist (persistent/share.py's pipelined read).
      unverified: (leaf number, index) of shards not checked yet: sent
        whole with their recorded checksum (the receiver checks it),
        checked here first before a part of one is cut.
      security: peer.integrity and peer.encryption (None: a MAC on every
        header and shard, no encryption).
    """
    self._ready = dict(ready or {})
    self._unverified = set(unverified)
    self._timeout_s = timeout_s
    self._prefix = log_prefix
    self._step = local.step
    records = {
      (leaf["path"], _index_key(s["index"])): s
      for leaf in local.manifest["leaves"]
      for s in leaf["shards"]
    }
    self._shards: dict[tuple[int, tuple], tuple[np.ndarray, dict, np.ndarray]] = {}
    for leaf_no, (path, by_index) in enumerate(zip(paths, local.arrays)):
      for index, arr in by_index.items():
        raw = arr.reshape(-1).view(np.uint8)
        self._shards[(leaf_no, index)] = (raw, records[(path, index)], arr)
    self._paths = list(paths)
    self._start(host, ports, security)

  def _handle(self, conn: protocol.Session) -> None:
    """One authenticated request: its shards (or byte ranges), in order."""
    try:
      if failpoints.armed("peer.refuse", self._step):
        return  # a test: the sender drops the connection
      request = conn.recv_json(protocol.MAX_DOCUMENT)
      reply, views, gates = self._answer(request)
      conn.send_json(reply)
      corrupt = failpoints.armed("peer.corrupt_send", self._step)
      for raw, gate in zip(views, gates):
        if gate is not None:
          gate.result(timeout=self._timeout_s)  # raises if its read failed: drop
        if corrupt:  # a test: one flipped bit on the wire
          raw = raw.copy()
          raw[len(raw) // 2] ^= 1
          corrupt = False
        conn.send_payload(raw)
    except (OSError, ValueError, TypeError, KeyError, IndexError) as e:  # a malformed request too
      logger.warning("%s peer transfer: a send failed: %s", self._prefix, e)
    except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as e:
      logger.warning("%s peer transfer: a shard never became ready: %r", self._prefix, e)
    except Exception as e:  # noqa: BLE001 - a gate's read failed: the receiver sees a drop
      logger.warning("%s peer transfer: not sending a shard whose read failed: %s", self._prefix, e)

  def _answer(self, request: Any) -> tuple[dict, list[np.ndarray], list]:
    if not isinstance(request, dict) or request.get("step") != self._step:
      error = f"this process serves step {self._step}, not {request.get('step')!r}"
      return {"error": error}, [], []
    records, views, gates = [], [], []
    for item in request.get("shards", []):
      leaf_no, path, index = item[:3]
      box = item[3] if len(item) > 3 else None  # a part of the shard (reshard.py)
      key = (leaf_no, _index_key(index))
      got = self._shards.get(key)
      if got is None or self._paths[leaf_no] != path or (box is not None and key in self._ready):
        return {"error": f"no shard {index} of leaf {path} here"}, [], []
      raw, record, arr = got
      if box is not None and _index_key(box) == key[1]:
        box = None  # the whole shard: as saved, with the checksum recorded at save
      if box is None:
        records.append({k: v for k, v in record.items() if k in ("nbytes", "crc32c", "crc32")})
      else:  # verified when read (or now): checksummed again as sent
        if key in self._unverified:
          if not checksum_ok(raw, record):
            return {"error": f"shard {index} of leaf {path} here fails its checksum"}, [], []
          self._unverified.discard(key)
        part = arr[tuple(slice(a - i0, b - i0) for (a, b), (i0, _) in zip(box, key[1]))]
        raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        records.append({"nbytes": raw.nbytes, **shard_checksum(raw)})
      views.append(raw)
      gates.append(self._ready.get(key))
    return {"shards": records}, views, gates


def transfer(
  step: int,
  abstract: Sequence[Any],
  paths: Sequence[str],
  local: LocalStep | None,
  *,
  mesh,
  topology,
  collectives,
  intact: Sequence[int],
  lost: Sequence[int],
  host: str | None,
  timeout_s: float,
  ports: tuple[int, int] | None = None,
  security: protocol.Security | None = None,
) -> list:
  """Moves a step to the slices that lost it. Called by: every process.

  Args:
    step: the step.
    abstract: abstract arrays with shardings, one per leaf.
    paths: their keystr paths.
    local: this process's verified shards (intact slices), else None.
    mesh: the job's mesh.
    topology: this process's Topology.
    collectives: the job's Collectives.
    intact: slices that serve, the planned source first.
    lost: slices that receive.
    host: the address to listen on (intact slices).
    timeout_s: the socket and coordination timeout.
    ports: the port range to listen on (None: any).
    security: peer.integrity and peer.encryption (None: the defaults).

  Returns:
    The step's arrays on every process: intact slices keep `local`,
    lost slices get theirs.

  Raises:
    PeerTransferError: on every process, if any receiver failed.
  """
  me = topology.process_index
  server, offer = None, None
  if topology.slice_index in intact:
    try:
      if host is None:
        raise OSError("no address: set peer.host (see PeerOptions)")
      server = Server(
        host,
        local,
        paths,
        timeout_s=timeout_s,
        log_prefix=topology.log_prefix(),
        ports=ports,
        security=security,
      )
      offer = server.offer()
    except OSError as e:
      offer = {"error": f"cannot listen on {host!r}: {e}"}
  arrays, error, pulls = None, None, {}
  if topology.slice_index in lost:
    receivers = sorted(p for s in lost for p in topology.slice_processes[s])
    layout = shards_lib.layout_for(paths, abstract)
    pulls = plan_pulls(
      layout,
      np.asarray(mesh.devices),
      topology.replica_axis_index,
      list(intact),
      receivers.index(me),
    )
  try:
    # Each receiver reads only the offers of its own senders.
    try:
      offers = collectives.exchange_some(
        f"peer_offer_{step}", offer, wanted=sorted(pulls), timeout_s=timeout_s
      )
    except CollectiveTimeoutError as e:
      offers, error = {}, f"process {me}: no address from its senders ({e})"
    if topology.slice_index in lost and error is None:
      try:
        t0 = time.perf_counter()
        buffer = receive(offers, layout, paths, pulls, step=step, timeout_s=timeout_s)
        t1 = time.perf_counter()
        arrays = placement.assemble_buffer(abstract, layout, buffer)
        logger.info(
          "%s peer transfer of step %d: received %.1f MiB in %.3f s (%.2f GB/s) from"
          " processes %s, placed in %.3f s",
          topology.log_prefix(),
          step,
          layout.nbytes / 2**20,
          t1 - t0,
          layout.nbytes / max(t1 - t0, 1e-9) / 1e9,
          sorted(pulls),
          time.perf_counter() - t1,
        )
      except (OSError, PeerTransferError) as e:  # CorruptCheckpointError is an OSError
        error = f"process {me} ({type(e).__name__}): {e}"
        logger.warning("%s peer transfer of step %d failed: %s", topology.log_prefix(), step, e)
    outcome = collectives.gather_sparse(f"peer_done_{step}", error)
  finally:
    if server is not None:
      server.close()
  failed = [e for _, e in sorted(outcome.items())]
  if failed:
    raise PeerTransferError(
      f"the transfer of step {step} to slices {list(lost)} failed: " + "; ".join(failed)
    )
  if arrays is None:  # an intact slice keeps its own verified shards
    arrays = placement.assemble_many(abstract, local.arrays)
  return arrays
