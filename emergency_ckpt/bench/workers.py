"""Code that runs inside the benchmark's multi-process jobs (run_job).

Each function takes the JSON args dict and returns this process's JSON
result; figures.py reduces them (per-process max or sum, then the
median over repetitions). Module-level imports stay light (no Orbax, no
manager), so a worker's "ready" time is that of a bare JAX job (plus the
launcher's package import, the same for every manager).

Directories (per manager and layout): the simulated host of process i has its
ramdisk at <shm_root>/<manager>/<layout>/host_<i>; the persistent directory
is <disk_root>/<manager>/<layout>/persistent.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import numpy as np

from emergency_ckpt.bench import adapters, peer
from emergency_ckpt.bench import measure as m
from emergency_ckpt.bench import state as st
from emergency_ckpt.bench.sync import barrier, lookup, publish, start_together
from emergency_ckpt.demo import job_process

SPAWN_ENV = "EC_BENCH_SPAWN_T"
VARIANTS = ("intact", "lose_slice", "persistent_cold")
# Untimed saves before the timed ones, the same for every manager: a job
# saves every few minutes for hours, so the figures are of the steady state.
# Ours keeps 2 local steps (its default): from the 4th save on, local
# retention has retired a step whose file the save writes into. The first
# save of a manager is reported on its own row.
WARMUP_SAVES = 3


def step_of(rep: int) -> int:
  """Step of the rep-th save: a multiple of every default save interval
  (ours: 10 and 100; Orbax multislice: 10 and 1000), so every manager saves
  both tiers on every step while keeping its default options."""
  return 1000 * (rep + 1)


def progress(msg: str) -> None:
  if jax.process_index() == 0:
    print(f"BENCH {msg}", flush=True)


def _spawn_time() -> float:
  return float(os.environ.get(SPAWN_ENV, "nan"))


def _paths(args: dict, manager: str, layout: str) -> tuple[str, str, str]:
  base = os.path.join(args["shm_root"], manager, layout)
  me = jax.process_index()
  return (
    os.path.join(base, f"host_{me}"),
    os.path.join(base, f"backup_{me}"),
    os.path.join(args["disk_root"], manager, layout, "persistent"),
  )


def _finish(result: dict) -> dict:
  """Returns `result` once every process is done. The coordinator (process 0)
  also waits for the others' result files: when it exits, the coordination
  service goes away and aborts any process still alive (SIGABRT)."""
  barrier("finish")
  out_dir = job_process.job_output_dir() if job_process.in_job() else None
  if jax.process_index() == 0 and out_dir:
    deadline = time.monotonic() + 60
    others = [os.path.join(out_dir, f"result_{i}.json") for i in range(1, jax.process_count())]
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in others):
      time.sleep(0.01)
  return result


def _has_files(path: str) -> bool:
  return any(files for _, _, files in os.walk(path))


# ---- raw bounds --------------------------------------------------------------
def _timed(name: str, fn) -> float:
  """A barrier, then the seconds fn() takes."""
  barrier(name)
  t0 = m.now()
  fn()
  return m.now() - t0


def _raw_rep(ctx: dict, rep: int) -> dict:
  """One repetition of the raw bounds of one layout: memcpy, ramdisk write
  and read (each with one and with N threads), the peer restore's (the
  senders' read of what they send, then the bytes over sockets with one and
  with N connections per pair), persistent write and cold read."""
  parts, staging, readback = ctx["parts"], ctx["staging"], ctx["readback"]
  shm_file, n = ctx["shm_file"], ctx["threads"]
  r: dict = {}
  c0 = time.process_time()
  r["memcpy_1t_s"] = _timed("raw-memcpy", lambda: m.memcpy(staging, parts))
  cpu = time.process_time() - c0
  r["memcpy_mt_s"] = _timed("raw-memcpy-mt", lambda: m.memcpy(staging, parts, n))
  c0 = time.process_time()
  r["ramdisk_write_1t_s"] = _timed("raw-write", lambda: m.write_file(shm_file, parts))
  r["cpu_memcpy_write_s"] = cpu + time.process_time() - c0  # the one-thread copies
  r["ramdisk_write_mt_s"] = _timed("raw-write-mt", lambda: m.write_file(shm_file, parts, n))
  for tag, k in (("1t", 1), ("mt", n)):
    readback[:] = 0
    r[f"ramdisk_read_{tag}_s"] = _timed(
      f"raw-read-{tag}", lambda k=k: m.read_file(shm_file, readback, k)
    )
    if not np.array_equal(readback, staging):
      raise AssertionError(f"ramdisk read-back ({tag}) differs from the bytes written")
  _raw_peer(ctx, rep, r)
  r["persistent_write_s"] = _timed("raw-pwrite", lambda: m.write_file(ctx["disk_file"], parts))
  m.evict_file(ctx["disk_file"])
  readback[:] = 0
  r["persistent_cold_read_s"] = _timed("raw-cold", lambda: m.read_file(ctx["disk_file"], readback))
  if not np.array_equal(readback, staging):
    raise AssertionError("raw read-back differs from the bytes written")
  return r


def _raw_peer(ctx: dict, rep: int, r: dict) -> None:
  """The peer restore's bound in this rep: a sender's read of the ranges it
  sends from its ramdisk file (one and N threads), then the plan's transfer
  over loopback sockets (one and N connections per pair), started at one
  instant everywhere; a receiver checks the bytes it got."""
  me, n, plan = jax.process_index(), ctx["threads"], ctx["plan"]
  staging, readback = ctx["staging"], ctx["readback"]
  sends = peer.sends_of(plan, me)
  for tag, k in (("1t", 1), ("mt", n)):

    def read(k=k):
      for _, a, b in sends:
        m.read_file(ctx["shm_file"], readback, k, a, b)

    dt = _timed(f"raw-peer-read-{tag}", read)
    r[f"peer_read_{tag}_s"] = dt if sends else None
  receives = plan.get(me, [])
  for tag, k in (("1s", 1), ("ns", n)):
    for _, a, b in receives:
      readback[a:b] = 0
    prefix = f"raw-peer/{ctx['layout']}/{rep}/{tag}/"
    r[f"peer_transfer_{tag}_s"] = peer.timed_transfer(
      plan,
      me,
      k,
      staging,
      readback,
      lambda key, value, prefix=prefix: publish(prefix + key, value),
      lambda key, prefix=prefix: lookup(prefix + key),
      lambda tag=tag: start_together(f"raw-peer-{tag}"),
    )
    if any(not np.array_equal(readback[a:b], staging[a:b]) for _, a, b in receives):
      raise AssertionError(f"bytes received from a peer ({tag}) differ from the sender's")


def raw_bounds(args: dict) -> dict:
  """Per layout and rep: memcpy, ramdisk write/read, the peer restore's
  read at the senders and socket transfer, persistent write and cold read
  of exactly this process's bytes, all processes at once."""
  ready_s = time.time() - _spawn_time()
  me = jax.process_index()
  threads = m.bound_threads()
  m.start_threads(threads)
  out: dict = {"pid": me, "ready_s": ready_s, "threads": threads, "layouts": {}}
  for name in st.LAYOUTS:
    layout = st.make_layout(name, args["mib"])
    state = st.make_state(layout)
    parts = st.unique_shards(state)
    nbytes = sum(p.nbytes for p in parts)
    shm_dir = os.path.join(args["shm_root"], "raw", name, f"host_{me}")
    disk_dir = os.path.join(args["disk_root"], "raw", name)
    m.reset_dir(shm_dir)
    os.makedirs(disk_dir, exist_ok=True)
    lost = layout.num_slices - 1
    ctx = {
      "layout": name,
      "parts": parts,
      "staging": np.ones(nbytes, np.uint8),  # preallocated and faulted in
      "readback": np.ones(nbytes, np.uint8),
      "threads": threads,
      "shm_file": os.path.join(shm_dir, "raw.bin"),
      "disk_file": os.path.join(disk_dir, f"raw_{me}.bin"),
      "plan": peer.plan(st.slice_processes(layout), lost, nbytes),
    }
    progress(
      f"raw bounds {name}: {args['reps']} reps of {nbytes / 2**20:.1f} MiB per process,"
      f" 1 and {threads} threads; peer restore of slice {lost}"
    )
    reps = [_raw_rep(ctx, k) for k in range(args["reps"] + 1)]  # the first is a warm-up, dropped
    out["layouts"][name] = {
      "slice": layout.slice_index,
      "bytes": nbytes,
      "peer": {"sends": peer.sends_of(ctx["plan"], me), "receives": ctx["plan"].get(me, [])},
      "reps": reps[1:],
    }
    shutil.rmtree(shm_dir, ignore_errors=True)
    os.remove(ctx["disk_file"])
    del state, parts, ctx
    barrier(f"raw-{name}-done")
  return _finish(out)


