"""Benchmark of in-slice redundancy (issue 18): `local.redundancy` schemes
against `"none"`, measured in the same job, interleaved.

  python -m benchmarks.redundancy --out DIR [--mib-per-process N] [--reps K]

One real 4-process jax.distributed CPU job, one slice (replica axis of size
1, 4 processes x 2 devices), each process a simulated machine of its own
(host_id "sim-host-<i>", ramdisk folder host_<i>). Rows:

- save() stall, and the wall time of the whole save (until
  wait_until_finished returns), for every scheme and for "none": one manager
  per scheme lives in the job at once (own folders and run_id); each rep
  saves the same state with every manager in a rotated order, each save
  waited for before the next, so the schemes share the machine's drift.
- time until durable: the manager's own `save_durable` events (event_log):
  tier "local" and the scheme's tier (e.g. "partner"), seconds from save()
  entry, per step the max over processes; the target compares the scheme's
  tier with the local write of the same save, and with `none`'s local
  write of the same rep (XOR sent beside the write, --overlap on, slows
  the write it is compared with: on 2 cores 0.30-0.38 s against 0.18-0.28
  s); it holds only if both rows do.
- training work during the background save: a fixed jitted update of the
  state (stands for train steps), timed right after save() returns while
  the background work runs, against the same work with no save ("idle").
- ramdisk bytes per process after the timed saves (allocated blocks):
  the process's own steps against the scheme's folders (e.g. partner/).
- restore onto the same topology, a fresh manager each, interleaved in a
  rotated order: "intact" (every ramdisk kept), "lost_host" (host 1 wiped:
  rebuilt from redundancy), "persistent_cold" / "persistent_warm" (hosts 1
  and 2 wiped, so no ramdisk holds process 1's shards: every process reads
  the persistent tier; cold evicts its files from the page cache first).
  Time from manager construction to restored, ready arrays per process
  (max over processes); every restored shard is checked bit for bit.

A new scheme (e.g. "xor") is one more entry of SCHEMES; a scheme the
installed library does not accept is skipped (and listed as such).

Directories: ramdisks under /dev/shm (a fresh folder per run), the
persistent tier under the system's temporary folder (a disk), both removed
at the end; events and job logs under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

NONE = "none"
# Redundancy schemes benchmarked against NONE, in this order; one entry per
# scheme. `durable_target`: the bound on (scheme tier durable) /
# (local durable), checked against the local write of the same save and
# against `none`'s local write of the same rep (work beside the write,
# local.redundancy_overlap, slows the scheme's own write): held only if both.
SCHEMES: dict[str, dict] = {
  "partner": {"durable_target": 2.0},
  "xor": {"durable_target": 1.5},
}
STALL_TARGET = 1.1  # scheme stall / none stall, same rep
RESTORE_TARGET = 0.5  # lost-host restore / persistent restore
BASE_TIERS = ("local", "persistent", "state")
BASE_SOURCES = ("local", "peer", "persistent")
PROCESSES = 4
DEVICES_PER_PROCESS = 2
LEAVES = 4
COLS = 1024
SEED = 20261125
WARMUP_SAVES = 2
PERSISTENT_STEP = 1_000_000  # the one step saved to both tiers (restored)
LOST = (1,)  # the host wiped in "lost_host"
UNPROTECTED = (1, 2)  # process 1 and its partner: nothing on a ramdisk holds process 1
VARIANTS = ("intact", "lost_host", "persistent_cold", "persistent_warm")
FG_ITERS = 4
OWN_KEYS = ("own", "spare")  # ramdisk folders of a process's own copies


def supported_schemes() -> tuple[list[str], list[str]]:
  """(schemes of SCHEMES the installed library accepts, those it rejects)."""
  import emergency_ckpt as ec  # noqa: PLC0415

  ok, skipped = [], []
  for name in SCHEMES:
    try:
      ec.LocalTierOptions(directory="/dev/shm/x", redundancy=name)
    except (ValueError, TypeError):
      skipped.append(name)
    else:
      ok.append(name)
  return ok, skipped


# ---- the train state ----------------------------------------------------------
def rows_per_leaf(mib_per_process: float) -> int:
  """Rows of each (rows, COLS) float32 leaf for `mib_per_process` MiB of
  unique shards per process (the 8 devices of the slice split every leaf)."""
  total = int(mib_per_process * 2**20) * PROCESSES // 4
  rows = total // (LEAVES * COLS)
  per = PROCESSES * DEVICES_PER_PROCESS
  rows -= rows % per
  if rows < per:
    raise ValueError(f"--mib-per-process {mib_per_process} is too small")
  return rows


def _block(leaf: int, block: int, rows: int):
  import numpy as np  # noqa: PLC0415

  a = np.random.default_rng([SEED, leaf, block]).random((rows, COLS), dtype=np.float32)
  a -= 0.5
  bits = a.view(np.uint32)
  bits[0, 0] = 0x80000000  # -0.0
  bits[0, 1] = 0x00000001  # smallest denormal
  bits[0, 2] = 0x7FC00000 | (leaf + 1)  # NaN with a payload
  return a


def _values(leaf: int, rows: int, index):
  """The values of the shard of leaf `leaf` at `index` (one block per device)."""
  per = rows // (PROCESSES * DEVICES_PER_PROCESS)
  start, stop, _ = index[0].indices(rows)
  if start % per or stop - start != per:
    raise ValueError(f"shard rows [{start}, {stop}) are not one block of {per}")
  return _block(leaf, start // per, per)


def _mesh():
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices).reshape(1, -1), ("replica", "data"))


def _abstract(mesh, rows: int) -> dict:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  sharding = NamedSharding(mesh, P("data", None))
  return {
    f"layer_{i}": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sharding)
    for i in range(LEAVES)
  }


def _make_state(abstract: dict) -> dict:
  import jax  # noqa: PLC0415

  out = {}
  for i, (name, leaf) in enumerate(abstract.items()):
    out[name] = jax.make_array_from_callback(
      leaf.shape, leaf.sharding, lambda idx, i=i, r=leaf.shape[0]: _values(i, r, idx)
    )
  return jax.block_until_ready(out)


def _mismatched_shards(restored: dict, abstract: dict) -> int:
  """Addressable shards of `restored` that differ bit for bit from the saved values."""
  import numpy as np  # noqa: PLC0415

  bad = 0
  for i, (name, leaf) in enumerate(abstract.items()):
    arr = restored.get(name) if isinstance(restored, dict) else None
    if arr is None or arr.shape != leaf.shape or arr.dtype != leaf.dtype:
      bad += 1
      continue
    for shard in arr.addressable_shards:
      want = _values(i, leaf.shape[0], shard.index).view(np.uint32)
      if not np.array_equal(np.asarray(shard.data).view(np.uint32), want):
        bad += 1
  return bad


# ---- inside the job ---------------------------------------------------------
def _options(args: dict, scheme: str):
  import jax  # noqa: PLC0415

  import emergency_ckpt as ec  # noqa: PLC0415

  me = jax.process_index()
  overlap = {} if args.get("overlap") is None else {"redundancy_overlap": args["overlap"]}
  return ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(
      directory=_host_dir(args, scheme, me),
      save_interval_steps=1,
      max_to_keep=2,
      redundancy=scheme,
      **overlap,
    ),
    persistent=ec.PersistentTierOptions(
      directory=os.path.join(args["disk_root"], scheme, "persistent"),
      save_interval_steps=PERSISTENT_STEP,
      max_to_keep=2,
    ),
    run_id=f"bench-{scheme}",
    host_id=f"sim-host-{me}",
    event_log=os.path.join(args["out"], "events", f"{scheme}-{{process}}.jsonl"),
    collective_timeout_s=120,
    state_commit_timeout_s=120,
  )


def _host_dir(args: dict, scheme: str, process: int) -> str:
  return os.path.join(args["shm_root"], scheme, f"host_{process}")


def _progress(msg: str) -> None:
  import jax  # noqa: PLC0415

  if jax.process_index() == 0:
    print(f"BENCH {time.strftime('%H:%M:%S')} {msg}", flush=True)


def _foreground(step_fn, state, iters: int) -> float:
  """Seconds for `iters` jitted updates of the state (stands for train steps)."""
  import jax  # noqa: PLC0415

  t0 = time.perf_counter()
  x = state
  for _ in range(iters):
    x = step_fn(x)
  jax.block_until_ready(x)
  return time.perf_counter() - t0


def _disk_bytes(root: str) -> dict[str, int]:
  """Allocated bytes under `root`: 'own' (this process's step folders and
  files), 'spare' (its retired step file kept for reuse) and one entry per
  other folder of the process folder (e.g. 'partner', a scheme's copies of
  other processes' steps)."""
  from emergency_ckpt.core import layout  # noqa: PLC0415

  out: dict[str, int] = {"own": 0}
  for dirpath, _, files in os.walk(root):
    rel = os.path.relpath(dirpath, root).split(os.sep)
    # <root>/<run_id>/process_<i>/<entry>/...
    entry = rel[2] if len(rel) > 2 else ""
    if entry.startswith(layout.SPARE_PREFIX):
      key = "spare"  # a retired step's file, kept for the next local write
    elif entry == "" or entry.startswith(("step_", ".")):
      key = "own"
    else:
      key = entry
    for name in files:
      st = os.lstat(os.path.join(dirpath, name))
      out[key] = out.get(key, 0) + st.st_blocks * 512
  return out


def _durable_events(path: str, steps: list[int]) -> dict:
  """{step: {tier: durable_s}} from this process's event log (failures as None)."""
  from emergency_ckpt.core import telemetry  # noqa: PLC0415

  want = set(steps)
  out: dict = {str(s): {} for s in steps}
  for e in telemetry.read_events(path):
    if e.get("event") in ("save_durable", "save_failed") and e.get("step") in want:
      ok = e["event"] == "save_durable"
      out[str(e["step"])][e["tier"]] = e.get("durable_s") if ok else None
  return out


def _link_tree(src: str, dst: str) -> None:
  """A copy of `src` made of hard links (instant on tmpfs; a restore only
  reads the files, and renames or deletions leave the links intact)."""
  shutil.rmtree(dst, ignore_errors=True)
  shutil.copytree(src, dst, symlinks=True, copy_function=os.link)


def _evict(root: str) -> int:
  from emergency_ckpt.bench import measure  # noqa: PLC0415

  return measure.evict_tree(root)


def bench_main(args: dict) -> dict:
  """The whole benchmark, on every process of the job."""
  import jax  # noqa: PLC0415

  import emergency_ckpt as ec  # noqa: PLC0415
  from emergency_ckpt.bench.sync import barrier  # noqa: PLC0415

  me = jax.process_index()
  schemes = args["schemes"]
  every = [NONE, *schemes]
  mesh = _mesh()
  abstract = _abstract(mesh, args["rows"])
  state = _make_state(abstract)
  nbytes = sum(
    s.data.nbytes for a in state.values() for s in a.addressable_shards if s.replica_id == 0
  )
  step_fn = jax.jit(lambda t: jax.tree.map(lambda x: x * 0.999 + 0.001, t))
  jax.block_until_ready(step_fn(state))  # compiled before anything is timed
  out: dict = {"process": me, "bytes": nbytes, "saves": [], "fg": [], "restores": []}

  # ---- saves: every manager alive at once, rotated order per rep ----------
  _progress(f"{every}: {WARMUP_SAVES} warm-up + {args['reps']} timed saves each")
  managers = {}
  for s in every:
    # One at a time: a manager sets Orbax's multihost ids up on a background
    # thread, and two doing it at once in one process race (ALREADY_EXISTS).
    managers[s] = ec.CheckpointManager(_options(args, s), mesh=mesh)
    managers[s].prepare(abstract)
    managers[s].wait_until_finished()
  if "xor" in managers:  # what local.redundancy_overlap resolved to here
    out["xor_overlap"] = getattr(managers["xor"]._redundancy, "overlap", None)  # noqa: SLF001
  barrier("red-prepared")
  total = WARMUP_SAVES + args["reps"]
  step = 0
  timed_steps: dict[str, list[int]] = {s: [] for s in every}
  for k in range(total):
    order = every[k % len(every) :] + every[: k % len(every)]
    for scheme in order:
      step += 1
      mngr = managers[scheme]
      barrier(f"red-save-{step}")
      t0 = time.perf_counter()
      saved = mngr.save(step, state)
      t1 = time.perf_counter()
      mngr.wait_until_finished()
      t2 = time.perf_counter()
      if not saved:
        raise RuntimeError(f"{scheme} did not save step {step}")
      if k >= WARMUP_SAVES:
        timed_steps[scheme].append(step)
        out["saves"].append(
          {"rep": k - WARMUP_SAVES, "scheme": scheme, "step": step, "stall_s": t1 - t0,
           "finished_s": t2 - t0, "position": order.index(scheme)}
        )  # fmt: skip
    _progress(f"save rep {k + 1}/{total} done")

  # ---- training work while the background save runs -------------------------
  for k in range(args["reps"]):
    probe = [*every, "idle"]
    order = probe[k % len(probe) :] + probe[: k % len(probe)]
    for scheme in order:
      barrier(f"red-fg-{k}-{scheme}")
      if scheme != "idle":
        step += 1
        managers[scheme].save(step, state)
      fg = _foreground(step_fn, state, args["fg_iters"])
      if scheme != "idle":
        managers[scheme].wait_until_finished()
      out["fg"].append({"rep": k, "scheme": scheme, "fg_s": fg})
    _progress(f"training-work rep {k + 1}/{args['reps']} done")

  # ---- ramdisk bytes, durable events --------------------------------------
  barrier("red-bytes")
  out["ramdisk"] = {s: _disk_bytes(_host_dir(args, s, me)) for s in every}
  out["durable"] = {
    s: _durable_events(os.path.join(args["out"], "events", f"{s}-{me}.jsonl"), timed_steps[s])
    for s in every
  }
  # the restored step: both tiers, written by every redundancy manager
  for scheme in schemes:  # one at a time: two Orbax saves in flight in one process time out
    managers[scheme].save(PERSISTENT_STEP, state)
    managers[scheme].wait_until_finished()
  for mngr in managers.values():
    mngr.close()
  barrier("red-closed")
  shutil.rmtree(_host_dir(args, NONE, me), ignore_errors=True)

  # ---- restores -----------------------------------------------------------
  for scheme in schemes:
    host = _host_dir(args, scheme, me)
    backup = host + ".backup"
    _link_tree(host, backup)
    persistent = os.path.join(args["disk_root"], scheme, "persistent")
    barrier(f"red-{scheme}-backup")
    for k in range(-1, args["reps"]):  # -1: the untimed warm-up round (compiles)
      order = VARIANTS[k % len(VARIANTS) :] + VARIANTS[: k % len(VARIANTS)]
      for variant in order:
        wiped = {"intact": (), "lost_host": LOST}.get(variant, UNPROTECTED)
        _link_tree(backup, host)
        if me in wiped:
          shutil.rmtree(host)
          os.makedirs(host, mode=0o700)
        barrier(f"red-{scheme}-{k}-{variant}-reset")
        evicted = _evict(persistent) if variant == "persistent_cold" and me == 0 else None
        barrier(f"red-{scheme}-{k}-{variant}-ready")
        t0 = time.perf_counter()
        mngr = ec.CheckpointManager(_options(args, scheme), mesh=mesh)
        t1 = time.perf_counter()
        rec = {"scheme": scheme, "rep": k, "variant": variant, "wiped": me in wiped,
               "evicted_files": evicted}  # fmt: skip
        try:
          r = mngr.restore(abstract)
          jax.block_until_ready(r.state)
        except ec.NoRestorableCheckpointError as e:  # every process alike
          rec.update(step=None, source=None, error=str(e)[:500], mismatched_shards=None)
        else:
          t2 = time.perf_counter()
          rec.update(step=r.step, source=r.source, total_s=t2 - t0, construct_s=t1 - t0,
                     restore_s=t2 - t1, mismatched_shards=_mismatched_shards(r.state, abstract))  # fmt: skip
          del r
        mngr.close()
        out["restores"].append(rec)
        barrier(f"red-{scheme}-{k}-{variant}-done")
      _progress(f"{scheme} restore round {k + 1}/{args['reps']} done")
    shutil.rmtree(backup, ignore_errors=True)
    shutil.rmtree(host, ignore_errors=True)
  barrier("red-finish")
  return out


# ---- reduction ----------------------------------------------------------------
def _stats(values: list[float]) -> dict:
  vals = [v for v in values if v is not None]
  if not vals:
    return {"median": None, "min": None, "max": None, "n": 0}
  return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _by(results: list[dict], key: str) -> dict:
  """{((field, value), ...): [per-process records]} of every process's `key`
  list, by scheme, rep and variant."""
  out: dict = {}
  for r in results:
    for rec in r[key]:
      ident = tuple((k, rec[k]) for k in ("scheme", "rep", "variant") if k in rec)
      out.setdefault(ident, []).append(rec)
  return out


def _own(folders: dict) -> int:
  return sum(v for k, v in folders.items() if k in OWN_KEYS)


def _extra(folders: dict) -> int:
  return sum(v for k, v in folders.items() if k not in OWN_KEYS)


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a and b else None


def reduce(results: list[dict], schemes: list[str]) -> dict:
  """Per rep the max over processes, then median and spread over reps;
  ratios are taken per rep (same rep, interleaved), then their median."""
  every = [NONE, *schemes]
  saves = _by(results, "saves")
  stall: dict = {s: {} for s in every}
  finished: dict = {s: {} for s in every}
  rep_step: dict = {s: {} for s in every}  # scheme: {rep: its step}
  for ident, recs in saves.items():
    d = dict(ident)
    stall[d["scheme"]][d["rep"]] = max(r["stall_s"] for r in recs)
    rep_step[d["scheme"]][d["rep"]] = recs[0]["step"]
    finished[d["scheme"]][d["rep"]] = max(r["finished_s"] for r in recs)
  out: dict = {"schemes": schemes, "rows": {}}
  rows = out["rows"]
  reps = sorted(stall[NONE])
  for s in every:
    rows[f"stall_s/{s}"] = _stats([stall[s][k] for k in reps])
    rows[f"finished_s/{s}"] = _stats([finished[s][k] for k in reps])
  # durable: per step, max over processes of each tier's durable_s
  durable: dict = {s: {} for s in every}
  for s in every:
    steps = sorted({int(st) for r in results for st in r["durable"][s]})
    for st in steps:
      tiers: dict = {}
      for r in results:
        for tier, v in r["durable"][s][str(st)].items():
          tiers.setdefault(tier, []).append(v)
      durable[s][st] = {
        t: (None if None in v or len(v) < len(results) else max(v)) for t, v in tiers.items()
      }
  rows[f"local_durable_s/{NONE}"] = _stats([d.get("local") for d in durable[NONE].values()])
  for s in schemes:
    extra = sorted({t for d in durable[s].values() for t in d} - set(BASE_TIERS))
    tier = extra[0] if extra else None
    out.setdefault("tiers", {})[s] = tier
    per = list(durable[s].values())
    rows[f"local_durable_s/{s}"] = _stats([d.get("local") for d in per])
    rows[f"redundant_durable_s/{s}"] = _stats([d.get(tier) for d in per])
    rows[f"state_durable_s/{s}"] = _stats([d.get("state") for d in per])
    # the scheme's own work: its tier's durable_s less the local one, per process
    gaps = []
    for st in durable[s]:
      g = [r["durable"][s][str(st)] for r in results]
      if all(x.get(tier) is not None and x.get("local") is not None for x in g):
        gaps.append(max(x[tier] - x["local"] for x in g))
    rows[f"redundancy_work_s/{s}"] = _stats(gaps)
    out.setdefault("failed_durable", {})[s] = sum(
      v is None for r in results for d in r["durable"][s].values() for v in d.values()
    )
    rows[f"durable_ratio/{s}"] = _stats(
      [d[tier] / d["local"] if d.get(tier) and d.get("local") else None for d in per]
    )
    # ... and over `none`'s local write of the same rep (step): work beside
    # the write (local.redundancy_overlap) slows the scheme's own write, which
    # flatters the ratio above
    rows[f"durable_vs_none_ratio/{s}"] = _stats(
      [
        _ratio(durable[s].get(rep_step[s].get(k), {}).get(tier),
               durable[NONE].get(rep_step[NONE].get(k), {}).get("local"))
        for k in reps
      ]
    )  # fmt: skip
    rows[f"stall_ratio/{s}"] = _stats([stall[s][k] / stall[NONE][k] for k in reps])
    rows[f"finished_ratio/{s}"] = _stats([finished[s][k] / finished[NONE][k] for k in reps])
  # training work
  fg: dict = {}
  for ident, recs in _by(results, "fg").items():
    d = dict(ident)
    fg.setdefault(d["scheme"], {})[d["rep"]] = max(r["fg_s"] for r in recs)
  for s in [*every, "idle"]:
    rows[f"fg_s/{s}"] = _stats(list(fg.get(s, {}).values()))
  for s in schemes:
    rows[f"fg_ratio_vs_none/{s}"] = _stats([fg[s][k] / fg[NONE][k] for k in fg[s]])
  # ramdisk bytes per process
  for s in every:
    own = [_own(r["ramdisk"][s]) for r in results]
    extra = [_extra(r["ramdisk"][s]) for r in results]
    rows[f"ramdisk_own_bytes/{s}"] = _stats(own)
    rows[f"ramdisk_extra_bytes/{s}"] = _stats(extra)
    out.setdefault("ramdisk_folders", {})[s] = [r["ramdisk"][s] for r in results]
  for s in schemes:
    rows[f"ramdisk_extra_ratio/{s}"] = _stats(
      [_extra(r["ramdisk"][s]) / _own(r["ramdisk"][s]) for r in results]
    )
  # restores
  checks = {"bad_shards": 0, "wrong_step": 0, "sources": {}}
  restore: dict = {}
  for ident, recs in _by(results, "restores").items():
    d = dict(ident)
    srcs = checks["sources"].setdefault(f"{d['scheme']}/{d['variant']}", set())
    srcs.update(f"{'wiped' if r['wiped'] else 'kept'}:{r['source']}" for r in recs)
    if any(r.get("error") for r in recs):
      checks.setdefault("errors", []).append(f"{d['scheme']}/{d['variant']}: {recs[0]['error']}")
      continue
    checks["bad_shards"] += sum(r["mismatched_shards"] for r in recs)
    checks["wrong_step"] += sum(r["step"] != PERSISTENT_STEP for r in recs)
    if d["rep"] >= 0:
      restore.setdefault((d["scheme"], d["variant"]), {})[d["rep"]] = max(
        r["total_s"] for r in recs
      )
  checks["sources"] = {k: sorted(v) for k, v in checks["sources"].items()}
  out["restore_checks"] = checks
  for (s, v), per in restore.items():
    rows[f"restore_s/{s}/{v}"] = _stats(list(per.values()))
  for s in schemes:
    lost = restore.get((s, "lost_host"), {})
    for v in ("persistent_cold", "persistent_warm"):
      base = restore.get((s, v), {})
      rows[f"restore_ratio/{s}/{v}"] = _stats([lost[k] / base[k] for k in lost if k in base])
  return out


# ---- report -------------------------------------------------------------------
def _fmt(stat: dict, unit: str = "s") -> str:
  if not stat or stat.get("median") is None:
    return "n/a"
  if unit == "MiB":
    f = lambda v: f"{v / 2**20:.1f}"  # noqa: E731
  elif unit == "x":
    f = lambda v: f"{v:.2f}x"  # noqa: E731
  else:
    f = lambda v: f"{v:.3f} s"  # noqa: E731
  return f"{f(stat['median'])} ({f(stat['min'])} - {f(stat['max'])})"


def _verdict(stat: dict, bound: float) -> str:
  if not stat or stat.get("median") is None:
    return "n/a"
  return "yes" if stat["median"] <= bound else "no"


def _yaml(value) -> str:
  return "null" if value is None else str(value).lower()


def markdown(doc: dict) -> str:
  """results.md: one table per scheme, medians with (min - max) over reps."""
  rows, cfg = doc["reduced"]["rows"], doc["config"]
  lines = [
    f"# Redundancy benchmark, {cfg['started_utc']}",
    "",
    f"1 slice x {PROCESSES} processes x {DEVICES_PER_PROCESS} CPU devices, each process a"
    f" simulated machine; {doc['bytes_per_process'] / 2**20:.1f} MiB of unique shards per"
    f" process; {cfg['reps']} reps, interleaved with `none` in a rotated order;"
    f" {cfg['machine']}, load average (1 min) {cfg['loadavg_1_5_15_before'][0]:.1f} before,"
    f" {cfg['loadavg_1_5_15_after'][0]:.1f} after;"
    f" job wall {doc['wall_s']:.0f} s. Figures: median (min - max)"
    " over reps of the max over processes; ratios per rep, then their median.",
    "",
    f"Library: {cfg['library']['path']} at {cfg['library']['commit'][:12]}"
    + (" (uncommitted changes)" if cfg["library"]["changed"] else ""),
    "",
    f"XOR chunks sent during the local write (local.redundancy_overlap ="
    f" {_yaml(cfg.get('redundancy_overlap'))}, per process: {cfg.get('xor_overlap')}).",
    "",
  ]
  if doc["skipped_schemes"]:
    lines += [f"Not built in this library (skipped): {', '.join(doc['skipped_schemes'])}.", ""]
  checks = doc["reduced"]["restore_checks"]
  for s in doc["reduced"]["schemes"]:
    tier = doc["reduced"]["tiers"].get(s)
    target = SCHEMES[s]["durable_target"]
    lines += [
      f"## {s}",
      "",
      f"| row | {NONE} | {s} | {s} / {NONE} (or as named) | target | held |",
      "| --- | --- | --- | --- | --- | --- |",
      f"| save() stall | {_fmt(rows[f'stall_s/{NONE}'])} | {_fmt(rows[f'stall_s/{s}'])}"
      f" | {_fmt(rows[f'stall_ratio/{s}'], 'x')} | <= {STALL_TARGET}x |"
      f" {_verdict(rows[f'stall_ratio/{s}'], STALL_TARGET)} |",
      f"| durable locally (event `local`) | {_fmt(rows[f'local_durable_s/{NONE}'])}"
      f" | {_fmt(rows[f'local_durable_s/{s}'])} | | | |",
      f"| durable with redundancy (event `{tier}`) | | {_fmt(rows[f'redundant_durable_s/{s}'])}"
      f" | {_fmt(rows[f'durable_ratio/{s}'], 'x')} of its local | <= {target}x |"
      f" {_verdict(rows[f'durable_ratio/{s}'], target)} |",
      f"| durable with redundancy, over `{NONE}`'s local write (same rep) | |"
      f" {_fmt(rows[f'redundant_durable_s/{s}'])}"
      f" | {_fmt(rows.get(f'durable_vs_none_ratio/{s}'), 'x')} | <= {target}x |"
      f" {_verdict(rows.get(f'durable_vs_none_ratio/{s}'), target)} |",
      f"| its {tier} work: (`{tier}` - `local`) durable_s, max over processes | |"
      f" {_fmt(rows[f'redundancy_work_s/{s}'])} | | | |",
      f"| state file written (event `state`) | | {_fmt(rows[f'state_durable_s/{s}'])} | | | |",
      f"| save until wait_until_finished | {_fmt(rows[f'finished_s/{NONE}'])}"
      f" | {_fmt(rows[f'finished_s/{s}'])} | {_fmt(rows[f'finished_ratio/{s}'], 'x')} | | |",
      f"| {cfg['fg_iters']} train-like updates during the background save (idle:"
      f" {_fmt(rows['fg_s/idle'])}) | {_fmt(rows[f'fg_s/{NONE}'])} | {_fmt(rows[f'fg_s/{s}'])}"
      f" | {_fmt(rows[f'fg_ratio_vs_none/{s}'], 'x')} | | |",
      f"| ramdisk bytes per process, own steps + spare | {_fmt(rows[f'ramdisk_own_bytes/{NONE}'], 'MiB')}"
      f" MiB | {_fmt(rows[f'ramdisk_own_bytes/{s}'], 'MiB')} MiB | | | |",
      f"| ramdisk bytes per process, extra ({s} folders) | | "
      f"{_fmt(rows[f'ramdisk_extra_bytes/{s}'], 'MiB')} MiB"
      f" | {_fmt(rows[f'ramdisk_extra_ratio/{s}'], 'x')} of own | | |",
      f"| restore, ramdisks intact | | {_fmt(rows.get(f'restore_s/{s}/intact'))} | | | |",
      f"| restore, host 1 lost (from {s}) | | {_fmt(rows.get(f'restore_s/{s}/lost_host'))} | | | |",
      f"| restore from persistent, hosts 1+2 lost, cache evicted | |"
      f" {_fmt(rows.get(f'restore_s/{s}/persistent_cold'))}"
      f" | lost host / this: {_fmt(rows.get(f'restore_ratio/{s}/persistent_cold'), 'x')}"
      f" | <= {RESTORE_TARGET}x | {_verdict(rows.get(f'restore_ratio/{s}/persistent_cold'), RESTORE_TARGET)} |",  # noqa: E501
      f"| restore from persistent, hosts 1+2 lost, cache warm | |"
      f" {_fmt(rows.get(f'restore_s/{s}/persistent_warm'))}"
      f" | lost host / this: {_fmt(rows.get(f'restore_ratio/{s}/persistent_warm'), 'x')}"
      f" | <= {RESTORE_TARGET}x | {_verdict(rows.get(f'restore_ratio/{s}/persistent_warm'), RESTORE_TARGET)} |",  # noqa: E501
      "",
    ]
    srcs = {k.split("/", 1)[1]: v for k, v in checks["sources"].items() if k.startswith(s + "/")}
    failed = doc["reduced"]["failed_durable"].get(s, 0)
    if failed:
      lines += [f"**{failed} save_failed events** in the timed saves (see the event logs).", ""]
    for err in checks.get("errors", []):
      lines += [f"**Restore failed**: {err}", ""]
    lines += [
      f"Restores (every scheme of the run): {checks['bad_shards']} mismatched shards,"
      f" {checks['wrong_step']} of another"
      f" step than {PERSISTENT_STEP}; sources (wiped/kept host: source): "
      + "; ".join(f"{v}: {', '.join(x)}" for v, x in sorted(srcs.items())),
      "",
    ]
  folders = doc["reduced"]["ramdisk_folders"]
  lines += ["Ramdisk bytes per process (MiB, allocated), after the timed saves:", ""]
  for s, per in folders.items():
    cells = ", ".join(
      f"p{i}: " + " + ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(d.items()))
      for i, d in enumerate(per)
    )
    lines.append(f"- {s}: {cells}")
  lines.append("")
  return "\n".join(lines)


# ---- driver -------------------------------------------------------------------
def run(
  out: str,
  mib_per_process: float,
  reps: int,
  fg_iters: int = FG_ITERS,
  overlap: bool | None = None,
) -> dict:
  """Runs the job, writes results.json and results.md under `out`, returns
  the document. `overlap`: local.redundancy_overlap (None: the library's
  default)."""
  from emergency_ckpt.bench import measure  # noqa: PLC0415
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415

  measure.precompile()  # the job imports bytecode, as from a wheel
  os.makedirs(out, exist_ok=True)
  schemes, skipped = supported_schemes()
  shm_root = tempfile.mkdtemp(prefix="ec-redbench-", dir="/dev/shm")
  disk_root = tempfile.mkdtemp(prefix="ec-redbench-")
  shutil.rmtree(os.path.join(out, "events"), ignore_errors=True)
  args = {
    "out": os.path.abspath(out),
    "shm_root": shm_root,
    "disk_root": disk_root,
    "rows": rows_per_leaf(mib_per_process),
    "reps": reps,
    "fg_iters": fg_iters,
    "schemes": schemes,
    "overlap": overlap,
  }
  started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
  load_before = os.getloadavg()
  try:
    job = run_job(
      "benchmarks.redundancy:bench_main",
      PROCESSES,
      args,
      devices_per_process=DEVICES_PER_PROCESS,
      timeout_s=3600,
      out_dir=os.path.join(out, "job"),
    )
    results = job.check()
  finally:
    shutil.rmtree(shm_root, ignore_errors=True)
    shutil.rmtree(disk_root, ignore_errors=True)
  doc = {
    "config": {
      "mib_per_process": mib_per_process,
      "reps": reps,
      "fg_iters": fg_iters,
      "redundancy_overlap": overlap,
      "xor_overlap": sorted({r.get("xor_overlap") for r in results}, key=str),
      "warmup_saves": WARMUP_SAVES,
      "started_utc": started,
      "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
      "python": sys.version.split()[0],
      "library": _library_version(),
      "loadavg_1_5_15_before": load_before,
      "loadavg_1_5_15_after": os.getloadavg(),
    },
    "skipped_schemes": skipped,
    "bytes_per_process": results[0]["bytes"],
    "wall_s": job.wall_s,
    "reduced": reduce(results, schemes),
    "processes": results,
  }
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(doc, f, indent=1, default=sorted)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(markdown(doc))
  return doc


# (label, row key with {s} for the scheme, unit, target) of the combined table
COMBINED_ROWS = (
  ("save() stall, none", "stall_s/none", "s", None),
  ("save() stall, {s}", "stall_s/{s}", "s", None),
  ("stall {s} / none (per rep)", "stall_ratio/{s}", "x", STALL_TARGET),
  ("durable locally (`local`), {s}", "local_durable_s/{s}", "s", None),
  ("durable with redundancy, {s}", "redundant_durable_s/{s}", "s", None),
  ("durable with redundancy / local (per save)", "durable_ratio/{s}", "x", "durable"),
  ("durable with redundancy / none's local (per rep)", "durable_vs_none_ratio/{s}", "x", "durable"),
  ("{s} work (redundant - local durable_s)", "redundancy_work_s/{s}", "s", None),
  ("train-like work during the save, none", "fg_s/none", "s", None),
  ("train-like work during the save, {s}", "fg_s/{s}", "s", None),
  ("train-like work, no save", "fg_s/idle", "s", None),
  ("train-like work {s} / none (per rep)", "fg_ratio_vs_none/{s}", "x", None),
  ("ramdisk per process, own steps + spare", "ramdisk_own_bytes/{s}", "MiB", None),
  ("ramdisk per process, extra ({s} folders)", "ramdisk_extra_bytes/{s}", "MiB", None),
  ("restore, intact", "restore_s/{s}/intact", "s", None),
  ("restore, host 1 lost (from {s})", "restore_s/{s}/lost_host", "s", None),
  ("restore from persistent, cache evicted", "restore_s/{s}/persistent_cold", "s", None),
  ("restore from persistent, cache warm", "restore_s/{s}/persistent_warm", "s", None),
  (
    "lost host / persistent cold (per rep)",
    "restore_ratio/{s}/persistent_cold",
    "x",
    RESTORE_TARGET,
  ),
  (
    "lost host / persistent warm (per rep)",
    "restore_ratio/{s}/persistent_warm",
    "x",
    RESTORE_TARGET,
  ),
)


def combine(dirs: list[str]) -> str:
  """One table over several runs' results.json: each run's median (min -
  max over its reps), and whether each target held in each run."""
  docs = []
  for d in dirs:
    with open(os.path.join(d, "results.json")) as f:
      docs.append(json.load(f))
  names = [os.path.basename(os.path.normpath(d)) for d in dirs]
  lines = [
    "| row | " + " | ".join(names) + " | target | held |",
    "| --- |" + " --- |" * (len(names) + 2),
  ]
  for scheme in docs[0]["reduced"]["schemes"]:
    for label, key, unit, target in COMBINED_ROWS:
      key = key.format(s=scheme)
      stats = [doc["reduced"]["rows"].get(key) for doc in docs]
      if target == "durable":
        target = SCHEMES[scheme]["durable_target"]
      held = "" if target is None else "/".join(_verdict(st, target) for st in stats)
      lines.append(
        f"| {label.format(s=scheme)} | "
        + " | ".join(_fmt(st, unit) + (" MiB" if unit == "MiB" else "") for st in stats)
        + f" | {'' if target is None else f'<= {target}x'} | {held} |"
      )
  checks = [doc["reduced"]["restore_checks"] for doc in docs]
  lines += [
    "",
    "Restores, all runs: "
    f"{sum(c['bad_shards'] for c in checks)} mismatched shards,"
    f" {sum(c['wrong_step'] for c in checks)} of another step,"
    f" {sum(len(c.get('errors', [])) for c in checks)} failed;"
    f" save_failed events: {sum(sum(d['reduced'].get('failed_durable', {}).values()) for d in docs)}.",
    "",
  ]
  return "\n".join(lines)


def _library_version() -> dict:
  """The checkout the job imported the library from: commit and changed files."""
  import subprocess  # noqa: PLC0415

  import emergency_ckpt  # noqa: PLC0415

  where = os.path.dirname(os.path.dirname(os.path.abspath(emergency_ckpt.__file__)))

  def git(*a: str) -> str:
    try:
      return subprocess.run(
        ["git", "-C", where, *a], capture_output=True, text=True, timeout=10
      ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return ""

  return {
    "path": where,
    "commit": git("rev-parse", "HEAD"),
    "changed": git("status", "--porcelain"),
  }


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="folder for results.json, results.md, logs")
  p.add_argument("--mib-per-process", type=float, default=128)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--fg-iters", type=int, default=FG_ITERS)
  p.add_argument(
    "--overlap",
    choices=("auto", "on", "off"),
    default="auto",
    help="local.redundancy_overlap: auto (the library's default), on or off",
  )
  p.add_argument(
    "--combine", nargs="+", metavar="RUN_DIR", help="only write --out/summary.md over these runs"
  )
  a = p.parse_args(argv)
  if a.combine:
    text = combine(a.combine)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
      f.write(text)
    print(text)
    return 0
  overlap = {"auto": None, "on": True, "off": False}[a.overlap]
  doc = run(a.out, a.mib_per_process, a.reps, a.fg_iters, overlap)
  print(markdown(doc))
  return 0


if __name__ == "__main__":
  sys.exit(main())
