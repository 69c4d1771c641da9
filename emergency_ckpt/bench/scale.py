"""Scale benchmark: the exchange and the restore planner as curves over the process count.

  python -m emergency_ckpt.bench.scale [--ks 16,64,256,1024,2048] [--max-k N] [--reps R]
                                       [--planner-processes 1024,4096,16384] [--out DIR]
  (or `emergency-ckpt bench --scale`)

Stages, each a curve over the process count K:
  exchange      the library's own `topology.Collectives.exchange` (not a model
                of it) against a real JAX coordination service on 127.0.0.1 with
                K simulated processes: one service client per process, one
                thread per process, all in this Python program. Each process
                exchanges a realistic inventory JSON (restore_plan.Inventory, a
                few step numbers and a host id). Per K: wall time of one exchange
                (all K threads wait on one start event; the time runs from its
                release to the last thread's return; median over --reps after
                one untimed warm-up), each process's CPU time in it (thread
                time: what one process of a real job spends), calls to the
                coordination service per process per exchange and bytes
                received per process (counted by a thin wrapper around each
                client). The GIL's switch interval is 50 ms meanwhile (at 5 ms,
                K waiting threads multiply the CPU spent).
  exchange_old  the previous algorithm, for contrast (set own key, then one
                blocking_key_value_get per process: N+1 calls each, N^2 on the
                service), re-implemented here as it was before the change to
                three calls; run for K <= --old-max-k only.
  planner       the pure restore planner at --planner-processes processes x
                --planner-slices slices x --planner-steps committed steps:
                Inventory.from_json of every process's exchanged inventory, then
                restore_plan.candidates + decide for the newest candidate (the
                restore's planning path; target under 100 ms at 16,384), and the
                tracemalloc peak per process.

Each stage's growth exponent is fitted (least squares of log time on log K
over K >= 64) and extrapolated to K = 16,384. Threads share one GIL, so an
exchange's wall time here is about K x one process's CPU time (every process
decodes K inventories, one after another): pessimistic; compare curves of one
run.

Writes <out>/scale.json, <out>/scale.md and <out>/scale.png (only when
matplotlib is installed: it is not a dependency of the package) and prints the
table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from emergency_ckpt import restore_plan

DEFAULT_KS = (16, 64, 256, 1024, 2048)
DEFAULT_MAX_K = 2048
DEFAULT_REPS = 3
DEFAULT_OLD_MAX_K = 256
DEFAULT_PLANNER_PROCESSES = (1024, 4096, 16384)
DEFAULT_PLANNER_SLICES = 64
DEFAULT_PLANNER_STEPS = 50
PROCESSES_PER_SLICE = 16  # the exchange's simulated topology
STEP_EVERY = 100
FIT_MIN_K = 64
EXTRAPOLATE_K = 16_384
PLANNER_TARGET_S = 0.1
NEW_CALLS = 3  # what Collectives.exchange promises per process, whatever K
SWITCH_INTERVAL_S = 0.05  # the GIL's, while simulated processes run (default 0.005)

_T0 = time.monotonic()


def progress(msg: str) -> None:
  print(f"[scale {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- simulated processes ------------------------------------------------------------------------
class CountingClient:
  """Forwards every method call to a coordination-service client, counting
  calls, bytes sent (str/bytes arguments) and received (return values), and
  seconds per method. One per simulated process, used by its thread only."""

  def __init__(self, client: Any):
    self._client = client
    self.reset()

  def reset(self) -> None:
    self.calls: Counter[str] = Counter()
    self.seconds: Counter[str] = Counter()
    self.bytes_sent = 0
    self.bytes_received = 0

  def __getattr__(self, name: str) -> Any:
    attr = getattr(self._client, name)
    if not callable(attr):
      return attr

    def call(*args, **kwargs):
      self.calls[name] += 1
      self.bytes_sent += sum(_size(a) for a in args)
      t0 = time.perf_counter()
      try:
        out = attr(*args, **kwargs)
      finally:
        self.seconds[name] += time.perf_counter() - t0
      self.bytes_received += _size(out)
      return out

    return call


def _size(value: Any) -> int:
  """Bytes of a call's strings (characters: keys and JSON values are ASCII)."""
  if isinstance(value, (str, bytes)):
    return len(value)
  if isinstance(value, (list, tuple)):
    return sum(map(_size, value))
  return 0


