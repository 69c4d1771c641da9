"""`emergency-ckpt`: inspect, verify and garbage-collect checkpoint folders,
summarise event logs, run the benchmark and the demo.

`inspect`, `verify` and `gc` work on folders only (no JAX job): a local root
(the `local.directory` of one host) or a persistent root (holding tensors/ and
state/). `report` reads the JSON-lines event logs written by
`emergency_ckpt.telemetry.EventLog`. Output is a plain table (colored only on a
terminal), or JSON with --json; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from etils import epath

from emergency_ckpt import local_tier, policies, state_store, telemetry


def _is_persistent(root: epath.Path) -> bool:
  return (root / "state").exists() or (root / "tensors").exists() or (root / "run.json").exists()


def _local_steps(root: str) -> list[dict[str, Any]]:
  """One row per (run, process, step) under a local root."""
  rows = []
  for run in sorted(os.listdir(root)):
    run_dir = os.path.join(root, run)
    if not os.path.isdir(run_dir):
      continue
    for proc in sorted(os.listdir(run_dir)):
      proc_dir = os.path.join(run_dir, proc)
      if not proc.startswith("process_") or not os.path.isdir(proc_dir):
        continue
      for name in sorted(os.listdir(proc_dir)):
        if name.startswith("step_"):
          rows.append(
            {
              "tier": "local",
              "run_id": run,
              "process": proc,
              "step": int(name[5:]),
              "path": os.path.join(proc_dir, name),
            }
          )
        elif name.startswith(".tmp-"):
          rows.append(
            {
              "tier": "local",
              "run_id": run,
              "process": proc,
              "step": None,
              "path": os.path.join(proc_dir, name),
              "status": "partial (ignored)",
            }
          )
  return rows


def _persistent_steps(root: epath.Path) -> list[dict[str, Any]]:
  from emergency_ckpt.persistent_tier import _ocp  # noqa: PLC0415 - heavy import

  rows = []
  tensors = root / "tensors"
  finalized = set(_ocp().path.step.checkpoint_steps(tensors)) if tensors.exists() else set()
  store = state_store.StateStore(root / "state", process_index=0, process_count=1)
  committed = set(store.committed_steps())
  for step in sorted(finalized | set(store.listed_steps())):
    rows.append(
      {
        "tier": "persistent",
        "step": step,
        "tensors": "committed" if step in finalized else "absent",
        "state": "committed" if step in committed else "uncommitted",
        "path": str(root),
      }
    )
  return rows


def _describe_local(row: dict[str, Any], check: bool) -> dict[str, Any]:
  if row["step"] is None:
    return row
  if check:
    body, problems = local_tier.verify_step_dir(row["path"])
  else:
    try:
      with open(os.path.join(row["path"], "manifest.json"), "rb") as f:
        body, problems = local_tier.decode_manifest(f.read(), row["path"]), []
    except (OSError, local_tier.CorruptCheckpointError) as e:
      body, problems = None, [str(e)]
  row = dict(row, status="ok" if not problems else "BAD", problems=problems)
  if body:
    row.update(
      bytes=body["nbytes"],
      saved_at=datetime.datetime.fromtimestamp(body["saved_at"]).isoformat(timespec="seconds"),
      slice=body["slice_index"],
      processes=body["topology"]["process_count"],
    )
  return row


def collect(dirs: list[str], *, check: bool) -> list[dict[str, Any]]:
  rows: list[dict[str, Any]] = []
  for d in dirs:
    root = epath.Path(d)
    if _is_persistent(root):
      rows.extend(_persistent_steps(root))
    elif os.path.isdir(d):
      rows.extend(_describe_local(r, check) for r in _local_steps(d))
    else:
      rows.append({"tier": "?", "path": d, "status": "BAD", "problems": ["no such directory"]})
  return rows


def _table(rows: list[dict[str, Any]]) -> str:
  cols = [
    "tier",
    "step",
    "status",
    "tensors",
    "state",
    "process",
    "slice",
    "bytes",
    "saved_at",
    "path",
  ]
  cols = [c for c in cols if any(c in r for r in rows)]
  cells = [[str(r.get(c, "")) for c in cols] for r in rows]
  widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
  lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
  for r in rows:
    lines += [f"  ! {p}" for p in r.get("problems", [])]
  return "\n".join(lines)


def cmd_inspect(a) -> int:
  rows = collect(a.dirs, check=False)
  print(json.dumps(rows, indent=1) if a.json else _table(rows))
  return 0


def cmd_verify(a) -> int:
  rows = collect(a.dirs, check=True)
  if a.step is not None:
    rows = [r for r in rows if r.get("step") == a.step]
  print(json.dumps(rows, indent=1) if a.json else _table(rows))
  if not rows:
    print(f"step {a.step} not found" if a.step is not None else "no steps found", file=sys.stderr)
    return 1
  bad = [
    r
    for r in rows
    if r.get("status") == "BAD" or (r.get("tier") == "persistent" and r.get("state") != "committed")
  ]
  return 1 if bad else 0


# ---- output helpers ------------------------------------------------------------
def _isatty(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):
    return False


class _Style:
  """ANSI styles, only when `stream` (stdout) is a terminal and NO_COLOR is unset."""

  _CODES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33"}

  def __init__(self, stream=None):
    stream = sys.stdout if stream is None else stream
    self.on = _isatty(stream) and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"

  def __call__(self, text: str, *styles: str) -> str:
    if not self.on or not styles:
      return text
    return f"\033[{';'.join(self._CODES[s] for s in styles)}m{text}\033[0m"


def _grid(
  headers: list[str],
  rows: list[list[Any]],
  style: _Style | None = None,
  color: Callable[[str, str], tuple[str, ...]] | None = None,
) -> str:
  """An aligned text table. `color(header, cell)` names styles for a cell
  (applied after padding, so alignment holds; only on a terminal)."""
  style = style or _Style()
  cells = [["-" if v is None else str(v) for v in row] for row in rows]
  widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
  last = len(headers) - 1
  lines = [
    "  ".join(
      style(h.ljust(w) if i < last else h, "bold") for i, (h, w) in enumerate(zip(headers, widths))
    )
  ]
  for r in cells:
    out = []
    for i, (h, v, w) in enumerate(zip(headers, r, widths)):
      text = v.ljust(w) if i < last else v
      out.append(style(text, *(color(h, v) if color else ())))
    lines.append("  ".join(out).rstrip())
  return "\n".join(line.rstrip() for line in lines)


def _mib(nbytes: int | None) -> str:
  if nbytes is None:
    return ""
  if nbytes < 1 << 20:
    return f"{nbytes / 1024:.1f} KiB"
  if nbytes < 1 << 30:
    return f"{nbytes / (1 << 20):.1f} MiB"
  return f"{nbytes / (1 << 30):.2f} GiB"


def _secs(value: float | None, digits: int = 3) -> str:
  return "-" if value is None else f"{value:.{digits}f}"


class _Progress:
  """Progress on stderr: on a terminal one status line rewritten in place;
  otherwise only permanent lines, plain (no escape or control codes)."""

  def __init__(self, stream=None):
    self.stream = sys.stderr if stream is None else stream
    self.tty = _isatty(self.stream)
    self._shown = 0
    self._lock = threading.Lock()

  def status(self, text: str) -> None:
    """A transient line (terminal only)."""
    if not self.tty:
      return
    with self._lock:
      text = text[: max(20, shutil.get_terminal_size((100, 24)).columns - 1)]  # no wrap
      self.stream.write("\r" + text + " " * max(0, self._shown - len(text)))
      self.stream.flush()
      self._shown = len(text)

  def line(self, text: str) -> None:
    """A permanent line (replaces the status line on a terminal)."""
    with self._lock:
      if self._shown:
        self.stream.write("\r" + " " * self._shown + "\r")
        self._shown = 0
      self.stream.write(text + "\n")
      self.stream.flush()

  def clear(self) -> None:
    with self._lock:
      if self._shown:
        self.stream.write("\r" + " " * self._shown + "\r")
        self.stream.flush()
        self._shown = 0


# ---- gc ------------------------------------------------------------------------
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


# ---- report --------------------------------------------------------------------
def _is_num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean(values: list[float]) -> float | None:
  return statistics.fmean(values) if values else None


def summarize_events(events: list[dict[str, Any]]) -> dict[str, Any]:
  """The `report` numbers of a run, from its events (see telemetry's schema)."""
  events = [e for e in events if _is_num(e.get("time"))]
  if not events:
    raise ValueError("no events with a time")
  starts = [
    e["wall_start"] for e in events if e["event"] == "run_start" and _is_num(e.get("wall_start"))
  ]
  t0 = min([e["time"] for e in events] + starts)
  t1 = max(e["time"] for e in events)
  wall = t1 - t0
  procs = sorted({e["process"] for e in events if isinstance(e.get("process"), int)})
  slice_of = {e["process"]: e.get("slice") for e in events if isinstance(e.get("process"), int)}
  saves = [e for e in events if e["event"] == "save"]
  stalls = [e["stall_s"] for e in saves if _is_num(e.get("stall_s"))]

  per_process = []
  for p in procs:
    mine = [e["stall_s"] for e in saves if e.get("process") == p and _is_num(e.get("stall_s"))]
    per_process.append(
      {
        "process": p,
        "slice": slice_of.get(p),
        "starts": sum(e["event"] == "run_start" and e.get("process") == p for e in events),
        "saves": len(mine),
        "stall_total_s": sum(mine),
        "stall_mean_s": _mean(mine),
        "stall_max_s": max(mine, default=None),
      }
    )
  slowest = max(per_process, key=lambda r: r["stall_total_s"], default=None)
  overhead = None
  if slowest is not None and wall > 0:
    overhead = 100.0 * slowest["stall_total_s"] / wall

  tiers = ["local", "persistent", "state"]
  for e in events:
    for t in (e.get("tiers") or []) if e["event"] == "save" else [e.get("tier")]:
      if isinstance(t, str) and t not in tiers:
        tiers.append(t)
  tier_rows = []
  for t in tiers:
    durable = [e for e in events if e["event"] == "save_durable" and e.get("tier") == t]
    ok = [e for e in durable if e.get("error") is None]
    times = [e["durable_s"] for e in ok if _is_num(e.get("durable_s"))]
    row = {
      "tier": t,
      "saved_steps": len({e.get("step") for e in saves if t in (e.get("tiers") or [])}),
      "durable_steps": len({e.get("step") for e in ok}),
      "durable_records": len(ok),
      "failed": sum(
        e.get("tier") == t
        and (e["event"] == "save_failed" or (e["event"] == "save_durable" and bool(e.get("error"))))
        for e in events
      ),
      "skipped": sum(e["event"] == "save_skipped" and e.get("tier") == t for e in events),
      "durable_mean_s": _mean(times),
      "durable_max_s": max(times, default=None),
    }
    if any(row[k] for k in ("saved_steps", "durable_records", "failed", "skipped")):
      tier_rows.append(row)

  restores = []
  for r in sorted((e for e in events if e["event"] == "restore"), key=lambda e: e["time"]):
    p, t, step = r.get("process"), r["time"], r.get("step")
    since = max((e["time"] for e in _restores_of(events, p) if e["time"] < t), default=-math.inf)
    saved = [
      e["step"] for e in saves if e.get("process") == p and e["time"] < t and _is_num(e.get("step"))
    ]
    trained = [
      e
      for e in events
      if e["event"] == "train_step"
      and e.get("process") == p
      and since < e["time"] < t
      and _is_num(e.get("step"))
    ]
    newest_saved = max(saved, default=None)
    newest_trained = max((e["step"] for e in trained), default=None)
    valid = _is_num(step)
    restores.append(
      {
        "process": p,
        "slice": r.get("slice"),
        "at_s": t - t0,
        "step": step,
        "source": r.get("source"),
        "duration_s": r.get("duration_s"),
        "bytes": r.get("bytes"),
        "error": r.get("error"),
        "tried": r.get("tried") or [],
        "newest_saved": newest_saved,
        "lost_steps": max(0, newest_saved - step) if valid and newest_saved is not None else None,
        "newest_trained": newest_trained,
        "redone_steps": (
          max(0, newest_trained - step) if valid and newest_trained is not None else None
        ),
        "redone_s": (
          sum(e.get("duration_s") or 0 for e in trained if e["step"] > step)
          if valid and trained
          else None
        ),
      }
    )

  errors = [
    {
      "at_s": e["time"] - t0,
      "process": e.get("process"),
      "slice": e.get("slice"),
      "event": e["event"],
      "step": e.get("step"),
      "tier": e.get("tier") or e.get("source"),
      "error": e.get("error"),
    }
    for e in events
    if e.get("error") is not None or e["event"] in ("save_failed", "save_skipped")
  ]
  return {
    "run_ids": sorted({str(e["run_id"]) for e in events if e.get("run_id") is not None}),
    "events": len(events),
    "processes": len(procs),
    "slices": len({s for s in slice_of.values() if s is not None}),
    "wall_start": t0,
    "wall_end": t1,
    "wall_s": wall,
    "checkpoint_overhead_pct": overhead,
    "overhead_process": None if slowest is None else slowest["process"],
    "stall": {
      "saves": len(stalls),
      "mean_s": _mean(stalls),
      "max_s": max(stalls, default=None),
      "total_s_slowest_process": None if slowest is None else slowest["stall_total_s"],
    },
    "per_process": per_process,
    "tiers": tier_rows,
    "restores": restores,
    "restore_total_s": sum(r["duration_s"] for r in restores if _is_num(r["duration_s"])),
    "train_steps": sum(e["event"] == "train_step" for e in events),
    "errors": errors,
  }


def _restores_of(events: list[dict[str, Any]], process: Any) -> list[dict[str, Any]]:
  return [e for e in events if e["event"] == "restore" and e.get("process") == process]


def _report_text(s: dict[str, Any], files: list[str], style: _Style) -> str:
  out = []
  title = f"run {', '.join(s['run_ids']) or '(no run_start event)'}"
  out.append(style(title, "bold"))
  out.append(
    f"{s['events']} events from {len(files)} file(s); {s['processes']} process(es),"
    f" {s['slices']} slice(s); {s['train_steps']} train_step events"
  )
  start = datetime.datetime.fromtimestamp(s["wall_start"]).isoformat(timespec="seconds")
  out.append(f"wall time            {s['wall_s']:.1f} s (from {start})")
  if s["checkpoint_overhead_pct"] is None:
    out.append("checkpoint overhead  - (no save events)")
  else:
    out.append(
      f"checkpoint overhead  {s['checkpoint_overhead_pct']:.2f} % (process"
      f" {s['overhead_process']}: {s['stall']['total_s_slowest_process']:.3f} s of save()"
      f" stalls / wall time)"
    )
  st = s["stall"]
  out.append(
    f"save stall           {st['saves']} saves, mean {_secs(st['mean_s'])} s,"
    f" max {_secs(st['max_s'])} s"
  )
  out.append(
    f"restore time         {s['restore_total_s']:.3f} s over {len(s['restores'])} restores"
  )
  if s["tiers"]:
    out += ["", style("saves per tier", "bold")]
    out.append(
      _grid(
        ["tier", "steps saved", "durable steps", "failed", "skipped", "mean durable s", "max s"],
        [
          [
            t["tier"],
            t["saved_steps"] if t["tier"] != "state" else "-",
            t["durable_steps"],
            t["failed"],
            t["skipped"],
            _secs(t["durable_mean_s"]),
            _secs(t["durable_max_s"]),
          ]
          for t in s["tiers"]
        ],
        style,
      )
    )
  if s["per_process"]:
    out += ["", style("save stall per process", "bold")]
    out.append(
      _grid(
        ["process", "slice", "starts", "saves", "total stall s", "mean s", "max s"],
        [
          [
            p["process"],
            p["slice"],
            p["starts"],
            p["saves"],
            _secs(p["stall_total_s"]),
            _secs(p["stall_mean_s"]),
            _secs(p["stall_max_s"]),
          ]
          for p in s["per_process"]
        ],
        style,
      )
    )
  out += ["", style("restores", "bold")]
  if not s["restores"]:
    out.append("none")
  else:
    out.append(
      _grid(
        [
          "at s",
          "process",
          "slice",
          "step",
          "source",
          "duration s",
          "newest saved",
          "lost steps",
          "redone steps",
          "redone s",
          "tried",
        ],
        [
          [
            f"{r['at_s']:.1f}",
            r["process"],
            r["slice"],
            r["step"],
            r["source"] if r["error"] is None else "FAILED",
            _secs(r["duration_s"]),
            r["newest_saved"],
            r["lost_steps"],
            r["redone_steps"],
            _secs(r["redone_s"], 2),
            ",".join(map(str, r["tried"])) or "-",
          ]
          for r in s["restores"]
        ],
        style,
      )
    )
  out += ["", style(f"errors and failures ({len(s['errors'])})", "bold")]
  if not s["errors"]:
    out.append("none")
  else:
    out.append(
      _grid(
        ["at s", "process", "slice", "event", "step", "tier", "error"],
        [
          [
            f"{e['at_s']:.1f}",
            e["process"],
            e["slice"],
            e["event"],
            e["step"],
            e["tier"],
            e["error"],
          ]
          for e in s["errors"]
        ],
        style,
        lambda h, v: ("red",) if h == "error" and v else (),
      )
    )
  return "\n".join(out)


def draw_timeline(events: list[dict[str, Any]], summary: dict[str, Any], out: str) -> str | None:
  """Draws saves, failures and restores per process to `out` (PNG) with
  matplotlib; returns None, or why nothing was drawn."""
  try:
    import matplotlib  # noqa: PLC0415 - optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return (
      "--png needs matplotlib, which is not installed here (it is not a dependency of"
      " emergency_ckpt): pip install matplotlib, then run report again"
    )
  t0 = summary["wall_start"]
  procs = sorted({e["process"] for e in events if isinstance(e.get("process"), int)})
  row = {p: i for i, p in enumerate(procs)}
  fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * max(1, len(procs))))
  marks = {
    "local save": ([], [], dict(marker="|", color="tab:blue", s=80)),
    "persistent save": ([], [], dict(marker="|", color="tab:green", s=200)),
    "failure / error": ([], [], dict(marker="x", color="tab:red", s=60)),
    "restore": ([], [], dict(marker="*", color="black", s=160)),
    "manager start": ([], [], dict(marker="o", facecolors="none", edgecolors="gray", s=50)),
  }
  for e in events:
    p = e.get("process")
    if p not in row or not _is_num(e.get("time")):
      continue
    x, y = e["time"] - t0, row[p]
    key = None
    if e["event"] == "save":
      key = "persistent save" if "persistent" in (e.get("tiers") or []) else "local save"
    elif e.get("error") is not None or e["event"] in ("save_failed", "save_skipped"):
      key = "failure / error"
    elif e["event"] == "restore":
      key = "restore"
      ax.annotate(
        f"{e.get('step')} ({e.get('source')})", (x, y), xytext=(4, 6), textcoords="offset points"
      )
    elif e["event"] == "run_start":
      key = "manager start"
    if key:
      marks[key][0].append(x)
      marks[key][1].append(y)
  for label, (xs, ys, kw) in marks.items():
    if xs:
      ax.scatter(xs, ys, label=label, **kw)
  ax.set_yticks(range(len(procs)))
  slice_of = {p["process"]: p["slice"] for p in summary["per_process"]}
  ax.set_yticklabels([f"process {p} (slice {slice_of.get(p)})" for p in procs])
  ax.set_ylim(-0.7, len(procs) - 0.3)
  ax.set_xlim(0, max(summary["wall_s"], 1e-3) * 1.12)  # room for the last labels
  ax.set_xlabel("seconds since start")
  pct = summary["checkpoint_overhead_pct"]
  ax.set_title(
    f"{', '.join(summary['run_ids']) or 'run'}: wall {summary['wall_s']:.0f} s, checkpoint"
    f" overhead {'-' if pct is None else f'{pct:.2f} %'}"
  )
  ax.grid(axis="x", alpha=0.3)
  ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return None


