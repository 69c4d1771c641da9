"""Collectives against a real JAX coordination service, with simulated
processes (one client each, threads of this test): what each exchange costs
and what it returns, the commit hint's counter, and the timeout's message."""

from __future__ import annotations

import concurrent.futures
import socket

import pytest

from benchmarks.scale_exchange import CountingClient as Counting
from emergency_ckpt.cluster.collectives import Collectives
from emergency_ckpt.cluster.topology import Topology
from emergency_ckpt.errors import CollectiveTimeoutError


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def job():
  """(collectives per simulated process, their counting clients) of a 6-process
  job in 2 slices of 3, on one real coordination service."""
  from jax._src.lib import _jax  # noqa: PLC0415

  n = 6
  addr = f"127.0.0.1:{_port()}"
  service = _jax.get_distributed_runtime_service(addr, n)
  clients = [_jax.get_distributed_runtime_client(addr, i, init_timeout=30) for i in range(n)]
  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    list(pool.map(lambda c: c.connect(), clients))
  slices = ((0, 1, 2), (3, 4, 5))
  counted = [Counting(c) for c in clients]
  cols = [
    Collectives(
      Topology(
        process_index=i,
        process_count=n,
        slice_index=i // 3,
        slice_processes=slices,
        replica_axis_index=0,
        replica_axis_name="replica",
        mesh_shape=(2, 3),
        mesh_axis_names=("replica", "data"),
      ),
      namespace="t",
      timeout_s=20,
      client=counted[i],
    )
    for i in range(n)
  ]
  yield cols, counted
  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    list(pool.map(lambda c: c.shutdown(), clients))
  service.shutdown()


def _all(cols, fn):
  with concurrent.futures.ThreadPoolExecutor(len(cols)) as pool:
    return list(pool.map(fn, cols))


def test_an_exchange_costs_three_calls_per_process_and_gives_everyone_everything(job):
  cols, counted = job
  got = _all(cols, lambda c: c.exchange("inv", {"p": c.topology.process_index}))
  assert all(g == {p: {"p": p} for p in range(6)} for g in got)
  assert [sum(c.calls.values()) for c in counted] == [3] * 6
  # a subset: slice 1 alone
  got = _all(
    cols[3:], lambda c: c.exchange("slice1", c.topology.process_index, processes=[3, 4, 5])
  )
  assert all(g == {3: 3, 4: 4, 5: 5} for g in got)
  assert [sum(c.calls.values()) for c in counted] == [3] * 3 + [6] * 3


def test_a_timeout_names_the_processes_that_never_came(job):
  cols, _ = job
  with pytest.raises(CollectiveTimeoutError, match=r"processes \[4, 5\]"):
    _all(cols[:4], lambda c: c.exchange("late", 1, timeout_s=1))


def test_the_commit_counter_reaches_its_target(job):
  cols, counted = job
  primary = cols[0]
  assert not primary.wait_count("written_7", 6, timeout_s=0.05)
  _all(cols, lambda c: c.count("written_7"))
  assert primary.wait_count("written_7", 6, timeout_s=5)
  assert sum(counted[3].calls.values()) == 1  # one call per process per step


def test_the_last_count_wakes_the_waiting_primary_without_polling(job):
  """count(name, target): the process that brings the counter to its target
  raises the "reached" flag; the primary's wait_count blocks on it (one
  blocking get per poll_s), so a wait of a second costs it a few calls, not
  a poll every few milliseconds."""
  import threading  # noqa: PLC0415
  import time  # noqa: PLC0415

  cols, counted = job
  primary, got = cols[0], []
  waiter = threading.Thread(
    target=lambda: got.append(primary.wait_count("written_9", 6, timeout_s=30, poll_s=10))
  )
  waiter.start()
  time.sleep(1.0)  # the primary waits before anyone counts
  _all(cols[:5], lambda c: c.count("written_9", 6))
  assert not got
  cols[5].count("written_9", 6)  # the last: raises the flag
  waiter.join(20)
  assert got == [True]
  calls = _calls(counted)
  assert calls == [3, 1, 1, 1, 1, 2], calls  # primary: its count, one read, one blocking get


def _calls(counted) -> list[int]:
  out = [sum(c.calls.values()) for c in counted]
  for c in counted:
    c.reset()
  return out