class _PerProcessSequences:
  """Stands in for topology._SEQUENCES while simulated processes run: the
  library numbers exchanges with one table per OS process, and here K
  processes share one, so each simulated process (named by its thread) gets
  its own table. Only the key numbering changes; Collectives.exchange runs
  unmodified."""

  def __init__(self):
    self._tables: dict[int, dict] = {}
    self._local = threading.local()

  def bind(self, process: int) -> None:
    self._local.process = process

  def setdefault(self, key, default):  # called under topology._SEQ_LOCK
    return self._tables.setdefault(self._local.process, {}).setdefault(key, default)


@contextlib.contextmanager
def _simulated_sequences():
  from emergency_ckpt import topology  # noqa: PLC0415 - pulls in JAX

  saved, seqs = topology._SEQUENCES, _PerProcessSequences()  # noqa: SLF001
  topology._SEQUENCES = seqs  # noqa: SLF001
  try:
    yield seqs
  finally:
    topology._SEQUENCES = saved  # noqa: SLF001


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_threads(
  k: int, fn: Callable[[int], Any], timeout_s: float, name: str
) -> tuple[float, list[float], list[Any]]:
  """Runs fn(i) for i < k, one thread each, all released by one start event:
  (seconds from the release to the last return, each thread's CPU seconds in
  fn, results).
  Raises the first thread's error, or TimeoutError if a thread outlives
  `timeout_s`."""
  start = threading.Event()
  ends = [0.0] * k
  cpu = [0.0] * k
  results: list[Any] = [None] * k
  errors: list[BaseException | None] = [None] * k

  def body(i: int) -> None:
    if not start.wait(timeout_s):
      errors[i] = TimeoutError("never released")
      return
    c0 = time.thread_time()
    try:
      results[i] = fn(i)
    except BaseException as e:  # noqa: BLE001 - reported below, by process
      errors[i] = e
    ends[i] = time.perf_counter()
    cpu[i] = time.thread_time() - c0

  threads = [threading.Thread(target=body, args=(i,), name=f"{name}-{i}") for i in range(k)]
  for t in threads:
    t.start()
  t0 = time.perf_counter()
  start.set()
  deadline = time.monotonic() + timeout_s
  for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
  alive = [i for i, t in enumerate(threads) if t.is_alive()]
  if alive:
    raise TimeoutError(f"{name}: processes {alive[:10]} still running after {timeout_s:.0f}s")
  bad = [(i, e) for i, e in enumerate(errors) if e is not None]
  if bad:
    i, e = bad[0]
    raise RuntimeError(f"{name}: process {i} (and {len(bad) - 1} more) failed: {e!r}") from e
  return max(ends) - t0, cpu, results


