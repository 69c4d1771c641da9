"""The scale benchmark's markdown table and log-log plot, from its JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FIT_MIN_K = 64  # growth is fitted over K >= this
EXTRAPOLATE_K = 16_384
PLANNER_TARGET_S = 0.1


def fmt_secs(v: float | None) -> str:
  if v is None:
    return "n/a"
  if v >= 100:
    return f"{v:,.0f} s"
  if v >= 10:
    return f"{v:.1f} s"
  if v >= 1:
    return f"{v:.2f} s"
  return f"{v * 1000:.1f} ms" if v >= 0.001 else f"{v * 1e6:.0f} us"


def _kib(v: float) -> str:
  return f"{v / 1024:,.1f} KiB"


def growth_rows(stages: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
  rows = []
  for stage in stages.values():
    rows.append((stage["label"] + ": wall time", stage["fit"]))
    if "fit_to_1024" in stage and stage["fit_to_1024"]["ks"] != stage["fit"]["ks"]:
      rows.append((stage["label"] + ": wall time, K <= 1,024", stage["fit_to_1024"]))
    if "fit_cpu" in stage:
      rows.append((stage["label"] + ": CPU per process", stage["fit_cpu"]))
  return rows


def render_markdown(doc: dict[str, Any]) -> str:
  cfg, stages = doc["config"], doc["stages"]
  new = {p["k"]: p for p in stages["exchange"]["points"]}
  old = {p["k"]: p for p in stages["exchange_old"]["points"]}
  every = {p["k"]: p for p in stages.get("exchange_allgather", {}).get("points", [])}
  argv = " ".join(["python -m benchmarks.scale", *cfg["argv"]])
  lines = [
    "# Scale benchmark: exchange and restore planner over the process count",
    "",
    f"Run {cfg['started_at']} on {cfg['cpus']} CPUs (load average before:"
    f" {cfg['loadavg_before']}, after: {doc['loadavg_after']}); jax {cfg['versions']['jax']};"
    f" {doc['wall_s']:.0f} s in all. Command: `{argv}`.",
    "",
    "## Exchange: K simulated processes against one real JAX coordination service",
    "",
    _mode(cfg, stages) + f" {cfg['processes_per_slice']} processes per slice."
    f" Payload: an inventory JSON of {_payload(stages)} bytes on average. Time: from the"
    f" release of one start event to the last process's return, median of {cfg['reps']}"
    " after one warm-up; it is the work of all K processes and the service on this"
    " machine's cores, so it is pessimistic. CPU/process: the median thread CPU time of"
    " one process's exchange, closer to what each process of a real job spends. All"
    " CPU / K: the CPU time of every thread of the simulation (clients, gRPC, service)"
    " in one exchange, over K; in brackets the service's own share, where it has a"
    " process to itself (worker mode). Calls"
    " and bytes received: per process per exchange, counted by a wrapper around each"
    " client. Tree = the library's inventory exchange (`inventory.gather`, a"
    " `Collectives.gather_tree`); all-gather = `Collectives.exchange` (every process"
    f" receives every inventory; K <= {cfg.get('allgather_max_k', '?')}); old = the"
    " algorithm before it (set + one blocking get per process), re-implemented in the"
    f" benchmark, K <= {cfg['old_max_k']} only.",
    "",
    "| K | tree: time | tree: CPU/process | tree: calls/process | tree: received/process"
    " | tree: service sends | tree: all CPU / K (service) | all-gather: time"
    " | all-gather: received/process | old: time | old: calls/process | connect K clients |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for k in sorted(new):
    p, o, a = new[k], old.get(k), every.get(k)
    lines.append(
      f"| {k:,} | {fmt_secs(p['wall_s'])} | {fmt_secs(p['cpu_s_per_process'])} | {calls_text(p)}"
      f" | {_kib(p['bytes_received_per_process'])}"
      f" | {p['service_bytes_sent'] / 2**20:,.2f} MiB"
      f" | {_all_cpu(p)}"
      f" | {fmt_secs(a['wall_s']) if a else '-'}"
      f" | {_kib(a['bytes_received_per_process']) if a else '-'}"
      f" | {fmt_secs(o['wall_s']) if o else '-'} | {calls_text(o) if o else '-'}"
      f" | {fmt_secs(p['connect_s'])} |"
    )
  pl = stages["planner"]["points"]
  lines += [
    "",
    f"## Restore planner ({pl[0]['slices'] if pl else '?'} slices x"
    f" {pl[0]['steps'] if pl else '?'} committed steps)",
    "",
    "As a job runs it: each slice's last process to arrive summarises its slice's inventory"
    " JSON (`restore_plan.slice_summary`; the slices run in parallel on their own"
    " hosts, so the slowest counts), the last of those combines the slice summaries"
    " (`job_summary`), then every process parses the job summary and runs"
    " `candidates` (all committed steps) and `decide` for the newest candidate;"
    f" median of {cfg['planner_reps']}. Restore path = slowest slice + combine +"
    f" candidates + decide; target under {PLANNER_TARGET_S * 1000:.0f} ms. All in one"
    " process: every slice's summary one after another (what one host would pay"
    " alone). Memory: tracemalloc peak of parsing every inventory and planning, above"
    " the JSON.",
    "",
    "| processes | slowest slice summary | combine | candidates | decide | restore path"
    " | all in one process | job summary | peak memory | per process"
    " | newest step (local / peer slices) | correct |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
  ]
  for p in pl:
    r = p["result"]
    lines.append(
      f"| {p['k']:,} | {fmt_secs(p['slice_summary_max_s'])} | {fmt_secs(p['combine_s'])}"
      f" | {fmt_secs(p['candidates_s'])} | {fmt_secs(p['decide_s'])}"
      f" | {fmt_secs(p['wall_s'])} | {fmt_secs(p['all_in_one_process_s'])}"
      f" | {p['job_summary_bytes']:,} B"
      f" | {p['tracemalloc_peak_bytes'] / 2**20:,.1f} MiB"
      f" | {p['peak_bytes_per_process']:,.0f} B | {r['newest_step']}"
      f" ({r['local_slices']} / {r['peer_slices']}) | {'yes' if p['correct'] else 'NO'} |"
    )
  lines += _real_jobs(doc.get("real_jobs"))
  lines += _commit(doc.get("commit"))
  lines += [
    "",
    f"## Growth (least squares of log time on log K over K >= {FIT_MIN_K})",
    "",
    f"| stage | exponent | sizes fitted | extrapolated to K = {EXTRAPOLATE_K:,} |",
    "| --- | ---: | --- | ---: |",
  ]
  for label, f in growth_rows(stages):
    exp = "n/a" if f["exponent"] is None else f"{f['exponent']:.2f}"
    ks = ", ".join(f"{k:,}" for k in f["ks"]) or "-"
    lines.append(f"| {label} | {exp} | {ks} | {fmt_secs(f['extrapolated_s'])} |")
  if doc.get("notes"):
    lines += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
  return "\n".join(lines) + "\n"


def _real_jobs(real: dict[str, Any] | None) -> list[str]:
  """The real jax.distributed jobs' table (bench/scale_real.py)."""
  if not real:
    return []
  counts = sorted(int(k) for k in real if k.isdigit())
  first = real[str(counts[0])]
  lines = [
    "",
    "## Real jobs: latest_step() and a restore with two slices from peers",
    "",
    f"Real `jax.distributed` jobs on this machine, 1 CPU device per process,"
    f" {first['processes_per_slice']} processes per slice, the same"
    f" {first['total_bytes'] / 2**20:,.0f} MiB in all at every size; the last"
    f" {first['wiped_slices']} slices' ramdisks wiped before the restart. Each process"
    " times its own call, each started on every process at one instant (a barrier,"
    " then a sleep until a time process 0 publishes)"
    + (
      " (the latest woke"
      f" {max(real[str(n)]['start_late_s']['max'] for n in counts) * 1e3:.1f} ms past it)"
      if "start_late_s" in first
      else ""
    )
    + "; max (what the job waits for) / median over"
    " processes. Restored values checked bit-for-bit."
    + (
      f" Every size ran {first['reps']} times, in turn; each figure is the median over"
      " those runs, each ratio the median of the per-run ratios (every run's below)."
      if first.get("reps", 1) > 1
      else ""
    ),
    "",
    "| processes | slices | latest_step() (first) | latest_step() (again) | restore()"
    " | manager construction | Orbax import | sources |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
  ]

  def mm(v: dict[str, float]) -> str:
    return f"{fmt_secs(v['max'])} / {fmt_secs(v['median'])}"

  for n in counts:
    r = real[str(n)]
    lines.append(
      f"| {n} | {r['slices']} | {mm(r['latest_step_s'])} | {mm(r['latest_step_again_s'])}"
      f" | {mm(r['restore_s'])} | {mm(r['manager_init_s'])} | {mm(r['import_orbax_s'])}"
      f" | {r['sources']} |"
    )
  per_run: list[str] = []
  for key, ratio in real.items():
    if key.startswith("ratio_"):
      _, hi, lo = key.split("_")
      cells = " | ".join(
        f"{v['max']:.1f}x / {v['median']:.1f}x" if v["max"] else "-"
        for v in (
          ratio["latest_step_s"],
          ratio["latest_step_again_s"],
          ratio["restore_s"],
          ratio["manager_init_s"],
        )
      )
      lines.append(f"| {hi} over {lo} | | {cells} | | |")
      if len(ratio["latest_step_s"].get("reps", ())) > 1:
        each = "; ".join(
          f"{label} " + ", ".join("-" if v is None else f"{v:.1f}x" for v in ratio[k]["reps"])
          for label, k in (
            ("first latest_step()", "latest_step_s"),
            ("again", "latest_step_again_s"),
            ("restore()", "restore_s"),
          )
        )
        per_run.append(f"{hi} over {lo}, max over processes, each run: {each}.")
  if per_run:
    lines += ["", *per_run]
  if all("restore_cpu_s" in real[str(n)] for n in counts):
    cpu = "; ".join(
      f"{n}: latest_step() {fmt_secs(real[str(n)]['latest_step_cpu_s']['median'])},"
      f" restore() {fmt_secs(real[str(n)]['restore_cpu_s']['median'])}"
      for n in counts
    )
    lines += [
      "",
      f"CPU per process (process time, all threads; median over processes): {cpu}. On"
      " this machine every process shares its 2 cores, so 4x the processes cost at least"
      " 4x the wall time where each spends the same CPU.",
    ]
  return lines