# ---- managers ----------------------------------------------------------------
def _timed_save(
  adapter: adapters.Adapter,
  step: int,
  state,
  rss_base: int,
  paired: tuple | None = None,
  paired_file: str | None = None,
) -> dict:
  """One save, timed. `paired` = (buffer, parts): first a memcpy of the
  same bytes with one thread, then with N threads, timed in the same job
  seconds before the save (a bound that shares the machine's drift, unlike
  the raw-bounds job's); `paired_file`: then a write + fsync of them to that
  file in the persistent dir, all processes at once (the
  durable-on-persistent row's same-job bound)."""
  memcpy_s = memcpy_mt_s = write_s = None
  if paired is not None:
    memcpy_s = _timed(f"memcpy-{step}", lambda: m.memcpy(*paired))
    n = m.bound_threads()
    memcpy_mt_s = _timed(f"memcpy-mt-{step}", lambda: m.memcpy(*paired, threads=n))
    if paired_file is not None:
      barrier(f"pwrite-{step}")
      t0 = m.now()
      m.write_file(paired_file, paired[1])
      write_s = m.now() - t0
  barrier(f"save-{step}")
  sampler = m.PeakRss().start()
  maxrss0 = m.maxrss_bytes()
  c0, t0 = time.process_time(), m.now()
  saved = adapter.save(step, state)
  t1 = m.now()
  adapter.wait_local()
  t2 = m.now()
  adapter.wait_all()
  t3 = m.now()
  cpu = time.process_time() - c0
  peak = sampler.stop()
  if not saved:
    raise RuntimeError(f"{adapter.name} did not save step {step}")
  return {
    "step": step,
    "stall_s": t1 - t0,
    "local_s": t2 - t0,
    "all_s": t3 - t0,
    "cpu_s": cpu,
    "peak_extra_bytes": peak - rss_base,
    "maxrss_delta_bytes": m.maxrss_bytes() - maxrss0,
    "peak_method": sampler.method,
    "paired_memcpy_1t_s": memcpy_s,
    "paired_memcpy_mt_s": memcpy_mt_s,
    "paired_persistent_write_s": write_s,
  }