class Simulation:
  """A coordination service on 127.0.0.1 and K connected clients (wrapped in
  CountingClient), with the topology of K processes in slices of 16."""

  def __init__(self, k: int, timeout_s: float):
    from jax._src.lib import _jax  # noqa: PLC0415 - only the benchmark needs it

    self.k, self.timeout_s = k, timeout_s
    self.address = f"127.0.0.1:{_free_port()}"
    self._service = _jax.get_distributed_runtime_service(self.address, k)
    raw: list[Any] = [None] * k
    timeout = int(timeout_s)

    def connect(i: int) -> None:  # blocks until every client has registered
      client = _jax.get_distributed_runtime_client(
        self.address, i, init_timeout=timeout, shutdown_timeout=timeout
      )
      raw[i] = client
      client.connect()

    try:
      self.connect_s, _, _ = _run_threads(k, connect, timeout_s, f"connect-k{k}")
    except BaseException:
      self._raw = [c for c in raw if c is not None]
      self.close()
      raise
    self._raw = raw
    self.clients = [CountingClient(c) for c in raw]
    per = min(PROCESSES_PER_SLICE, k)
    self.slice_processes = tuple(tuple(range(s, min(s + per, k))) for s in range(0, k, per))

  def topology(self, i: int):
    from emergency_ckpt.topology import Topology  # noqa: PLC0415

    per = len(self.slice_processes[0])
    return Topology(
      process_index=i,
      process_count=self.k,
      slice_index=i // per,
      slice_processes=self.slice_processes,
      replica_axis_index=0,
      replica_axis_name="replica",
      mesh_shape=(len(self.slice_processes), per * 4),
      mesh_axis_names=("replica", "data"),
    )

  def close(self) -> float:
    """Shuts every client down (in threads: client shutdown is a barrier over
    all of them), then the service; the seconds it took."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_quiet_shutdown, args=(c,)) for c in self._raw]
    for t in threads:
      t.start()
    deadline = time.monotonic() + self.timeout_s
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
      progress(f"K={self.k}: {stuck} client shutdowns still running; shutting the service down")
    _quiet_shutdown(self._service)
    self._raw, self.clients = [], []
    return time.perf_counter() - t0


def _quiet_shutdown(obj: Any) -> None:
  try:
    obj.shutdown()
  except Exception as e:  # noqa: BLE001 - best effort at the end of a run
    progress(f"shutdown: {e}")


def inventory_payload(process: int, slice_index: int) -> dict[str, Any]:
  """What one process sends in a restore's inventory exchange: its newest
  local steps and host id (the primary also lists the shared tiers)."""
  newest = 50 * STEP_EVERY
  local = tuple(range(newest - 4 * STEP_EVERY, newest + 1, STEP_EVERY))
  primary = process == 0
  digest = hashlib.sha256(f"host-{process // 4}".encode()).hexdigest()
  host = f"boot:{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
  rejected = {local[0] - STEP_EVERY: "checksum mismatch in shard 3"} if process % 8 == 7 else {}
  return restore_plan.Inventory(
    process=process,
    slice=slice_index,
    local_steps=local,
    local_rejected=rejected,
    persistent_steps=tuple(range(STEP_EVERY * 10, newest + 1, STEP_EVERY * 10))
    if primary
    else None,
    state_steps=tuple(range(STEP_EVERY, newest + 1, STEP_EVERY)) if primary else None,
    host=host,
  ).to_json()


def old_exchange(client: Any, key: str, me: int, procs: Sequence[int], payload: Any, timeout_s):
  """The previous Collectives.exchange (before the three-call version): set
  its own key, then one blocking get per process, in order, against one
  deadline. Re-implemented here as the baseline; not library code."""
  client.key_value_set(f"{key}/{me}", json.dumps(payload, sort_keys=True))
  deadline = time.monotonic() + timeout_s
  out = {}
  for p in procs:
    remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
    out[p] = json.loads(client.blocking_key_value_get(f"{key}/{p}", max(remaining_ms, 1)))
  return out


def _round_stats(sim: Simulation, wall_s: float, cpu: list[float]) -> dict[str, Any]:
  calls = [sum(c.calls.values()) for c in sim.clients]
  by_method = Counter()
  for c in sim.clients:
    by_method.update(c.calls)
  seconds = {m: statistics.median(c.seconds[m] for c in sim.clients) for m in sorted(by_method)}
  return {
    "wall_s": wall_s,
    "cpu_s": statistics.median(cpu),
    "calls_min": min(calls),
    "calls_max": max(calls),
    "calls_by_method": {m: n / sim.k for m, n in sorted(by_method.items())},
    "bytes_received": statistics.median(c.bytes_received for c in sim.clients),
    "bytes_sent": statistics.median(c.bytes_sent for c in sim.clients),
    "method_s_median": seconds,
  }


def _exchange_point(
  sim: Simulation, rounds: list[dict[str, Any]], payload_bytes: list[int]
) -> dict[str, Any]:
  timed = rounds[1:]  # the first round is the warm-up
  walls = [r["wall_s"] for r in timed]
  methods = sorted({m for r in timed for m in r["method_s_median"]})
  return {
    "k": sim.k,
    "wall_s": statistics.median(walls),
    "wall_s_reps": walls,
    "warmup_s": rounds[0]["wall_s"],
    "cpu_s_per_process": statistics.median(r["cpu_s"] for r in timed),
    "calls_per_process": timed[0]["calls_max"],
    "calls_per_process_min": min(r["calls_min"] for r in rounds),
    "calls_per_process_max": max(r["calls_max"] for r in rounds),
    "calls_by_method": timed[0]["calls_by_method"],
    "bytes_received_per_process": statistics.median(r["bytes_received"] for r in timed),
    # what the one service sends per exchange, all processes together
    "service_bytes_sent": sim.k * statistics.median(r["bytes_received"] for r in timed),
    "bytes_sent_per_process": statistics.median(r["bytes_sent"] for r in timed),
    "payload_bytes_mean": sum(payload_bytes) / len(payload_bytes),
    "method_s_median": {
      m: statistics.median(r["method_s_median"].get(m, 0.0) for r in timed) for m in methods
    },
    "connect_s": sim.connect_s,
  }


@contextlib.contextmanager
def _switch_interval(seconds: float):
  """A longer GIL switch interval while K threads run: at the default 5 ms,
  waiting threads wake so often that contention multiplies the CPU spent
  (4x at K = 1,024 on 2 cores), an artifact of simulating K processes in one
  interpreter, each of which has a GIL of its own in a real job."""
  saved = sys.getswitchinterval()
  sys.setswitchinterval(seconds)
  try:
    yield
  finally:
    sys.setswitchinterval(saved)


def measure_exchange(k: int, reps: int, run_old: bool, timeout_s: float) -> dict[str, Any]:
  """Both exchange algorithms at K simulated processes, against one service."""
  with _switch_interval(SWITCH_INTERVAL_S):
    return _measure_exchange(k, reps, run_old, timeout_s)


def _measure_exchange(k: int, reps: int, run_old: bool, timeout_s: float) -> dict[str, Any]:
  from emergency_ckpt.topology import Collectives  # noqa: PLC0415

  sim = Simulation(k, timeout_s)
  progress(f"K={k}: {k} clients connected in {sim.connect_s:.2f}s")
  out: dict[str, Any] = {}
  try:
    with _simulated_sequences() as seqs:
      colls = [
        Collectives(sim.topology(i), namespace=f"scale-k{k}", timeout_s=timeout_s, client=c)
        for i, c in enumerate(sim.clients)
      ]
      payloads = [inventory_payload(i, i // len(sim.slice_processes[0])) for i in range(k)]
      sizes = [len(json.dumps(p, sort_keys=True)) for p in payloads]
      checked: list[Any] = []

      def new(i: int) -> bool:
        seqs.bind(i)
        got = colls[i].exchange("inventory", payloads[i])
        if i == 0:
          checked.append(got)
        return len(got) == k and got[k - 1] == payloads[k - 1] and got[i] == payloads[i]

      rounds = []
      for rep in range(reps + 1):
        for c in sim.clients:
          c.reset()
        wall, cpu, ok = _run_threads(k, new, timeout_s, f"exchange-k{k}")
        if not all(ok) or checked[-1] != dict(enumerate(payloads)):
          raise AssertionError(f"K={k}: an exchange returned wrong values")
        checked.clear()
        rounds.append(_round_stats(sim, wall, cpu))
        label = "warm-up" if rep == 0 else f"rep {rep}"
        progress(
          f"K={k}: exchange {label}: {wall:.3f}s, CPU per process {_secs(rounds[-1]['cpu_s'])}"
        )
      out["exchange"] = _exchange_point(sim, rounds, sizes)

      if run_old:
        procs = list(range(k))
        rounds = []
        for rep in range(reps + 1):
          key = f"emergency_ckpt/scale-old-k{k}/inventory/{rep}"

          def old(i: int, key=key) -> bool:
            got = old_exchange(sim.clients[i], key, i, procs, payloads[i], timeout_s)
            return len(got) == k and got[k - 1] == payloads[k - 1]

          for c in sim.clients:
            c.reset()
          wall, cpu, ok = _run_threads(k, old, timeout_s, f"old-exchange-k{k}")
          if not all(ok):
            raise AssertionError(f"K={k}: an old-algorithm exchange returned wrong values")
          rounds.append(_round_stats(sim, wall, cpu))
          label = "warm-up" if rep == 0 else f"rep {rep}"
          progress(f"K={k}: old algorithm {label}: {wall:.3f}s")
        out["exchange_old"] = _exchange_point(sim, rounds, sizes)
  finally:
    shutdown_s = sim.close()
    progress(f"K={k}: service and clients shut down in {shutdown_s:.2f}s")
  for point in out.values():
    point["shutdown_s"] = shutdown_s
  return out


# ---- planner --------------------------------------------------------------------------------------
def planner_inputs(processes: int, slices: int, steps: int):
  """(every process's exchanged inventory JSON, slice_processes, expected).

  Every process holds every committed step in its local tier, except one
  process in each slice s with s % 16 == 5, which lost the newest 3 steps,
  and one in each slice s % 16 == 9, which lost a step in the middle. The
  primary lists all `steps` committed state steps and every 10th step in the
  persistent tier. Expected: the newest step, restored locally by every
  slice but those with s % 16 == 5, which get it from a peer."""
  slices = min(slices, processes)
  if processes % slices:
    raise ValueError(f"{processes} processes do not split into {slices} equal slices")
  per = processes // slices
  all_steps = tuple(range(STEP_EVERY, STEP_EVERY * steps + 1, STEP_EVERY))
  damaged = min(2, per - 1)  # which process of a slice lost steps
  encoded = []
  for p in range(processes):
    s, j = divmod(p, per)
    local = all_steps
    if j == damaged and s % 16 == 5:
      local = all_steps[:-3]
    elif j == damaged and s % 16 == 9:
      local = all_steps[: steps // 2] + all_steps[steps // 2 + 1 :]
    inv = restore_plan.Inventory(
      process=p,
      slice=s,
      local_steps=local,
      persistent_steps=all_steps[9::10] if p == 0 else None,
      state_steps=all_steps if p == 0 else None,
      host=f"boot:{hashlib.sha256(str(p // 4).encode()).hexdigest()[:32]}",
    )
    encoded.append(json.dumps(inv.to_json(), sort_keys=True))
  slice_processes = tuple(tuple(range(s * per, (s + 1) * per)) for s in range(slices))
  peer = tuple(s for s in range(slices) if s % 16 == 5)
  local_slices = tuple(s for s in range(slices) if s not in peer)
  expected = {
    "newest_step": all_steps[-1],
    "candidates": steps,
    "local_slices": len(local_slices),
    "peer_slices": len(peer),
    "peer_source": local_slices[0] if peer else None,
    "in_persistent": all_steps[-1] in all_steps[9::10],
  }
  return encoded, slice_processes, expected


def _plan(encoded: list[str], slice_processes, statuses):
  t0 = time.perf_counter()
  invs = [restore_plan.Inventory.from_json(json.loads(e)) for e in encoded]
  t1 = time.perf_counter()
  cands = restore_plan.candidates(invs, slice_processes)
  t2 = time.perf_counter()
  plan = restore_plan.decide(cands[0], statuses, slice_processes) if cands else None
  t3 = time.perf_counter()
  return {"parse_s": t1 - t0, "candidates_s": t2 - t1, "decide_s": t3 - t2}, cands, plan


def measure_planner(processes: int, slices: int, steps: int, reps: int) -> dict[str, Any]:
  encoded, slice_processes, expected = planner_inputs(processes, slices, steps)
  ok = restore_plan.Status(local_ok=True, state_ok=True)
  statuses = dict.fromkeys(range(processes), ok)
  runs = []
  for _ in range(reps):
    gc.collect()
    times, cands, plan = _plan(encoded, slice_processes, statuses)
    runs.append(times)
  newest = cands[0] if cands else None
  got = {
    "newest_step": newest.step if newest else None,
    "candidates": len(cands),
    "local_slices": len(newest.local_slices) if newest else None,
    "peer_slices": plan.sources.count(restore_plan.PEER) if plan else None,
    "peer_source": plan.peer_source if plan else None,
    "in_persistent": newest.in_persistent if newest else None,
  }
  # Memory: inventories parsed from JSON, then candidates + decide, under
  # tracemalloc (the encoded JSON, the exchange's output, is the baseline).
  del cands, plan
  gc.collect()
  tracemalloc.start()
  try:
    base = tracemalloc.get_traced_memory()[0]
    invs = [restore_plan.Inventory.from_json(json.loads(e)) for e in encoded]
    held = tracemalloc.get_traced_memory()[0] - base
    cands = restore_plan.candidates(invs, slice_processes)
    restore_plan.decide(cands[0], statuses, slice_processes)
    peak = tracemalloc.get_traced_memory()[1] - base
  finally:
    tracemalloc.stop()
  del invs, cands

  def med(key: str) -> float:
    return statistics.median(r[key] for r in runs)

  return {
    "k": processes,
    "slices": len(slice_processes),
    "steps": steps,
    "wall_s": med("candidates_s") + med("decide_s"),
    "candidates_s": med("candidates_s"),
    "decide_s": med("decide_s"),
    "parse_s": med("parse_s"),
    "reps": runs,
    "inventory_json_bytes_mean": sum(len(e) for e in encoded) / processes,
    "inventories_bytes": held,
    "tracemalloc_peak_bytes": peak,
    "peak_bytes_per_process": peak / processes,
    "result": got,
    "expected": expected,
    "correct": got == expected,
  }


# ---- fits, report ---------------------------------------------------------------------------------
def fit(
  points: Sequence[dict[str, Any]], key: str = "wall_s", min_k: int = FIT_MIN_K
) -> dict[str, Any]:
  """Least squares of log(point[key]) on log(k) over k >= min_k, extrapolated
  to EXTRAPOLATE_K; exponent None with fewer than two such sizes."""
  import numpy as np  # noqa: PLC0415

  used = [p for p in points if p["k"] >= min_k and p.get(key)]
  out: dict[str, Any] = {"of": key, "min_k": min_k, "ks": [p["k"] for p in used]}
  if len(used) < 2:
    return dict(out, exponent=None, extrapolated_k=EXTRAPOLATE_K, extrapolated_s=None)
  x = np.log([p["k"] for p in used])
  y = np.log([p[key] for p in used])
  b, a = np.polyfit(x, y, 1)
  return dict(
    out,
    exponent=float(b),
    extrapolated_k=EXTRAPOLATE_K,
    extrapolated_s=float(np.exp(a + b * np.log(EXTRAPOLATE_K))),
  )


STAGE_LABELS = {
  "exchange": "exchange: Collectives.exchange (set + barrier + directory get)",
  "exchange_old": "exchange, OLD algorithm (set + one blocking get per process)",
  "planner": "planner: restore_plan.candidates + decide (newest candidate)",
}


def _secs(v: float | None) -> str:
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


def _growth_rows(stages: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
  rows = []
  for stage in stages.values():
    rows.append((stage["label"] + ": wall time", stage["fit"]))
    if "fit_cpu" in stage:
      rows.append((stage["label"] + ": CPU per process", stage["fit_cpu"]))
  return rows


def render_markdown(doc: dict[str, Any]) -> str:
  cfg, stages = doc["config"], doc["stages"]
  new = {p["k"]: p for p in stages["exchange"]["points"]}
  old = {p["k"]: p for p in stages["exchange_old"]["points"]}
  argv = " ".join(["python -m emergency_ckpt.bench.scale", *cfg["argv"]])
  lines = [
    "# Scale benchmark: exchange and restore planner over the process count",
    "",
    f"Run {cfg['started_at']} on {cfg['cpus']} CPUs (load average before:"
    f" {cfg['loadavg_before']}, after: {doc['loadavg_after']}); jax {cfg['versions']['jax']};"
    f" {doc['wall_s']:.0f} s in all. Command: `{argv}`.",
    "",
    "## Exchange: K simulated processes against one real JAX coordination service",
    "",
    "One client and one thread per simulated process, all in one Python program on"
    f" 127.0.0.1 (GIL switch interval {cfg['switch_interval_s'] * 1000:.0f} ms)."
    f" Payload: an inventory JSON of {_payload(stages)} bytes on average. Time: from the"
    f" release of one start event to the last process's return, median of {cfg['reps']}"
    " after one warm-up; it is the work of all K processes and the service on this"
    " machine's cores, so it is pessimistic. CPU/process: the median thread CPU time of"
    " one process's exchange (decoding K inventories, its gRPC calls; some GIL"
    " contention left), closer to what each process of a real job spends. Calls and"
    " bytes received: per process per exchange, counted by a wrapper around each"
    " client. New = the library's `Collectives.exchange`; old = the previous algorithm"
    f" (set + one blocking get per process), re-implemented in the benchmark, K <="
    f" {cfg['old_max_k']} only.",
    "",
    "| K | new: time | new: CPU/process | new: calls/process | new: received/process"
    " | new: service sends | new: set / barrier / dir get (median per process, GIL waits"
    " included) | old: time | old: CPU/process | old: calls/process | connect K clients |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for k in sorted(new):
    p, o = new[k], old.get(k)
    m = p["method_s_median"]
    split = " / ".join(
      _secs(m.get(n)) for n in ("key_value_set", "wait_at_barrier", "key_value_dir_get")
    )
    lines.append(
      f"| {k:,} | {_secs(p['wall_s'])} | {_secs(p['cpu_s_per_process'])} | {_calls(p)}"
      f" | {_kib(p['bytes_received_per_process'])}"
      f" | {p['service_bytes_sent'] / 2**20:,.1f} MiB | {split}"
      f" | {_secs(o['wall_s']) if o else '-'} | {_secs(o['cpu_s_per_process']) if o else '-'}"
      f" | {_calls(o) if o else '-'} | {_secs(p['connect_s'])} |"
    )
  pl = stages["planner"]["points"]
  lines += [
    "",
    f"## Restore planner ({pl[0]['slices'] if pl else '?'} slices x"
    f" {pl[0]['steps'] if pl else '?'} committed steps)",
    "",
    "Every process's inventory parsed from its exchanged JSON (`Inventory.from_json`),"
    " then `restore_plan.candidates` (all committed steps) and `decide` for the newest"
    f" candidate; median of {cfg['planner_reps']}. Target for candidates + decide:"
    f" under {PLANNER_TARGET_S * 1000:.0f} ms. Memory: tracemalloc peak of parse +"
    " candidates + decide above the exchanged JSON.",
    "",
    "| processes | parse inventories | candidates | decide | candidates + decide"
    " | peak memory | per process | newest step (local / peer slices) | correct |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
  ]
  for p in pl:
    r = p["result"]
    lines.append(
      f"| {p['k']:,} | {_secs(p['parse_s'])} | {_secs(p['candidates_s'])}"
      f" | {_secs(p['decide_s'])} | {_secs(p['wall_s'])}"
      f" | {p['tracemalloc_peak_bytes'] / 2**20:,.1f} MiB"
      f" | {p['peak_bytes_per_process']:,.0f} B | {r['newest_step']}"
      f" ({r['local_slices']} / {r['peer_slices']}) | {'yes' if p['correct'] else 'NO'} |"
    )
  lines += [
    "",
    f"## Growth (least squares of log time on log K over K >= {FIT_MIN_K})",
    "",
    f"| stage | exponent | sizes fitted | extrapolated to K = {EXTRAPOLATE_K:,} |",
    "| --- | ---: | --- | ---: |",
  ]
  for label, f in _growth_rows(stages):
    exp = "n/a" if f["exponent"] is None else f"{f['exponent']:.2f}"
    ks = ", ".join(f"{k:,}" for k in f["ks"]) or "-"
    lines.append(f"| {label} | {exp} | {ks} | {_secs(f['extrapolated_s'])} |")
  if doc.get("notes"):
    lines += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
  return "\n".join(lines) + "\n"


def _payload(stages) -> str:
  pts = stages["exchange"]["points"]
  return f"{pts[0]['payload_bytes_mean']:.0f}" if pts else "?"


def _calls(p: dict[str, Any]) -> str:
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


def _service_bytes_at(points: Sequence[dict[str, Any]], k: int) -> str:
  """K^2 entries of the measured size per entry (key + value), as text."""
  if not points:
    return "?"
  last = max(points, key=lambda p: p["k"])
  per_entry = last["bytes_received_per_process"] / last["k"]
  return f"{k * k * per_entry / 2**30:,.0f} GiB"


# ---- main -----------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
  try:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or values[0] < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m emergency_ckpt.bench.scale",
    description=__doc__.split("\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__.split("\n", 2)[2],
  )
  p.add_argument("--ks", type=_int_list, default=list(DEFAULT_KS), help="process counts")
  p.add_argument("--max-k", type=int, default=DEFAULT_MAX_K, help="drop larger --ks")
  p.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed exchanges per K")
  p.add_argument(
    "--old-max-k", type=int, default=DEFAULT_OLD_MAX_K, help="largest K for the old algorithm"
  )
  p.add_argument(
    "--planner-processes",
    type=_int_list,
    default=list(DEFAULT_PLANNER_PROCESSES),
    help="process counts for the planner",
  )
  p.add_argument("--planner-slices", type=int, default=DEFAULT_PLANNER_SLICES)
  p.add_argument("--planner-steps", type=int, default=DEFAULT_PLANNER_STEPS)
  p.add_argument("--planner-reps", type=int, default=3)
  p.add_argument("--timeout", type=float, default=300.0, help="seconds per exchange round")
  p.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
  args = p.parse_args(argv)
  args.ks = [k for k in args.ks if k <= args.max_k]
  if not args.ks:
    p.error(f"no process count in --ks is <= --max-k {args.max_k}")
  if args.reps < 1 or args.planner_reps < 1:
    p.error("--reps and --planner-reps must be >= 1")
  if args.planner_steps < 1 or args.planner_slices < 1:
    p.error("--planner-steps and --planner-slices must be >= 1")
  for n in args.planner_processes:
    if n % min(args.planner_slices, n):
      p.error(f"--planner-processes {n} does not split into {args.planner_slices} equal slices")
  return args


def _versions() -> dict[str, str]:
  out = {"python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "numpy"):
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = "?"
  return out


def _loadavg() -> list[float] | None:
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except OSError:
    return None


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  config = {
    "argv": list(argv),
    "ks": args.ks,
    "reps": args.reps,
    "old_max_k": args.old_max_k,
    "planner_processes": args.planner_processes,
    "planner_slices": args.planner_slices,
    "planner_steps": args.planner_steps,
    "planner_reps": args.planner_reps,
    "processes_per_slice": PROCESSES_PER_SLICE,
    "switch_interval_s": SWITCH_INTERVAL_S,
    "cpus": os.cpu_count(),
    "versions": _versions(),
    "started_at": started,
    "loadavg_before": _loadavg(),
  }
  stages: dict[str, dict[str, Any]] = {
    name: {"label": STAGE_LABELS[name], "points": []} for name in STAGE_LABELS
  }
  stages["exchange_old"]["algorithm"] = "old: set + N blocking gets (re-implemented, not library)"
  stages["exchange"]["algorithm"] = "new: emergency_ckpt.topology.Collectives.exchange"
  for k in args.ks:
    got = measure_exchange(k, args.reps, k <= args.old_max_k, args.timeout)
    for name, point in got.items():
      stages[name]["points"].append(point)
    gc.collect()
  for n in args.planner_processes:
    progress(
      f"planner: {n:,} processes x {args.planner_slices} slices x {args.planner_steps} steps"
    )
    point = measure_planner(n, args.planner_slices, args.planner_steps, args.planner_reps)
    progress(
      f"planner: {n:,} processes: candidates + decide {_secs(point['wall_s'])},"
      f" peak {point['peak_bytes_per_process']:,.0f} B/process, correct={point['correct']}"
    )
    stages["planner"]["points"].append(point)
  for name, stage in stages.items():
    stage["fit"] = fit(stage["points"])
    if name.startswith("exchange"):
      stage["fit_cpu"] = fit(stage["points"], "cpu_s_per_process")
  calls = {
    p["k"]: (p["calls_per_process_min"], p["calls_per_process_max"])
    for p in stages["exchange"]["points"]
  }
  stages["exchange"]["calls_constant"] = all(c == (NEW_CALLS, NEW_CALLS) for c in calls.values())
  biggest = max(stages["planner"]["points"], key=lambda p: p["k"])
  stages["planner"]["target_s"] = PLANNER_TARGET_S
  stages["planner"]["meets_target_at_largest"] = biggest["wall_s"] < PLANNER_TARGET_S
  notes = [
    "Calls per process per exchange, new algorithm: "
    + ", ".join(f"K={p['k']}: {_calls(p)}" for p in stages["exchange"]["points"]),
    "Bytes received per process grow linearly with K in both algorithms (every process"
    " receives every process's inventory): the one service sends K^2 inventories per"
    f" exchange, {_service_bytes_at(stages['exchange']['points'], EXTRAPOLATE_K)} at"
    f" K = {EXTRAPOLATE_K:,}.",
    "Wall time here is close to K x CPU/process: the K simulated processes decode their"
    " K inventories each under one GIL, one after another; in a real job each process"
    " decodes on its own host, so its latency is nearer the service's time plus its own"
    " CPU/process.",
  ]
  if not stages["planner"]["meets_target_at_largest"]:
    notes.append(
      f"planner at {biggest['k']:,} processes: candidates + decide took"
      f" {_secs(biggest['wall_s'])}, over the {PLANNER_TARGET_S * 1000:.0f} ms target."
    )
  return {
    "config": config,
    "stages": stages,
    "notes": notes,
    "loadavg_after": _loadavg(),
    "wall_s": time.monotonic() - _T0,
  }


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  progress(
    f"exchange at K={args.ks} ({args.reps} reps, old algorithm up to K={args.old_max_k});"
    f" planner at {args.planner_processes} processes"
  )
  doc = run(args, argv)
  json_path = os.path.join(args.out, "scale.json")
  with open(json_path, "w") as f:
    json.dump(doc, f, indent=1)
  md = render_markdown(doc)
  with open(os.path.join(args.out, "scale.md"), "w") as f:
    f.write(md)
  why = write_png(doc, os.path.join(args.out, "scale.png"))
  print(md)
  for label, f in _growth_rows(doc["stages"]):
    exp = "n/a" if f["exponent"] is None else f"{f['exponent']:.2f}"
    print(
      f"{label}: growth exponent {exp} over K={f['ks']}; extrapolated to"
      f" K={EXTRAPOLATE_K:,}: {_secs(f['extrapolated_s'])}"
    )
  if why:
    print(f"note: {why}")
  print(f"wrote {json_path}, scale.md" + ("" if why else ", scale.png") + f" in {args.out}")
  planner_ok = all(p["correct"] for p in doc["stages"]["planner"]["points"])
  return 0 if planner_ok else 1


if __name__ == "__main__":
  sys.exit(main())
