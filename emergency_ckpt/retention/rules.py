"""Retention: which steps each tier keeps, as pure functions of listings.

ONE plan for the manager (after each save, commit and upload) and for
`emergency-ckpt gc` (offline): both list what exists, call these functions,
and delete `plan.delete`. A step is kept if ANY rule keeps it (`Rules`: the
newest N, every P-th, the K best by a metric) or a protection holds it.
Protections, whatever the rules say:

- local tier (per process): the newest step held whose state is committed
  (the newest restorable candidate) and every newer step (its commit may be
  on its way); no held step committed yet: nothing is deleted. Without a
  state store at all (gc given none): the newest step.
- persistent tier: the newest restorable step (finalized tensors AND
  committed state) and every newer step (its commit may be on its way); none
  restorable yet: nothing is deleted.
- state store: the state of every persistent step and of every local step
  kept, the newest commit and every newer step (none committed yet: every
  step), every persistent-interval step newer than the newest persistent step
  (its upload may be in flight), and among committed steps what the LOCAL
  tier's rules keep (plus `extra_newest`).

Every plan carries a reason per step (gc prints them). No I/O, no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping

from emergency_ckpt.errors import InvalidOptionsError

Metrics = Mapping[int, Mapping[str, float]]
"""{step: {metric name: value}}; a step without a finite value is never "best"."""

LOCAL_LAG_STEPS = 2
"""`extra_newest` of the manager's state plan: it keeps the state of this
many committed steps beyond `local.max_to_keep`, because it cannot list the
other hosts' ramdisks and a slow host's local copies may lag the newest
commits (a local copy without its state is not restorable). gc lists the
local roots it is given and passes the steps it keeps as `local_kept`."""

BEST_MODES = ("min", "max")


def _optional_int(value, name: str, minimum: int) -> None:
  ok = value is None or (
    isinstance(value, int) and not isinstance(value, bool) and value >= minimum
  )
  if not ok:
    raise InvalidOptionsError(f"{name} must be an integer >= {minimum} or None, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rules:
  """One tier's retention rules; a step is kept if ANY rule keeps it."""

  max_to_keep: int | None
  """The newest N steps; None: every step (0: none by this rule, as `gc --keep 0`)."""
  keep_period: int | None = None
  """Every step divisible by N (milestones kept forever)."""
  keep_best: int | None = None
  """The N best steps by `best_metric` (steps without it never count as best)."""
  best_metric: str | None = None
  """The metric that ranks steps for `keep_best`; None: keep_best is off."""
  best_mode: str = "min"
  """"min" if smaller is better (a loss), "max" if larger is (an accuracy)."""

  def __post_init__(self):
    _optional_int(self.max_to_keep, "max_to_keep", 0)
    _optional_int(self.keep_period, "keep_period", 1)
    _optional_int(self.keep_best, "keep_best", 0)
    if self.best_mode not in BEST_MODES:
      raise InvalidOptionsError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """What one retention pass over one listing keeps and deletes."""

  keep: frozenset[int]
  delete: tuple[int, ...]
  """Oldest first."""
  reasons: Mapping[int, str]
  """Every step of the listing: why it is kept, or why no rule keeps it."""


def keep_latest(
  steps: Iterable[int], max_to_keep: int | None, protected: Iterable[int] = ()
) -> set[int]:
  """The newest `max_to_keep` steps (all if None) plus `protected` (those present)."""
  ordered = sorted(set(steps), reverse=True)
  keep = set(ordered if max_to_keep is None else ordered[:max_to_keep])
  return keep | (set(protected) & set(ordered))


