"""The save cadence (cadence.py) wired into a manager: what it measures
(the work in flight) and run.json's fields.

With persistent "auto" or save_interval_s, the retainer (retention/, which
keeps the state of a persistent step newer than the newest finalized one,
as its upload may be in flight) learns the persistent steps from the
cadence (Cadence.persistent_steps, followed by the manager's parts): the
state store keeps the state of exactly the steps sent to the persistent
tier, not of every step.

Called by: the manager's parts (manager/parts.py), on every process while
the manager is built. Blocks on nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from emergency_ckpt.save.cadence import TIERS, Cadence, TierPlan, managed
from emergency_ckpt.save.cadence_targets import FailureHistory

if TYPE_CHECKING:
  from emergency_ckpt.cluster.context import JobContext
  from emergency_ckpt.core.health import HealthTracker
  from emergency_ckpt.runtime.background import Background

LOCAL_LANES = ("d2h", "local-write", "redundancy", "state-write", "retention")
"""Background lanes whose work follows a local save."""


def busy_probe(background: Background, health: HealthTracker) -> Callable[[], frozenset[str]]:
  """The tiers with save work in flight, as a function: "local" while a lane
  of LOCAL_LANES has a task, "persistent" while an upload runs (or waits
  for its admission)."""

  def busy() -> frozenset[str]:
    out = set()
    if any(background.busy(lane) for lane in LOCAL_LANES):
      out.add("local")
    if background.busy("admission") or health.in_flight("persistent") is not None:
      out.add("persistent")
    return frozenset(out)

  return busy


def for_job(
  ctx: JobContext, *, background: Background, history: FailureHistory | None = None
) -> Cadence | None:
  """This process's Cadence, or None when every tier has a fixed step interval.
  Called by: every process, once, while its manager is built (it numbers
  the manager's keys, the same on every process).

  Args:
    ctx: the job.
    background: the manager's lanes (what is in flight).
    history: this run's starts (the primary's estimate of the MTBF).
  """
  options, topo = ctx.options, ctx.topology
  if not managed(options):
    return None
  several = topo.process_count > 1
  return Cadence(
    {t: TierPlan.of(getattr(options, t)) for t in TIERS},
    deciding=topo.is_primary_process,
    channel=ctx.collectives if several else None,
    prefix=ctx.collectives.sequenced("cadence") if several else "cadence",
    events=ctx.events,
    log_prefix=topo.log_prefix(),
    primary=topo.primary_process,
    timeout_s=options.collective_timeout_s,
    history=history,
    busy=busy_probe(background, ctx.health),
  )


def run_record(options: Any) -> dict:
  """run.json's save-interval fields: each tier's save_interval_steps and
  save_interval_s; "persistent_save_interval_steps" is an integer
  (`emergency-ckpt gc`, which cannot ask the running manager, protects the
  state of the steps it names whose upload may be in flight): 1 with
  "auto" or seconds, where any step may be a persistent step."""
  local, persistent = options.local, options.persistent
  return {
    "local_save_interval_steps": local.save_interval_steps,
    "local_save_interval_s": local.save_interval_s,
    "persistent_save_interval_steps": (
      1 if TierPlan.of(persistent).managed else persistent.save_interval_steps
    ),
    "persistent_save_interval_s": persistent.save_interval_s,
    **({"persistent_save_cadence": "auto"} if persistent.save_interval_steps == "auto" else {}),
  }
