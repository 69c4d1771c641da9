"""`emergency-ckpt inspect` and `verify`: scan local and persistent roots, one
row per step, and (verify) check markers and checksums. No JAX: local roots
through folders.walk_local and local_format, persistent roots through
persistent_layout.scan."""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

from etils import epath

from emergency_ckpt.core import layout
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local import folders
from emergency_ckpt.local import format as local_format
from emergency_ckpt.persistent import layout as persistent_layout


def _local_steps(root: str) -> list[dict[str, Any]]:
  """One row per step, unmarked step folder and .tmp-* folder under a local
  root (folders.walk_local: names outside the layout are ignored)."""
  rows = []
  for proc in folders.walk_local(root).processes:
    where = {"tier": "local", "run_id": proc.run_id}
    where["process"] = layout.process_dir_name(proc.process_index)
    for step, path in sorted(proc.steps.items()):
      rows.append({**where, "step": step, "path": path})
    for step, path in sorted(proc.unmarked.items()):
      problem = (
        f"{path}: no {layout.MANIFEST_FILE}, so not a step (restore and gc ignore it):"
        " a damaged copy; delete the folder"
      )
      rows.append({**where, "step": step, "path": path, "status": "BAD", "problems": [problem]})
    for path in proc.tmp:
      if layout.is_spare_name(os.path.basename(path)):
        status = "spare (a retired step's file, reused by the next save)"
      else:
        status = "partial (ignored)"
      rows.append({**where, "step": None, "path": path, "status": status})
  return rows


def _persistent_steps(root: epath.Path, check: bool) -> list[dict[str, Any]]:
  """One row per step; `check`: every shard of each restorable step read
  and compared with its recorded CRC32C (persistent_verify)."""
  listing = persistent_layout.scan(root)
  finalized, committed = set(listing.tensor_steps), listing.committed
  rows = []
  for step in sorted(finalized | set(listing.state_steps)):
    row = {
      "tier": "persistent",
      "step": step,
      "tensors": "committed" if step in finalized else "absent",
      "state": "committed" if step in committed else "uncommitted",
      "path": str(root),
    }
    if check and step in finalized and step in committed:
      from emergency_ckpt.persistent import verify as persistent_verify  # noqa: PLC0415 - tensorstore

      problems = persistent_verify.verify_step(root, step)
      row.update(status="ok" if not problems else "BAD", problems=problems)
    rows.append(row)
  return rows


def _describe_local(row: dict[str, Any], check: bool) -> dict[str, Any]:
  if row["step"] is None or "problems" in row:
    return row
  if check:
    body, problems = local_format.verify_step_dir(row["path"])
  else:
    try:
      body, problems = local_format.read_manifest(row["path"]), []
    except (OSError, CorruptCheckpointError) as e:
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
  """One row per step (and per unmarked or temporary folder) under the roots.

  Args:
    dirs: local roots (a host's local.directory) and persistent roots.
    check: also read every shard and compare it with its recorded checksum
      (verify); else read the markers only (inspect).

  Returns:
    The rows; a missing root is a row with status "BAD".
  """
  rows: list[dict[str, Any]] = []
  for d in dirs:
    root = epath.Path(d)
    if persistent_layout.looks_persistent(root):
      rows.extend(_persistent_steps(root, check))
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
  """`emergency-ckpt inspect`: prints every step per tier.

  Args:
    a: the parsed arguments (dirs, json).

  Returns:
    The exit status: 0.
  """
  rows = collect(a.dirs, check=False)
  print(json.dumps(rows, indent=1) if a.json else _table(rows))
  return 0


def cmd_verify(a) -> int:
  """`emergency-ckpt verify`: checks markers and checksums, and prints them.

  Args:
    a: the parsed arguments (dirs, step, json).

  Returns:
    The exit status: 1 if anything is bad or nothing was found, else 0.
  """
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
