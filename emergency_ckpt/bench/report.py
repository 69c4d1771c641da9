"""The benchmark's markdown table and notes, from the figures of figures.py."""

from __future__ import annotations

from emergency_ckpt.bench import workers
from emergency_ckpt.bench.adapters import MANAGERS, ORBAX_MS, ORBAX_P2P, OURS
from emergency_ckpt.bench.figures import METRICS, MIB, SAME_JOB_WHY, gb_per_s
from emergency_ckpt.demo.launcher import start_note


def _fmt(v, unit: str) -> str:
  if v is None:
    return "n/a"
  if unit == "MiB":
    return f"{v:.1f} MiB"
  if unit == "cpu-s":
    return f"{v:.3f} cpu-s"
  return f"{v:.3f} s"


def _x(r) -> str:
  return "n/a" if r is None else f"{r:.2f}x"


def _gbps(g) -> str:
  return "" if g is None else f" ({g:.2f} GB/s)"


def _part(fig: dict) -> str:
  """One way a bound was timed: '2 threads 0.04102 s (6.55 GB/s)'."""
  if "threads" in fig:
    n, what = fig["threads"], "thread"
  else:
    n, what = fig.get("connections per pair", 1), "connection"
  label = f"{n} {what}{'s' if n != 1 else ''}"
  value = "n/a" if fig["value"] is None else f"{fig['value']:.4g} s"
  return f"{label} {value}{_gbps(fig.get('gb_per_s'))}"


def _raw_line(key: str, b: dict) -> str:
  """A raw bound with its GB/s and, where timed several ways, each way."""
  head = f"`{key}` = {b['value']:.4g} {b['unit']}" if b["value"] is not None else f"`{key}` = n/a"
  head += _gbps(b.get("gb_per_s"))
  parts = {
    k: dict(v, gb_per_s=gb_per_s(v.get("bytes", b.get("bytes")), v["value"]))
    for k, v in b.get("parts", {}).items()
  }
  if "read_s" in b:
    reads = " and ".join(_part(v) for k, v in parts.items() if "_read_" in k)
    moves = " and ".join(_part(v) for k, v in parts.items() if "_transfer_" in k)
    head += (
      f", limited by the {b.get('limited_by') or 'n/a'} (senders' read: {reads};"
      f" socket transfer: {moves})"
    )
  elif parts:
    head += ", the faster of " + " and ".join(_part(v) for v in parts.values())
  return f"- {head}: {b['what']}"


