"""The three tiers' retention plans: the rules plus each tier's protections.

ONE plan for the manager (after each save, commit and upload) and for
`emergency-ckpt gc` (offline): both list what exists, call these functions,
and delete `plan.delete`. A step is kept if any rule keeps it (rules.py) or
a protection holds it. Protections, whatever the rules say:

- local tier (per process): the newest step held whose state is committed
  (the newest restorable candidate) and every newer step (its commit may be
  on its way); no held step committed yet: nothing is deleted. Without a
  state store at all (gc given none): the newest step.
- persistent tier: the newest restorable step (finalized tensors AND
  committed state) and the newer steps (their commits may be on their way;
  the manager's at most `max_to_keep` + 1); none restorable yet: nothing
  is deleted.
- state store: the state of every persistent step and of every local step
  kept, the newest commit and every newer step (none committed yet: every
  step), every step saved to the persistent tier (a persistent-interval
  step, or one the manager names) newer than the newest persistent step
  (its upload may be in flight), and among committed steps what the LOCAL
  tier's rules keep (plus `extra_newest`).

Pure functions of listings: no I/O, no JAX. Called by: the retainer (the
manager's background retention), `emergency-ckpt gc`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable

from emergency_ckpt.retention.rules import Metrics, Plan, Rules, explain, make_plan

LOCAL_LAG_STEPS = 2
"""`extra_newest` of the manager's state plan: it keeps the state of this
many committed steps beyond `local.max_to_keep`, because it cannot list the
other hosts' ramdisks and a slow host's local copies may lag the newest
commits (a local copy without its state is not restorable). gc lists the
local roots it is given and passes the steps it keeps as `local_kept`."""


def newest_committed(steps: Iterable[int], is_committed: Callable[[int], bool]) -> int | None:
  """The newest committed step, asked newest first and only until the first yes.

  Args:
    steps: the steps held.
    is_committed: whether a step's state is committed (each ask may read
      storage).

  Returns:
    The newest of `steps` for which `is_committed` holds, or None.
  """
  return next((s for s in sorted(set(steps), reverse=True) if is_committed(s)), None)


def local_plan(
  steps: Iterable[int],
  rules: Rules,
  *,
  is_committed: Callable[[int], bool] | None,
  metrics: Metrics | None = None,
  claimed: Collection[int] = (),
) -> Plan:
  """One process's local steps to keep and delete.

  Protected: the newest committed step held, and `max_to_keep` + 1 steps
  newer than it (their commits may be in flight; older uncommitted steps
  go, so a state store that cannot commit never fills the ramdisk): first
  those whose state this process wrote (`claimed`: their COMMIT may come
  at any moment; claims.py), then the newest. Called by: every process
  (manager), gc.

  Args:
    steps: the local steps this process holds.
    rules: the local tier's rules.
    is_committed: whether a step's state is committed (the state store's
      is_committed, or `committed.__contains__` of a listing); asked newest
      first, until the first yes. None: no state store is known (gc given
      none), so the newest step is taken as the newest restorable one.
    metrics: {step: {metric name: value}} for keep_best.
    claimed: the steps whose state file this process wrote, not known
      committed yet (retention/claims.py); the manager's only.

  Returns:
    The plan, with a reason per step.
  """
  steps = sorted(set(steps))
  protected: dict[int, str] = {}
  if is_committed is None:
    if steps:
      protected[steps[-1]] = "newest step (no state store given: the newest restorable)"
  else:
    newest = newest_committed(steps, is_committed)
    newer = steps if newest is None else [s for s in steps if s > newest]
    # Their commits may be in flight, but only so many: while the state
    # store cannot commit (its bucket is sick) training goes on, and the
    # ramdisk must not fill with steps that may never commit.
    # `max_to_keep` + 1 of them: the claimed ones (their COMMIT may come at
    # any moment), then the newest
    mine = [s for s in newer if s in claimed]
    for s in mine:
      protected[s] = "not committed yet (its state is written here: its COMMIT may follow)"
    room = (rules.max_to_keep or len(newer)) + 1 - len(mine)
    others = [s for s in newer if s not in claimed]
    for s in others[max(0, len(others) - room) :] if room > 0 else ():
      protected[s] = "not committed yet (its commit may be in flight)"
    if newest is not None:
      protected[newest] = "newest restorable here (newest committed step held)"
  return explain(steps, rules, metrics=metrics, protected=protected)


def persistent_plan(
  steps: Iterable[int],
  rules: Rules,
  *,
  committed: Collection[int],
  metrics: Metrics | None = None,
  capped: bool = False,
) -> Plan:
  """Persistent (tensor) steps to keep and delete.

  Protected: the newest restorable step (finalized tensors and committed
  state) and every newer step (their state commit may be in flight), or
  with `capped` the `max_to_keep` + 1 newest of them; none restorable yet:
  every step. Called by: the primary process (manager, capped: a state
  store that cannot commit must not fill the bucket), gc (not capped: run
  beside a job, it cannot tell a commit backlog from a stopped one).

  Args:
    steps: the finalized tensor steps.
    rules: the persistent tier's rules.
    committed: the state store's committed steps.
    metrics: {step: {metric name: value}} for keep_best.
    capped: at most `rules.max_to_keep` + 1 steps newer than the newest
      restorable one are protected.

  Returns:
    The plan, with a reason per step.
  """
  steps = sorted(set(steps))
  committed = set(committed)
  restorable = [s for s in steps if s in committed]
  if not restorable:
    why = "no step has both finalized tensors and committed state: nothing is deleted"
    protected = dict.fromkeys(steps, why)
  else:
    newest = restorable[-1]
    newer = [s for s in steps if s > newest]
    # their commits may be in flight, but only so many: a state store that
    # cannot commit must not fill the bucket (as local_plan)
    if capped and rules.max_to_keep is not None:
      newer = newer[max(0, len(newer) - (rules.max_to_keep + 1)) :]
    protected = dict.fromkeys(
      newer, "newer than the newest restorable step (state commit may be in flight)"
    )
    protected[newest] = "newest restorable (finalized tensors + committed state)"
  return explain(steps, rules, metrics=metrics, protected=protected)


def state_plan(
  listed: Iterable[int],
  committed: Iterable[int],
  rules: Rules,
  *,
  persistent: Iterable[int] = (),
  local_kept: Iterable[int] = (),
  persistent_interval: int | None = None,
  uploading: Iterable[int] = (),
  metrics: Metrics | None = None,
  extra_newest: int = 0,
) -> Plan:
  """State-store steps to keep and delete.

  Uncommitted state older than the newest commit goes unless protected.
  Called by: the primary process (manager), gc.

  Args:
    listed: every state step.
    committed: the committed ones.
    rules: the LOCAL tier's rules (state outlives a local copy only as long
      as the copy may be restored).
    persistent: the persistent steps that stay (their state is kept).
    local_kept: local steps known to stay (gc).
    persistent_interval: the persistent tier's fixed save interval: its
      steps are persistent steps (None: unknown, or chosen by the manager).
    uploading: steps saved to the persistent tier besides those of
      `persistent_interval` (the manager's, where it chooses the interval:
      the steps its schedule sent there, forced saves included).
    metrics: {step: {metric name: value}} for keep_best.
    extra_newest: committed steps kept beyond `rules.max_to_keep` (the
      manager passes LOCAL_LAG_STEPS).

  Returns:
    The plan, with a reason per step.
  """
  listed = sorted(set(listed))
  committed_set = set(committed) & set(listed)
  persistent = set(persistent)
  local_kept = set(local_kept)
  newest_commit = max(committed_set, default=None)
  newest_persistent = max(persistent, default=None)
  uploading = set(uploading)

  def uploads(s: int) -> bool:  # a persistent step whose upload may be in flight
    if newest_persistent is not None and s <= newest_persistent:
      return False
    return s in uploading or (persistent_interval is not None and s % persistent_interval == 0)

  protected: dict[int, str] = {}
  for s in listed:
    if s in persistent:
      protected[s] = "state of a kept persistent step"
    elif s in local_kept:
      protected[s] = "state of a kept local step"
    elif newest_commit is None:
      protected[s] = "no committed state yet: nothing is deleted"
    elif s == newest_commit:
      protected[s] = "newest commit (the newest restorable candidate)"
    elif s > newest_commit:
      protected[s] = "uncommitted, newer than the newest commit (may be in flight)"
    elif uploads(s):
      protected[s] = (
        "a persistent step newer than the newest finalized one (upload may be in flight)"
      )
  if rules.max_to_keep is not None and extra_newest:
    rules = dataclasses.replace(rules, max_to_keep=rules.max_to_keep + extra_newest)
  decided = explain(
    committed_set,
    rules,
    metrics=metrics,
    protected={s: why for s, why in protected.items() if s in committed_set},
  )
  keep = set(decided.keep)
  reasons = dict(decided.reasons)
  for s in listed:
    if s in committed_set:
      continue
    if s in protected:
      keep.add(s)
      reasons[s] = protected[s]
    else:
      reasons[s] = "uncommitted (no valid COMMIT or files missing), older than the newest commit"
  return make_plan(listed, keep, reasons)