def _pristine(host: str, backup: str) -> None:
  shutil.rmtree(host, ignore_errors=True)
  shutil.copytree(backup, host, symlinks=True)


def _make(args: dict, layout: st.Layout, host: str, persistent: str) -> adapters.Adapter:
  """The job's manager (args["manager"]); ours with args' peer integrity."""
  name = args["manager"]
  extra = {}
  if name == adapters.OURS and args.get("peer_integrity"):
    extra["peer_integrity"] = args["peer_integrity"]
  return adapters.make(name, layout, host, persistent, **extra)


def _timed_restore(
  args: dict,
  layout: st.Layout,
  variant: str,
  wiped: tuple[int, ...],
  original,
  paired_read: tuple[str, np.ndarray] | None = None,
) -> dict:
  """Resets the ramdisks to the saved copies (where a backup exists; the
  others are never modified by a restore), wipes the `wiped` slices'
  ramdisks (and evicts the persistent files for 'persistent_cold'), then
  times a fresh manager from construction to restored, ready arrays.
  `paired_read` = (file, buffer), for 'persistent_cold': first a cold read
  of the process's bytes from that file in the persistent dir, all
  processes at once, just before the restore (its same-job bound)."""
  name = args["manager"]
  host, backup, persistent = _paths(args, name, layout.name)
  if os.path.isdir(backup):
    _pristine(host, backup)
  if layout.slice_index in wiped:
    m.reset_dir(host)
  barrier(f"restore-{variant}-reset")
  evicted = None
  if variant == "persistent_cold" and jax.process_index() == 0:
    evicted = m.evict_tree(persistent)
  cold_read_s = None
  if variant == "persistent_cold" and paired_read is not None:
    m.evict_file(paired_read[0])
    barrier(f"restore-{variant}-paired")
    t0 = m.now()
    m.read_file(*paired_read)
    cold_read_s = m.now() - t0
  had_local = _has_files(host)
  _release_host_buffers()
  barrier(f"restore-{variant}-ready")
  t0 = m.now()
  adapter = _make(args, layout, host, persistent)
  t1 = m.now()
  restored, step, source = adapter.restore()
  jax.block_until_ready(restored)
  t2 = m.now()
  adapter.close()
  bad = st.mismatched_shards(restored, layout, original)
  del restored
  barrier(f"restore-{variant}-done")
  return {
    "variant": variant,
    "step": int(step),
    "source": source,
    "total_s": t2 - t0,
    "construct_s": t1 - t0,
    "restore_call_s": t2 - t1,
    "mismatched_shards": bad,
    "had_local": had_local,
    "evicted_files": evicted,
    "paired_cold_read_s": cold_read_s,
    "phases": getattr(adapter, "phases", None),  # ours: seconds per part of the restore
  }