def _commit(commit: dict[str, Any] | None) -> list[str]:
  """The state-store commit's table (bench/scale_commit.py)."""
  if not commit:
    return []
  lines = ["", "## State-store commit: K simulated writers on fake-gcs-server", ""]
  if "skipped" in commit:
    return lines + [f"Not run: {commit['skipped']}."]
  lines += [
    "The library's own StateStore on gs:// (a real fake-gcs-server; every request"
    " counted by a recording proxy): K threads each write their JSON and add one to"
    " the commit counter; the primary waits on the counter, lists the step's folder"
    " once and writes COMMIT; then committed_steps() over 50 committed steps."
    f" Target: last write to COMMIT under {commit['target_s']:.0f} s at 1,024 writers.",
    "",
    "| K | last write to COMMIT | counter wait / listing / upload | objects written"
    " | commit listing pages | committed_steps(): requests | seconds"
    " | before: listing pages |",
    "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
  ]
  for p in commit["points"]:
    cs = p["committed_steps"]
    reqs = ", ".join(f"{n} {kind}" for kind, n in sorted(cs["requests"].items()))
    lines.append(
      f"| {p['k']:,} | {fmt_secs(p['last_write_to_commit_s'])}"
      f" | {fmt_secs(p['commit_hint_s'])} / {fmt_secs(p['commit_list_s'])}"
      f" / {fmt_secs(p['commit_upload_s'])} | {p['objects_written']:,}"
      f" | {p['commit_listing_pages']} | {reqs} | {fmt_secs(cs['seconds'])}"
      f" | {cs['old_listing_pages']} |"
    )
  return lines


