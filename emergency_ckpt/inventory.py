"""What every process holds, agreed: the inventory exchange and what follows from it.

One exchange gives every process every process's inventory (its usable local
steps, and from the primary process the persistent and committed state
steps), so all of them compute the same restorable steps. Each process's
host id rides along: the first exchange also checks that no machine runs
processes of two slices (placement.py). metadata(step) is one more exchange.

Called by: every process (collectives through topology.Collectives).
"""

from __future__ import annotations

import dataclasses

from emergency_ckpt import persistent_layout, placement, restore_plan
from emergency_ckpt.errors import StepError


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

  def __init__(self, *, topology, collectives, local, persistent, state, events, host: str):
    self._topology = topology
    self._collectives = collectives
    self._local = local
    self._persistent = persistent
    self._state = state
    self._events = events
    self._host = host
    self._placement_checked = False
    self.placement_problem: str | None = None
    """See CheckpointManager.placement_problem."""

  def exchange(self, name: str) -> list[restore_plan.Inventory]:
    """Every process's inventory, by process index. Called by: every process."""
    topo = self._topology
    local, rejected = self._local.usable_steps()
    inv = restore_plan.Inventory(
      process=topo.process_index,
      slice=topo.slice_index,
      local_steps=tuple(local),
      local_rejected=rejected,
      persistent_steps=tuple(self._persistent.steps()) if topo.is_primary_process else None,
      state_steps=tuple(self._state.committed_steps()) if topo.is_primary_process else None,
      host=self._host,
    )
    got = self._collectives.exchange(name, inv.to_json())
    invs = [restore_plan.Inventory.from_json(got[p]) for p in sorted(got)]
    if not self._placement_checked:
      self._check_placement(invs)
    return invs

  def _check_placement(self, invs: list[restore_plan.Inventory]) -> None:
    """Once per manager: does any machine run processes of two slices?"""
    self._placement_checked = True
    shared = placement.shared_hosts(
      {inv.process: inv.host for inv in invs}, self._topology.slice_processes
    )
    self.placement_problem = placement.describe(shared)
    if self.placement_problem and self._topology.is_primary_process:
      self._events.record(
        "placement", hosts=len({inv.host for inv in invs}), error=self.placement_problem
      )

  def restorable_steps(self, name: str) -> list[int]:
    """Restorable steps by markers, oldest first (the same on every process)."""
    invs = self.exchange(name)
    return sorted(c.step for c in restore_plan.candidates(invs, self._topology.slice_processes))

  def metadata(self, step: int) -> StepMetadata:
    """See CheckpointManager.metadata. Called by: every process (one exchange)."""
    topo = self._topology
    mine: dict = {"local": self._local.step_bytes(step)}
    if topo.is_primary_process:
      mine["primary"] = {
        "persistent_bytes": persistent_layout.step_bytes(self._persistent.directory, step)
        if step in self._persistent.steps()
        else None,
        "committed": self._state.is_committed(step),
        "record": self._state.record(step),
      }
    got = self._collectives.exchange(f"metadata_{step}", mine)
    primary = got[topo.primary_process]["primary"]
    local_slices = tuple(
      s
      for s, procs in enumerate(topo.slice_processes)
      if all(got[p]["local"] is not None for p in procs)
    )
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
      local_bytes=sum(v["local"] or 0 for v in got.values()),
      persistent_bytes=primary["persistent_bytes"],
      topology=info.get("topology"),
      saved_at=info.get("saved_at", record.get("committed_at")),
      metrics=record.get("metrics") or {},
    )
