"""`emergency-ckpt gc`: apply retention offline to local and persistent roots.

The plans are retention/plans.py's, the ones the manager runs (reasons per step);
the listings are folders.walk_local and persistent_layout.scan; deletions go
through the same namespace moves as the tiers'. No JAX, no Orbax."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from typing import Any

from etils import epath

from emergency_ckpt.cli._output import Progress, Style, grid, mib
from emergency_ckpt.core import layout
from emergency_ckpt.local import folders
from emergency_ckpt.persistent import layout as persistent_layout
from emergency_ckpt.retention import plans
from emergency_ckpt.retention.rules import Plan, Rules

_TIER_ORDER = {"local": 0, "persistent": 1, "state": 2}


def _dir_bytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      with contextlib.suppress(OSError):
        total += os.lstat(os.path.join(root, name)).st_size
  return total


def _key(root: epath.PathLike) -> str:
  return os.fspath(epath.Path(root))


def _rows(tier: str, location: str, plan: Plan, paths: dict[int, str]) -> list[dict]:
  rows = []
  for s, reason in sorted(plan.reasons.items()):
    action = "keep" if s in plan.keep else "delete"
    rows.append(
      {
        "tier": tier,
        "location": location,
        "step": s,
        "action": action,
        "reason": reason,
        "path": paths[s],
      }
    )
  return rows


def _gc_local(
  root: str,
  rules: Rules,
  by_run: dict[str, persistent_layout.PersistentListing],
  explicit: persistent_layout.PersistentListing | None,
  local_kept: dict[str, set[int]],
  warnings: list[str],
) -> list[dict[str, Any]]:
  """Rows for every step of every process under a local root."""
  rows = []
  warned: set[str] = set()
  for proc in folders.walk_local(root).processes:
    store = explicit or by_run.get(proc.run_id)
    if store is None and rules.keep_best is not None and proc.run_id not in warned:
      warned.add(proc.run_id)
      warnings.append(
        f"{layout.run_dir(root, proc.run_id)}: no state store matched (run.json of a persistent"
        " root in DIR..., or --state), so --keep-best has no metrics and --keep/--keep-period"
        " decide alone"
      )
    if not proc.steps:
      continue
    plan = plans.local_plan(
      proc.steps,
      rules,
      is_committed=None if store is None else store.committed.__contains__,
      metrics=None if store is None else store.metrics,
    )
    if store is not None:
      local_kept.setdefault(_key(store.root), set()).update(plan.keep)
    for row in _rows("local", proc.path, plan, dict(proc.steps)):
      if row["action"] == "delete":
        row["bytes"] = _dir_bytes(row["path"])
        row["_delete"] = functools.partial(folders.delete_local_step_dir, row["path"])
      rows.append(row)
  return rows


def _gc_persistent(
  listing: persistent_layout.PersistentListing, rules: Rules, local_kept: set[int]
) -> list[dict]:
  """Rows for every finalized tensor step and every state step of a persistent root."""
  tensors = layout.tensors_dir(listing.root)
  metrics = listing.metrics
  tensor_plan = plans.persistent_plan(
    listing.tensor_steps, rules, committed=listing.committed, metrics=metrics
  )
  paths = {s: str(layout.tensor_step_dir(tensors, s)) for s in listing.tensor_steps}
  rows = []
  for row in _rows("persistent", str(listing.root), tensor_plan, paths):
    if row["action"] == "delete":
      row["bytes"] = persistent_layout.step_bytes(tensors, row["step"])
      row["_delete"] = functools.partial(persistent_layout.delete_step, tensors, row["step"])
    rows.append(row)
  state_plan = plans.state_plan(
    listing.state_steps,
    listing.committed,
    rules,
    persistent=tensor_plan.keep,
    local_kept=local_kept,
    persistent_interval=listing.persistent_interval,
    metrics=metrics,
  )
  store = listing.state_store()
  paths = {s: str(store.step_dir(s)) for s in listing.state_steps}
  for row in _rows("state", str(listing.root), state_plan, paths):
    if row["action"] == "delete":
      row["_delete"] = functools.partial(store.delete, row["step"])
    rows.append(row)
  return rows


def plan_gc(
  dirs: list[str], rules: Rules, *, state: str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
  """What `gc` keeps and deletes under the given roots, deleting nothing.

  Args:
    dirs: local roots (a host's local.directory) and persistent roots.
    rules: the retention rules (from gc's flags), for every tier.
    state: a persistent root whose state store tells the local roots which
      steps are committed (and their metrics); None: a persistent root in
      `dirs` whose run.json names the run.

  Returns:
    (rows, warnings): one row per step and tier with its action ("keep",
    "delete", or "error" for a missing root) and the reason; rows to delete
    carry a private "_delete" callable.
  """
  warnings: list[str] = []
  explicit = None
  if state is not None:
    explicit = persistent_layout.scan(state)
    if not explicit.state_steps:
      warnings.append(f"--state {state}: no state/<step> folders found")
  persistent, local, rows = [], [], []
  for d in dirs:
    if persistent_layout.looks_persistent(d):
      persistent.append(persistent_layout.scan(d))
    elif os.path.isdir(d):
      local.append(d)
    else:
      rows.append(
        {"tier": "?", "location": d, "step": None, "action": "error", "reason": "no such directory"}
      )
  by_run = {listing.run_id: listing for listing in persistent if listing.run_id}
  local_kept: dict[str, set[int]] = {}  # persistent root -> local steps kept (their state stays)
  for d in local:
    rows += _gc_local(d, rules, by_run, explicit, local_kept, warnings)
  for listing in persistent:
    rows += _gc_persistent(listing, rules, local_kept.get(_key(listing.root), set()))
  rows.sort(key=lambda r: (r["location"], _TIER_ORDER.get(r["tier"], 9), r["step"] or 0))
  return rows, warnings


def _run_deletions(rows: list[dict[str, Any]], progress: Progress) -> None:
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
  """`emergency-ckpt gc`: applies retention, or shows it with --dry-run.

  Args:
    a: the parsed arguments (dirs, keep, keep_period, keep_best, metric,
      mode, state, dry_run, json).

  Returns:
    The exit status: 0, or 1 if a root does not exist or a deletion failed.
  """
  rules = Rules(
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
    _run_deletions(rows, Progress())
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
    style = Style()
    body = [
      [r["tier"], r["step"], r["action"], mib(r.get("bytes")), r["location"], r["reason"]]
      for r in public
    ]
    print(grid(["tier", "step", "action", "size", "where", "reason"], body, style, _action_color))
    verb = "would delete" if a.dry_run else "deleted"
    print(
      f"\n{verb} {summary['deleted']} step folder(s)"
      f" ({mib(summary['freed_bytes'])} of local and tensor steps), kept {summary['kept']}"
      + (f", {summary['failed']} failed" if failed else "")
      + (" (dry run: nothing was deleted)" if a.dry_run else "")
    )
  for w in warnings:
    print(f"warning: {w}", file=sys.stderr)
  return 1 if failed else 0