def _release_host_buffers() -> None:
  """Lets jax release, untimed, the host memory the last restore's arrays
  aliased (their mapping or receive buffer): jax drops its references to
  such buffers only on its next call from Python, so without this the next
  timed restore would pay the last one's unmapping (30-100 ms at 256 MiB on
  the 2-core VM), which a restarted process never has."""
  jax.block_until_ready(jax.device_put(np.zeros(1, np.float32)))


def manager_main(args: dict) -> dict:
  """Layout 2x2 first (so RSS is measured in a fresh process): WARMUP_SAVES
  untimed saves then `reps` timed saves on one manager; then an untimed warm-up round
  and `reps` rounds of three restores (intact, last slice's ramdisks lost,
  persistent with the page cache evicted), each by a fresh manager; leaves
  the 2x2 ramdisks holding the newest step for manager_restart. Layout 4x1:
  one save, then a warm-up and `reps` restores after losing the last slice's
  ramdisk."""
  name = args["manager"]
  if name != adapters.OURS:
    adapters.orbax_prerequisites()
  out: dict = {"pid": jax.process_index(), "layouts": {}}
  out["layouts"]["2x2"] = _main_2x2(args)
  out["layouts"]["4x1"] = _main_4x1(args)
  progress(f"{name}: main job done")
  return _finish(out)


def _setup(args: dict, layout_name: str):
  """(layout, host dir, backup dir, persistent dir, state, record) for one layout."""
  layout = st.make_layout(layout_name, args["mib"])
  host, backup, persistent = _paths(args, args["manager"], layout.name)
  m.reset_dir(host)
  state = st.make_state(layout)
  rec: dict = {"slice": layout.slice_index, "bytes": st.bytes_per_process(state)}
  return layout, host, backup, persistent, state, rec


def _main_4x1(args: dict) -> dict:
  name, reps = args["manager"], args["reps"]
  layout, host, backup, persistent, state, rec = _setup(args, "4x1")
  progress(f"{name} 4x1: save, then {reps} restores after losing slice {layout.num_slices - 1}")
  adapter = _make(args, layout, host, persistent)
  rec["save"] = _timed_save(adapter, step_of(0), state, m.rss_bytes())
  adapter.close()
  lost = (layout.num_slices - 1,)
  if layout.slice_index in lost:  # only the wiped ramdisks need resetting
    shutil.copytree(host, backup, symlinks=True)
  barrier("backup4-done")
  progress(f"{name} 4x1: warm-up restore lose_slice")
  rec["first_restores"] = {"lose_slice": _timed_restore(args, layout, "lose_slice", lost, state)}
  rec["restores"] = {"lose_slice": []}
  for k in range(reps):
    progress(f"{name} 4x1: restore lose_slice ({k + 1}/{reps})")
    rec["restores"]["lose_slice"].append(_timed_restore(args, layout, "lose_slice", lost, state))
  shutil.rmtree(host, ignore_errors=True)
  shutil.rmtree(backup, ignore_errors=True)
  barrier("4x1-done")
  if jax.process_index() == 0:
    shutil.rmtree(os.path.dirname(persistent), ignore_errors=True)
  return rec


