"""The scale benchmark's exchange stage: the library's own inventory exchange
(inventory.gather: a Collectives.gather_tree) against a real JAX coordination
service with K simulated processes (one client each, counted, one thread
each: in P worker processes of K/P threads, or all in this program), beside
the all-gather exchange (Collectives.exchange: every process receives every
inventory) and the algorithm before it (one blocking get per process), for
contrast.

Workers: spawned per K (no fork: the service's gRPC threads run here), each
holds a ClientGroup of consecutive processes and answers commands on a
pipe; one multiprocessing Event releases every worker's threads at once.
The wall time runs from that release (time.perf_counter in this process) to
the last thread's return in any worker: perf_counter is CLOCK_MONOTONIC,
one clock for every process of the machine."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.scale_planner import STEP_EVERY
from benchmarks.scale_report import fmt_secs
from emergency_ckpt.restore import summary as restore_summary

PROCESSES_PER_SLICE = 16  # the exchange's simulated topology
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

  def stats(self) -> dict[str, Any]:
    """Counts since the last reset (picklable)."""
    return {
      "calls": dict(self.calls),
      "seconds": dict(self.seconds),
      "bytes_sent": self.bytes_sent,
      "bytes_received": self.bytes_received,
    }


def _size(value: Any) -> int:
  """Bytes of a call's strings (characters: keys and JSON values are ASCII)."""
  if isinstance(value, (str, bytes)):
    return len(value)
  if isinstance(value, (list, tuple)):
    return sum(map(_size, value))
  return 0


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
  t0, ends, cpu, results = _run_released(range(k), fn, timeout_s, name, time.perf_counter)
  return max(ends) - t0, cpu, results


def _run_released(
  indices: Sequence[int],
  fn: Callable[[int], Any],
  timeout_s: float,
  name: str,
  release: Callable[[], float | None],
) -> tuple[float | None, list[float], list[float], list[Any]]:
  """Runs fn(i) for each i in `indices`, one thread each: once every thread
  has started, `release()` (which returns the release time, or None when
  the caller in another process keeps it: it waits for that caller's
  release) and then one start event lets them all go. (release time, each
  thread's return time (time.perf_counter: CLOCK_MONOTONIC, the same clock
  in every process of this machine), each one's CPU seconds in fn, results),
  in the order of `indices`. Raises the first thread's error, or
  TimeoutError naming the processes still running after `timeout_s`."""
  n = len(indices)
  start = threading.Event()
  ends = [0.0] * n
  cpu = [0.0] * n
  results: list[Any] = [None] * n
  errors: list[BaseException | None] = [None] * n

  def body(j: int) -> None:
    if not start.wait(timeout_s):
      errors[j] = TimeoutError("never released")
      return
    c0 = time.thread_time()
    try:
      results[j] = fn(indices[j])
    except BaseException as e:  # noqa: BLE001 - reported below, by process
      errors[j] = e
    ends[j] = time.perf_counter()
    cpu[j] = time.thread_time() - c0

  threads = [
    threading.Thread(target=body, args=(j,), name=f"{name}-{i}") for j, i in enumerate(indices)
  ]
  for t in threads:
    t.start()
  try:
    t0 = release()
  finally:
    start.set()  # also on a failed release: the threads end ("never released" if late)
  deadline = time.monotonic() + timeout_s
  for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
  alive = [indices[j] for j, t in enumerate(threads) if t.is_alive()]
  if alive:
    raise TimeoutError(f"{name}: processes {alive[:10]} still running after {timeout_s:.0f}s")
  bad = [(indices[j], e) for j, e in enumerate(errors) if e is not None]
  if bad:
    i, e = bad[0]
    raise RuntimeError(f"{name}: process {i} (and {len(bad) - 1} more) failed: {e!r}") from e
  return t0, ends, cpu, results


def slice_processes(k: int) -> tuple[tuple[int, ...], ...]:
  """The simulated job's slices: PROCESSES_PER_SLICE consecutive processes each."""
  per = min(PROCESSES_PER_SLICE, k)
  return tuple(tuple(range(s, min(s + per, k))) for s in range(0, k, per))