def test_gather_tree_gives_everyone_one_summary_and_nobody_every_value(job):
  cols, counted = job

  def per_slice(s, values):
    return {"slice": s, "sum": sum(v["p"] for v in values.values()), "n": len(values)}

  def run(c):
    me = c.topology.process_index
    return c.gather_tree(
      "inv",
      {"p": me, "pad": "x" * 1000},
      per_slice=per_slice,
      combine=lambda sums: sorted((s, v["sum"], v["n"]) for s, v in sums.items()),
    )

  got = _all(cols, run)
  assert got == [[[0, 3, 3], [1, 12, 3]]] * 6
  # a plain process: set, add one to its slice's counter, one blocking get of
  # the job summary (no barrier); the last of a slice to count also reads its
  # slice, sets the summary and counts it (6); the last of those reads the
  # summaries and sets the job's (7, and needs no get).
  calls = _calls(counted)
  assert sorted(calls) == [3, 3, 3, 3, 6, 7], calls
  assert [sum(c > 3 for c in calls[i : i + 3]) for i in (0, 3)] == [1, 1], calls  # one per slice
  for c in counted:
    assert c.bytes_received < 3000  # at most its own slice's values, never all six
  # the next job-wide barrier lets the primary delete the finished exchange's
  # keys, on a thread of its own (off the path to the next exchange)
  _all(cols, lambda c: c.barrier("next"))
  assert cols[0].wait_deleted(10)
  assert _calls(counted) == [3] + [2] * 5
  left = [k for k, _ in counted[0].key_value_dir_get("emergency_ckpt/t/")]
  assert left and all("/next/" in k for k in left), left
  # so does the next gather_tree, once every slice's summary is in
  got = _all(cols, run)
  assert got == [[[0, 3, 3], [1, 12, 3]]] * 6
  assert cols[0].wait_deleted(10)
  assert counted[0].calls["key_value_delete"] == 1
  left = [k for k, _ in counted[0].key_value_dir_get("emergency_ckpt/t/")]
  assert left and all("/inv/1/" in k for k in left), left  # the first (inv/0) and next: gone


def test_gather_sparse_sends_only_what_is_not_none(job):
  cols, counted = job
  got = _all(
    cols,
    lambda c: c.gather_sparse("errs", "bad" if c.topology.process_index in (1, 4) else None),
  )
  assert got == [{1: "bad", 4: "bad"}] * 6
  assert _calls(counted) == [3, 4, 3, 3, 4, 3]


def test_broadcast_and_exchange_some_read_only_what_they_need(job):
  cols, counted = job
  got = _all(
    cols, lambda c: c.broadcast("b", "hi" if c.topology.process_index == 0 else None, source=0)
  )
  assert got == ["hi"] * 6
  assert _calls(counted) == [1] * 6
  # processes 3-5 publish, process 0 wants 3 and 5, the rest want nothing
  got = _all(
    cols,
    lambda c: c.exchange_some(
      "offer",
      {"from": c.topology.process_index} if c.topology.slice_index == 1 else None,
      wanted=[3, 5] if c.topology.process_index == 0 else [],
    ),
  )
  assert got[0] == {3: {"from": 3}, 5: {"from": 5}} and got[1:] == [{}] * 5
  assert _calls(counted) == [2, 0, 0, 1, 1, 1]


def test_group_by_returns_only_the_own_group(job):
  cols, counted = job
  got = _all(cols, lambda c: c.group_by("host", f"h{c.topology.process_index % 2}", 1))
  assert got[0] == {0: 1, 2: 1, 4: 1} and got[3] == {1: 1, 3: 1, 5: 1}
  assert _calls(counted) == [3] * 6


def test_assign_gives_each_member_only_its_part(job):
  """The last member of the group to arrive runs the function over every
  member's value and sets each other member's part; the others set, count
  and get (3 calls), it reads the values and sets P - 1 parts."""
  cols, counted = job
  seen = []

  def parts(values):
    seen.append(dict(values))
    total = sum(v["p"] for v in values.values())
    return {p: {"me": p, "total": total} for p in values}

  got = _all(
    cols[3:],
    lambda c: c.assign(
      "grp", {"p": c.topology.process_index, "pad": "x" * 1000}, processes=[3, 4, 5], assign=parts
    ),
  )
  assert got == [{"me": p, "total": 12} for p in (3, 4, 5)], got
  assert len(seen) == 1 and sorted(seen[0]) == [3, 4, 5], seen
  calls = _calls(counted)[3:]
  assert sorted(calls) == [3, 3, 5], calls
  for i, c in enumerate(counted[3:]):
    if calls[i] == 3:  # a member receives its part, never the others' values
      assert c.bytes_received < 500, c.bytes_received


def test_assign_timeout_names_the_missing_members_or_a_stalled_assigner(job):
  cols, _ = job
  with pytest.raises(CollectiveTimeoutError, match=r"processes \[5\] \(of 3-5\)"):
    _all(
      cols[3:5],
      lambda c: c.assign(
        "late", 1, processes=[3, 4, 5], assign=lambda v: dict.fromkeys(v, 0), timeout_s=1
      ),
    )

  def stall(values):
    raise RuntimeError("stalled")  # whoever completes the count

  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    futures = [
      pool.submit(c.assign, "stall", 1, processes=[0, 1, 2], assign=stall, timeout_s=2)
      for c in cols[:3]
    ]
    errors = [f.exception() for f in futures]
  assert sum(isinstance(e, RuntimeError) and str(e) == "stalled" for e in errors) == 1, errors
  others = [e for e in errors if isinstance(e, CollectiveTimeoutError)]
  assert len(others) == 2, errors
  for e in others:
    assert "every process of 0-2 arrived" in str(e) and "never published" in str(e), e


def test_gather_tree_timeout_names_the_missing_processes(job):
  cols, _ = job
  with pytest.raises(CollectiveTimeoutError, match=r"processes \[5\]"):
    _all(
      cols[:5],
      lambda c: c.gather_tree(
        "late", 1, per_slice=lambda s, v: len(v), combine=lambda s: s, timeout_s=5
      ),
    )


