"""The primary slice's agreement on which persistent steps it uploads
(persistent/admission.py), with the coordination service replaced by a
shared in-memory store: pure logic, several "processes" as threads."""

from __future__ import annotations

import concurrent.futures
import threading
import types

from emergency_ckpt.core.health import HealthTracker
from emergency_ckpt.persistent.admission import Ticket, UploadAdmission


class Store:
  """The coordination service's flags, counters and values, shared."""

  def __init__(self):
    self.cond = threading.Condition()
    self.flags: set[str] = set()
    self.counts: dict[str, int] = {}
    self.values: dict[str, str] = {}
    self.calls = 0


class FakeCollectives:
  def __init__(self, store: Store):
    self.s = store

  def _call(self):
    self.s.calls += 1

  def signal(self, name):
    with self.s.cond:
      self._call()
      self.s.flags.add(name)
      self.s.cond.notify_all()

  def flag_set(self, name):
    with self.s.cond:
      self._call()
      return name in self.s.flags

  def count(self, name, target=None):
    with self.s.cond:
      self._call()
      self.s.counts[name] = self.s.counts.get(name, 0) + 1
      self.s.cond.notify_all()

  def wait_count(self, name, target, *, timeout_s):
    with self.s.cond:
      self._call()
      return self.s.cond.wait_for(lambda: self.s.counts.get(name, 0) >= target, timeout_s)

  def publish(self, name, value):
    with self.s.cond:
      self._call()
      self.s.values[name] = value
      self.s.cond.notify_all()

  def wait_value(self, name, *, timeout_s):
    with self.s.cond:
      self._call()
      if self.s.cond.wait_for(lambda: name in self.s.values, timeout_s):
        return self.s.values[name]
      return None

  def forget(self, *, signal=None, count=None):
    with self.s.cond:
      self.s.flags.discard(signal)
      self.s.counts.pop(count, None)

  def forget_value(self, name):
    with self.s.cond:
      self.s.values.pop(name, None)


class Events:
  def __init__(self):
    self.records = []

  def record(self, event, **fields):
    self.records.append((event, fields))


def _process(store: Store, index: int, n: int, timeout_s: float = 5.0) -> UploadAdmission:
  topo = types.SimpleNamespace(
    slice_processes=[list(range(n))],
    is_primary_process=index == 0,
    primary_process=0,
    log_prefix=lambda: f"[process={index}]",
  )
  ctx = types.SimpleNamespace(
    collectives=FakeCollectives(store),
    topology=topo,
    options=types.SimpleNamespace(collective_timeout_s=timeout_s),
    health=HealthTracker(["persistent"]),
    events=Events(),
  )
  return UploadAdmission(ctx, on_failed=lambda step, error: None)


def _round(procs, step, busy):
  """Every process enters `step` (busy[i]: its upload still runs), then the
  pending ones decide on threads (as on their upload lanes)."""
  tickets = [p.enter(step, busy="upload of step 1" if b else None) for p, b in zip(procs, busy)]
  with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
    return list(pool.map(lambda pt: pt[0].decide(pt[1]), zip(procs, tickets))), tickets


def test_all_free_every_process_uploads():
  store = Store()
  procs = [_process(store, i, 4) for i in range(4)]
  decided, tickets = _round(procs, 3, [False] * 4)
  assert [t.go for t in tickets] == [None] * 4  # nobody knows in save()
  assert [t.go for t in decided] == [True] * 4


def test_primary_busy_skips_at_once_everywhere():
  store = Store()
  procs = [_process(store, i, 4) for i in range(4)]
  decided, tickets = _round(procs, 6, [True, False, False, False])
  assert tickets[0].go is False and "previous upload still runs" in tickets[0].why
  assert [t.go for t in decided] == [False] * 4
  assert all("previous upload still runs" in t.why for t in decided), decided


def test_one_other_process_busy_vetoes_the_step_for_all():
  store = Store()
  procs = [_process(store, i, 3) for i in range(3)]
  decided, tickets = _round(procs, 9, [False, False, True])
  assert tickets[2].go is False
  assert [t.go for t in decided] == [False] * 3
  assert "another process" in decided[0].why