def topology(k: int, i: int):
  """Simulated process i's Topology in a job of k processes."""
  from emergency_ckpt.cluster.topology import Topology  # noqa: PLC0415

  slices = slice_processes(k)
  per = len(slices[0])
  return Topology(
    process_index=i,
    process_count=k,
    slice_index=i // per,
    slice_processes=slices,
    replica_axis_index=0,
    replica_axis_name="replica",
    mesh_shape=(len(slices), per * 4),
    mesh_axis_names=("replica", "data"),
  )


def _cpu_s() -> float:
  """This process's CPU seconds so far, every thread (user + system)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


ROUNDS = ("gather", "all-gather", "old algorithm")
XOR_ROUNDS = ("xor set-up", "xor set-up (all-gather)")  # K processes as one slice


class ClientGroup:
  """Simulated processes lo..hi-1 of a K-process job: one coordination-service
  client each (wrapped in CountingClient), their Collectives, and the rounds
  they run (ROUNDS), one thread per process. Lives in the program that holds
  the service (one interpreter) or in one of its worker processes."""

  def __init__(self, k: int, lo: int, hi: int, address: str, timeout_s: float):
    from emergency_ckpt.cluster import jax_runtime  # noqa: PLC0415 - imports JAX

    self.k, self.timeout_s = k, timeout_s
    self.indices = range(lo, hi)
    timeout = int(timeout_s)
    self._raw = [
      jax_runtime.coordination_client(address, i, timeout_s=timeout) for i in self.indices
    ]
    self.clients = [CountingClient(c) for c in self._raw]
    self._fns: dict[str, Callable[[int, int], bool]] | None = None
    self._colls: dict[int, Any] = {}  # {process: its Collectives}, from _setup

  def connect(self, release: Callable[[], float | None]) -> dict[str, Any]:
    """Connects every client (each blocks until all K have registered)."""
    lo = self.indices[0]
    c0 = _cpu_s()
    t0, ends, _, _ = _run_released(
      self.indices,
      lambda i: self._raw[i - lo].connect(),
      self.timeout_s,
      f"connect-k{self.k}",
      release,
    )
    return {"t0": t0, "end": max(ends), "cpu_s": _cpu_s() - c0}

  def _setup(self) -> dict[str, Callable[[int, int], bool]]:
    """The rounds' per-process functions fn(i, rep) -> whether process i got
    the right answer (the tree's answers are checked after the round)."""
    from emergency_ckpt.cluster.collectives import Collectives  # noqa: PLC0415
    from emergency_ckpt.core import parity as xor_parity  # noqa: PLC0415
    from emergency_ckpt.restore import inventory  # noqa: PLC0415

    k, lo, timeout_s = self.k, self.indices[0], self.timeout_s
    slices = slice_processes(k)
    per = len(slices[0])
    colls = {
      i: Collectives(topology(k, i), namespace=f"scale-k{k}", timeout_s=timeout_s, client=c)
      for i, c in zip(self.indices, self.clients)
    }
    self._colls = colls
    payloads = [inventory_payload(i, i // per) for i in range(k)]
    self.payload_sizes = [len(json.dumps(p, sort_keys=True)) for p in payloads]
    invs = [restore_summary.Inventory.from_json(p) for p in payloads]
    self._want = restore_summary.summarize(invs, slices)
    self._got: dict[int, Any] = {}
    procs = list(range(k))

    def tree(i: int, rep: int) -> bool:
      self._got[i] = inventory.gather(colls[i], invs[i], "inventory")  # checked after
      return True

    def allgather(i: int, rep: int) -> bool:
      got = colls[i].exchange("inventory_all", payloads[i])
      return len(got) == k and got[k - 1] == payloads[k - 1] and got[i] == payloads[i]

    def old(i: int, rep: int) -> bool:
      key = f"emergency_ckpt/scale-old-k{k}/inventory/{rep}"
      got = old_exchange(self.clients[i - lo], key, i, procs, payloads[i], timeout_s)
      return len(got) == k and got[k - 1] == payloads[k - 1]

    def xor_setup(i: int, rep: int) -> bool:
      # the XOR set-up (redundancy.Xor) with all K processes in one slice,
      # one machine each: the slice's last to arrive cuts the groups
      part = colls[i].assign(
        "xor_hosts", f"m{i}", processes=procs, assign=lambda m: xor_parity.parts(procs, m, 8)
      )
      return i in part["group"] and len(part["group"]) == 8

    def xor_setup_allgather(i: int, rep: int) -> bool:
      # the same before Collectives.assign: every process got every machine
      machines = colls[i].exchange("xor_hosts_all", f"m{i}", processes=procs)
      group = next(g for g in xor_parity.groups(procs, machines, 8) if i in g)
      return len(group) == 8

    fns = dict(zip(ROUNDS, (tree, allgather, old)))
    fns.update({XOR_ROUNDS[0]: xor_setup, XOR_ROUNDS[1]: xor_setup_allgather})
    return fns

  def round(self, what: str, rep: int, release: Callable[[], float | None]) -> dict[str, Any]:
    """One round of `what` on each of this group's processes: the release
    time (or None), and per process its return time, CPU seconds, counts,
    whether its answer was right; this group's CPU seconds, every thread."""
    if self._fns is None:
      self._fns = self._setup()
    for c in self.clients:
      c.reset()
    self._got = {}
    fn = self._fns[what]
    c0 = _cpu_s()
    t0, ends, cpu, ok = _run_released(
      self.indices, lambda i: fn(i, rep), self.timeout_s, f"{what}-k{self.k}", release
    )
    for coll in self._colls.values():  # the primary deletes keys on a thread of its own:
      coll.wait_deleted(self.timeout_s)  # counted in this round, whatever the timing
    cpu_all = _cpu_s() - c0
    if what == "gather":  # outside the timed part
      ok = [self._got.get(i) == self._want for i in self.indices]
    return {
      "t0": t0,
      "cpu_s": cpu_all,
      "processes": [
        dict(c.stats(), process=i, end=e, cpu_s=t, ok=bool(g))
        for i, c, e, t, g in zip(self.indices, self.clients, ends, cpu, ok)
      ],
    }

  def close(self) -> None:
    """Shuts every client down, in threads: client shutdown is a barrier over
    all K of them (in every process that holds some)."""
    threads = [threading.Thread(target=_quiet_shutdown, args=(c,)) for c in self._raw]
    for t in threads:
      t.start()
    deadline = time.monotonic() + self.timeout_s
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
      progress(f"K={self.k}: {stuck} client shutdowns still running")
    self._raw, self.clients = [], []


def _worker_main(conn, start, k: int, lo: int, hi: int, address: str, timeout_s: float) -> None:
  """A worker process: simulated processes lo..hi-1 (a ClientGroup), driven
  by the parent through `conn`: ("connect",), ("round", what, rep), ("close",).
  Each answers ("ready", None) once its threads wait, runs when `start` (one
  event for every worker) is set, and answers ("done", result) or
  ("error", (type name, message))."""
  sys.setswitchinterval(SWITCH_INTERVAL_S)
  try:
    group = ClientGroup(k, lo, hi, address, timeout_s)
  except BaseException as e:  # noqa: BLE001 - sent to the parent
    conn.send(("error", (type(e).__name__, f"worker for processes {lo}-{hi - 1}: {e!r}")))
    return
  conn.send(("done", None))

  def release() -> None:
    conn.send(("ready", None))
    if not start.wait(timeout_s):
      raise TimeoutError(f"processes {lo}-{hi - 1}: never released in {timeout_s:.0f}s")

  while True:
    try:
      msg = conn.recv()
    except EOFError:  # the parent is gone
      group.close()
      return
    try:
      if msg[0] == "connect":
        out = group.connect(release)
      elif msg[0] == "round":
        out = group.round(msg[1], msg[2], release)
      elif msg[0] == "close":
        group.close()
        conn.send(("done", None))
        return
      else:
        raise ValueError(f"unknown command {msg[0]!r}")
    except BaseException as e:  # noqa: BLE001 - sent to the parent
      conn.send(("error", (type(e).__name__, str(e))))
      continue
    conn.send(("done", out))


class Simulation:
  """A coordination service on 127.0.0.1 (in this process) and K connected
  clients, with the topology of K processes in slices of 16. With workers=1
  every client is a thread of this interpreter; with P > 1 workers, P worker
  processes (spawned) hold K/P consecutive clients each, as threads, all
  released by one cross-process start event."""

  def __init__(self, k: int, timeout_s: float, workers: int = 1):
    from emergency_ckpt.cluster import jax_runtime  # noqa: PLC0415 - imports JAX

    self.k, self.timeout_s = k, timeout_s
    self.workers = max(1, min(workers, k))
    self.address = f"127.0.0.1:{_free_port()}"
    self.slice_processes = slice_processes(k)
    self._service = jax_runtime.coordination_service(self.address, k)
    self._group: ClientGroup | None = None
    self._procs: list[Any] = []
    self._conns: list[Any] = []
    self._ranges = [
      (w * k // self.workers, (w + 1) * k // self.workers) for w in range(self.workers)
    ]
    self._broken = False
    try:
      if self.workers == 1:
        self._group = ClientGroup(k, 0, k, address=self.address, timeout_s=timeout_s)
      else:
        self._spawn()
      res = self._release("connect", ("connect",), f"connect-k{k}")
      self.connect_s = max(r["end"] for r in res) - res[0]["t0"]
    except BaseException:
      self.close()
      raise

  @property
  def mode(self) -> str:
    if self.workers == 1:
      return "one interpreter: every simulated process a thread of the program with the service"
    return (
      f"{self.workers} worker processes, each {self.k // self.workers:,}"
      f"{'+' if self.k % self.workers else ''} simulated processes as threads; the service"
      " in the parent"
    )

  def _spawn(self) -> None:
    ctx = multiprocessing.get_context("spawn")  # no fork: the service's gRPC threads run
    self._start = ctx.Event()
    for lo, hi in self._ranges:
      parent, child = ctx.Pipe()
      proc = ctx.Process(
        target=_worker_main,
        args=(child, self._start, self.k, lo, hi, self.address, self.timeout_s),
        name=f"scale-worker-{lo}-{hi - 1}",
        daemon=True,
      )
      proc.start()
      child.close()
      self._procs.append(proc)
      self._conns.append(parent)
    self._collect(f"start workers k{self.k}", self.timeout_s)

  def _collect(self, what: str, timeout_s: float, tag: str = "done") -> list[Any]:
    """One `tag` answer from every worker, in worker order; raises naming
    the workers (and their processes) that sent an error or nothing."""
    out: list[Any] = [None] * len(self._conns)
    pending = dict(enumerate(self._conns))
    deadline = time.monotonic() + timeout_s
    while pending:
      ready = multiprocessing.connection.wait(
        list(pending.values()), max(0.0, deadline - time.monotonic())
      )
      if not ready:
        self._broken = True
        late = ", ".join(
          f"worker {w} (processes {self._ranges[w][0]}-{self._ranges[w][1] - 1})" for w in pending
        )
        raise TimeoutError(f"{what}: {late} sent nothing in {timeout_s:.0f}s")
      for w in [w for w, c in pending.items() if c in ready]:
        lo, hi = self._ranges[w]
        try:
          got, value = pending.pop(w).recv()
        except EOFError:
          self._broken = True
          raise RuntimeError(
            f"{what}: worker {w} (processes {lo}-{hi - 1}) exited"
            f" (exit code {self._procs[w].exitcode})"
          ) from None
        if got == "error":
          self._broken = True
          kind, msg = value
          raise (TimeoutError if kind == "TimeoutError" else RuntimeError)(f"{what}: {msg}")
        if got != tag:
          self._broken = True
          raise RuntimeError(f"{what}: worker {w} answered {got!r}, not {tag!r}")
        out[w] = value
    return out

  def _release(self, what: str, msg: tuple, name: str) -> list[dict[str, Any]]:
    """Runs `msg` on every simulated process, released at once; each group's
    answer, with "t0" (the release time) set."""
    if self._group is not None:
      meth = getattr(self._group, msg[0])
      return [meth(*msg[1:], release=time.perf_counter)]
    for c in self._conns:
      c.send(msg)
    self._collect(name, self.timeout_s, "ready")  # every worker's threads wait
    t0 = time.perf_counter()
    self._start.set()
    try:
      res = self._collect(name, self.timeout_s + 30)
    finally:
      self._start.clear()  # every worker has passed it (or the run is over)
    for r in res:
      r["t0"] = t0
    return res

  def round(self, what: str, rep: int) -> dict[str, Any]:
    """One round of `what` (ROUNDS) on every simulated process: wall seconds
    from the release to the last process's return, per process records
    (in process order), and CPU seconds: all of it (service and clients),
    and the service's alone (in worker mode: this process)."""
    c0 = _cpu_s()
    res = self._release(what, ("round", what, rep), f"{what}-k{self.k}")
    parent_cpu = _cpu_s() - c0
    procs = [p for r in res for p in r["processes"]]
    return {
      "wall_s": max(p["end"] for p in procs) - res[0]["t0"],
      "processes": procs,
      "cpu_total_s": parent_cpu + (0.0 if self._group else sum(r["cpu_s"] for r in res)),
      "service_cpu_s": None if self._group else parent_cpu,
    }

  def close(self) -> float:
    """Shuts every client down, then the service; the seconds it took. A
    worker that failed or does not finish in time is killed."""
    t0 = time.perf_counter()
    if self._group is not None:
      self._group.close()
    elif self._conns:
      if not self._broken:
        try:
          for c in self._conns:
            c.send(("close",))
          self._collect(f"close k{self.k}", self.timeout_s + 30)
        except Exception as e:  # noqa: BLE001 - killed below
          progress(f"K={self.k}: workers not closed: {e}")
      for p in self._procs:
        p.join(5.0 if not self._broken else 0.0)
        if p.is_alive():
          p.kill()
          p.join()
      for c in self._conns:
        c.close()
      self._conns, self._procs = [], []
    _quiet_shutdown(self._service)
    self._group = None
    return time.perf_counter() - t0


def _quiet_shutdown(obj: Any) -> None:
  try:
    obj.shutdown()
  except Exception as e:  # noqa: BLE001 - best effort at the end of a run
    progress(f"shutdown: {e}")


def inventory_payload(process: int, slice_index: int) -> dict[str, Any]:
  """What one process sends in a restore's inventory exchange: its newest
  local steps (the primary also lists the shared tiers)."""
  newest = 50 * STEP_EVERY
  local = tuple(range(newest - 4 * STEP_EVERY, newest + 1, STEP_EVERY))
  primary = process == 0
  rejected = {local[0] - STEP_EVERY: "checksum mismatch in shard 3"} if process % 8 == 7 else {}
  return restore_summary.Inventory(
    process=process,
    slice=slice_index,
    local_steps=local,
    local_rejected=rejected,
    persistent_steps=tuple(range(STEP_EVERY * 10, newest + 1, STEP_EVERY * 10))
    if primary
    else None,
    state_steps=tuple(range(STEP_EVERY, newest + 1, STEP_EVERY)) if primary else None,
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


def payload_sizes(k: int) -> list[int]:
  """Bytes of each simulated process's inventory JSON."""
  per = len(slice_processes(k)[0])
  return [len(json.dumps(inventory_payload(i, i // per), sort_keys=True)) for i in range(k)]


def _round_stats(k: int, rnd: dict[str, Any]) -> dict[str, Any]:
  procs = rnd["processes"]
  calls = [sum(p["calls"].values()) for p in procs]
  by_method: Counter[str] = Counter()
  for p in procs:
    by_method.update(p["calls"])
  seconds = {m: statistics.median(p["seconds"].get(m, 0.0) for p in procs) for m in by_method}
  return {
    "wall_s": rnd["wall_s"],
    "cpu_s": statistics.median(p["cpu_s"] for p in procs),
    "cpu_total_s": rnd["cpu_total_s"],
    "service_cpu_s": rnd["service_cpu_s"],
    "calls_min": min(calls),
    "calls_max": max(calls),
    "calls_by_method": {m: n / k for m, n in sorted(by_method.items())},
    "bytes_received": statistics.median(p["bytes_received"] for p in procs),
    "bytes_received_max": max(p["bytes_received"] for p in procs),
    "bytes_sent": statistics.median(p["bytes_sent"] for p in procs),
    "method_s_median": dict(sorted(seconds.items())),
  }


def _exchange_point(
  sim: Simulation, rounds: list[dict[str, Any]], payload_bytes: list[int]
) -> dict[str, Any]:
  timed = rounds[1:]  # the first round is the warm-up
  walls = [r["wall_s"] for r in timed]
  methods = sorted({m for r in timed for m in r["method_s_median"]})
  service = [r["service_cpu_s"] for r in timed if r["service_cpu_s"] is not None]
  return {
    "k": sim.k,
    "wall_s": statistics.median(walls),
    "wall_s_reps": walls,
    "warmup_s": rounds[0]["wall_s"],
    "workers": sim.workers,
    "mode": sim.mode,
    "cpu_s_per_process": statistics.median(r["cpu_s"] for r in timed),
    # every thread of the simulation (service, clients, gRPC), per simulated process
    "cpu_total_s_per_process": statistics.median(r["cpu_total_s"] for r in timed) / sim.k,
    # the service's process (worker mode only: it holds no client)
    "service_cpu_s": statistics.median(service) if service else None,
    "calls_per_process": timed[0]["calls_max"],
    "calls_per_process_min": min(r["calls_min"] for r in rounds),
    "calls_per_process_max": max(r["calls_max"] for r in rounds),
    "calls_by_method": timed[0]["calls_by_method"],
    "bytes_received_per_process": statistics.median(r["bytes_received"] for r in timed),
    "bytes_received_per_process_max": max(r["bytes_received_max"] for r in timed),
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
  interpreter, each of which has a GIL of its own in a real job. (Worker
  processes set it for themselves.)"""
  saved = sys.getswitchinterval()
  sys.setswitchinterval(seconds)
  try:
    yield
  finally:
    sys.setswitchinterval(saved)


def default_workers() -> int:
  """Worker processes for the simulated clients: one per CPU."""
  return os.cpu_count() or 1


def measure_exchange(
  k: int,
  reps: int,
  run_old: bool,
  timeout_s: float,
  run_allgather: bool = True,
  workers: int = 1,
) -> dict[str, Any]:
  """The library's inventory exchange (a gather_tree), beside the all-gather
  exchange and the old algorithm, at K simulated processes, against one
  service; the clients in `workers` processes (1: threads of this one)."""
  with _switch_interval(SWITCH_INTERVAL_S):
    return _measure_exchange(k, reps, run_old, timeout_s, run_allgather, workers)


def _rounds(sim: Simulation, what: str, reps: int) -> list[dict[str, Any]]:
  """reps + 1 rounds of `what` on every simulated process (the first is the
  warm-up); raises naming the processes that got a wrong answer (checked
  after each round, outside the timed part)."""
  rounds = []
  for rep in range(reps + 1):
    rnd = sim.round(what, rep)
    wrong = [p["process"] for p in rnd["processes"] if not p["ok"]]
    if wrong:
      raise AssertionError(f"K={sim.k}: {what} gave processes {wrong[:8]} a wrong answer")
    rounds.append(_round_stats(sim.k, rnd))
    label = "warm-up" if rep == 0 else f"rep {rep}"
    progress(
      f"K={sim.k}: {what} {label}: {rnd['wall_s']:.3f}s, CPU per process"
      f" {fmt_secs(rounds[-1]['cpu_s'])}, all CPU {rnd['cpu_total_s']:.3f}s"
    )
  return rounds


def _measure_exchange(
  k: int, reps: int, run_old: bool, timeout_s: float, run_allgather: bool, workers: int
) -> dict[str, Any]:
  sim = Simulation(k, timeout_s, workers)
  progress(f"K={k}: {k} clients connected in {sim.connect_s:.2f}s ({sim.mode})")
  out: dict[str, Any] = {}
  sizes = payload_sizes(k)
  try:
    out["exchange"] = _exchange_point(sim, _rounds(sim, "gather", reps), sizes)
    if run_allgather:
      out["exchange_allgather"] = _exchange_point(sim, _rounds(sim, "all-gather", reps), sizes)
    if run_old:
      out["exchange_old"] = _exchange_point(sim, _rounds(sim, "old algorithm", reps), sizes)
  finally:
    shutdown_s = sim.close()
    progress(f"K={k}: service and clients shut down in {shutdown_s:.2f}s")
  for point in out.values():
    point["shutdown_s"] = shutdown_s
  return out
