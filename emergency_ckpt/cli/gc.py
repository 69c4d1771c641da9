"""`emergency-ckpt gc`: apply retention offline to local and persistent roots."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
from typing import Any

from etils import epath

from emergency_ckpt import local_tier, policies, state_store
from emergency_ckpt.cli._output import _grid, _mib, _Progress, _Style
from emergency_ckpt.cli.inspect import _is_persistent

_STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_TIER_ORDER = {"local": 0, "persistent": 1, "state": 2}


@dataclasses.dataclass
class _StateView:
  """One persistent root's state store, read once: committed steps, metrics."""

  root: epath.Path
  store: state_store.StateStore
  listed: list[int]
  committed: set[int]
  metrics: dict[int, dict]
  run_id: str | None
  local_kept: set[int] = dataclasses.field(default_factory=set)


def _state_view(root: epath.Path) -> _StateView:
  store = state_store.StateStore(root / "state", process_index=0, process_count=1)
  committed = set(store.committed_steps())
  metrics = {}
  for step in committed:
    values = (store.record(step) or {}).get("metrics")
    if isinstance(values, dict):
      metrics[step] = values
  try:
    run_id = json.loads((root / "run.json").read_text()).get("run_id")
  except (OSError, ValueError, AttributeError):
    run_id = None
  return _StateView(root, store, store.listed_steps(), committed, metrics, run_id)


def _value(metrics: dict[int, dict], step: int, metric: str | None) -> str | None:
  v = (metrics.get(step) or {}).get(metric) if metric else None
  return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _decide(
  steps, rules: policies.Retention, metrics: dict[int, dict], protected: dict[int, str]
) -> dict[int, tuple[str, str]]:
  """{step: ("keep" | "delete", reason)}: `policies.retain` decides; the
  reason names every rule that keeps a step, or each rule it misses."""
  steps = sorted(set(steps))
  keep = policies.retain(steps, rules, metrics=metrics, protected=protected)
  newest = policies.keep_latest(steps, rules.max_to_keep)
  best: list[int] = []
  if rules.keep_best is not None and rules.best_metric is not None:
    present = {s: metrics.get(s) or {} for s in steps}
    best = policies.best_steps(present, rules.best_metric, rules.best_mode, rules.keep_best)
  out = {}
  for s in steps:
    why, why_not = [], []
    if s in protected:
      why.append(protected[s])
    (why if s in newest else why_not).append(
      f"{'' if s in newest else 'not among the '}newest {rules.max_to_keep}"
    )
    if rules.keep_period is not None:
      hit = s % rules.keep_period == 0
      (why if hit else why_not).append(f"{'' if hit else 'not a '}multiple of {rules.keep_period}")
    if rules.best_metric is not None and rules.keep_best is not None:
      value = _value(metrics, s, rules.best_metric)
      shown = f"{rules.best_metric}={value}" if value is not None else f"no {rules.best_metric}"
      if s in best:
        why.append(f"best {rules.keep_best} by {shown} (#{best.index(s) + 1})")
      else:
        why_not.append(f"not among the best {rules.keep_best} ({shown})")
    if s in keep:
      out[s] = ("keep", "; ".join(why) or "retained")
    else:
      out[s] = ("delete", ", ".join(why_not) or "not retained")
  return out


def _dir_bytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      with contextlib.suppress(OSError):
        total += os.lstat(os.path.join(root, name)).st_size
  return total


