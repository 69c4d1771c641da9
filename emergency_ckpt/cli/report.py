"""`emergency-ckpt report`: summarise a run from its telemetry event logs, as
tables, JSON or a timeline PNG."""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
from typing import Any

from emergency_ckpt.cli._output import Style, grid, secs
from emergency_ckpt.cli.goodput import fill_redone, goodput_lines, goodput_summary
from emergency_ckpt.cli.outages import find_outages
from emergency_ckpt.cli.timeline import draw_timeline
from emergency_ckpt.core import telemetry


def _is_num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean(values: list[float]) -> float | None:
  return statistics.fmean(values) if values else None


def summarize_events(events: list[dict[str, Any]]) -> dict[str, Any]:
  """The `report` numbers of a run.

  Args:
    events: the run's events, from every process's log (telemetry's schema).

  Returns:
    The summary: wall time, checkpoint overhead, stalls per process,
    durable times per tier, restores with lost and redone steps, each
    tier's outages (cli/outages.py), goodput per process and incarnation
    (cli/goodput.py), errors.

  Raises:
    ValueError: no event has a time.
  """
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
      "durable_mean_s": _mean(times),
      "durable_max_s": max(times, default=None),
    }
    if any(row[k] for k in ("saved_steps", "durable_records", "failed")):
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
    if e.get("error") is not None or e["event"] == "save_failed"
  ]
  summary = {
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
    "outages": find_outages(events, t0),
    "goodput": goodput_summary(events, t0, t1),
    "errors": errors,
  }
  fill_redone(restores, summary["goodput"])
  return summary


def _restores_of(events: list[dict[str, Any]], process: Any) -> list[dict[str, Any]]:
  return [e for e in events if e["event"] == "restore" and e.get("process") == process]


def _report_text(s: dict[str, Any], files: list[str], style: Style) -> str:
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
    f"save stall           {st['saves']} saves, mean {secs(st['mean_s'])} s,"
    f" max {secs(st['max_s'])} s"
  )
  out.append(
    f"restore time         {s['restore_total_s']:.3f} s over {len(s['restores'])} restores"
  )
  out += goodput_lines(s["goodput"], style)
  if s["tiers"]:
    out += ["", style("saves per tier", "bold")]
    out.append(
      grid(
        ["tier", "steps saved", "durable steps", "failed", "mean durable s", "max s"],
        [
          [
            t["tier"],
            t["saved_steps"] if t["tier"] != "state" else "-",
            t["durable_steps"],
            t["failed"],
            secs(t["durable_mean_s"]),
            secs(t["durable_max_s"]),
          ]
          for t in s["tiers"]
        ],
        style,
      )
    )
  if s["per_process"]:
    out += ["", style("save stall per process", "bold")]
    out.append(
      grid(
        ["process", "slice", "starts", "saves", "total stall s", "mean s", "max s"],
        [
          [
            p["process"],
            p["slice"],
            p["starts"],
            p["saves"],
            secs(p["stall_total_s"]),
            secs(p["stall_mean_s"]),
            secs(p["stall_max_s"]),
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
      grid(
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
            secs(r["duration_s"]),
            r["newest_saved"],
            r["lost_steps"],
            r["redone_steps"],
            secs(r["redone_s"], 2),
            ",".join(map(str, r["tried"])) or "-",
          ]
          for r in s["restores"]
        ],
        style,
      )
    )
  out += ["", style(f"outages ({len(s['outages'])})", "bold")]
  if not s["outages"]:
    out.append("none")
  else:
    out.append(
      grid(
        [
          "tier",
          "began at s",
          "lasted s",
          "steps skipped",
          "steps failed",
          "caught up",
          "catch-up s",
        ],
        [
          [
            o["tier"],
            f"{o['began_s']:.1f}",
            "ongoing" if o["duration_s"] is None else f"{o['duration_s']:.1f}",
            o["skipped"],
            o["failed"],
            "-" if o["caught_up_step"] is None else f"step {o['caught_up_step']}",
            secs(o["catch_up_s"], 2),
          ]
          for o in s["outages"]
        ],
        style,
      )
    )
  out += ["", style(f"errors and failures ({len(s['errors'])})", "bold")]
  if not s["errors"]:
    out.append("none")
  else:
    out.append(
      grid(
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


def cmd_report(a) -> int:
  """`emergency-ckpt report`: summarises a run from its event logs.

  Args:
    a: the parsed arguments (logs, json, png).

  Returns:
    The exit status: 1 if a log is missing, holds no events, or the
    timeline could not be drawn; else 0.
  """
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
    print(_report_text(summary, files, Style()))
  if a.png:
    why = draw_timeline(events, summary, a.png)
    if why is not None:
      print(f"report: {why}", file=sys.stderr)
      return 1
    print(f"report: timeline written to {a.png}", file=sys.stderr)
  return 0