def test_a_process_that_never_joins_makes_it_a_skip_not_a_hang():
  store = Store()
  procs = [_process(store, i, 3, timeout_s=0.3) for i in range(3)]
  t0 = procs[0].enter(12, busy=None)
  t1 = procs[1].enter(12, busy=None)  # process 2 is dead: never enters
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    d0, d1 = pool.map(lambda pt: pt[0].decide(pt[1]), [(procs[0], t0), (procs[1], t1)])
  assert d0.go is False and d1.go is False
  assert "within" in d0.why


def test_coordination_calls_per_process_are_constant_and_old_keys_go():
  store = Store()
  n = 16
  procs = [_process(store, i, n) for i in range(n)]
  for step in range(3, 60, 3):
    store.calls = 0
    _round(procs, step, [False] * n)
    assert store.calls <= 3 * n + 2  # O(1) per process: count + wait, the primary's few more
  assert len(store.values) <= 3 and len(store.counts) <= 3  # only the last decisions remain


def test_skips_are_recorded_once_warned_and_in_health(caplog):
  store = Store()
  (p,) = [_process(store, 0, 1)]
  for step in (3, 6, 9):
    p.skipped(Ticket(step, False, "the previous upload still runs (step 1)"))
  health = p._ctx.health.snapshot()["persistent"]  # noqa: SLF001
  assert health.skipped_steps == (3, 6, 9) and health.skipped_total == 3
  events = [f for e, f in p._ctx.events.records if e == "save_skipped"]  # noqa: SLF001
  assert [f["step"] for f in events] == [3, 6, 9] and all(f["waiting_on"] for f in events)
  warnings = [r for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 1 and "persistent step 3 skipped" in warnings[0].getMessage()


def _confirm_round(procs, step, errors):
  """Every process confirms `step` (errors[i]: its preparation failed), on threads."""
  with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
    return list(pool.map(lambda pe: pe[0].confirm(step, pe[1]), zip(procs, errors)))


def test_every_process_ready_enters_the_save():
  store = Store()
  procs = [_process(store, i, 4) for i in range(4)]
  _round(procs, 3, [False] * 4)
  assert _confirm_round(procs, 3, [None] * 4) == [True] * 4


def test_one_process_that_failed_to_prepare_keeps_every_other_out():
  store = Store()
  procs = [_process(store, i, 3) for i in range(3)]
  _round(procs, 6, [False] * 3)
  got = _confirm_round(procs, 6, [None, "OSError: disk", None])
  assert got == [False, False, False]
  for i in (0, 2):  # the ready ones record a skip naming why; the failing one records its failure
    health = procs[i]._ctx.health.snapshot()["persistent"]  # noqa: SLF001
    assert health.skipped_steps == (6,) and not health.in_flight, health
    (event,) = [f for e, f in procs[i]._ctx.events.records if e == "save_skipped"]  # noqa: SLF001
    assert "failed to prepare" in event["waiting_on"]
  assert procs[1]._ctx.health.snapshot()["persistent"].skipped_total == 0  # noqa: SLF001


def test_a_process_that_never_confirms_is_a_skip_and_vetoes_a_late_one():
  store = Store()
  procs = [_process(store, i, 3, timeout_s=0.3) for i in range(3)]
  got = _confirm_round(procs[:2], 9, [None, None])  # process 2 is still preparing
  assert got == [False, False]
  events = [f for e, f in procs[0]._ctx.events.records if e == "save_skipped"]  # noqa: SLF001
  assert "within" in events[0]["waiting_on"]
  # process 2 comes in late: everyone counted, but the others left: it must not go in alone
  assert procs[2].confirm(9, None) is False


def test_confirm_keys_go_with_the_old_decisions():
  store = Store()
  n = 4
  procs = [_process(store, i, n) for i in range(n)]
  for step in range(3, 30, 3):
    _round(procs, step, [False] * n)
    assert _confirm_round(procs, step, [None] * n) == [True] * n
  assert len(store.counts) <= 6 and not store.flags  # ready and prepared counters of the last two
