"""Reduces per-process job results to figures and ratios (report.py renders them).

Every figure is the median over repetitions of a per-repetition reduction
over processes: the max for times and RAM (the job waits for its slowest
process), the sum for CPU-seconds.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from emergency_ckpt.bench.adapters import MANAGERS, ORBAX_MS, ORBAX_P2P

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Metric:
  key: str
  label: str
  unit: str
  bound: str
  same_job: bool = False
  """The ratio's bound is `bound` timed inside the manager's own job (its
  figure's "bound" field), not the raw-bounds job's: for the stall, a memcpy
  that differs between jobs by more than the target's margin (see
  SAME_JOB_WHY). The raw-bounds job's ratio is kept as to_raw_job_bound."""


# The same memcpy varies between jobs on a shared machine by more than a
# 1.2x target, while within one job two buffers track each other closely
# (docs/benchmarks.md has the figures): the stall is judged against a memcpy
# timed in its own job.
SAME_JOB_WHY = (
  "the same memcpy varies between jobs on this machine by more than the 1.2x"
  " target (bare jobs: medians 42-66 ms), so the stall is divided by a memcpy of"
  " the same bytes timed in the same job, just before each save"
)

METRICS = (
  Metric("save_stall_s", "save() stall", "s", "memcpy_s", same_job=True),
  Metric("first_save_stall_s", "first save() stall of a manager", "s", "memcpy_s", same_job=True),
  Metric("save_durable_local_s", "save until durable locally", "s", "ramdisk_write_s"),
  Metric(
    "save_durable_persistent_s",
    "save until durable on persistent",
    "s",
    "persistent_write_s",
    same_job=True,
  ),
  Metric("save_cpu_s", "CPU-seconds per save, all processes", "cpu-s", "cpu_memcpy_write_s"),
  Metric(
    "save_peak_extra_ram_mib", "peak extra host RAM in save, per process", "MiB", "one_copy_mib"
  ),
  Metric("restore_intact_s", "restore, all slices intact", "s", "ramdisk_read_s"),
  Metric("restore_lose_slice_s", "restore, slice 1 ramdisks lost (2x2)", "s", "peer_restore_s"),
  Metric(
    "restore_lose_slice_4x1_s", "restore, slice 3 ramdisk lost (4x1)", "s", "peer_restore_4x1_s"
  ),
  Metric(
    "restore_persistent_cold_s",
    "restore from persistent, cache evicted",
    "s",
    "persistent_cold_read_s",
    same_job=True,
  ),
  Metric("start_to_restored_s", "process spawn to restored state", "s", "ready_plus_read_s"),
)

BOUNDS = {
  "memcpy_s": "memcpy of the process's bytes into a preallocated buffer, the faster of one"
  " thread and N (each copying one contiguous range)",
  "ramdisk_write_s": "write + fsync of the process's bytes to a new file on its ramdisk, the"
  " faster of one thread (write()) and N (each pwrite()s one contiguous range)",
  "persistent_write_s": "write + fsync of the process's bytes to a new file in the persistent dir",
  "cpu_memcpy_write_s": "CPU-seconds of the one-thread memcpy + ramdisk write, summed over"
  " processes",
  "one_copy_mib": "one host copy of the process's bytes (computed, not measured)",
  "ramdisk_read_s": "read of the process's bytes from its ramdisk into a preallocated buffer,"
  " the faster of one thread and N (each preadv()s one contiguous range)",
  "ramdisk_read_4x1_s": "the same on the 4x1 mesh (each process holds a whole replica)",
  "peer_restore_s": "peer restore of slice 1's processes (2x2): the slower of the senders'"
  " ramdisk read of the bytes they send (the faster of one thread and N) and a TCP transfer of"
  " them over loopback sockets between the same processes as the managers' peer restore"
  " (sendall into recv_into a preallocated buffer; the faster of one connection and N per pair)",
  "peer_restore_4x1_s": "the same on the 4x1 mesh: slice 3's process gets a third of its bytes"
  " from each other slice's process at once",
  "persistent_cold_read_s": "read from the persistent dir after fsync + POSIX_FADV_DONTNEED",
  "ready_s": "process spawn to jax.distributed ready, no checkpoint library imported"
  " (median over the raw job and every restart job)",
  "ready_plus_read_s": "ready_s + ramdisk_read_s (computed)",
}