def _finite(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def best_steps(metrics: Metrics, metric: str, mode: str, n: int | None = None) -> list[int]:
  """Steps ranked best first by `metrics[step][metric]` (ties: newer first);
  steps lacking a finite value are left out. The first `n` if given."""
  scored = []
  for step, values in metrics.items():
    value = (values or {}).get(metric)
    if _finite(value):
      scored.append((value if mode == "min" else -value, -step))
  ranked = [-neg_step for _, neg_step in sorted(scored)]
  return ranked if n is None else ranked[:n]


def _best(steps: Iterable[int], rules: Rules, metrics: Metrics | None) -> list[int]:
  if rules.keep_best is None or rules.best_metric is None:
    return []
  steps = set(steps)
  present = {s: m for s, m in (metrics or {}).items() if s in steps}
  return best_steps(present, rules.best_metric, rules.best_mode, rules.keep_best)


def retain(
  steps: Iterable[int],
  rules: Rules,
  *,
  metrics: Metrics | None = None,
  protected: Iterable[int] = (),
) -> set[int]:
  """Steps to keep: the union of the newest `max_to_keep`, every
  `keep_period`-th, the `keep_best` best by metric, and `protected` (those
  present). The same inputs give the same set on every process."""
  steps = set(steps)
  keep = keep_latest(steps, rules.max_to_keep, protected)
  if rules.keep_period is not None:
    keep |= {s for s in steps if s % rules.keep_period == 0}
  return keep | set(_best(steps, rules, metrics))


def _shown(metrics: Metrics, step: int, metric: str) -> str:
  value = (metrics.get(step) or {}).get(metric)
  return f"{metric}={value:g}" if _finite(value) else f"no {metric}"


def explain(
  steps: Iterable[int],
  rules: Rules,
  *,
  metrics: Metrics | None = None,
  protected: Mapping[int, str] | None = None,
) -> Plan:
  """`retain` with a reason per step: every rule (or protection, its reason
  the value in `protected`) that keeps it, or each rule it misses."""
  steps = sorted(set(steps))
  protected = dict(protected or {})
  metrics = metrics or {}
  keep = retain(steps, rules, metrics=metrics, protected=protected)
  newest = keep_latest(steps, rules.max_to_keep)
  best = _best(steps, rules, metrics)
  reasons = {}
  for s in steps:
    why, why_not = [], []
    if s in protected:
      why.append(protected[s])
    if rules.max_to_keep is None:
      why.append("every step (no max_to_keep)")
    elif s in newest:
      why.append(f"newest {rules.max_to_keep}")
    else:
      why_not.append(f"not among the newest {rules.max_to_keep}")
    if rules.keep_period is not None:
      if s % rules.keep_period == 0:
        why.append(f"multiple of {rules.keep_period}")
      else:
        why_not.append(f"not a multiple of {rules.keep_period}")
    if rules.best_metric is not None and rules.keep_best is not None:
      shown = _shown(metrics, s, rules.best_metric)
      if s in best:
        why.append(f"best {rules.keep_best} by {shown} (#{best.index(s) + 1})")
      else:
        why_not.append(f"not among the best {rules.keep_best} ({shown})")
    if s in keep:
      reasons[s] = "; ".join(why) or "retained"
    else:
      reasons[s] = ", ".join(why_not) or "not retained"
  return _plan(steps, keep, reasons)


def _plan(steps: Iterable[int], keep: Iterable[int], reasons: Mapping[int, str]) -> Plan:
  steps = sorted(set(steps))
  keep = frozenset(keep) & frozenset(steps)
  return Plan(keep=keep, delete=tuple(s for s in steps if s not in keep), reasons=dict(reasons))


# ---- the three tiers -----------------------------------------------------------------
def newest_committed(steps: Iterable[int], is_committed: Callable[[int], bool]) -> int | None:
  """The newest of `steps` for which `is_committed` holds; asked newest
  first and only until the first yes (each ask may read storage)."""
  return next((s for s in sorted(set(steps), reverse=True) if is_committed(s)), None)


def local_plan(
  steps: Iterable[int],
  rules: Rules,
  *,
  is_committed: Callable[[int], bool] | None,
  metrics: Metrics | None = None,
) -> Plan:
  """One process's local steps to keep and delete.

  `is_committed(step)`: whether the step's state is committed (the state
  store's is_committed, or `committed.__contains__` of a listing); asked
  newest first, until the first yes. None: no state store is known (gc
  given none), so the newest step is taken as the newest restorable one.
  Protected: the newest committed step held and every newer step; with no
  held step committed, every step. Called by: every process (manager), gc."""
  steps = sorted(set(steps))
  protected: dict[int, str] = {}
  if is_committed is None:
    if steps:
      protected[steps[-1]] = "newest step (no state store given: the newest restorable)"
  else:
    newest = newest_committed(steps, is_committed)
    if newest is None:
      protected = dict.fromkeys(steps, "no step held here is committed yet: nothing is deleted")
    else:
      for s in steps:
        if s > newest:
          protected[s] = "newer than the newest committed step held (commit may be in flight)"
      protected[newest] = "newest restorable here (newest committed step held)"
  return explain(steps, rules, metrics=metrics, protected=protected)


def persistent_plan(
  steps: Iterable[int],
  rules: Rules,
  *,
  committed: Collection[int],
  metrics: Metrics | None = None,
) -> Plan:
  """Persistent (tensor) steps to keep and delete. `steps`: the finalized
  ones; `committed`: the state store's committed steps. Protected: the
  newest restorable step (both) and every newer step; none restorable yet:
  every step. Called by: the primary process (manager), gc."""
  steps = sorted(set(steps))
  committed = set(committed)
  restorable = [s for s in steps if s in committed]
  if not restorable:
    why = "no step has both finalized tensors and committed state: nothing is deleted"
    protected = dict.fromkeys(steps, why)
  else:
    newest = restorable[-1]
    protected = {
      s: "newer than the newest restorable step (state commit may be in flight)"
      for s in steps
      if s > newest
    }
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
  metrics: Metrics | None = None,
  extra_newest: int = 0,
) -> Plan:
  """State-store steps to keep and delete.

  `listed`: every state step; `committed`: the committed ones; `rules`: the
  LOCAL tier's (state outlives a local copy only as long as the copy may be
  restored); `persistent`: the persistent steps that stay (their state is
  kept); `local_kept`: local steps known to stay (gc); `persistent_interval`:
  the persistent tier's save interval (None: unknown); `extra_newest`:
  committed steps kept beyond `rules.max_to_keep` (the manager passes
  LOCAL_LAG_STEPS). Uncommitted state older than the newest commit goes
  unless protected. Called by: the primary process (manager), gc."""
  listed = sorted(set(listed))
  committed_set = set(committed) & set(listed)
  persistent = set(persistent)
  local_kept = set(local_kept)
  newest_commit = max(committed_set, default=None)
  newest_persistent = max(persistent, default=None)
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
    elif (
      persistent_interval is not None
      and s % persistent_interval == 0
      and (newest_persistent is None or s > newest_persistent)
    ):
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
  return _plan(listed, keep, reasons)
