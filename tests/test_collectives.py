"""Collectives against a real JAX coordination service, with simulated
processes (one client each, threads of this test): what each exchange costs
and what it returns, the commit hint's counter, and the timeout's message."""

from __future__ import annotations

import concurrent.futures
import socket

import pytest

from emergency_ckpt.bench.scale_exchange import CountingClient as Counting
from emergency_ckpt.errors import CollectiveTimeoutError
from emergency_ckpt.topology import Collectives, Topology


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