def markdown(doc: dict) -> str:
  cfg = doc["config"]
  raw, res, rat = doc["raw_bounds"], doc["results"], doc["ratios"]
  lines = [
    "# emergency_ckpt vs Orbax emergency managers",
    "",
    f"{cfg['mib_per_replica']} MiB float32 per replica; 4 processes x 2 CPU devices;"
    f" mesh 2x2 = (replica=2, data=4) ({cfg['bytes_per_process']['2x2'] / MIB:.1f} MiB per"
    f" process), 4x1 = (replica=4, data=2) ({cfg['bytes_per_process']['4x1'] / MIB:.1f} MiB"
    f" per process). Median of {cfg['reps']} rep(s); per rep the max over processes"
    " (CPU: the sum). 'vs raw' = figure / raw bound; 'ours / X' = emergency_ckpt / X."
    " GB/s beside a bound: the process's bytes / the bound / 1e9 (every process at once).",
    "",
    "| metric | raw bound | emergency_ckpt | vs raw | orbax_multislice | vs raw"
    " | orbax_p2p | vs raw | ours / multislice | ours / p2p |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  nbytes = cfg["bytes_per_process"]["2x2"]
  for mt in METRICS:
    if mt.same_job:
      per_job = [res[name]["metrics"][mt.key].get("bound") for name in MANAGERS]
      bound_cell = "same job: " + " / ".join(
        _fmt(b, mt.unit) + _gbps(gb_per_s(nbytes, b)) for b in per_job
      )
    else:
      bound_cell = _fmt(raw[mt.bound]["value"], mt.unit) + _gbps(raw[mt.bound].get("gb_per_s"))
    row = [mt.label, bound_cell]
    for name in MANAGERS:
      row += [
        _fmt(res[name]["metrics"][mt.key]["value"], mt.unit),
        _x(rat[name][mt.key]["to_raw_bound"]),
      ]
    row += [_x(rat[OURS][mt.key][f"to_{ORBAX_MS}"]), _x(rat[OURS][mt.key][f"to_{ORBAX_P2P}"])]
    lines.append("| " + " | ".join(row) + " |")
  paired = {
    name: res[name]["extras"]["paired_stall_ratio"]
    for name in MANAGERS
    if "paired_stall_ratio" in res[name].get("extras", {})
  }
  if paired:
    lines += [
      "",
      "save() stall rows: 'raw bound' is the memcpy of the same bytes timed just before"
      " each save in that manager's own job (emergency_ckpt / orbax_multislice / orbax_p2p),"
      " the faster of one thread and N (each copying a contiguous range):"
      f" {SAME_JOB_WHY}. Per save (each the max over processes), stall / that memcpy:",
    ]
    for name, r in paired.items():
      samples = ", ".join(f"{x:.2f}x" for x in r["samples"])
      lines.append(f"- {name}: {r['value']:.2f}x (saves: {samples})")
    for name in paired:
      copies = res[name]["extras"].get("paired_memcpy")
      if copies:
        n = copies["threads"]
        one, many = (copies["parts"][k] for k in ("paired_memcpy_1t_s", "paired_memcpy_mt_s"))
        lines.append(
          f"- {name}'s memcpy (median over saves): "
          + _part({"threads": 1, "value": one, "gb_per_s": gb_per_s(nbytes, one)})
          + ", "
          + _part({"threads": n, "value": many, "gb_per_s": gb_per_s(nbytes, many)})
        )
    memcpys = [raw["memcpy_s"]["value"]] + [
      res[name]["metrics"]["save_stall_s"].get("bound") for name in MANAGERS
    ]
    memcpys = [x for x in memcpys if x is not None]
    cross = ", ".join(
      f"{name} {_x(rat[name]['save_stall_s'].get('to_raw_job_bound'))}" for name in MANAGERS
    )
    lines.append(
      f"- the same memcpy in this run's jobs: {min(memcpys):.3f}-{max(memcpys):.3f} s;"
      f" against the raw-bounds job's ({raw['memcpy_s']['value']:.3f} s) the stall is {cross}"
    )
  persistent_rows = [mt for mt in METRICS if mt.same_job and mt.bound.startswith("persistent_")]
  if persistent_rows:
    lines += [
      "",
      "Persistent rows (durable on persistent, restore from persistent cold): 'raw bound' is"
      " a write + fsync of the same bytes to a file in the persistent dir, timed just before"
      " each save, and a cold read of that file (page cache evicted) just before each cold"
      " restore, all processes at once, in that manager's own job: the disk's speed drifts"
      " between jobs (cold reads 0.46-0.81 s for the same bytes in six runs of 2026-11-25)."
      " Against the raw-bounds job's bound:",
    ]
    for mt in persistent_rows:
      cross = ", ".join(
        f"{name} {_x(rat[name][mt.key].get('to_raw_job_bound'))}" for name in MANAGERS
      )
      lines.append(f"- {mt.label}: {cross}")
  lines += ["", "Raw bounds (GB/s: the process's bytes / the bound / 1e9, every process at once):"]
  for key, b in raw.items():
    lines.append(_raw_line(key, b))
  lines += ["", "Restore sources and bit-exactness (values include -0.0 and a denormal):"]
  for name in MANAGERS:
    for mt in METRICS:
      fig = res[name]["metrics"][mt.key]
      if "sources" in fig:
        srcs = "; ".join(f"{k}: {', '.join(v)}" for k, v in fig["sources"].items())
        lines.append(f"- {name} / {mt.label}: {srcs}")
    exact = res[name]["extras"].get("bit_exact")
    if exact:
      lines.append(f"- {name} bit-exact: " + ", ".join(f"{k}={v}" for k, v in exact.items()))
    restart = res[name]["extras"].get("restart")
    if restart:
      lines.append(
        f"- {name} restart jobs: spawn to ready {restart['ready_s_median']:.3f} s, ready to"
        f" restored {restart['after_ready_s_median']:.3f} s (imports, manager, restore);"
        f" bit-exact={restart['bit_exact']}"
      )
  lines += ["", "Timed saves per slice (stall / durable local / all tiers / CPU / peak extra RAM):"]
  for name in MANAGERS:
    by_slice = res[name]["extras"].get("saves_by_slice", {})
    parts = [
      f"{k}: {v['stall_s']:.3f} / {v['local_s']:.3f} / {v['all_s']:.3f} s,"
      f" {v['cpu_s']:.3f} cpu-s, {v['peak_extra_mib']:.1f} MiB"
      for k, v in by_slice.items()
    ]
    if parts:
      lines.append(f"- {name}: " + "; ".join(parts))
  lines += ["", "Notes:"]
  for name in MANAGERS:
    for mt in METRICS:
      fig = res[name]["metrics"][mt.key]
      if fig.get("reason"):
        lines.append(f"- {name} / {mt.label}: null, {fig['reason']}")
      elif fig.get("note"):
        lines.append(f"- {name} / {mt.label}: {fig['note']}")
    for k, v in res[name]["extras"].get("notes", {}).items():
      lines.append(f"- {name} {k}: {v}")
  for label, why in doc.get("retried", {}).items():
    lines.append(f"- {label} ran twice: its first attempt {why} (logs/attempt1_*)")
  lines += [
    "- restore figures time a fresh manager from construction to ready arrays"
    " (Orbax P2P starts its peer fetch in the constructor), after one untimed"
    " warm-up round per process (compiles); the JSON splits construct_s and"
    " restore_call_s and gives first_in_process_total_s, and for ours each"
    " process's phases (inventory, read, agree, transfer, place, persistent)."
    " Before each timed restore, jax releases the host memory the last one's"
    " arrays aliased, untimed (it does so on its next call; a restarted process"
    " has none to release). The restart row is the cold path end to end.",
    f"- saves: {workers.WARMUP_SAVES} untimed warm-up saves (steady state: ours"
    " writes into a retired step's file from its 4th save on), then timed saves on"
    " the same manager; every step hits both tiers of every manager (steps are"
    " multiples of 1000). The first-save row is the first warm-up save.",
  ]
  if note := start_note():
    lines.append(f"- {note}")
  return "\n".join(lines) + "\n"