def _mode(cfg: dict[str, Any], stages: dict[str, Any]) -> str:
  """Where the simulated processes ran (the rows' mode), as a sentence."""
  workers = sorted({p.get("workers", 1) for p in stages["exchange"]["points"]})
  gil = f"GIL switch interval {cfg['switch_interval_s'] * 1000:.0f} ms"
  if workers == [1]:
    return (
      "Mode: one interpreter. One client and one thread per simulated process, all in one"
      f" Python program with the service, on 127.0.0.1 ({gil}),"
    )
  return (
    f"Mode: {'/'.join(map(str, workers))} worker processes (--exchange-workers"
    f" {cfg.get('exchange_workers', '?')}; fewer where K is smaller). One client and one"
    " thread per simulated process; each worker, one Python interpreter, holds K/P"
    " consecutive processes; one start event across the workers releases them all; the"
    f" service in the benchmark's own process, on 127.0.0.1 ({gil} in each worker),"
  )


def _all_cpu(p: dict[str, Any]) -> str:
  if "cpu_total_s_per_process" not in p:
    return "-"
  svc = p.get("service_cpu_s")
  extra = "" if svc is None else f" ({fmt_secs(svc / p['k'])})"
  return fmt_secs(p["cpu_total_s_per_process"]) + extra


def _payload(stages) -> str:
  pts = stages["exchange"]["points"]
  return f"{pts[0]['payload_bytes_mean']:.0f}" if pts else "?"


