"""Who sends what to whom in a peer transfer: pure, shared by both transports.

Lost slices are spread over the intact ones round-robin, so with several
intact slices the sends run in parallel: the collective transport assigns
whole slices (rounds of a permutation), the stream transport single shards.
The state must be replicated over the replica axis (each slice holds a full
copy) for any slice to serve another.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from emergency_ckpt.core import compat
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import PeerTransferError, TopologyError


def source_of(intact: Sequence[int], k: int) -> int:
  """The k-th pick of the round-robin over slices.

  Args:
    intact: the slices picked from.
    k: the pick's number.

  Returns:
    A slice of `intact`.
  """
  return intact[k % len(intact)]


def check_peer_compatible(
  paths: Sequence[str], abstract: Sequence, mesh, replica_axis: str
) -> str | None:
  """Why no slice can serve another the shards of a state.

  Args:
    paths: the leaves' keystr paths.
    abstract: abstract arrays with shardings, one per leaf.
    mesh: the job's mesh.
    replica_axis: the mesh axis the slices span.

  Returns:
    The reason, or None if a slice can serve another.
  """
  return compat.replica_problem(paths, abstract, mesh, replica_axis)


def routes(intact: Sequence[int], lost: Sequence[int]) -> list[list[tuple[int, int]]]:
  """Who sends to whom, in rounds: every lost slice gets one sender; within
  a round no slice sends or receives twice (a permutation).

  Args:
    intact: the slices that hold the step.
    lost: the slices that lost it.

  Returns:
    Rounds of (source, destination) slice pairs.

  Raises:
    TopologyError: no intact slice.
  """
  if not intact:
    raise TopologyError("a peer transfer needs at least one intact slice")
  rounds: list[list[tuple[int, int]]] = []
  for i, dst in enumerate(lost):
    r = i // len(intact)
    if r == len(rounds):
      rounds.append([])
    rounds[r].append((source_of(intact, i), dst))
  return rounds


def plan_pulls(
  layout: shards_lib.Layout,
  mesh_devices: np.ndarray,
  replica_axis_index: int,
  intact: Sequence[int],
  rank: int,
) -> dict[int, list[tuple[int, shards_lib.ShardSlot]]]:
  """Whom a receiver pulls each shard from: the process holding the same
  mesh coordinates in an intact slice, round-robin over `intact` (offset by
  the receiver's rank among receivers, so several receivers spread over the
  senders). Pure: devices need only `.id` and `.process_index`.

  Args:
    layout: the receiver's shards.
    mesh_devices: the mesh's devices (an array).
    replica_axis_index: the index of the axis the slices span.
    intact: the slices that serve.
    rank: the receiver's rank among receivers.

  Returns:
    {sender process: [(leaf number, slot)]}.

  Raises:
    PeerTransferError: no intact slice.
  """
  if not intact:
    raise PeerTransferError("a peer transfer needs at least one intact slice")
  coords = {d.id: idx for idx, d in np.ndenumerate(mesh_devices)}
  out: dict[int, list[tuple[int, shards_lib.ShardSlot]]] = {}
  k = rank
  for leaf_no, leaf in enumerate(layout.leaves):
    for slot in leaf.slots:
      if not slot.nbytes:
        continue
      source = list(coords[slot.devices[0].id])
      source[replica_axis_index] = source_of(intact, k)
      k += 1
      sender = int(mesh_devices[tuple(source)].process_index)
      out.setdefault(sender, []).append((leaf_no, slot))
  return out


def plan_split(
  layout: shards_lib.Layout,
  mesh_devices: np.ndarray,
  replica_axis_index: int,
  num_slices: int,
  my_slice: int,
  readers: int | None = None,
) -> tuple[set[tuple[int, shards_lib.Index]], dict[int, list[tuple[int, shards_lib.ShardSlot]]]]:
  """A read split between the slices (every slice needs the same shards).
  The slots, in layout order, are cut into `readers` contiguous runs of
  about equal bytes (the same cut on every process at the same mesh
  coordinates): contiguous, because tensorstore coalesces nearby reads of
  one data file, gaps included, so interleaved slots cost almost the whole
  file on every reader. A slot is pulled from the process at the same
  coordinates in its reading slice. Pure: devices need only `.id` and
  `.process_index`.

  Args:
    layout: this process's shards.
    mesh_devices: the mesh's devices (an array).
    replica_axis_index: the index of the axis the slices span.
    num_slices: the slice count.
    my_slice: this process's slice.
    readers: 1..num_slices (None: all): slices 0..readers-1 read from
      storage, the others only receive.

  Returns:
    (the (leaf number, index) slots this process reads, {sender process:
    [(leaf number, slot)]} of the rest).

  Raises:
    ValueError: `readers` out of range.
  """
  readers = num_slices if readers is None else readers
  if not 1 <= readers <= num_slices:
    raise ValueError(f"readers must be 1..{num_slices} (the slice count), got {readers}")
  coords = {d.id: idx for idx, d in np.ndenumerate(mesh_devices)}
  total = sum(slot.nbytes for leaf in layout.leaves for slot in leaf.slots)
  done = 0
  mine: set[tuple[int, shards_lib.Index]] = set()
  pulls: dict[int, list[tuple[int, shards_lib.ShardSlot]]] = {}
  for leaf_no, leaf in enumerate(layout.leaves):
    for slot in leaf.slots:
      if not slot.nbytes:
        continue
      # contiguous runs, by the slot's middle byte
      reader = min(readers - 1, (2 * done + slot.nbytes) * readers // (2 * total))
      done += slot.nbytes
      if reader == my_slice:
        mine.add((leaf_no, slot.index))
        continue
      source = list(coords[slot.devices[0].id])
      source[replica_axis_index] = reader
      sender = int(mesh_devices[tuple(source)].process_index)
      pulls.setdefault(sender, []).append((leaf_no, slot))
  return mine, pulls


# The rule's unit: every reader slice reads at least this much. Each reader
# pays a fixed cost (Orbax metadata, tensorstore opens), so small models are
# read by one slice; the split's gain, R times the read bandwidth and each
# reader's egress cut R-fold, needs slices on hosts of their own, which the
# study on one machine (benchmarks/results/2026-11-25-shared-read/) could
# not show: the crossover is put above the sizes it measured, not measured.
SHARED_READ_MIN_BYTES = 256 << 20


def reader_slices(num_slices: int, model_bytes: int, configured: int | None = None) -> int:
  """How many slices read a shared persistent restore from storage (the
  others receive everything over the peer transport). Pure; the same on
  every process (the model's bytes, not this process's).

  Args:
    num_slices: the slice count S.
    model_bytes: the model's bytes.
    configured: persistent.shared_read_slices (None: the rule).

  Returns:
    `configured` capped at S, else min(S, model bytes //
    SHARED_READ_MIN_BYTES), at least 1 (one slice reads models under twice
    the unit; every slice reads one of S units or more).
  """
  if configured is not None:
    return max(1, min(configured, num_slices))
  return max(1, min(num_slices, model_bytes // SHARED_READ_MIN_BYTES))
