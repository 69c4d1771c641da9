"""A receiver's side of a peer transfer: it asks a sender (stream.Server)
for shards and receives them into their slots of one buffer, over one or
several connections per sender.

Each shard is one payload: its pieces are MAC'd and summed into its
checksum on a helper thread while the next piece arrives (session.py), so
every byte is checked while still in cache, and the check overlaps the
kernel's copy of the next piece. The shard's checksum must match the
sender's manifest record before the transfer counts.

Called by: stream.transfer (a restore's receivers), persistent/share.py,
restore/reshard_transfer.py (request). Per process; no collective.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Sequence

import numpy as np

from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CorruptCheckpointError, PeerTransferError
from emergency_ckpt.local.format import RunningChecksum
from emergency_ckpt.runtime.buffers import aligned_empty
from emergency_ckpt.transport import protocol


@contextlib.contextmanager
def request(offer: dict, sender: int, step: int, shards: list, *, timeout_s: float):
  """A connection to a Server that asked it for some shards of a step.

  Args:
    offer: the sender's offer (Listener.offer), or {"error": why not}.
    sender: its process index (for messages).
    step: the step.
    shards: [leaf number, path, index], or [..., box] for a part of one.
    timeout_s: the socket timeout.

  Yields:
    (session, one record per shard: nbytes and checksum); the shards
    follow in that order, each one payload (protocol.recv_into checks its
    MAC; the caller checks its size and checksum).

  Raises:
    PeerTransferError: no offer, or the sender refused.
    OSError: the connection failed.
  """
  if "error" in offer:
    raise PeerTransferError(f"process {sender} cannot serve: {offer['error']}")
  with protocol.connect(offer, timeout_s=timeout_s, step=step) as sock:
    sock.send_json({"step": step, "shards": shards})
    reply = sock.recv_json(protocol.MAX_DOCUMENT)
    if not isinstance(reply, dict):
      raise PeerTransferError(f"process {sender} answered {type(reply).__name__}, not a reply")
    if "error" in reply:
      raise PeerTransferError(f"process {sender} refused: {reply['error']}")
    records = reply.get("shards", [])
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
      raise PeerTransferError(f"process {sender} answered malformed records")
    if len(records) != len(shards):
      raise PeerTransferError(f"process {sender} answered {len(records)} of {len(shards)} shards")
    yield sock, records


def pull(
  offer: dict,
  sender: int,
  step: int,
  items: Sequence[tuple[int, shards_lib.ShardSlot]],
  paths: Sequence[str],
  buffer: np.ndarray,
  *,
  timeout_s: float,
) -> None:
  """Receives shards of `step` from one sender into their slots of `buffer`,
  each verified against the sender's checksum as it arrives.

  Args:
    offer: the sender's offer.
    sender: its process index.
    step: the step.
    items: (leaf number, slot) of each shard.
    paths: the keystr paths of the leaves.
    buffer: the receiver's buffer (uint8), laid out as the slots say.
    timeout_s: the socket timeout.

  Raises:
    PeerTransferError: no offer, or the sender refused.
    CorruptCheckpointError: a shard's size, MAC or checksum is wrong.
    OSError: the connection failed.
  """
  shards = [[leaf_no, paths[leaf_no], [list(r) for r in slot.index]] for leaf_no, slot in items]
  with request(offer, sender, step, shards, timeout_s=timeout_s) as (sock, records):
    for (leaf_no, slot), record in zip(items, records):
      where = f"leaf {paths[leaf_no]} shard {slot.index} of step {step} from process {sender}"
      if record.get("nbytes") != slot.nbytes:
        raise CorruptCheckpointError(
          f"{where}: {record.get('nbytes')} bytes, expected {slot.nbytes}"
        )
      view = buffer[slot.offset : slot.offset + slot.nbytes]
      running = RunningChecksum(record)
      sock.recv_payload(view, running.update)  # summed piece by piece, as it arrives
      if not running.ok():
        raise CorruptCheckpointError(f"{where} fails its checksum on arrival")


STREAM_MIN_BYTES = 32 << 20
"""The least a stream of its own is worth: fewer bytes share a connection."""


def streams_per_sender() -> int:
  """Connections a receiver opens to each sender: one per two of this
  host's cores, at most 4. One stream's receive (a kernel copy, the MAC
  and the checksum of every byte) runs at a few GB/s on one core; a
  faster link needs several, and on a host of few cores they would only
  take turns on them."""
  return max(1, min(4, (os.cpu_count() or 1) // 2))


def split_streams(items: Sequence[tuple[int, shards_lib.ShardSlot]], streams: int) -> list[list]:
  """Splits one sender's shards into at most `streams` runs of about
  equal bytes, in order (a shard is never cut), each of at least
  STREAM_MIN_BYTES but the last.

  Args:
    items: (leaf number, slot) of each shard.
    streams: the most runs wanted.

  Returns:
    The runs, non-empty, their concatenation `items`.
  """
  total = sum(slot.nbytes for _, slot in items)
  count = max(1, min(streams, len(items), total // STREAM_MIN_BYTES))
  target = total / count
  runs, run, acc = [], [], 0
  for item in items:
    run.append(item)
    acc += item[1].nbytes
    if acc >= target * (len(runs) + 1) and len(runs) < count - 1:
      runs.append(run)
      run = []
  if run:
    runs.append(run)
  return runs


def receive(
  offers: dict[int, dict | None],
  layout: shards_lib.Layout,
  paths: Sequence[str],
  pulls: dict[int, list],
  *,
  step: int,
  timeout_s: float,
  buffer: np.ndarray | None = None,
) -> np.ndarray:
  """This receiver's shards of `step`, pulled from every sender at once.

  Args:
    offers: {sender: its offer}.
    layout: the receiver's buffer layout.
    paths: the keystr paths of the leaves.
    pulls: {sender: [(leaf number, slot)]} (routing.plan_pulls).
    step: the step.
    timeout_s: the socket timeout.
    buffer: a buffer that already holds the other slots (None: a new
      page-aligned one).

  Returns:
    The buffer, every pulled slot filled and verified.

  Raises:
    PeerTransferError, CorruptCheckpointError, OSError: the first failure
    (pull).
  """
  if buffer is None:
    buffer = aligned_empty(layout.nbytes)
  if not pulls:
    return buffer
  jobs = [
    (sender, part)
    for sender, items in pulls.items()
    for part in split_streams(items, streams_per_sender())
  ]
  pool = concurrent.futures.ThreadPoolExecutor(len(jobs), "ec-peer-recv")
  try:
    futures = []
    for sender, items in jobs:
      offer = offers.get(sender) or {"error": "it published no address (not an intact slice?)"}
      futures.append(
        pool.submit(pull, offer, sender, step, items, paths, buffer, timeout_s=timeout_s)
      )
    for f in concurrent.futures.as_completed(futures):
      f.result()  # the first failure ends the transfer
  finally:
    pool.shutdown(wait=False, cancel_futures=True)  # never wait on a failed transfer's stragglers
  return buffer