def _gc_local(
  root: str,
  rules: policies.Retention,
  views_by_run: dict[str, _StateView],
  explicit: _StateView | None,
  warnings: list[str],
) -> list[dict[str, Any]]:
  """Rows for every step of every process under a local root."""
  rows = []
  for run in sorted(os.listdir(root)):
    run_dir = os.path.join(root, run)
    if os.path.islink(run_dir) or not os.path.isdir(run_dir):
      continue
    view = explicit or views_by_run.get(run)
    if view is None and rules.keep_best is not None:
      warnings.append(
        f"{run_dir}: no state store matched (run.json of a persistent root in DIR..., or"
        " --state), so --keep-best has no metrics and --keep/--keep-period decide alone"
      )
    for proc in sorted(os.listdir(run_dir)):
      proc_dir = os.path.join(run_dir, proc)
      if not proc.startswith("process_") or os.path.islink(proc_dir) or not os.path.isdir(proc_dir):
        continue
      steps = {}
      for name in os.listdir(proc_dir):
        m = _STEP_DIR_RE.match(name)
        if m and os.path.isfile(os.path.join(proc_dir, name, "manifest.json")):
          steps[int(m.group(1))] = os.path.join(proc_dir, name)
      if not steps:
        continue
      protected: dict[int, str] = {}
      metrics: dict[int, dict] = {}
      if view is None:
        protected[max(steps)] = "newest step (no state store given: the newest restorable)"
      else:
        metrics = view.metrics
        if not view.committed:
          protected = dict.fromkeys(steps, "no committed state yet: nothing is deleted")
        else:
          newest_committed = max(view.committed)
          for s in steps:
            if s > newest_committed:
              protected[s] = "newer than the newest committed state (commit may be in flight)"
          held = sorted(set(steps) & view.committed)
          if held:
            protected[held[-1]] = "newest restorable here (newest committed step held)"
      for s, (action, reason) in _decide(steps, rules, metrics, protected).items():
        row = {
          "tier": "local",
          "location": proc_dir,
          "step": s,
          "action": action,
          "reason": reason,
          "path": steps[s],
        }
        if action == "keep" and view is not None:
          view.local_kept.add(s)
        if action == "delete":
          row["bytes"] = _dir_bytes(steps[s])
          row["_delete"] = functools.partial(local_tier.delete_step_dir, steps[s])
        rows.append(row)
  return rows


def _gc_persistent(root: epath.Path, rules: policies.Retention, view: _StateView) -> list[dict]:
  """Rows for every finalized tensor step and every state step of a persistent root."""
  from emergency_ckpt import persistent_tier  # noqa: PLC0415 - imports JAX and Orbax

  tensors_dir = root / "tensors"
  tensor_steps = persistent_tier.list_steps(tensors_dir)
  restorable = sorted(set(tensor_steps) & view.committed)
  protected: dict[int, str] = {}
  for s in tensor_steps:
    if not restorable:
      protected[s] = "no step has both tensors and committed state: nothing is deleted"
    elif s > restorable[-1]:
      protected[s] = "newer than the newest restorable step (state commit may be in flight)"
  if restorable:
    protected[restorable[-1]] = "newest restorable (finalized tensors + committed state)"
  rows = []
  kept_tensors = set()
  for s, (action, reason) in _decide(tensor_steps, rules, view.metrics, protected).items():
    path = tensors_dir / str(s)
    row = {
      "tier": "persistent",
      "location": str(root),
      "step": s,
      "action": action,
      "reason": reason,
      "path": str(path),
    }
    if action == "keep":
      kept_tensors.add(s)
    else:
      row["bytes"] = persistent_tier.step_bytes(tensors_dir, s)
      row["_delete"] = functools.partial(persistent_tier.delete_step, tensors_dir, s)
    rows.append(row)

  newest_committed = max(view.committed, default=None)
  state_protected: dict[int, str] = {}
  for s in view.listed:
    if s in kept_tensors:
      state_protected[s] = "state of a kept persistent step"
    elif s in view.local_kept:
      state_protected[s] = "state of a kept local step"
    elif newest_committed is None or s > newest_committed:
      state_protected[s] = "uncommitted, newer than the newest commit (may be in flight)"
  committed = sorted(view.committed & set(view.listed))
  decided = _decide(
    committed,
    rules,
    view.metrics,
    {s: r for s, r in state_protected.items() if s in view.committed},
  )
  for s in view.listed:
    if s in decided:
      action, reason = decided[s]
    elif s in state_protected:
      action, reason = "keep", state_protected[s]
    else:
      action, reason = (
        "delete",
        "uncommitted (no valid COMMIT or files missing), older than the newest commit",
      )
    row = {
      "tier": "state",
      "location": str(root),
      "step": s,
      "action": action,
      "reason": reason,
      "path": str(view.store.step_dir(s)),
    }
    if action == "delete":
      row["_delete"] = functools.partial(view.store.delete, s)
    rows.append(row)
  return rows