def _stalled(cols, per_slice, combine):
  """Runs gather_tree "stall" on every process: (the summariser's error, every
  other process's, in process order)."""
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    futures = [
      pool.submit(c.gather_tree, "stall", 1, per_slice=per_slice, combine=combine, timeout_s=2)
      for c in cols
    ]
    errors = [f.exception() for f in futures]
  failed = [e for e in errors if isinstance(e, RuntimeError)]
  assert len(failed) == 1, errors
  return failed[0], [e for e in errors if e is not failed[0]]


def test_gather_tree_timeout_names_a_stalled_summariser(job):
  """Everyone arrived but the job summary was never published: the others'
  error says so and names the processes that could have published it (the
  slices' summarisers), not processes that merely came."""
  cols, counted = job

  def combine(sums):
    raise RuntimeError("stalled")  # whoever completes the exchange

  failed, others = _stalled(cols, lambda s, v: len(v), combine)
  summarisers = [i for i, c in enumerate(counted) if c.calls["key_value_increment"] == 2]
  assert len(summarisers) == 2, summarisers
  for e in others:
    assert isinstance(e, CollectiveTimeoutError), e
    assert "every process arrived" in str(e) and "job summary" in str(e), e
    assert f"processes {summarisers}" in str(e), e


def test_gather_tree_timeout_names_a_slice_whose_summary_never_came(job):
  cols, _ = job

  def per_slice(s, values):
    if s == 1:
      raise RuntimeError("stalled")
    return len(values)

  failed, others = _stalled(cols, per_slice, lambda sums: sums)
  for e in others:
    assert isinstance(e, CollectiveTimeoutError), e
    assert "summary of slices [1]" in str(e) and "processes 3-5" in str(e), e


def test_forget_deletes_a_steps_hints(job):
  cols, counted = job
  cols[0].signal("committed_3")
  _all(cols, lambda c: c.count("written_3"))
  assert cols[0].wait_count("written_3", 6, timeout_s=5)
  cols[0].forget(signal="committed_3", count="written_3")
  assert counted[0].key_value_dir_get("emergency_ckpt/t/") == []
  import threading  # noqa: PLC0415

  assert not cols[1].wait_signal("committed_3", timeout_s=0.2, stop=threading.Event(), poll_s=0.1)


def test_a_count_read_at_its_target_waits_for_the_last_counters_flag(job):
  """The last counter raises its "reached" flag just after its increment.
  A primary that reads the counter at its target in between must not
  return before the flag lands: its forget() would run first and the flag
  would outlive the step (a leaked key per step, seen in a 32-process
  job)."""
  import threading  # noqa: PLC0415
  import time  # noqa: PLC0415

  from emergency_ckpt.cluster.signals import _reached  # noqa: PLC0415

  cols, counted = job
  _all(cols[:5], lambda c: c.count("written_5", 6))
  cols[5].count("written_5")  # the increment; its flag comes 0.3 s later
  late = threading.Thread(target=lambda: (time.sleep(0.3), cols[5].signal(_reached("written_5"))))
  late.start()
  assert cols[0].wait_count("written_5", 6, timeout_s=5, poll_s=2)
  cols[0].forget(count="written_5")
  late.join()
  assert counted[0].key_value_dir_get("emergency_ckpt/t/") == []


def test_a_new_client_starts_its_own_sequence():
  """Exchange keys are numbered per client. A client created after another
  was freed may get its id(); it must still start at 0, or its process
  would wait under other keys than the rest (seen: a fixture's fresh
  clients timing out in a full suite run)."""
  from emergency_ckpt.cluster import rendezvous  # noqa: PLC0415

  class Client:
    pass

  for _ in range(200):
    assert rendezvous._next_key("seq-test", "x", Client()).endswith("/x/0")


def test_the_primarys_key_deletions_never_hold_up_its_next_exchange(job):
  """The primary deletes finished exchanges' keys on a thread of its own: a
  deletion stuck at the service (here: held until released) does not delay
  the primary's next exchanges, and it is done once released."""
  import threading  # noqa: PLC0415

  cols, counted = job
  gate = threading.Event()
  inner = counted[0]._client  # noqa: SLF001 - the primary's real client

  class Held:
    def __getattr__(self, name):
      return getattr(inner, name)

    def key_value_delete(self, key):
      gate.wait(30)
      return inner.key_value_delete(key)

  counted[0]._client = Held()  # noqa: SLF001
  _all(cols, lambda c: c.barrier("one"))
  _all(cols, lambda c: c.barrier("two"))  # the primary queues barrier one's keys
  got = _all(cols, lambda c: c.gather_sparse("three", c.topology.process_index or None))
  assert got == [{p: p for p in range(1, 6)}] * 6  # not held up by the deletion
  assert not cols[0].wait_deleted(0.2)  # still held
  gate.set()
  assert cols[0].wait_deleted(20)
  left = {k.split("/")[2] for k, _ in inner.key_value_dir_get("emergency_ckpt/t/")}
  assert "one" not in left and "two" not in left and "three" in left, left
