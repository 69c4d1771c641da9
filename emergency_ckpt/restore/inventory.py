"""What every process holds, agreed: the inventory exchange and what follows from it.

Each process reports its inventory (its usable local steps, and from the
primary process the persistent and committed state steps); one gather_tree
summarises them per slice and then for the job, so every process gets the
same summary (restore_summary.JobInventory) and computes the same restorable
steps, and nobody receives every process's inventory. Once per manager, the
processes of each machine compare slices (placement.py: no machine may run
processes of two slices). metadata(step) is one more gather_tree.

Called by: every process (collectives through cluster.collectives.Collectives).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from emergency_ckpt.cluster import placement
from emergency_ckpt.errors import StepError
from emergency_ckpt.persistent import layout as persistent_layout
from emergency_ckpt.restore import plan as restore_plan
from emergency_ckpt.restore import summary as restore_summary

if TYPE_CHECKING:
  from emergency_ckpt.cluster.collectives import Collectives
  from emergency_ckpt.cluster.context import JobContext
  from emergency_ckpt.restore.tiers import LocalSource, PersistentSource, StateSource


@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """What metadata(step) knows of a saved step; the same on every process."""

  step: int
  restorable: bool
  """Its state is committed and some tier holds its tensors."""
  local_slices: tuple[int, ...]
  """Slices every process of which has a local copy (by listing)."""
  persistent: bool
  """The persistent tier holds a finalized copy."""
  state_committed: bool
  local_bytes: int
  """Bytes of every process's local copy, summed."""
  persistent_bytes: int | None
  """Bytes of the persistent copy (None if there is none)."""
  topology: dict | None
  """The topology it was saved with (slices, processes, mesh)."""
  saved_at: float | None
  """Unix time its state was committed."""
  metrics: dict
  """What save(metrics=...) got for it."""