def cmd_report(a) -> int:
  files = telemetry._expand(a.logs)
  missing = [f for f in files if not os.path.isfile(f)]
  if missing:
    print(f"report: no such file(s): {', '.join(missing)}", file=sys.stderr)
    return 1
  events = telemetry.read_events(files)
  if not events:
    print(f"report: no events in {', '.join(files) or ' '.join(a.logs)}", file=sys.stderr)
    return 1
  summary = summarize_events(events)
  if a.json:
    print(json.dumps(dict(summary, files=files), indent=1))
  else:
    print(_report_text(summary, files, _Style()))
  if a.png:
    why = draw_timeline(events, summary, a.png)
    if why is not None:
      print(f"report: {why}", file=sys.stderr)
      return 1
    print(f"report: timeline written to {a.png}", file=sys.stderr)
  return 0


# ---- bench ---------------------------------------------------------------------
def _bench_module():
  """benchmarks.run from the repository checkout (not part of the package)."""
  try:
    from benchmarks import run  # noqa: PLC0415
  except ImportError:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(repo, "benchmarks", "run.py")):
      raise SystemExit(
        "emergency-ckpt bench: the benchmarks/ folder of the repository checkout is"
        " needed; run it from a clone of the repository (python -m emergency_ckpt.cli bench)"
      ) from None
    sys.path.insert(0, repo)
    from benchmarks import run  # noqa: PLC0415
  return run