# A bound timed with one thread and with N: {bound: (one-thread key, N-thread key)}
# in the raw job's per-rep records. The bound is the faster figure.
THREADED = {
  "memcpy_s": ("memcpy_1t_s", "memcpy_mt_s"),
  "ramdisk_write_s": ("ramdisk_write_1t_s", "ramdisk_write_mt_s"),
  "ramdisk_read_s": ("ramdisk_read_1t_s", "ramdisk_read_mt_s"),
}
# The peer restore's parts: (senders' read, socket transfer), each timed two ways.
PEER_READ = ("peer_read_1t_s", "peer_read_mt_s")
PEER_TRANSFER = ("peer_transfer_1s_s", "peer_transfer_ns_s")


def gb_per_s(nbytes: float | None, seconds: float | None) -> float | None:
  """Throughput in GB/s (1e9 bytes per second); None without a positive time."""
  if nbytes is None or seconds is None or seconds <= 0:
    return None
  return nbytes / seconds / 1e9


def faster(parts: dict[str, float | None]) -> str | None:
  """The key of the smallest (fastest) figure of `parts`; None if none has one."""
  have = {k: v for k, v in parts.items() if v is not None}
  return min(have, key=have.__getitem__) if have else None


def _median(xs: Sequence[float]) -> float | None:
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


def _per_rep(
  procs: Sequence[dict], get: Callable[[dict], Sequence[float]], reduce=max, where=None
) -> list[float]:
  """Per repetition, `reduce` over processes (those `where` accepts)."""
  rows = [get(p) for p in procs if where is None or where(p)]
  return [reduce(col) for col in zip(*rows)]


def _per_rep_of(procs: Sequence[dict], key: str) -> list[float]:
  """Per repetition, the max of `key` over the processes that timed it
  (a peer bound's senders or receivers; the others record None)."""
  cols = zip(*[[r.get(key) for r in p["reps"]] for p in procs])
  return [max(xs) for xs in ([x for x in col if x is not None] for col in cols) if xs]