class Inventory:
  """This process's view of the job's checkpoints, through exchanges."""

  def __init__(
    self,
    ctx: JobContext,
    *,
    local: LocalSource,
    persistent: PersistentSource,
    state: StateSource,
    host: str,
  ):
    """Args:
    ctx: the job.
    local: this process's local tier.
    persistent: the persistent tier (listed by the primary process only).
    state: the state store (listed by the primary process only).
    host: this process's machine (cluster.topology.host_identity).
    """
    self._topology = ctx.topology
    self._collectives = ctx.collectives
    self._local = local
    self._persistent = persistent
    self._state = state
    self._events = ctx.events
    self._host = host
    self._placement_checked = False
    self.placement_problem: str | None = None
    """See CheckpointManager.placement_problem."""

  def exchange(self, name: str) -> restore_summary.JobInventory:
    """The job's inventory, summarised. Called by: every process. Blocks
    on one gather_tree (and, the first time, the machine's group_by).

    Args:
      name: the exchange's key name (unique per call site).

    Returns:
      The job summary, the same on every process.
    """
    topo = self._topology
    first = not self._placement_checked
    # First: the machine's processes; it also tells the local tier whose
    # folders are live (never taken as copies).
    report = self._group_machine() if first else None
    local, rejected = self._local.usable_steps()
    state_steps = uncommitted = None
    if topo.is_primary_process:  # one listing of the state store's root
      listed = self._state.listed_steps()
      state_steps = self._state.committed_steps(listed)
      uncommitted = sorted(set(listed) - set(state_steps))
    inv = restore_summary.Inventory(
      process=topo.process_index,
      slice=topo.slice_index,
      local_steps=tuple(local),
      local_rejected=rejected,
      persistent_steps=tuple(self._persistent.steps()) if topo.is_primary_process else None,
      state_steps=None if state_steps is None else tuple(state_steps),
      state_uncommitted=None if uncommitted is None else tuple(uncommitted),
      copies={
        step: [c.to_json() for _, c in found.values()]
        for step, found in self._local.copies().items()
      },
      parity={
        step: [b.to_json() for b in found.values()] for step, found in self._local.parity().items()
      },
      placement=report,
    )
    job = gather(self._collectives, inv, name)
    if first and topo.num_slices > 1:
      self._judge_placement(job)
    return job

  def _group_machine(self) -> dict | None:
    """Once per manager, before the first inventory: the processes of each
    machine compare slices (one group_by), and even with one slice they are
    found: their folders are live, never taken as copies
    (local_tier.set_colocated). Returns this process's report, riding on
    the inventory exchange, if it is the first of a machine that runs
    processes of two slices (so everyone receives only the problems, and
    no second exchange is needed)."""
    self._placement_checked = True
    topo = self._topology
    mine = self._collectives.group_by("placement_hosts", self._host, topo.slice_index)
    self._local.set_colocated(mine)
    if topo.num_slices > 1 and len(set(mine.values())) > 1 and topo.process_index == min(mine):
      return {"host": self._host, "processes": sorted(mine)}
    return None

  def _judge_placement(self, job: restore_summary.JobInventory) -> None:
    """Does any machine run processes of two slices? From the reports in
    the first job summary (the first REJECTED_SHOWN machines, of a count)."""
    topo = self._topology
    hosts = {p: rep["host"] for rep in job.placement for p in rep["processes"]}
    shared = placement.shared_hosts(hosts, topo.slice_processes)
    self.placement_problem = placement.describe(shared, more=job.placement_count - len(shared))
    if self.placement_problem and topo.is_primary_process:
      self._events.record("placement", hosts=job.placement_count, error=self.placement_problem)

  def restorable_steps(self, name: str) -> list[int]:
    """Restorable steps by markers, oldest first. Called by: every process
    (one exchange).

    Args:
      name: the exchange's key name.

    Returns:
      The steps, the same on every process.
    """
    return sorted(c.step for c in restore_plan.candidates(self.exchange(name)))

  def metadata(self, step: int) -> StepMetadata:
    """See CheckpointManager.metadata. Called by: every process (one gather_tree).

    Args:
      step: the step to describe.

    Returns:
      Its metadata, the same on every process.

    Raises:
      StepError: no tier has it.
    """
    topo = self._topology
    self._local.usable_steps()  # copies other processes left on this host count too
    mine: dict = {"local": self._local.step_bytes(step)}
    if topo.is_primary_process:
      mine["primary"] = {
        "persistent_bytes": persistent_layout.step_bytes(self._persistent.directory, step)
        if step in self._persistent.steps()
        else None,
        "committed": self._state.is_committed(step),
        "record": self._state.record(step),
      }
    got = self._collectives.gather_tree(
      f"metadata_{step}",
      mine,
      per_slice=lambda s, values: {
        "complete": len(values) == len(topo.slice_processes[s])
        and all(v["local"] is not None for v in values.values()),
        "bytes": sum(v["local"] or 0 for v in values.values()),
        "primary": next((v["primary"] for v in values.values() if "primary" in v), None),
      },
      combine=lambda sums: {
        "local_slices": [s for s, v in sorted(sums.items()) if v["complete"]],
        "bytes": sum(v["bytes"] for v in sums.values()),
        "primary": next(v["primary"] for v in sums.values() if v["primary"] is not None),
      },
    )
    primary = got["primary"]
    local_slices = tuple(got["local_slices"])
    record = primary["record"] or {}
    info = record.get("info") or {}
    persistent = primary["persistent_bytes"] is not None
    if not local_slices and not persistent and not record:
      raise StepError(f"step {step} is in no tier; all_steps() lists the restorable steps.")
    return StepMetadata(
      step=step,
      restorable=primary["committed"] and (bool(local_slices) or persistent),
      local_slices=local_slices,
      persistent=persistent,
      state_committed=primary["committed"],
      local_bytes=got["bytes"],
      persistent_bytes=primary["persistent_bytes"],
      topology=info.get("topology"),
      saved_at=info.get("saved_at", record.get("committed_at")),
      metrics=record.get("metrics") or {},
    )


def gather(
  collectives: Collectives, inv: restore_summary.Inventory, name: str
) -> restore_summary.JobInventory:
  """Every process's `inv`, summarised per slice and then for the job (see
  restore_summary.slice_summary, job_summary). Called by: every process; what
  the scale benchmark measures.

  Args:
    collectives: the job's collectives.
    inv: this process's inventory.
    name: the exchange's key name.

  Returns:
    The job summary, the same on every process.
  """
  slices = collectives.topology.slice_processes
  got = collectives.gather_tree(
    name,
    inv.to_json(),
    per_slice=lambda s, values: restore_summary.slice_summary(s, values, len(slices[s])),
    combine=lambda sums: restore_summary.job_summary(sums, len(slices)),
  )
  return restore_summary.JobInventory.from_json(got)
