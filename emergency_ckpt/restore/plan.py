"""Pure restore planning: inventories and load statuses in, a plan out.

No JAX, no I/O: every process computes the same plan from the same job
summary of the inventories (slice_summary per slice, job_summary of those,
through Collectives.gather_tree), so agreement needs no further collective.

A step is restorable iff its state-store marker is committed AND (every
process of at least one slice holds it in the local tier OR the persistent
tier has it committed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from emergency_ckpt.restore import holdings

LOCAL, PEER, PERSISTENT = "local", "peer", "persistent"
RESHARD = "reshard"
"""A plan's source when the ramdisk copies were written on another mesh:
every process assembles its shards from the saved ones (reshard.py); a
process's own result names `local` or `peer` (where its bytes came from)."""


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
  state_uncommitted: tuple[int, ...] | None = None
  """Step folders of the state store without a valid COMMIT (the primary's,
  from the same listing as state_steps): what a restore discards if newer."""
  copies: Mapping[int, Sequence[Sequence]] = dataclasses.field(default_factory=dict)
  """{step: [[topology digest, saved process, saved slice, slice position,
  saved slice size, 1 if a partner copy else 0], ...]} of the copies on
  this host (local_tier.Copy; holdings.py)."""
  parity: Mapping[int, Sequence[Sequence]] = dataclasses.field(default_factory=dict)
  """{step: [[topology digest, saved process, saved slice, slice position,
  saved slice size, [its XOR group's positions]], ...]} of the parity
  blocks on this host (holdings.py)."""
  placement: Mapping[str, Any] | None = None
  """{"host", "processes"}: set only on a manager's first exchange, by the
  first process of a machine that runs processes of two slices (placement.py)."""

  def to_json(self) -> dict[str, Any]:
    return {
      **({"placement": dict(self.placement)} if self.placement else {}),
      "process": self.process,
      "slice": self.slice,
      "local_steps": list(self.local_steps),
      "copies": {str(k): [list(c) for c in v] for k, v in self.copies.items()},
      "parity": {str(k): [list(c) for c in v] for k, v in self.parity.items()},
      "local_rejected": {str(k): v for k, v in self.local_rejected.items()},
      "persistent_steps": None if self.persistent_steps is None else list(self.persistent_steps),
      "state_steps": None if self.state_steps is None else list(self.state_steps),
      **(
        {"state_uncommitted": list(self.state_uncommitted)}
        if self.state_uncommitted is not None
        else {}
      ),
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
      state_uncommitted=opt(d.get("state_uncommitted")),
      copies={int(k): [tuple(c) for c in v] for k, v in d.get("copies", {}).items()},
      parity={int(k): [tuple(c) for c in v] for k, v in d.get("parity", {}).items()},
      placement=d.get("placement"),
    )


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
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Status:
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


REJECTED_SHOWN = 16
"""Rejected local copies (and shared machines) named in a summary (the
rest are counted)."""


def slice_summary(slice_index: int, values: Mapping[int, Mapping], expected: int) -> dict:
  """One slice's inventories ({process: Inventory JSON}) in one JSON value:
  the steps every one of its `expected` processes holds locally, how many
  hold each other step, a few rejected copies, and the shared tiers if the
  primary is among them. What the last of the slice to arrive publishes."""
  held: set[int] | None = None
  some: dict[int, int] = {}
  rejected: list[str] = []
  shared: list[dict] = []
  out: dict[str, Any] = {"slice": slice_index}
  copies: dict = {}
  for process, inv in sorted(values.items()):
    holdings.add_report(copies, inv.get("copies", {}), inv.get("parity", {}))
    if inv.get("placement"):
      shared.append(inv["placement"])
    steps = inv["local_steps"]
    held = set(steps) if held is None else held.intersection(steps)
    for step in steps:
      some[step] = some.get(step, 0) + 1
    for step, why in sorted(inv.get("local_rejected", {}).items(), key=lambda kv: int(kv[0])):
      rejected.append(f"process {process} ignored local step {step}: {why}")
    if inv.get("persistent_steps") is not None or inv.get("state_steps") is not None:
      out["persistent_steps"] = list(inv.get("persistent_steps") or ())
      out["state_steps"] = list(inv.get("state_steps") or ())
      out["state_uncommitted"] = list(inv.get("state_uncommitted") or ())
  if len(values) < expected:
    held = set()
  held = held or set()
  out.update(
    held=sorted(held),
    some={str(step): n for step, n in sorted(some.items()) if step not in held},
    rejected=rejected[:REJECTED_SHOWN],
    rejected_count=len(rejected),
    copies=holdings.pack(copies),
  )
  if shared:
    out.update(placement=shared[:REJECTED_SHOWN], placement_count=len(shared))
  return out


