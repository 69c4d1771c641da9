"""What the job holds, summarised: each process's inventory, its slice's
summary and the job's (pure).

Each process reports an `Inventory` (its usable local steps, and from the
primary process the persistent and committed state steps); `slice_summary`
folds one slice's inventories, `job_summary` folds the slices' summaries
(both run inside Collectives.gather_tree, so every process receives the same
job summary), and `summarize` does both at once for tests and benchmarks.
The plan (plan.py) reads nothing else.

Called by: the inventory exchange and the restore planner, on every process.
Blocks on nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from emergency_ckpt.restore import holdings


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
    """This inventory as JSON (what gather_tree sends)."""
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
    """The inventory that to_json's `d` describes."""
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


REJECTED_SHOWN = 16
"""Rejected local copies (and shared machines) named in a summary (the
rest are counted)."""


def slice_summary(slice_index: int, values: Mapping[int, Mapping], expected: int) -> dict:
  """One slice's inventories ({process: Inventory JSON}) in one JSON value:
  the steps every one of its `expected` processes holds locally, how many
  hold each other step, a few rejected copies, and the shared tiers if the
  primary is among them. What the last of the slice to arrive publishes.

  Args:
    slice_index: the slice.
    values: {process: Inventory JSON} of the slice's processes.
    expected: how many processes the slice has.

  Returns:
    The slice summary (JSON).
  """
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
  the primary publishes.

  Args:
    summaries: {slice: its slice_summary}.
    num_slices: how many slices the job has.

  Returns:
    The job summary (JSON; JobInventory.from_json reads it).
  """
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
    """The job inventory that job_summary's JSON `d` describes."""
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
  """What gather_tree computes from these inventories, in one place.

  Args:
    invs: every process's inventory.
    slice_processes: the processes of each slice.

  Returns:
    The job inventory.
  """
  by_process = {inv.process: inv.to_json() for inv in invs}
  summaries = {
    s: slice_summary(s, {p: by_process[p] for p in procs if p in by_process}, len(procs))
    for s, procs in enumerate(slice_processes)
  }
  return JobInventory.from_json(job_summary(summaries, len(slice_processes)))
