"""Pure restore planning: inventories and load statuses in, a plan out.

No JAX, no I/O: every process computes the same plan from the same exchanged
inventories, so agreement needs no further collective.

A step is restorable iff its state-store marker is committed AND (every
process of at least one slice holds it in the local tier OR the persistent
tier has it committed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

LOCAL, PEER, PERSISTENT = "local", "peer", "persistent"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inventory:
  """What one process reports before restore. Only the primary lists the
  shared tiers (persistent, state), so the others leave them None."""

  process: int
  slice: int
  local_steps: tuple[int, ...]
  local_rejected: Mapping[int, str] = dataclasses.field(default_factory=dict)
  persistent_steps: tuple[int, ...] | None = None
  state_steps: tuple[int, ...] | None = None
  host: str | None = None
  """The machine the process runs on (topology.host_identity)."""

  def to_json(self) -> dict[str, Any]:
    return {
      "process": self.process,
      "slice": self.slice,
      "local_steps": list(self.local_steps),
      "local_rejected": {str(k): v for k, v in self.local_rejected.items()},
      "persistent_steps": None if self.persistent_steps is None else list(self.persistent_steps),
      "state_steps": None if self.state_steps is None else list(self.state_steps),
      "host": self.host,
    }

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Inventory:
    opt = lambda v: None if v is None else tuple(v)  # noqa: E731
    return cls(
      process=d["process"],
      slice=d["slice"],
      local_steps=tuple(d["local_steps"]),
      local_rejected={int(k): v for k, v in d.get("local_rejected", {}).items()},
      persistent_steps=opt(d.get("persistent_steps")),
      state_steps=opt(d.get("state_steps")),
      host=d.get("host"),
    )


@dataclasses.dataclass(frozen=True)
class Candidate:
  step: int
  local_slices: tuple[int, ...]
  """Slices whose every process lists the step in its local tier."""
  in_persistent: bool


@dataclasses.dataclass(frozen=True)
class Status:
  """One process's attempt at a candidate: could it read its local shards
  (None: it was not asked to) and its own JSON?"""

  local_ok: bool | None
  state_ok: bool
  error: str | None = None
  mismatch: str | None = None  # a user error (tree/shape/dtype): raise, never skip

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Status:
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  step: int
  sources: tuple[str, ...]
  """sources[s]: where slice s gets the step: local, peer or persistent."""
  peer_source: int | None
  """The slice that sends to the PEER slices (None when no slice needs it)."""


def _shared(invs: Sequence[Inventory], field: str) -> tuple[int, ...]:
  for inv in invs:
    value = getattr(inv, field)
    if value is not None:
      return value
  return ()


def slice_steps(
  invs: Sequence[Inventory], slice_processes: Sequence[Sequence[int]]
) -> list[set[int]]:
  """Per slice, the steps every one of its processes holds locally (one
  pass over the inventories: linear in processes)."""
  local = {inv.process: inv.local_steps for inv in invs}
  out = []
  for procs in slice_processes:
    held: set[int] | None = None
    for p in procs:
      steps = local.get(p, ())
      held = set(steps) if held is None else held.intersection(steps)
      if not held:
        break
    out.append(held or set())
  return out


def complete_slices(
  step: int, invs: Sequence[Inventory], slice_processes: Sequence[Sequence[int]]
) -> tuple[int, ...]:
  """Slices every process of which holds `step` locally."""
  return tuple(s for s, held in enumerate(slice_steps(invs, slice_processes)) if step in held)


def candidates(
  invs: Sequence[Inventory], slice_processes: Sequence[Sequence[int]], *, step: int | None = None
) -> list[Candidate]:
  """Restorable steps by markers, newest first (only `step` if given)."""
  persistent = set(_shared(invs, "persistent_steps"))
  held = slice_steps(invs, slice_processes)
  out = []
  for s in sorted(set(_shared(invs, "state_steps")), reverse=True):
    if step is not None and s != step:
      continue
    local = tuple(i for i, steps in enumerate(held) if s in steps)
    if local or s in persistent:
      out.append(Candidate(s, local, s in persistent))
  return out


def decide(
  cand: Candidate, statuses: Mapping[int, Status], slice_processes: Sequence[Sequence[int]]
) -> RestorePlan | None:
  """The plan for `cand` given every process's load status, or None when the
  step turned out not restorable (a JSON or every copy failed verification)."""
  if not all(st.state_ok for st in statuses.values()):
    return None
  good = [s for s in cand.local_slices if all(statuses[p].local_ok for p in slice_processes[s])]
  if good:
    sources = tuple(LOCAL if s in good else PEER for s in range(len(slice_processes)))
    return RestorePlan(cand.step, sources, good[0] if PEER in sources else None)
  if cand.in_persistent:
    return RestorePlan(cand.step, (PERSISTENT,) * len(slice_processes), None)
  return None


def describe_absence(invs: Sequence[Inventory], slice_processes: Sequence[Sequence[int]]) -> str:
  """Why nothing is restorable, for the error message."""
  state = sorted(_shared(invs, "state_steps"))
  persistent = sorted(_shared(invs, "persistent_steps"))
  lines = [
    f"state steps with a COMMIT marker: {state or 'none'}",
    f"persistent tensor steps: {persistent or 'none'}",
  ]
  for s, procs in enumerate(slice_processes):
    per = {inv.process: sorted(inv.local_steps) for inv in invs if inv.process in procs}
    lines.append(f"slice {s} local steps per process: {per}")
  for inv in invs:
    for step, why in sorted(inv.local_rejected.items()):
      lines.append(f"process {inv.process} ignored local step {step}: {why}")
  return "; ".join(lines)