# ---- raw bounds --------------------------------------------------------------
def raw_figures(raw: list[dict], restart_ready: Sequence[float] = ()) -> dict[str, dict]:
  """The raw bounds. `restart_ready`: every restart job's spawn-to-ready time
  (max over processes), pooled with the raw job's for a steadier ready_s.

  Each figure: value (median over reps of the per-rep max over processes),
  unit, samples, what; a bound of bytes also `bytes` (per process) and
  `gb_per_s`. A bound timed with one thread and with N keeps both under
  `parts` (value, samples, threads) and is the faster (`chosen`); the peer
  bounds are the slower of their read and transfer (`read_s`,
  `transfer_s`, each the faster of its two parts; `limited_by`), their
  parts with the bytes they moved (a sender reads only what it sends)."""

  def lay(name):
    return [p["layouts"][name] for p in raw]

  two, four = lay("2x2"), lay("4x1")
  threads = max((p.get("threads", 1) for p in raw), default=1)
  nbytes = {"2x2": max(p["bytes"] for p in two), "4x1": max(p["bytes"] for p in four)}
  out: dict[str, dict] = {}

  def add(key, samples, unit="s", layout=None):
    out[key] = {"value": _median(samples), "unit": unit, "samples": samples, "what": BOUNDS[key]}
    if layout:
      out[key]["bytes"] = nbytes[layout]
      out[key]["gb_per_s"] = gb_per_s(nbytes[layout], out[key]["value"])

  def part(procs, key):
    n = 1 if key.endswith(("_1t_s", "_1s_s")) else threads
    samples = _per_rep_of(procs, key)
    what = "threads" if "_transfer_" not in key else "connections per pair"
    return {"value": _median(samples), "samples": samples, what: n}

  def add_faster(key, procs, keys, layout):
    parts = {k: part(procs, k) for k in keys}
    chosen = faster({k: v["value"] for k, v in parts.items()})
    add(key, parts[chosen]["samples"] if chosen else [], layout=layout)
    out[key].update(parts=parts, chosen=chosen)

  def add_peer(key, procs, layout):
    parts = {k: part(procs, k) for k in PEER_READ + PEER_TRANSFER}
    # GB/s of a read: the most bytes a sender reads (4x1: a third of its bytes)
    read_bytes = max(
      (sum(b - a for _, a, b in p["peer"]["sends"]) for p in procs if "peer" in p),
      default=nbytes[layout],
    )
    for k in PEER_READ:
      parts[k]["bytes"] = read_bytes
    for k in PEER_TRANSFER:
      parts[k]["bytes"] = nbytes[layout]
    read = faster({k: parts[k]["value"] for k in PEER_READ})
    move = faster({k: parts[k]["value"] for k in PEER_TRANSFER})
    if read is None or move is None:
      samples = []
    else:
      samples = [max(a, b) for a, b in zip(parts[read]["samples"], parts[move]["samples"])]
    add(key, samples, layout=layout)
    read_s = parts[read]["value"] if read else None
    move_s = parts[move]["value"] if move else None
    value = None if read_s is None or move_s is None else max(read_s, move_s)
    out[key].update(
      value=value,
      gb_per_s=gb_per_s(nbytes[layout], value),
      parts=parts,
      read_s=read_s,
      transfer_s=move_s,
      limited_by=None if value is None else ("read" if read_s >= move_s else "transfer"),
    )

  for key, keys in THREADED.items():
    add_faster(key, two, keys, "2x2")
  add_peer("peer_restore_s", two, "2x2")
  add(
    "persistent_write_s",
    _per_rep(two, lambda p: [r["persistent_write_s"] for r in p["reps"]]),
    layout="2x2",
  )
  add(
    "persistent_cold_read_s",
    _per_rep(two, lambda p: [r["persistent_cold_read_s"] for r in p["reps"]]),
    layout="2x2",
  )
  add(
    "cpu_memcpy_write_s",
    _per_rep(two, lambda p: [r["cpu_memcpy_write_s"] for r in p["reps"]], reduce=sum),
    "cpu-s",
  )
  add_faster("ramdisk_read_4x1_s", four, THREADED["ramdisk_read_s"], "4x1")
  add_peer("peer_restore_4x1_s", four, "4x1")
  add("one_copy_mib", [nbytes["2x2"] / MIB], "MiB")
  add("ready_s", [max(p["ready_s"] for p in raw), *restart_ready])
  add("ready_plus_read_s", [out["ready_s"]["value"] + out["ramdisk_read_s"]["value"]])
  return out


# ---- managers ----------------------------------------------------------------
def _sources(pairs) -> dict[str, list[str]]:
  """{"slice s": sorted distinct sources} from (slice, records) pairs."""
  out: dict[str, set] = {}
  for slice_index, records in pairs:
    for r in records:
      out.setdefault(f"slice {slice_index}", set()).add(r["source"])
  return {k: sorted(v) for k, v in sorted(out.items())}