def _main_2x2(args: dict) -> dict:
  name, reps = args["manager"], args["reps"]
  layout, host, backup, persistent, state, rec = _setup(args, "2x2")
  progress(f"{name} 2x2: 1 warm-up + {reps} timed saves")
  adapter = _make(args, layout, host, persistent)
  rec["notes"] = dict(adapter.notes)
  rec["threads"] = m.bound_threads()  # of the paired N-thread memcpy
  if hasattr(adapter, "bound"):
    rec["p2p_server"] = adapter.bound
  parts = st.unique_shards(state)
  m.start_threads(m.bound_threads())  # the N-thread memcpy's pool, before the RSS baseline
  paired = (np.ones(sum(p.nbytes for p in parts), np.uint8), parts)  # before the RSS baseline
  paired_file = os.path.join(os.path.dirname(persistent), f"paired_raw_{jax.process_index()}.bin")
  os.makedirs(os.path.dirname(paired_file), exist_ok=True)
  barrier("saves-begin")
  # The documented start-up (latest_step() / restore() first) loads Orbax in
  # the background: library code held once per process, not the save's.
  adapter.latest_step()
  adapter.wait_all()
  rss_base = m.rss_bytes()  # before prepare(): the prepared buffer's pages count as the save's
  # The documented flow: prepare() while the trainer initializes (its wait
  # stands for the compile time before a trainer's first save).
  adapter.prepare()
  adapter.wait_all()
  barrier("saves-prepared")
  saves = [
    _timed_save(adapter, step_of(k), state, rss_base, paired, paired_file)
    for k in range(WARMUP_SAVES + reps)
  ]
  paired_read = (paired_file, paired[0])
  del paired
  adapter.close()
  rec["rss_base_bytes"] = rss_base
  rec["warmup_save"], rec["warmup_saves"] = saves[0], saves[:WARMUP_SAVES]
  rec["saves"] = saves[WARMUP_SAVES:]
  shutil.copytree(host, backup, symlinks=True)
  barrier("backup-done")
  wipes = {"intact": (), "lose_slice": (layout.num_slices - 1,)}
  wipes["persistent_cold"] = tuple(range(layout.num_slices))
  # One untimed round first: the first restore in a process also compiles
  # (broadcast / peer transfer), which would land on whichever variant ran
  # first. Restart jobs measure that cold path end to end.
  rec["first_restores"] = {}
  for variant in VARIANTS:
    progress(f"{name} 2x2: warm-up restore {variant}")
    rec["first_restores"][variant] = _timed_restore(
      args, layout, variant, wipes[variant], state, paired_read
    )
  rec["restores"] = {v: [] for v in VARIANTS}
  for k in range(reps):
    for variant in VARIANTS:
      progress(f"{name} 2x2: restore {variant} ({k + 1}/{reps})")
      rec["restores"][variant].append(
        _timed_restore(args, layout, variant, wipes[variant], state, paired_read)
      )
  os.remove(paired_file)
  _pristine(host, backup)  # what manager_restart restores
  shutil.rmtree(backup)
  barrier("2x2-done")
  return rec


def manager_restart(args: dict) -> dict:
  """A restarted job: from process spawn (the launcher's timestamp) through
  imports, jax.distributed init, manager construction and restore of the
  intact 2x2 ramdisk copies, to restored, ready arrays."""
  ready_s = time.time() - _spawn_time()
  name = args["manager"]
  t0 = time.perf_counter()
  layout = st.make_layout("2x2", args["mib"])
  host, _, persistent = _paths(args, name, layout.name)
  progress(f"{name}: restart job restoring")
  t1 = time.perf_counter()
  adapter = _make(args, layout, host, persistent)
  t2 = time.perf_counter()
  restored, step, source = adapter.restore()
  jax.block_until_ready(restored)
  t3 = time.perf_counter()
  restored_s = time.time() - _spawn_time()
  adapter.close()
  return _finish(
    {
      "pid": jax.process_index(),
      "slice": layout.slice_index,
      "ready_s": ready_s,
      "restored_s": restored_s,
      "after_ready": {"layout_s": t1 - t0, "construct_s": t2 - t1, "restore_s": t3 - t2},
      "step": int(step),
      "source": source,
      "mismatched_shards": st.mismatched_shards(restored, layout),
    }
  )
