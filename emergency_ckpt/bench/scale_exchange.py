"""The scale benchmark's exchange stage: the library's own inventory exchange
(inventory.gather: a Collectives.gather_tree) against a real JAX coordination
service with K simulated processes (threads of this program, one client
each, counted), beside the all-gather exchange (Collectives.exchange: every
process receives every inventory) and the algorithm before it (one blocking
get per process), for contrast."""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from emergency_ckpt import restore_plan
from emergency_ckpt.bench.scale_planner import STEP_EVERY
from emergency_ckpt.bench.scale_report import fmt_secs

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
  local steps (the primary also lists the shared tiers)."""
  newest = 50 * STEP_EVERY
  local = tuple(range(newest - 4 * STEP_EVERY, newest + 1, STEP_EVERY))
  primary = process == 0
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


def measure_exchange(
  k: int, reps: int, run_old: bool, timeout_s: float, run_allgather: bool = True
) -> dict[str, Any]:
  """The library's inventory exchange (a gather_tree), beside the all-gather
  exchange and the old algorithm, at K simulated processes, against one
  service."""
  with _switch_interval(SWITCH_INTERVAL_S):
    return _measure_exchange(k, reps, run_old, timeout_s, run_allgather)


def _rounds(
  sim: Simulation, fn, reps: int, timeout_s: float, what: str, check=None
) -> list[dict[str, Any]]:
  """reps + 1 rounds of fn(i) on every simulated process (the first is the
  warm-up); fn returns whether its process got the right answer, or
  `check(what)` raises, after the round (outside the timed part)."""
  rounds = []
  for rep in range(reps + 1):
    for c in sim.clients:
      c.reset()
    wall, cpu, ok = _run_threads(sim.k, lambda i, rep=rep: fn(i, rep), timeout_s, what)
    if check is not None:
      check(what)
    if not all(ok):
      raise AssertionError(f"K={sim.k}: {what} returned wrong values")
    rounds.append(_round_stats(sim, wall, cpu))
    label = "warm-up" if rep == 0 else f"rep {rep}"
    progress(
      f"K={sim.k}: {what} {label}: {wall:.3f}s, CPU per process {fmt_secs(rounds[-1]['cpu_s'])}"
    )
  return rounds


def _measure_exchange(
  k: int, reps: int, run_old: bool, timeout_s: float, run_allgather: bool
) -> dict[str, Any]:
  from emergency_ckpt import inventory  # noqa: PLC0415
  from emergency_ckpt.topology import Collectives  # noqa: PLC0415

  sim = Simulation(k, timeout_s)
  progress(f"K={k}: {k} clients connected in {sim.connect_s:.2f}s")
  out: dict[str, Any] = {}
  try:
    colls = [
      Collectives(sim.topology(i), namespace=f"scale-k{k}", timeout_s=timeout_s, client=c)
      for i, c in enumerate(sim.clients)
    ]
    per = len(sim.slice_processes[0])
    payloads = [inventory_payload(i, i // per) for i in range(k)]
    sizes = [len(json.dumps(p, sort_keys=True)) for p in payloads]
    invs = [restore_plan.Inventory.from_json(p) for p in payloads]
    want = restore_plan.summarize(invs, sim.slice_processes)

    got: list[Any] = [None] * k

    def tree(i: int, rep: int) -> bool:
      got[i] = inventory.gather(colls[i], invs[i], "inventory")  # checked after the round
      return True

    def check(what: str) -> None:
      wrong = [i for i in range(k) if got[i] != want]
      if wrong:
        raise AssertionError(f"K={k}: {what} gave processes {wrong[:8]} a wrong summary")

    out["exchange"] = _exchange_point(
      sim, _rounds(sim, tree, reps, timeout_s, "gather", check), sizes
    )

    if run_allgather:

      def allgather(i: int, rep: int) -> bool:
        got = colls[i].exchange("inventory_all", payloads[i])
        return len(got) == k and got[k - 1] == payloads[k - 1] and got[i] == payloads[i]

      rounds = _rounds(sim, allgather, reps, timeout_s, "all-gather")
      out["exchange_allgather"] = _exchange_point(sim, rounds, sizes)

    if run_old:
      procs = list(range(k))

      def old(i: int, rep: int) -> bool:
        key = f"emergency_ckpt/scale-old-k{k}/inventory/{rep}"
        got = old_exchange(sim.clients[i], key, i, procs, payloads[i], timeout_s)
        return len(got) == k and got[k - 1] == payloads[k - 1]

      out["exchange_old"] = _exchange_point(
        sim, _rounds(sim, old, reps, timeout_s, "old algorithm"), sizes
      )
  finally:
    shutdown_s = sim.close()
    progress(f"K={k}: service and clients shut down in {shutdown_s:.2f}s")
  for point in out.values():
    point["shutdown_s"] = shutdown_s
  return out