def manager_figures(
  name: str, main: list[dict] | None, main_error: str | None, restarts: list, restart_errors: list
) -> tuple[dict[str, dict], dict]:
  """({metric: {"value", "samples", "note"|"reason"}}, extras) of one manager."""
  figs: dict[str, dict] = {}
  extras: dict[str, Any] = {}
  if main is None:
    reason = f"the manager's job failed: {main_error}"
    for mt in METRICS:
      if mt.key != "start_to_restored_s":
        figs[mt.key] = {"value": None, "reason": reason}
  else:
    two = [p["layouts"]["2x2"] for p in main]
    four = [p["layouts"]["4x1"] for p in main]

    def add(key, samples, note=None):
      figs[key] = {"value": _median(samples), "samples": samples}
      if note:
        figs[key]["note"] = note

    def saves(field):
      return lambda p: [s[field] for s in p["saves"]]

    add("save_stall_s", _per_rep(two, saves("stall_s")))
    add(
      "first_save_stall_s",
      [max(p["warmup_save"]["stall_s"] for p in two)],
      "one sample: the untimed warm-up save of the timed manager, after prepare() where"
      " the manager has it (ours) and a wait standing for the trainer's compile time",
    )
    if name == ORBAX_MS:
      add(
        "save_durable_local_s",
        _per_rep(two, saves("all_s"), where=lambda p: p["slice"] != 0),
        "slices >= 1 only: by design slice 0 keeps no ramdisk copy",
      )
      add(
        "save_durable_persistent_s",
        _per_rep(two, saves("all_s"), where=lambda p: p["slice"] == 0),
        "slice 0 only: the slice that writes persistent",
      )
    else:
      add("save_durable_local_s", _per_rep(two, saves("local_s")))
      add("save_durable_persistent_s", _per_rep(two, saves("all_s")))
    add("save_cpu_s", _per_rep(two, saves("cpu_s"), reduce=sum))
    add(
      "save_peak_extra_ram_mib",
      [x / MIB for x in _per_rep(two, saves("peak_extra_bytes"))],
      "peak RSS during save + wait (the kernel's VmHWM, reset before each save; sampled"
      " every 5 ms where the reset is refused), minus RSS before the manager's first save",
    )
    for variant, key in (
      ("intact", "restore_intact_s"),
      ("lose_slice", "restore_lose_slice_s"),
      ("persistent_cold", "restore_persistent_cold_s"),
    ):
      add(key, _per_rep(two, lambda p, v=variant: [r["total_s"] for r in p["restores"][v]]))
      figs[key]["sources"] = _sources((p["slice"], p["restores"][variant]) for p in two)
    add(
      "restore_lose_slice_4x1_s",
      _per_rep(four, lambda p: [r["total_s"] for r in p["restores"]["lose_slice"]]),
    )
    figs["restore_lose_slice_4x1_s"]["sources"] = _sources(
      (p["slice"], p["restores"]["lose_slice"]) for p in four
    )
    if name == ORBAX_MS:
      srcs = figs["restore_lose_slice_s"]["sources"]
      if any("persistent" in s for v in srcs.values() for s in v):
        figs["restore_lose_slice_s"]["note"] = (
          "on 2 slices only slice 1 keeps a ramdisk copy, so losing it means a"
          " persistent restore (page cache warm)"
        )
    for key, bound in same_job_bounds(two).items():
      figs[key]["bound"] = bound
    extras = _manager_extras(two, four)
  if restarts:
    per_job = [max(p["restored_s"] for p in job) for job in restarts]
    figs["start_to_restored_s"] = {"value": _median(per_job), "samples": per_job}
    figs["start_to_restored_s"]["sources"] = _sources(
      (p["slice"], [p]) for job in restarts for p in job
    )
    extras["restart"] = {
      "ready_s_median": _median(restart_ready(restarts)),
      "after_ready_s_median": _median(
        [max(p["restored_s"] - p["ready_s"] for p in job) for job in restarts]
      ),
      "steps": sorted({p["step"] for job in restarts for p in job}),
      "bit_exact": all(p["mismatched_shards"] == 0 for job in restarts for p in job),
    }
    parts = [p["after_ready"] for job in restarts for p in job if "after_ready" in p]
    if parts:  # where the time after jax.distributed's set-up goes (median over processes)
      extras["restart"]["after_ready_parts_median"] = {
        k: _median([x[k] for x in parts]) for k in parts[0]
      }
  else:
    figs["start_to_restored_s"] = {
      "value": None,
      "reason": "no restart job succeeded: " + "; ".join(e for e in restart_errors if e)
      if restart_errors
      else "the main job failed, so no restart job ran",
    }
  if restart_errors:
    extras["restart_errors"] = restart_errors
  return {mt.key: figs[mt.key] for mt in METRICS}, extras