def _phase(label: str, reps: int) -> str:
  if label == "raw":
    return "raw bounds (memcpy, ramdisk, persistent disk)"
  m = re.fullmatch(r"(.+)-restart-(\d+)", label)
  if m:
    return f"{m.group(1)} restart rep {int(m.group(2)) + 1}/{reps} (spawn to restored)"
  m = re.fullmatch(r"(.+)-main", label)
  if m:
    return f"{m.group(1)} main job (saves, restores intact / lost slice / persistent)"
  return label


class _LogSink:
  """The benchmark's detailed stderr: to a file, the last line kept for display."""

  def __init__(self, f):
    self._f = f
    self.last = ""

  def write(self, text: str) -> int:
    self._f.write(text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines:
      self.last = lines[-1].strip()
    return len(text)

  def flush(self) -> None:
    self._f.flush()


class _BenchProgress:
  """benchmarks.run's on_job hook: one numbered line per job."""

  def __init__(self, total: int, reps: int, progress: _Progress, sink: _LogSink | None):
    self.total, self.reps, self.index = total, reps, 0
    self.progress, self.sink = progress, sink
    self.current: tuple[str, float] | None = None
    self.failed: list[str] = []

  def __call__(self, label: str, status: str, wall_s: float | None, error: str | None) -> None:
    phase = _phase(label, self.reps)
    if status == "start":
      self.index += 1
      self.current = (f"[{self.index}/{self.total}] {phase}", time.monotonic())
      if not self.progress.tty:
        self.progress.line(f"{self.current[0]} ...")
      return
    head = f"[{self.index}/{self.total}] {phase}"
    self.current = None
    if status == "done":
      self.progress.line(f"{head} done in {wall_s:.1f}s")
    else:
      self.failed.append(label)
      self.progress.line(f"{head} FAILED after {wall_s or 0:.1f}s: {error}")
      if label.endswith("-main"):  # its restart jobs are skipped
        self.total -= self.reps

  def tick(self) -> None:
    if self.current is not None:
      text, t = self.current
      detail = f" | {self.sink.last}" if self.sink is not None and self.sink.last else ""
      self.progress.status(f"{text} ... {time.monotonic() - t:.0f}s{detail}")


def cmd_bench(a) -> int:
  run = _bench_module()
  argv = ["--out", a.out]
  if a.quick:
    argv.append("--quick")
  for flag, value in (
    ("--mib-per-replica", a.mib_per_replica),
    ("--reps", a.reps),
    ("--managers", a.managers),
    ("--job-timeout", a.job_timeout),
  ):
    if value is not None:
      argv += [flag, str(value)]
  if a.keep:
    argv.append("--keep")
  args = run.parse_args(argv)  # defaults and validation, as the benchmark applies them
  total = 1 + len(args.managers) * (1 + args.reps)
  progress = _Progress()
  os.makedirs(a.out, exist_ok=True)
  log_path = os.path.join(a.out, "bench.log")
  progress.line(
    f"bench: {args.mib_per_replica} MiB per replica, {args.reps} rep(s), managers"
    f" {', '.join(args.managers)}: {total} jobs"
    + ("" if a.verbose else f"; detailed log in {log_path}")
  )
  t0 = time.monotonic()
  with contextlib.ExitStack() as stack:
    sink = None
    if not a.verbose:
      sink = _LogSink(stack.enter_context(open(log_path, "w", encoding="utf-8")))
      stack.enter_context(contextlib.redirect_stderr(sink))
    tracker = _BenchProgress(total, args.reps, progress, sink)
    stop = threading.Event()
    if progress.tty:

      def tick():
        while not stop.wait(1.0):
          tracker.tick()

      ticker = threading.Thread(target=tick, name="ec-bench-progress", daemon=True)
      ticker.start()
      stack.callback(ticker.join)
    stack.callback(stop.set)
    rc = run.main(argv, on_job=tracker)
  progress.clear()
  out = os.path.join(a.out, "results")
  progress.line(
    f"bench: finished in {time.monotonic() - t0:.0f}s, exit {rc}; results in {out}.md and"
    f" {out}.json" + ("" if a.verbose else f"; log {log_path}")
  )
  if tracker.failed:
    progress.line(f"bench: failed jobs: {', '.join(tracker.failed)}")
  return rc


def cmd_demo(a) -> int:
  from examples import demo  # noqa: PLC0415

  return demo.main(a.rest)


# ---- argument parsing ----------------------------------------------------------
_GC_HELP = """\
Apply retention offline (no JAX job needed) to local roots (a host's
local.directory: <dir>/<run_id>/process_<i>/step_<N>) and/or persistent roots
(tensors/<N> Orbax steps, state/<N> JSON + COMMIT).

A step is kept if ANY rule keeps it: the newest N (--keep), every step divisible
by P (--keep-period), the K best by a metric read from each step's COMMIT record
in the state store (--keep-best K --metric NAME --mode min|max). Always kept,
whatever the rules say:
  persistent root: the newest restorable step (finalized tensors + committed
    state) and any newer tensor step (its state commit may be in flight); the
    state of every kept tensor step, of every local step kept in the same call,
    and every state newer than the newest COMMIT. Other state steps (the state
    of local-tier saves) follow the same rules among committed steps;
    uncommitted state older than the newest COMMIT is deleted.
  local root, per process: with a state store (--state ROOT, or a persistent
    root given in DIR... whose run.json names the run), the newest committed
    step held and every newer step; without one, the newest step.
Unfinished saves (.tmp-* folders, unfinalized Orbax folders) are left alone: a
manager removes them when it starts. Deletion renames a step out of the
listing first, so a crash never leaves a half-deleted step listed.
Run it while no job writes these folders, and start with --dry-run.
"""

_GC_EPILOG = """\
examples:
  emergency-ckpt gc gs://bucket/run --keep 3 --keep-period 1000 --dry-run
  emergency-ckpt gc /dev/shm/ckpt gs://bucket/run --keep 2 \\
      --keep-best 2 --metric eval_loss --mode min
  emergency-ckpt gc /dev/shm/ckpt --state gs://bucket/run --keep 1 --json
exit status: 0, or 1 if a DIR does not exist or a deletion failed.
"""

_REPORT_HELP = """\
Summarise a run from the JSON-lines event logs of emergency_ckpt.telemetry.
EventLog (one file per process, or a folder of *.jsonl files; restarts may
append to the same files).

Definitions:
  wall time: from the earliest event (or run_start's wall_start) to the latest
    event over all files, restarts and downtime included.
  checkpoint overhead: the total time save() blocked the training loop
    (the sum of the "save" events' stall_s) of the process with the largest
    total, divided by the wall time, in %. Background writes, uploads,
    restores and redone work are not in it; they are reported separately.
  durable time: from the save() call until the tier holds the step (mean and
    max of save_durable events without error, per tier: local, persistent,
    state).
  lost steps (per restore): the newest step that process saved before the
    restore minus the restored step. Redone steps: the newest train_step the
    process recorded since its previous restore minus the restored step (and
    their duration_s summed: redone s), when the trainer records train_step.
"""

_BENCH_HELP = """\
Run the benchmark (benchmarks/run.py, repository checkout only): emergency_ckpt
against Orbax's multislice and P2P emergency checkpoint managers and the raw
bounds of this machine (memcpy, ramdisk, disk), 4 processes x 2 CPU devices.
Jobs: the raw bounds, then per manager a main job (save stall and durable
times, restore intact / after losing a slice / from persistent) and K restart
jobs (spawn to restored state). Shows one numbered line per job (a live status
line on a terminal); the benchmark's detailed log goes to OUT/bench.log
(--verbose: to stderr). Writes OUT/results.json and OUT/results.md and prints
the table. The full size (512 MiB per replica, 3 reps) takes a long time;
--quick (4 MiB, 1 rep) is a smoke run of a few minutes.
"""


def _nonneg_int(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def _pos_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def build_parser() -> argparse.ArgumentParser:
  fmt = argparse.RawDescriptionHelpFormatter
  p = argparse.ArgumentParser(prog="emergency-ckpt", description=__doc__, formatter_class=fmt)
  sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
  dirs_help = "local roots (a host's local.directory) or persistent roots (path or gs://)"

  s = sub.add_parser(
    "inspect",
    help="list steps per tier, markers, sizes, topology, save time",
    description="List every step per tier with its markers, size, slice and save time."
    " Reads folders only.",
  )
  s.add_argument("dirs", nargs="+", metavar="DIR", help=dirs_help)
  s.add_argument("--json", action="store_true", help="print JSON instead of a table")
  s.set_defaults(fn=cmd_inspect)

  s = sub.add_parser(
    "verify",
    help="check markers and checksums; exit 1 if anything is bad",
    description="Check local manifests and every shard's CRC32, and persistent state"
    " COMMIT markers. Exit status 1 if anything is bad or nothing was found.",
  )
  s.add_argument("dirs", nargs="+", metavar="DIR", help=dirs_help)
  s.add_argument("--step", type=int, help="check this step only")
  s.add_argument("--json", action="store_true", help="print JSON instead of a table")
  s.set_defaults(fn=cmd_verify)

  s = sub.add_parser(
    "gc",
    help="apply retention offline (keep newest N, every P-th, best K); --dry-run",
    description=_GC_HELP,
    epilog=_GC_EPILOG,
    formatter_class=fmt,
  )
  s.add_argument("dirs", nargs="+", metavar="DIR", help=dirs_help)
  s.add_argument(
    "--keep", type=_nonneg_int, required=True, metavar="N", help="keep the newest N steps"
  )
  s.add_argument(
    "--keep-period", type=_pos_int, metavar="P", help="also keep every step divisible by P"
  )
  s.add_argument(
    "--keep-best", type=_pos_int, metavar="K", help="also keep the K best steps by --metric"
  )
  s.add_argument("--metric", metavar="NAME", help="metric of the COMMIT record that ranks steps")
  s.add_argument(
    "--mode",
    choices=("min", "max"),
    default="min",
    help="min: smaller --metric is better (a loss; default); max: larger is better",
  )
  s.add_argument(
    "--state",
    metavar="ROOT",
    help="persistent root whose state store tells local roots which steps are committed"
    " (and their metrics); default: a persistent root in DIR... whose run.json names the run",
  )
  s.add_argument(
    "--dry-run", action="store_true", help="show what would be deleted; delete nothing"
  )
  s.add_argument("--json", action="store_true", help="print JSON instead of a table")
  s.set_defaults(fn=cmd_gc)

  s = sub.add_parser(
    "report",
    help="summarise a run from event logs: overhead, saves, restores, lost steps, errors",
    description=_REPORT_HELP,
    formatter_class=fmt,
    epilog="example:\n  emergency-ckpt report logs/events_*.jsonl --png timeline.png",
  )
  s.add_argument(
    "logs", nargs="+", metavar="LOG", help="JSON-lines event files, or folders of *.jsonl"
  )
  s.add_argument("--json", action="store_true", help="print JSON instead of tables")
  s.add_argument(
    "--png",
    metavar="OUT.png",
    help="also draw a timeline (saves, failures, restores per process); needs matplotlib",
  )
  s.set_defaults(fn=cmd_report)

  s = sub.add_parser(
    "bench",
    help="benchmark against Orbax's emergency managers and the raw bounds",
    description=_BENCH_HELP,
    formatter_class=fmt,
    epilog="example:\n  emergency-ckpt bench --quick --out /tmp/bench",
  )
  s.add_argument("--quick", action="store_true", help="4 MiB per replica, 1 rep (smoke run)")
  s.add_argument(
    "--mib-per-replica", type=_pos_int, metavar="N", help="train state size (default 512)"
  )
  s.add_argument("--reps", type=_pos_int, metavar="K", help="restart jobs per manager (default 3)")
  s.add_argument("--out", default="bench_out", metavar="DIR", help="output folder (bench_out)")
  s.add_argument(
    "--managers",
    metavar="A,B",
    help="comma-separated subset of emergency_ckpt,orbax_multislice,orbax_p2p (default: all)",
  )
  s.add_argument("--job-timeout", type=float, metavar="S", help="seconds per job (default scaled)")
  s.add_argument("--keep", action="store_true", help="keep the ramdisk and persistent folders")
  s.add_argument(
    "--verbose", action="store_true", help="the benchmark's detailed log to stderr, not a file"
  )
  s.set_defaults(fn=cmd_bench)

  s = sub.add_parser(
    "demo",
    help="run the README's main job",
    description="The README's main job: a 2-slice CPU training run loses a slice and"
    " resumes from its peer, bit-exactly. Arguments after `demo` go to examples/demo.py.",
  )
  s.add_argument(
    "rest",
    nargs=argparse.REMAINDER,
    metavar="ARGS",
    help="passed to examples/demo.py: --root DIR (work folder; default a fresh one under"
    " /dev/shm), --keep (keep the work folder)",
  )
  s.set_defaults(fn=cmd_demo)
  return p


def main(argv: list[str] | None = None) -> int:
  p = build_parser()
  a = p.parse_args(argv)
  if a.cmd == "gc":
    if (a.keep_best is None) != (a.metric is None):
      p.error("gc: --keep-best K and --metric NAME go together")
  return a.fn(a)


if __name__ == "__main__":
  sys.exit(main())
