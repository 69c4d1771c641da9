"""`emergency-ckpt report --png`: a run's timeline, drawn with matplotlib.

One row per process: each incarnation's span (a line from its start to
its last event), its manager starts, local and persistent saves, failures
and restores (with the restored step and its source), and where an
incarnation ended without close() (cli/goodput.py), over the seconds since
the run started, titled with the run's wall time, checkpoint overhead and
goodput. matplotlib is optional (not a dependency of
emergency_ckpt): without it nothing is drawn and the caller says why.

Called by: report.py (cmd_report), with summarize_events' result.
"""

from __future__ import annotations

import math
from typing import Any


def _is_num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def draw_timeline(events: list[dict[str, Any]], summary: dict[str, Any], out: str) -> str | None:
  """Draws saves, failures and restores per process as a PNG, with matplotlib.

  Args:
    events: the run's events.
    summary: summarize_events' result for them.
    out: the PNG file to write.

  Returns:
    None, or why nothing was drawn (matplotlib is not installed).
  """
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
    "ended without close()": ([], [], dict(marker="X", color="darkred", s=120)),
  }
  for i, inc in enumerate(summary["goodput"]["incarnations"]):
    if inc["process"] in row:
      y = row[inc["process"]]
      ax.hlines(
        y,
        inc["began_s"],
        inc["ended_s"],
        color="lightgray",
        linewidth=6,
        zorder=0,
        label=None if i else "process running",
      )
      if inc["failed"]:
        marks["ended without close()"][0].append(inc["ended_s"])
        marks["ended without close()"][1].append(y)
  for e in events:
    p = e.get("process")
    if p not in row or not _is_num(e.get("time")):
      continue
    x, y = e["time"] - t0, row[p]
    key = None
    if e["event"] == "save":
      key = "persistent save" if "persistent" in (e.get("tiers") or []) else "local save"
    elif e.get("error") is not None or e["event"] == "save_failed":
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
  pct, good = summary["checkpoint_overhead_pct"], summary["goodput"]["goodput_pct"]
  ax.set_title(
    f"{', '.join(summary['run_ids']) or 'run'}: wall {summary['wall_s']:.0f} s, checkpoint"
    f" overhead {'-' if pct is None else f'{pct:.2f} %'}, goodput"
    f" {'-' if good is None else f'{good:.1f} %'}"
  )
  ax.grid(axis="x", alpha=0.3)
  ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return None