def paired_memcpy(two: list[dict]) -> dict:
  """The memcpy timed just before each save in a manager's 2x2 job, with one
  thread and with N: per save the max over processes of each, and the
  faster of those two (`per_save`); the medians over the timed saves; the
  same for the first (warm-up) save."""
  one = _per_rep(two, lambda p: [s["paired_memcpy_1t_s"] for s in p["saves"]])
  many = _per_rep(two, lambda p: [s["paired_memcpy_mt_s"] for s in p["saves"]])
  first = {
    k: max(p["warmup_save"][k] for p in two) for k in ("paired_memcpy_1t_s", "paired_memcpy_mt_s")
  }
  medians = {"paired_memcpy_1t_s": _median(one), "paired_memcpy_mt_s": _median(many)}
  return {
    "per_save": [min(a, b) for a, b in zip(one, many)],
    "parts": medians,
    "value": medians[faster(medians)] if faster(medians) else None,
    "first_parts": first,
    "first": first[faster(first)],
    "threads": max((p.get("threads", 1) for p in two), default=1),
  }


def same_job_bounds(two: list[dict]) -> dict[str, float | None]:
  """The same-job bounds from a manager's 2x2 job (per rep the max over
  processes, the median over reps): the stall rows' memcpy of the same
  bytes timed just before each save (and the one before the first save),
  the faster of one thread and N; the durable-on-persistent row's write +
  fsync of them to the persistent dir, just before each save; the cold
  persistent restore's cold read of them from there, just before each such
  restore."""
  cold = _per_rep(
    two, lambda p: [r.get("paired_cold_read_s") for r in p["restores"]["persistent_cold"]]
  )
  writes = _per_rep(two, lambda p: [s.get("paired_persistent_write_s") for s in p["saves"]])
  copies = paired_memcpy(two)
  return {
    "save_stall_s": copies["value"],
    "first_save_stall_s": copies["first"],
    "save_durable_persistent_s": _median([x for x in writes if x is not None]),
    "restore_persistent_cold_s": _median([x for x in cold if x is not None]),
  }


def _saves_by_slice(two: list[dict]) -> dict[str, dict]:
  """Per slice: the timed saves' medians of the max over its processes
  (CPU: the sum), to tell the primary slice's persistent work from the rest."""
  out = {}
  for s in sorted({p["slice"] for p in two}):
    procs = [p for p in two if p["slice"] == s]

    def med(field, reduce=max, scale=1.0, procs=procs):
      rows = _per_rep(procs, lambda q: [x[field] * scale for x in q["saves"]], reduce=reduce)
      return _median(rows)

    out[f"slice {s}"] = {
      "stall_s": med("stall_s"),
      "local_s": med("local_s"),
      "all_s": med("all_s"),
      "cpu_s": med("cpu_s", reduce=sum),
      "peak_extra_mib": med("peak_extra_bytes", scale=1 / MIB),
    }
  return out


def restart_ready(restarts: list[list[dict]]) -> list[float]:
  """Per restart job: spawn to jax.distributed ready, max over processes."""
  return [max(p["ready_s"] for p in job) for job in restarts]