def plan_gc(
  dirs: list[str], rules: policies.Retention, *, state: str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
  """(rows, warnings): one row per step and tier with action "keep" or
  "delete" and the reason. Rows to delete carry a private "_delete" callable."""
  warnings: list[str] = []
  explicit = None
  if state is not None:
    explicit = _state_view(epath.Path(state))
    if not explicit.listed:
      warnings.append(f"--state {state}: no state/<step> folders found")
  persistent, local, rows = [], [], []
  for d in dirs:
    root = epath.Path(d)
    if _is_persistent(root):
      persistent.append((root, _state_view(root)))
    elif os.path.isdir(d):
      local.append(d)
    else:
      rows.append(
        {"tier": "?", "location": d, "step": None, "action": "error", "reason": "no such directory"}
      )
  by_run = {view.run_id: view for _, view in persistent if view.run_id}
  for d in local:
    rows += _gc_local(d, rules, by_run, explicit, warnings)
  for root, view in persistent:
    if explicit is not None and str(explicit.root) == str(root):
      view.local_kept |= explicit.local_kept
    rows += _gc_persistent(root, rules, view)
  rows.sort(key=lambda r: (r["location"], _TIER_ORDER.get(r["tier"], 9), r["step"] or 0))
  return rows, warnings


def _run_deletions(rows: list[dict[str, Any]], progress: _Progress) -> None:
  doomed = [r for r in rows if r["action"] == "delete"]
  doomed.sort(key=lambda r: _TIER_ORDER[r["tier"]])  # tensors before their state
  for i, r in enumerate(doomed, 1):
    progress.status(f"gc [{i}/{len(doomed)}] deleting {r['tier']} step {r['step']}: {r['path']}")
    try:
      r["_delete"]()
      r["action"] = "deleted"
    except Exception as e:  # noqa: BLE001 - report every failure, go on with the rest
      r["action"] = "FAILED"
      r["reason"] = f"{r['reason']}; delete failed: {e}"
  progress.clear()


def _action_color(header: str, value: str) -> tuple[str, ...]:
  if header != "action":
    return ()
  return {
    "keep": ("green",),
    "deleted": ("red",),
    "would delete": ("yellow",),
    "FAILED": ("red", "bold"),
    "error": ("red", "bold"),
  }.get(value, ())


def cmd_gc(a) -> int:
  rules = policies.Retention(
    max_to_keep=a.keep,
    keep_period=a.keep_period,
    keep_best=a.keep_best,
    best_metric=a.metric,
    best_mode=a.mode,
  )
  rows, warnings = plan_gc(a.dirs, rules, state=a.state)
  if a.dry_run:
    for r in rows:
      if r["action"] == "delete":
        r["action"] = "would delete"
  else:
    _run_deletions(rows, _Progress())
  gone = [r for r in rows if r["action"] in ("deleted", "would delete")]
  failed = [r for r in rows if r["action"] in ("FAILED", "error")]
  summary = {
    "dry_run": a.dry_run,
    "kept": sum(r["action"] == "keep" for r in rows),
    "deleted": len(gone),
    "failed": len(failed),
    "freed_bytes": sum(r.get("bytes") or 0 for r in gone),
  }
  public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
  if a.json:
    print(json.dumps({"summary": summary, "rows": public, "warnings": warnings}, indent=1))
  else:
    style = _Style()
    body = [
      [r["tier"], r["step"], r["action"], _mib(r.get("bytes")), r["location"], r["reason"]]
      for r in public
    ]
    print(_grid(["tier", "step", "action", "size", "where", "reason"], body, style, _action_color))
    verb = "would delete" if a.dry_run else "deleted"
    print(
      f"\n{verb} {summary['deleted']} step folder(s)"
      f" ({_mib(summary['freed_bytes'])} of local and tensor steps), kept {summary['kept']}"
      + (f", {summary['failed']} failed" if failed else "")
      + (" (dry run: nothing was deleted)" if a.dry_run else "")
    )
  for w in warnings:
    print(f"warning: {w}", file=sys.stderr)
  return 1 if failed else 0
