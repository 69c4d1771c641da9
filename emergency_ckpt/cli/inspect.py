"""`emergency-ckpt inspect` and `verify`: scan local and persistent roots, one
row per step, and (verify) check markers and checksums."""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

from etils import epath

from emergency_ckpt import local_tier, state_store


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
              "status": "spare (a retired step's file, reused by the next save)"
              if name.startswith(".tmp-spare-")
              else "partial (ignored)",
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