def calls_text(p: dict[str, Any]) -> str:
  lo, hi = p["calls_per_process_min"], p["calls_per_process_max"]
  return f"{hi:,}" if lo == hi else f"{lo:,}-{hi:,}"


def write_png(doc: dict[str, Any], path: str) -> str | None:
  """Log-log time against K, one line per stage (and the exchanges' CPU per
  process, dotted); None, or why there is no PNG."""
  try:
    import matplotlib  # noqa: PLC0415 - optional, not a dependency of the package

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import FixedLocator, NullLocator  # noqa: PLC0415
  except ImportError:
    return "matplotlib is not installed: no scale.png (pip install matplotlib)"
  fig, ax = plt.subplots(figsize=(9, 6))
  ks: set[int] = set()
  for name, stage in doc["stages"].items():
    series = [("wall_s", stage["fit"], "-", " wall")]
    if "fit_cpu" in stage:
      series.append(("cpu_s_per_process", stage["fit_cpu"], ":", " CPU/process"))
    color = None
    for key, f, style, what in series:
      pts = [p for p in stage["points"] if p.get(key)]
      if not pts:
        continue
      ks.update(p["k"] for p in pts)
      exp = "" if f["exponent"] is None else f" (slope {f['exponent']:.2f})"
      (line,) = ax.plot(
        [p["k"] for p in pts],
        [p[key] for p in pts],
        marker="o" if style == "-" else ".",
        linestyle="--" if name == "exchange_old" and style == "-" else style,
        color=color,
        label=stage["label"] + (what if "fit_cpu" in stage else "") + exp,
      )
      color = line.get_color()
  ax.axhline(PLANNER_TARGET_S, color="grey", linewidth=0.8, linestyle="-.")
  ax.text(min(ks or {1}), PLANNER_TARGET_S * 1.1, "planner target", color="grey", fontsize=8)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.xaxis.set_major_locator(FixedLocator(sorted(ks)))
  ax.xaxis.set_minor_locator(NullLocator())
  ax.set_xticklabels([f"{k:,}" for k in sorted(ks)], fontsize=8)
  ax.set_xlabel("processes K")
  ax.set_ylabel("seconds (median)")
  ax.set_title("emergency_ckpt at scale (K simulated processes on one machine)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


def service_bytes_at(points: Sequence[dict[str, Any]], k: int) -> str:
  """K^2 entries of the measured size per entry (key + value), as text."""
  if not points:
    return "?"
  last = max(points, key=lambda p: p["k"])
  per_entry = last["bytes_received_per_process"] / last["k"]
  return f"{k * k * per_entry / 2**30:,.0f} GiB"


# ---- main -----------------------------------------------------------------------------------------
