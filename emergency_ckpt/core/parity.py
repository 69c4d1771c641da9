"""XOR parity across a group of hosts (local.redundancy = "xor"), pure.

SCR's XOR scheme: the processes of a slice form groups of k members on
distinct machines. Member i's step (its shards.bin, n_i bytes) is cut into
k-1 chunks of ceil(n_i / (k-1)) bytes; each chunk is assigned to one of the
other members, and member j keeps the parity P_j = XOR of the chunks
assigned to it (zero-padded to the longest). So each member stores
1/(k-1) of a step extra, and any one member lost is rebuilt from the k-1
others: chunk t of member m is P_j XOR the other chunks in P_j, where j is
the member its chunk t went to.

Called by: the XOR redundancy (redundancy/: forming groups, sending,
accumulating, rebuilding). No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def groups(processes: Sequence[int], machine_of: Mapping[int, str], size: int) -> list[list[int]]:
  """The slice's processes in groups of at most `size` (and at least 2),
  each on distinct machines where the machines allow: processes are taken
  round-robin over machines, then cut into near-equal consecutive runs of
  at most min(size, machines) members.

  Args:
    processes: the slice's processes.
    machine_of: {process: its machine}.
    size: the configured group size.

  Returns:
    The groups, each a list of processes in member order.
  """
  by_machine: dict[str, list[int]] = {}
  for p in processes:
    by_machine.setdefault(machine_of[p], []).append(p)
  order: list[int] = []
  queues = [list(q) for q in by_machine.values()]
  while any(queues):
    for q in queues:
      if q:
        order.append(q.pop(0))
  k = max(2, min(size, len(by_machine)))
  n = len(order)
  count = max(1, -(-n // k))
  out, start = [], 0
  for g in range(count):
    length = n // count + (1 if g < n % count else 0)
    out.append(order[start : start + length])
    start += length
  return out


def parts(processes: Sequence[int], machine_of: Mapping[int, str], size: int) -> dict[int, dict]:
  """What each process needs of groups() (a collective's parts: nobody
  needs the whole slice's machines).

  Args:
    processes, machine_of, size: as for groups().

  Returns:
    {process: {"group": its group, "machines": the group's machines, in
    member order}}.
  """
  out = {}
  for group in groups(processes, machine_of, size):
    part = {"group": group, "machines": [machine_of[p] for p in group]}
    out.update((p, part) for p in group)
  return out


def shared_machines(group: Sequence[int], machine_of: Mapping[int, str]) -> list[int]:
  """Members of `group` that share a machine with an earlier member.

  Args:
    group: the members, in order.
    machine_of: {process: its machine}.

  Returns:
    Those members, in order.
  """
  seen, out = set(), []
  for p in group:
    if machine_of[p] in seen:
      out.append(p)
    seen.add(machine_of[p])
  return out


def chunk(n: int, k: int, t: int) -> tuple[int, int]:
  """Where chunk t of a member's bytes lies.

  Args:
    n: the member's byte count.
    k: the group's size.
    t: the chunk (0..k-2).

  Returns:
    (offset, length) of the chunk.
  """
  size = -(-n // (k - 1)) if n else 0
  start = min(n, t * size)
  return start, min(n, start + size) - start


def assigned(i: int, j: int, k: int) -> int:
  """Which chunk of member i goes into member j's parity.

  Args:
    i: the sending member.
    j: the parity's member (i != j).
    k: the group's size.

  Returns:
    The chunk index.
  """
  return (j - i - 1) % k


def block_length(sizes: Sequence[int], j: int) -> int:
  """Bytes of member j's parity block: the longest chunk of the others.

  Args:
    sizes: every member's byte count, in member order.
    j: the parity's member.

  Returns:
    The block's length.
  """
  k = len(sizes)
  return max(chunk(n, k, 0)[1] for i, n in enumerate(sizes) if i != j)


def xor_into(acc: np.ndarray, data) -> None:
  """acc[:len(data)] ^= data, in place.

  Args:
    acc: the uint8 accumulator.
    data: bytes or a uint8 array, no longer than `acc`.
  """
  view = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
  np.bitwise_xor(acc[: len(view)], view, out=acc[: len(view)])


def parity(j: int, data: Sequence[bytes | np.ndarray]) -> np.ndarray:
  """Member j's parity block from every member's bytes (what the senders'
  chunks add up to on j).

  Args:
    j: the parity's member.
    data: every member's bytes, in member order.

  Returns:
    The block (uint8).
  """
  k = len(data)
  acc = np.zeros(block_length([len(d) for d in data], j), np.uint8)
  for i, d in enumerate(data):
    if i != j:
      off, length = chunk(len(d), k, assigned(i, j, k))
      xor_into(acc, np.asarray(memoryview(d))[off : off + length])
  return acc


def rebuild_sources(m: int, k: int) -> list[tuple[int, list[tuple[int, int]]]]:
  """How member m's chunks are rebuilt: every chunk of m = P_j XOR the
  other chunks in P_j.

  Args:
    m: the lost member.
    k: the group's size.

  Returns:
    Per chunk t of m, (the member j whose parity holds it, [(member i, its
    chunk index) for the other chunks in P_j]).
  """
  out = []
  for t in range(k - 1):
    j = (m + t + 1) % k
    out.append((j, [(i, assigned(i, j, k)) for i in range(k) if i not in (j, m)]))
  return out