def _manager_extras(two: list[dict], four: list[dict]) -> dict:
  def med_max(rows, field):
    return _median(_per_rep(rows, lambda p: [r[field] for r in p]))

  warmup = [p["warmup_save"] for p in two]
  stalls = _per_rep(two, lambda p: [s["stall_s"] for s in p["saves"]])
  paired = paired_memcpy(two)
  copies = paired["per_save"]
  extras: dict[str, Any] = {
    "paired_stall_ratio": {
      "value": _median([a / b for a, b in zip(stalls, copies)]),
      "samples": [a / b for a, b in zip(stalls, copies)],
      "memcpy_s": copies,
    },
    "paired_memcpy": {k: v for k, v in paired.items() if k != "per_save"},
    "first_save": {f: max(s[f] for s in warmup) for f in ("stall_s", "local_s", "all_s")}
    | {"cpu_s": sum(s["cpu_s"] for s in warmup)},
    "save_maxrss_delta_mib": _median(
      _per_rep(two, lambda p: [s["maxrss_delta_bytes"] / MIB for s in p["saves"]])
    ),
    "bytes_per_process": {
      "2x2": max(p["bytes"] for p in two),
      "4x1": max(p["bytes"] for p in four),
    },
    "saves_by_slice": _saves_by_slice(two),
    "restore_breakdown": {},
    "bit_exact": {},
    "notes": two[0].get("notes", {}),
  }
  for layout, rows in (("2x2", two), ("4x1", four)):
    for variant in rows[0]["restores"]:
      recs = [p["restores"][variant] for p in rows]
      key = f"{layout}/{variant}"
      extras["restore_breakdown"][key] = {
        "construct_s": med_max(recs, "construct_s"),
        "restore_call_s": med_max(recs, "restore_call_s"),
        "steps": sorted({r["step"] for p in recs for r in p}),
      }
      first = [p["first_restores"][variant] for p in rows]
      timed = [r for p in recs for r in p]
      extras["restore_breakdown"][key]["first_in_process_total_s"] = max(
        r["total_s"] for r in first
      )
      phases = _phases_by_process(rows, recs)
      if phases:
        extras["restore_breakdown"][key]["phases"] = phases
      evicted = [r["evicted_files"] for r in timed + first if r.get("evicted_files") is not None]
      if evicted:
        extras["restore_breakdown"][key]["evicted_files"] = max(evicted)
      extras["bit_exact"][key] = all(r["mismatched_shards"] == 0 for r in timed + first)
  servers = [p.get("p2p_server") for p in two if p.get("p2p_server")]
  if servers:
    extras["p2p_servers"] = servers
  extras["save_4x1"] = {f: max(p["save"][f] for p in four) for f in ("stall_s", "local_s", "all_s")}
  return extras


def _phases_by_process(rows: list[dict], recs: list[list[dict]]) -> dict[str, dict[str, float]]:
  """{"process N (slice S)": {phase: median seconds over the timed
  restores}} where the manager reports its restore's phases (ours), else {}."""
  out = {}
  for i, (p, reps) in enumerate(zip(rows, recs)):
    phases = [r.get("phases") or {} for r in reps]
    names = sorted({k for ph in phases for k in ph})
    if names:
      out[f"process {i} (slice {p['slice']})"] = {
        k: round(_median([ph.get(k, 0.0) for ph in phases]), 4) for k in names
      }
  return out


# ---- ratios ------------------------------------------------------------------
def _ratio(a, b):
  return None if a is None or b is None or b <= 0 else a / b


def ratios(raw: dict[str, dict], results: dict[str, dict]) -> dict:
  out: dict[str, dict] = {}
  for name in MANAGERS:
    out[name] = {}
    for mt in METRICS:
      fig = results[name]["metrics"][mt.key]
      v = fig["value"]
      if mt.same_job:
        r = {
          "to_raw_bound": _ratio(v, fig.get("bound")),
          "to_raw_job_bound": _ratio(v, raw[mt.bound]["value"]),
        }
      else:
        r = {"to_raw_bound": _ratio(v, raw[mt.bound]["value"])}
      for other in (ORBAX_MS, ORBAX_P2P):
        if other != name:
          r[f"to_{other}"] = _ratio(v, results[other]["metrics"][mt.key]["value"])
      out[name][mt.key] = r
  return out


# ---- markdown ----------------------------------------------------------------
