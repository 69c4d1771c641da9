"""Pure restore planning: inventories and load statuses in, a plan out.

No JAX, no I/O: every process computes the same plan from the same job
summary of the inventories (slice_summary per slice, job_summary of those,
through Collectives.gather_tree), so agreement needs no further collective.

A step is restorable iff its state-store marker is committed AND (every
process of at least one slice holds it in the local tier OR the persistent
tier has it committed).

Called by: the inventory (summaries, inside gather_tree) and the restorer,
on every process. Blocks on nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from emergency_ckpt.restore.summary import JobInventory

LOCAL, PEER, PERSISTENT = "local", "peer", "persistent"
RESHARD = "reshard"
"""A plan's source when the ramdisk copies were written on another mesh:
every process assembles its shards from the saved ones (reshard.py); a
process's own result names `local` or `peer` (where its bytes came from)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  step: int
  local_slices: tuple[int, ...]
  """Slices whose every process lists the step in its local tier."""
  in_persistent: bool
  reshard: tuple[int, ...] = ()
  """Saved slices (of another topology) whose every process's copy is on
  some host of this job: each holds the whole step (reshard.py)."""
  reshard_topology: str | None = None
  reshard_partner: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  """{saved slice: positions only partner copies hold} (peer/partner.py)."""
  reshard_parity: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  """{saved slice: positions only an XOR rebuild provides} (peer/xor.py)."""
  reshard_groups: Mapping[int, tuple[tuple[int, ...], ...]] = dataclasses.field(
    default_factory=dict
  )
  """{saved slice: its XOR groups, as positions}."""


@dataclasses.dataclass(frozen=True)
class Status:
  """One process's attempt at a candidate: could it read its local shards
  (None: it was not asked to) and its own JSON?"""

  local_ok: bool | None
  state_ok: bool
  error: str | None = None
  mismatch: str | None = None  # a user error (tree/shape/dtype): raise, never skip
  reshard_bad: tuple[int, ...] = ()
  """Saved slices whose copy on this host failed verification (or whose
  layout cannot feed this state): they serve no reshard."""

  @property
  def is_ok(self) -> bool:
    """Everything asked was read: what a process need not report."""
    return (
      self.state_ok
      and self.local_ok is not False
      and not self.error
      and not self.mismatch
      and not self.reshard_bad
    )

  def to_json(self) -> dict[str, Any]:
    """This status as JSON (what gather_sparse sends)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Status:
    """The status that to_json's `d` describes."""
    d = dict(d)
    d["reshard_bad"] = tuple(d.get("reshard_bad", ()))
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  step: int
  sources: tuple[str, ...]
  """sources[s]: where slice s gets the step: local, peer or persistent."""
  peer_source: int | None
  """The slice that sends to the PEER slices (None when no slice needs it)."""
  reshard_slices: tuple[int, ...] = ()
  """With sources RESHARD: the saved slices that serve."""
  reshard_partner: tuple[tuple[int, ...], ...] = ()
  """Per reshard slice: the positions only partner copies hold."""
  reshard_parity: tuple[tuple[int, ...], ...] = ()
  """Per reshard slice: the positions rebuilt from XOR parity."""
  reshard_groups: tuple[tuple[tuple[int, ...], ...], ...] = ()
  """Per reshard slice: its XOR groups (positions)."""


def complete_slices(step: int, job: JobInventory) -> tuple[int, ...]:
  """The slices every process of which holds `step` locally.

  Args:
    step: the step.
    job: the job inventory.

  Returns:
    The slices.
  """
  return job.held.get(step, ())


def candidates(job: JobInventory, *, step: int | None = None) -> list[Candidate]:
  """Restorable steps by markers, newest first.

  Args:
    job: the job inventory.
    step: only this step, if given.

  Returns:
    A Candidate per restorable step.
  """
  persistent = set(job.persistent_steps)
  out = []
  for s in sorted(set(job.state_steps), reverse=True):
    if step is not None and s != step:
      continue
    local = job.held.get(s, ())
    r = job.reshard.get(s) or {}
    reshard = tuple(r.get("slices", ()))
    if local or s in persistent or reshard:
      out.append(
        Candidate(
          s,
          local,
          s in persistent,
          reshard,
          r.get("topology"),
          _per_slice(r, "partner_only"),
          _per_slice(r, "parity_only"),
          {int(k): tuple(tuple(g) for g in v) for k, v in r.get("groups", {}).items()},
        )
      )
  return out


def _per_slice(r: Mapping[str, Any], key: str) -> dict[int, tuple[int, ...]]:
  return {int(k): tuple(v) for k, v in r.get(key, {}).items()}


def decide(
  cand: Candidate, statuses: Mapping[int, Status], slice_processes: Sequence[Sequence[int]]
) -> RestorePlan | None:
  """The plan for `cand` given the processes' load statuses, or None when
  the step turned out not restorable (a JSON or every copy failed
  verification).

  Args:
    cand: the candidate step.
    statuses: {process: Status}; may hold only the processes that failed
      something (Status.is_ok ones may be left out: gather_sparse).
    slice_processes: the processes of each slice.

  Returns:
    The plan, or None.
  """
  if not all(st.state_ok for st in statuses.values()):
    return None
  failed = {p for p, st in statuses.items() if st.local_ok is False}
  good = [s for s in cand.local_slices if failed.isdisjoint(slice_processes[s])]
  if good:
    sources = tuple(LOCAL if s in good else PEER for s in range(len(slice_processes)))
    return RestorePlan(cand.step, sources, good[0] if PEER in sources else None)
  bad = {s for st in statuses.values() for s in st.reshard_bad}
  reshard = tuple(s for s in cand.reshard if s not in bad)
  if reshard and not cand.local_slices:
    return RestorePlan(
      cand.step,
      (RESHARD,) * len(slice_processes),
      None,
      reshard,
      tuple(cand.reshard_partner.get(s, ()) for s in reshard),
      tuple(cand.reshard_parity.get(s, ()) for s in reshard),
      tuple(cand.reshard_groups.get(s, ()) for s in reshard),
    )
  if cand.in_persistent:
    return RestorePlan(cand.step, (PERSISTENT,) * len(slice_processes), None)
  return None


def describe_absence(job: JobInventory) -> str:
  """Why nothing is restorable, for the error message.

  Args:
    job: the job inventory.

  Returns:
    What was found, in words.
  """
  lines = [
    f"state steps with a COMMIT marker: {sorted(job.state_steps) or 'none'}",
    f"persistent tensor steps: {sorted(job.persistent_steps) or 'none'}",
    "local steps held by every process of a slice: "
    + (
      ", ".join(f"step {step} on slices {list(sl)}" for step, sl in sorted(job.held.items()))
      or "none"
    ),
  ]
  if job.partial:
    lines.append("held by only some processes: " + ", ".join(job.partial))
  lines += list(job.rejected)
  if job.rejected_count > len(job.rejected):
    lines.append(f"and {job.rejected_count - len(job.rejected)} more rejected local copies")
  return "; ".join(lines)
