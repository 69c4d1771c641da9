"""Replica placement: do the slices' copies sit on different machines?

A slice's local copies protect against losing a machine only if no machine
holds processes of two slices: losing it then loses both copies of the shards
those slices share, and the restore that a peer should have served falls
back to the persistent tier. Pure functions; the host ids come from
topology.host_identity(), compared per machine by inventory.py (once per
manager; only shared machines are reported to everyone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def shared_hosts(
  hosts: Mapping[int, str | None], slice_processes: Sequence[Sequence[int]]
) -> dict[str, dict[int, tuple[int, ...]]]:
  """The hosts that run processes of two or more slices.

  Args:
    hosts: {process: its host id}, None where unknown (left out).
    slice_processes: the processes of each slice.

  Returns:
    {host: {slice: its processes on that host}} of those hosts, sorted
    ({} for single-slice jobs: nothing to share).
  """
  by_host: dict[str, dict[int, list[int]]] = {}
  for s, procs in enumerate(slice_processes):
    for p in procs:
      host = hosts.get(p)
      if host is not None:
        by_host.setdefault(host, {}).setdefault(s, []).append(p)
  return {
    host: {s: tuple(sorted(ps)) for s, ps in sorted(slices.items())}
    for host, slices in sorted(by_host.items())
    if len(slices) > 1
  }


def describe(shared: Mapping[str, Mapping[int, Sequence[int]]], *, more: int = 0) -> str | None:
  """What is wrong with shared hosts and how to fix it.

  Args:
    shared: shared_hosts()'s answer (or a part of it).
    more: shared hosts beyond those in `shared` (counted, not named).

  Returns:
    The message, or None if nothing is shared.
  """
  if not shared:
    return None
  parts = []
  for host, slices in shared.items():
    on = ", ".join(f"slice {s} (processes {list(ps)})" for s, ps in slices.items())
    parts.append(f"host {host!r} runs {on}")
  if more > 0:
    parts.append(f"and {more} more hosts run processes of two or more slices")
  return (
    "; ".join(parts) + ". Losing such a host loses every local copy of the shards"
    " these slices hold, so a peer cannot serve them and the restore falls back to"
    " the persistent tier. Put each replica-axis entry on other hosts (e.g. reshape"
    " jax.devices() to (num_hosts, devices_per_host) when process ids are contiguous"
    " per host), or set host_id if processes of one machine are separate failure"
    " domains."
  )