def job_summary(summaries: Mapping[int, Mapping], num_slices: int) -> dict:
  """The S slice summaries in one JSON value, the same for every process:
  per step, the slices that hold it whole (as ranges); the shared tiers;
  the first few partial holdings and rejected copies, for messages. What
  the primary publishes."""
  held: dict[int, list[int]] = {}
  partial: list[str] = []
  rejected: list[str] = []
  rejected_count = 0
  shared = {"persistent_steps": [], "state_steps": [], "state_uncommitted": []}
  machines: list[dict] = []
  machines_count = 0
  copies: dict = {}
  for s in range(num_slices):
    summ = summaries.get(s) or {}
    holdings.add_summary(copies, summ.get("copies", {}))
    machines += summ.get("placement", [])[: REJECTED_SHOWN - len(machines)]
    machines_count += summ.get("placement_count", 0)
    for step in summ.get("held", ()):
      held.setdefault(step, []).append(s)
    for step, n in summ.get("some", {}).items():
      if len(partial) < REJECTED_SHOWN:
        partial.append(f"slice {s}: step {step} on {n} of its processes")
    rejected += summ.get("rejected", [])[: REJECTED_SHOWN - len(rejected)]
    rejected_count += summ.get("rejected_count", 0)
    if "state_steps" in summ:
      shared = {k: summ.get(k, []) for k in shared}
  return {
    "slices": num_slices,
    "held": {str(step): holdings.ranges(sl) for step, sl in sorted(held.items())},
    "partial": partial,
    "rejected": rejected,
    "rejected_count": rejected_count,
    "reshard": holdings.complete(copies),
    **shared,
    **({"placement": machines, "placement_count": machines_count} if machines_count else {}),
  }


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobInventory:
  """Every process's inventory, summarised (job_summary): what restore
  planning needs, the same on every process, O(steps x slices) at most."""

  num_slices: int
  held: Mapping[int, tuple[int, ...]]
  """{step: slices every process of which holds it locally}."""
  persistent_steps: tuple[int, ...] = ()
  state_steps: tuple[int, ...] = ()
  state_uncommitted: tuple[int, ...] = ()
  """Inventory.state_uncommitted of the primary."""
  partial: tuple[str, ...] = ()
  rejected: tuple[str, ...] = ()
  rejected_count: int = 0
  reshard: Mapping[int, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  """{step: holdings.complete's entry} of the saved slices the ramdisks
  serve whole (Candidate.reshard)."""
  placement: tuple[Mapping[str, Any], ...] = ()
  """The first REJECTED_SHOWN machines reported running processes of two
  slices (Inventory.placement), of `placement_count`."""
  placement_count: int = 0

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> JobInventory:
    return cls(
      num_slices=d["slices"],
      held={
        int(step): tuple(s for a, b in runs for s in range(a, b + 1))
        for step, runs in d["held"].items()
      },
      persistent_steps=tuple(d.get("persistent_steps", ())),
      state_steps=tuple(d.get("state_steps", ())),
      state_uncommitted=tuple(d.get("state_uncommitted", ())),
      partial=tuple(d.get("partial", ())),
      rejected=tuple(d.get("rejected", ())),
      rejected_count=d.get("rejected_count", 0),
      reshard={int(k): v for k, v in d.get("reshard", {}).items()},
      placement=tuple(d.get("placement", ())),
      placement_count=d.get("placement_count", 0),
    )


def summarize(invs: Sequence[Inventory], slice_processes: Sequence[Sequence[int]]) -> JobInventory:
  """What gather_tree computes from these inventories, in one place (pure)."""
  by_process = {inv.process: inv.to_json() for inv in invs}
  summaries = {
    s: slice_summary(s, {p: by_process[p] for p in procs if p in by_process}, len(procs))
    for s, procs in enumerate(slice_processes)
  }
  return JobInventory.from_json(job_summary(summaries, len(slice_processes)))


def complete_slices(step: int, job: JobInventory) -> tuple[int, ...]:
  """Slices every process of which holds `step` locally."""
  return job.held.get(step, ())


def candidates(job: JobInventory, *, step: int | None = None) -> list[Candidate]:
  """Restorable steps by markers, newest first (only `step` if given)."""
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
  verification). `statuses` may hold only the processes that failed
  something (Status.is_ok ones may be left out: gather_sparse)."""
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
  """Why nothing is restorable, for the error message."""
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
