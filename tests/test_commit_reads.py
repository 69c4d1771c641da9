"""Local retention's COMMIT reads never wait on a sick state store
(retention/commit_reads.py). Pure logic: the store is a function."""

from __future__ import annotations

import threading
import time

import pytest

from emergency_ckpt.retention import plans
from emergency_ckpt.retention.commit_reads import CommitReads
from emergency_ckpt.retention.rules import Rules


class Store:
  """A state store whose reads answer from `committed`, hang while `hung` is
  set (until `released`), or raise `error`."""

  def __init__(self, committed=()):
    self.committed = set(committed)
    self.reads: list[int] = []
    self.hung = threading.Event()
    self.released = threading.Event()
    self.error: Exception | None = None

  def has_commit(self, step: int) -> bool:
    self.reads.append(step)
    if self.hung.is_set():
      self.released.wait(30)
    if self.error is not None:
      raise self.error
    return step in self.committed


@pytest.fixture
def store():
  s = Store(committed={4, 6})
  yield s
  s.released.set()


def test_known_commits_are_not_read_and_reads_are_once_per_step_per_pass(store):
  reads = CommitReads(store.has_commit, log_prefix="[t]")
  reads.learned(8)
  ask = reads.asker()
  assert ask(8) and ask(6) and not ask(7)
  assert ask(6) and not ask(7)
  assert store.reads == [6, 7]
  assert reads.known() == {6, 8}  # a read that said yes is remembered
  assert reads.asker()(6) and store.reads == [6, 7]
  reads.close()


def test_a_hung_store_costs_one_bounded_wait_then_nothing(store, caplog):
  reads = CommitReads(store.has_commit, log_prefix="[t]", wait_s=0.2)
  reads.learned(2)
  store.hung.set()
  ask = reads.asker()
  t0 = time.monotonic()
  assert not ask(6)  # committed in the store, but it does not answer
  assert not ask(4)  # the pass asks no more
  assert ask(2)  # known commits still count
  assert time.monotonic() - t0 < 1.0
  # the next passes do not pile reads behind the stuck one, nor wait
  t0 = time.monotonic()
  assert not reads.asker()(6)
  assert time.monotonic() - t0 < 0.1
  assert store.reads == [6]
  assert sum("cannot read COMMITs" in r.message for r in caplog.records) == 1
  # the store answers again: reads resume
  store.hung.clear()
  store.released.set()
  time.sleep(0.05)
  assert 6 in reads.known()  # the read that timed out said yes, late: remembered
  assert reads.asker()(4)
  assert any("reads COMMITs again" in r.message for r in caplog.records)
  reads.close()


def test_a_failing_store_counts_as_unknown_not_as_an_error(store):
  reads = CommitReads(store.has_commit, log_prefix="[t]")
  store.error = OSError("connection reset")
  ask = reads.asker()
  assert not ask(6) and not ask(4)
  assert store.reads == [6]
  reads.close()


def test_a_hung_store_keeps_the_ramdisk_within_its_budget_and_every_claimed_step(store):
  """The plan a pass makes while the store hangs: the newest known commit,
  every claimed step (its COMMIT may come) and at most max_to_keep + 1
  newer steps in all; the steps saved during the outage are not all kept."""
  reads = CommitReads(store.has_commit, log_prefix="[t]", wait_s=0.1)
  reads.learned(6)
  store.hung.set()
  held = list(range(5, 31))  # 24 steps saved since the newest known commit
  plan = plans.local_plan(held, Rules(max_to_keep=2), is_committed=reads.asker(), claimed={7})
  assert 6 in plan.keep and 7 in plan.keep
  assert set(plan.keep) <= {5, 6, 7, 29, 30}
  reads.close()
