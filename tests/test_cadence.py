"""Save intervals chosen by the manager: save_interval_steps "auto" and
save_interval_s (save/cadence*.py).

Pure logic on a fake clock: simulated trainers whose saves cost a known
stall and slowdown, the primary's decisions, and the agreement of several
"processes" through a fake coordination service (one thread, processes
interleaved by hand: in lockstep, lagging, ahead, or missing reads). Then
the options and configs, the manager's wiring in one process, and one real
2-process job.
"""

from __future__ import annotations

import json
import os
import random

import pytest

import emergency_ckpt as ec
from emergency_ckpt.config import options_from_dict
from emergency_ckpt.errors import CollectiveTimeoutError, InvalidOptionsError
from emergency_ckpt.runtime.background import Background
from emergency_ckpt.save import cadence_job
from emergency_ckpt.save.cadence import LOCAL_WARMUP_STEPS, Cadence, TierPlan
from emergency_ckpt.save.cadence_costs import CostModel
from emergency_ckpt.save.cadence_schedule import Segment, TierSchedule, change_start
from emergency_ckpt.save.cadence_targets import (
  DEFAULT_MTBF_S,
  MIN_MTBF_S,
  FailureHistory,
  Planner,
  budget_interval,
  mtbf_estimate,
  seconds_interval,
  young_daly_s,
)

NEVER = TierPlan(fixed=10**9)  # a fixed tier that never saves in these runs


class Events:
  def __init__(self):
    self.records = []

  def record(self, event, **fields):
    self.records.append((event, fields))

  def cadence(self, tier):
    return [f for e, f in self.records if e == "cadence" and f["tier"] == tier]


class Store:
  """The coordination service's key-value store, shared by the fake processes."""

  def __init__(self):
    self.values: dict[str, str] = {}
    self.calls: dict[str, int] = {}


class Channel:
  """One process's client of `Store`; `miss` reads answer None (late reads)."""

  def __init__(self, store: Store, who: str, miss: int = 0):
    self.store, self.who, self.miss = store, who, miss

  def _call(self):
    self.store.calls[self.who] = self.store.calls.get(self.who, 0) + 1

  def publish(self, name, value, *, overwrite=False):
    self._call()
    if name in self.store.values and not overwrite:
      raise AssertionError(f"{name} published twice")
    self.store.values[name] = value

  def try_value(self, name):
    self._call()
    if self.miss > 0:
      self.miss -= 1
      return None
    return self.store.values.get(name)


class Proc:
  """One process's trainer on a fake clock: every step calls decide(); a
  local save stalls `stall_s` (plus the wait for a previous write still in
  flight, if `overlap`), then writes in the background for `write_s`; a step
  that starts while a write is in flight takes `slow_s` longer. Persistent
  saves likewise (p_stall_s, upload_s, p_slow_s)."""

  def __init__(
    self,
    plans,
    *,
    deciding=True,
    channel=None,
    step_s=0.1,
    stall_s=0.0001,
    write_s=0.01,
    slow_s=0.0,
    p_stall_s=0.0,
    upload_s=0.0,
    p_slow_s=0.0,
    overlap=False,
    noise=0.0,
    step_noise=None,
    seed=0,
    history=None,
    timeout_s=30.0,
  ):
    self.t = 0.0
    self.events = Events()
    self.step_s, self.stall_s, self.write_s, self.slow_s = step_s, stall_s, write_s, slow_s
    self.p_stall_s, self.upload_s, self.p_slow_s = p_stall_s, upload_s, p_slow_s
    self.overlap, self.rng = overlap, random.Random(seed)
    self.noise, self.step_noise = noise, noise if step_noise is None else step_noise
    self.local_until = self.upload_until = -1.0
    self.saved = {"local": [], "persistent": []}
    self.spent = 0.0  # stall + slowdown, for the overhead actually paid
    self.on_sleep = None
    self.next = None
    self.cad = Cadence(
      plans,
      deciding=deciding,
      channel=channel,
      events=self.events,
      clock=lambda: self.t,
      wall=lambda: 1e9 + self.t,
      sleep=self._sleep,
      busy=self._busy,
      history=history,
      timeout_s=timeout_s,
    )

  def _busy(self):
    out = set()
    if self.t < self.local_until:
      out.add("local")
    if self.t < self.upload_until:
      out.add("persistent")
    return frozenset(out)

  def _sleep(self, d):
    self.t += d
    if self.on_sleep is not None:
      self.on_sleep()

  def _jitter(self, x, noise=None):
    noise = self.noise if noise is None else noise
    return x * (1 + noise * (2 * self.rng.random() - 1))

  def step(self, s, *, force=False):
    d = self.cad.decide(s, force=force)
    if d.any:
      stall = 0.0
      if d.local:
        if self.overlap:
          stall += max(0.0, self.local_until - self.t)  # waits for the last write
        stall += self._jitter(self.stall_s)
      if d.persistent:
        stall += self.p_stall_s
      self.t += stall
      self.spent += stall
      if d.local:
        self.local_until = self.t + self.write_s
        self.saved["local"].append(s)
      if d.persistent:
        self.upload_until = self.t + self.upload_s
        self.saved["persistent"].append(s)
      self.cad.saved(s, d)
    train = self._jitter(self.step_s, self.step_noise)
    if self.t < self.local_until:
      train += self.slow_s
      self.spent += self.slow_s
    if self.t < self.upload_until:
      train += self.p_slow_s
      self.spent += self.p_slow_s
    self.t += train
    return d


def local_auto(budget=0.01, persistent=NEVER):
  return {"local": TierPlan(auto=True, budget=budget), "persistent": persistent}


def run(proc, first, last):
  for s in range(first, last + 1):
    proc.step(s)
  return proc


def gaps(steps):
  return [b - a for a, b in zip(steps, steps[1:])]


# ---- the local tier's "auto" -------------------------------------------------
def test_budget_met_at_one_saves_every_step():
  p = run(Proc(local_auto()), 1, 300)
  assert p.saved["local"][:3] == [1, 1 + LOCAL_WARMUP_STEPS, 1 + 2 * LOCAL_WARMUP_STEPS]
  assert p.cad.interval("local") == 1
  assert p.saved["local"][-100:] == list(range(201, 301))  # every step
  (change,) = p.events.cadence("local")[1:]  # one change, after the warm-up
  assert change["interval_steps"] == 1 and change["why"]["cost_s"] < 0.001


def test_expensive_save_grows_the_interval_to_the_budget():
  # a save costs 20 ms of stall + 10 ms of slowdown of the step beside its
  # write: 30 ms; 1% of a 100 ms step is 1 ms a step: every 30 steps meets
  # the budget, 36 with its 20% headroom
  p = run(Proc(local_auto(), stall_s=0.02, write_s=0.05, slow_s=0.01), 1, 1500)
  assert p.cad.interval("local") == 36
  change = p.events.cadence("local")[-1]
  assert change["why"]["cost_s"] == pytest.approx(0.03, rel=1e-3)
  assert change["why"]["slowdown_s"] == pytest.approx(0.01, rel=1e-3)
  assert change["why"]["overhead"] <= 0.01 + 1e-9
  tail = p.saved["local"][-20:]
  assert set(gaps(tail)) == {36}
  # the overhead the trainer paid over the settled tail is within the budget
  q = Proc(local_auto(), stall_s=0.02, write_s=0.05, slow_s=0.01)
  run(q, 1, 1000)
  spent0, t0 = q.spent, q.t
  run(q, 1001, 1600)
  assert 0.0075 <= (q.spent - spent0) / (q.t - t0) <= 0.01


def test_a_larger_budget_saves_more_often():
  p = run(Proc(local_auto(budget=0.1), stall_s=0.02, write_s=0.05, slow_s=0.01), 1, 600)
  assert p.cad.interval("local") == 4  # 30 ms / (10% of 100 ms) = 3, 20% headroom


@pytest.mark.parametrize("seed", range(6))
def test_noisy_costs_do_not_make_the_interval_swing(seed):
  # stalls vary +-30% save to save, step times +-5% step to step
  p = Proc(
    local_auto(), stall_s=0.02, write_s=0.05, slow_s=0.01, noise=0.3, step_noise=0.05, seed=seed
  )
  run(p, 1, 6000)
  changes = [(f["from_step"], f["interval_steps"]) for f in p.events.cadence("local")[1:]]
  assert len(changes) <= 3 and len([s for s, _ in changes if s > 1000]) <= 2, changes
  assert 30 <= p.cad.interval("local") <= 45


def test_a_cost_that_depends_on_the_interval_settles():
  # a write lasts 0.35 s: at short intervals the next save waits for it (its
  # stall grows); at long ones it does not. The interval must settle, not swing.
  p = Proc(local_auto(budget=0.05), stall_s=0.01, write_s=0.35, slow_s=0.0, overlap=True)
  run(p, 1, 3000)
  intervals = [f["interval_steps"] for f in p.events.cadence("local")]
  # the budget alone asks for every 3rd step, where each save would wait for
  # the last write: it stops at the 4 steps a write runs, and stays there
  assert intervals == [5, 4], intervals


def test_writes_longer_than_the_warm_up_double_the_interval():
  # every step has a write in flight from the first: no step time to compare to
  p = run(Proc(local_auto(), stall_s=0.001, write_s=10.0, slow_s=0.0), 1, 200)
  first = p.events.cadence("local")[1]
  assert first["interval_steps"] == 2 * LOCAL_WARMUP_STEPS and "outlast" in first["why"]["reason"]


# ---- the persistent tier's "auto" --------------------------------------------
def test_young_daly_numbers_are_exact():
  assert young_daly_s(50.0, 10_000.0) == 1000.0
  assert young_daly_s(0.0, 10_000.0) == 0.0
  m = CostModel()
  m.step_s.value, m.step_s.count = 2.0, 10
  c = m.tiers["persistent"]
  c.cost.value = c.stall.value = 50.0
  c.samples = 1
  c.busy_steps.value = 0.0
  got = Planner(m, FailureHistory()).persistent(10_000.0, 0.0, 100)
  assert got is not None
  k, why = got
  assert k == 500  # 1000 s at 2 s a step
  assert why["young_daly_s"] == 1000.0 and why["mtbf_from"] == "option"
  # the same MTBF estimated from restarts: 3 starts over 20000 s
  history = FailureHistory(first_start=0.0, starts=3)
  k, why = Planner(m, history).persistent(None, 20_000.0, 100)
  assert (k, why["mtbf_s"], why["mtbf_from"]) == (500, 10_000.0, "restarts")
  # uploads that run 600 steps: the interval leaves room for them
  c.busy_steps.value = 600.0
  assert Planner(m, FailureHistory()).persistent(10_000.0, 0.0, 100)[0] == 750
  # a change under 20% is not made
  c.busy_steps.value = 0.0
  assert Planner(m, FailureHistory()).persistent(10_000.0, 0.0, 450) is None


def test_mtbf_estimate_sources():
  assert mtbf_estimate(123.0, FailureHistory(), 0.0) == (123.0, "option")
  assert mtbf_estimate(None, FailureHistory(first_start=0.0), 10.0) == (DEFAULT_MTBF_S, "default")
  assert mtbf_estimate(None, FailureHistory(first_start=0.0), 3 * DEFAULT_MTBF_S) == (
    3 * DEFAULT_MTBF_S,
    "default",
  )
  assert mtbf_estimate(None, FailureHistory(first_start=0.0, starts=5), 100.0) == (
    MIN_MTBF_S,
    "restarts",
  )


def test_failure_history_counts_this_runs_starts_only():
  first = FailureHistory.after(None, "run-a", 100.0)
  assert first == FailureHistory(first_start=100.0, starts=1)
  record = {"run_id": "run-a", **first.as_record()}
  assert FailureHistory.after(record, "run-a", 500.0) == FailureHistory(first_start=100.0, starts=2)
  assert FailureHistory.after(record, "run-b", 500.0) == FailureHistory(first_start=500.0, starts=1)
  bad = {"run_id": "run-a", "first_start": "yesterday", "starts": 4}
  assert FailureHistory.after(bad, "run-a", 500.0).starts == 1


def test_persistent_auto_end_to_end_on_a_fake_clock():
  # 5 s per upload's stall, 1 s steps, MTBF 3600 s: sqrt(2*5*3600) = 189.7 s
  plans = {"local": TierPlan(fixed=10), "persistent": TierPlan(auto=True, mtbf_s=3600.0)}
  p = run(Proc(plans, step_s=1.0, p_stall_s=5.0, upload_s=0.5), 1, 1500)
  assert p.saved["persistent"][:2] == [1, 101]  # warm-up: the first step, then 100
  assert p.cad.interval("persistent") == 190
  change = p.events.cadence("persistent")[-1]
  assert change["why"]["young_daly_s"] == pytest.approx(189.7, abs=0.1)
  assert set(gaps(p.saved["persistent"][-4:])) == {190}
  assert all(s % 10 == 0 for s in p.saved["local"])  # the fixed tier as before


# ---- save_interval_s -----------------------------------------------------------
def test_seconds_in_one_process_save_the_first_step_that_long_after_the_last():
  plans = {"local": TierPlan(seconds=1.0), "persistent": NEVER}
  p = Proc(plans, step_s=0.15)
  began = {}
  for s in range(1, 120):
    p.step_s = 0.15 if s < 50 else 0.4  # the step time changes
    began[s] = p.t
    p.step(s)
  saved = p.saved["local"]
  assert saved[0] == 1 and len(saved) >= 20
  for a, b in zip(saved, saved[1:]):
    assert began[b] - began[a] >= 1.0  # at least 1 s after the previous save
    assert b - 1 == a or began[b - 1] - began[a] < 1.0  # and the first such step


def test_seconds_become_a_step_schedule_agreed_by_every_process():
  store = Store()
  plans = {"local": TierPlan(seconds=2.0), "persistent": NEVER}
  primary = Proc(plans, channel=Channel(store, "p0"), step_s=0.1, stall_s=0.0)
  other = Proc(plans, deciding=False, channel=Channel(store, "p1"), step_s=0.1, stall_s=0.0)
  drive(primary, [(other, 0)], 1, 400)
  assert primary.saved == other.saved
  assert primary.cad.interval("local") == 20  # 2 s of 0.1 s steps
  assert set(gaps(primary.saved["local"][-10:])) == {20}


# ---- agreement between processes ---------------------------------------------
def drive(primary, readers, first, last):
  """Runs steps first..last on every process. A reader with lag L runs step
  s once the primary ran s + L (L < 0: |L| steps ahead of it); a reader
  that waits for the primary's schedule lets the primary run a step per
  poll (its sleep)."""
  primary.next = first
  for r, _ in readers:
    r.next = first

  def advance_primary():
    if primary.next <= last:
      primary.step(primary.next)
      primary.next += 1

  for r, _ in readers:
    r.on_sleep = advance_primary
  while primary.next <= last or any(r.next <= last for r, _ in readers):
    advance_primary()
    for r, lag in readers:
      limit = last if primary.next > last else primary.next - 1 - lag
      while r.next <= min(last, limit):
        r.step(r.next)
        r.next += 1


def job(store, lags, misses=None, **costs):
  plans = local_auto()
  primary = Proc(plans, channel=Channel(store, "p0"), **costs)
  readers = []
  for i, lag in enumerate(lags, start=1):
    miss = (misses or {}).get(i, 0)
    # the other processes measure other costs: it must not matter
    reader = Proc(
      plans, deciding=False, channel=Channel(store, f"p{i}", miss=miss), stall_s=0.05 * i
    )
    readers.append((reader, lag))
  return primary, readers


COSTS = {"stall_s": 0.02, "write_s": 0.05, "slow_s": 0.01}  # interval 5 -> 36


@pytest.mark.parametrize(
  "lags",
  [[0, 0], [3, 10], [-3, -7], [25, -12]],
  ids=["lockstep", "behind", "ahead", "mixed"],
)
def test_every_process_saves_the_same_steps(lags):
  store = Store()
  primary, readers = job(store, lags, **COSTS)
  drive(primary, readers, 1, 1500)
  assert primary.cad.interval("local") == 36
  assert len(primary.events.cadence("local")) >= 2  # it changed
  for r, _ in readers:
    assert r.saved == primary.saved
    assert [f["from_step"] for f in r.events.cadence("local")] == [
      f["from_step"] for f in primary.events.cadence("local")
    ]


def test_no_read_per_step_and_no_wait_in_lockstep():
  store = Store()
  primary, readers = job(store, [0], **COSTS)
  drive(primary, readers, 1, 1500)
  reader = readers[0][0]
  assert reader.cad.waits == 0
  saves = len(reader.saved["local"])
  assert store.calls["p1"] <= saves  # at most one read per save of its own
  assert store.calls["p1"] < 1500 / 5
  assert store.calls["p0"] < 1500 / 5  # the primary publishes every half lead


def test_a_process_ahead_of_the_primary_waits_for_its_schedule():
  store = Store()
  primary, readers = job(store, [-40], **COSTS)
  drive(primary, readers, 1, 800)
  reader = readers[0][0]
  assert reader.cad.waits > 0
  assert reader.saved == primary.saved


def test_a_process_that_reads_late_still_agrees():
  store = Store()
  # process 1's first 40 reads find nothing (a slow service): it keeps its
  # schedule and, at its horizon, polls until it reads the primary's
  primary, readers = job(store, [0, 0], misses={1: 40}, **COSTS)
  drive(primary, readers, 1, 1500)
  late, prompt = readers[0][0], readers[1][0]
  assert late.cad.waits > 0 and prompt.cad.waits == 0
  assert late.saved == prompt.saved == primary.saved


def test_a_silent_primary_is_a_timeout_naming_it():
  store = Store()
  reader = Proc(local_auto(), deciding=False, channel=Channel(store, "p1"), timeout_s=5.0)
  with pytest.raises(CollectiveTimeoutError, match="primary process"):
    run(reader, 1, 200)
  assert 5.0 <= reader.t < 10.0


def test_forced_saves_save_both_tiers_and_keep_the_schedule():
  store = Store()
  primary, readers = job(store, [0], **COSTS)
  reader = readers[0][0]
  drive(primary, readers, 1, 100)
  for p in (primary, reader):
    d = p.step(101, force=True)
    assert d.local and d.persistent
  drive(primary, readers, 102, 600)
  assert 101 in reader.saved["persistent"]
  assert primary.saved == reader.saved


# ---- the schedule ---------------------------------------------------------------
def test_schedule_segments_and_where_a_change_starts():
  sched = TierSchedule(Segment(100, 10))
  assert [s for s in range(95, 131) if sched.saves(s)] == [100, 110, 120, 130]
  assert sched.last_save_at_or_before(125) == 120 and sched.next_save_after(125) == 130
  # shorter: starts right after the horizon; longer: at the next old save
  assert change_start(sched, 125, 1) == 126
  assert change_start(sched, 125, 50) == 130
  assert change_start(sched, 125, 3) == 126  # 120 + 3 is already agreed: after 125
  sched.add(Segment(130, 50, 1))
  assert [s for s in range(95, 240) if sched.saves(s)] == [100, 110, 120, 130, 180, 230]
  with pytest.raises(ValueError):
    sched.add(Segment(120, 5, 2))  # no later than the newest
  with pytest.raises(ValueError):
    sched.add(Segment(300, 5, 3))  # not the next seq
  once = TierSchedule(Segment(7, None))
  assert [s for s in range(0, 50) if once.saves(s)] == [7]
  assert change_start(once, 30, 20) == 31  # 7 + 20 is agreed already
  seg = Segment(40, 8, 3, {"cost_s": 0.5})
  assert Segment.from_json(seg.to_json(), 3) == seg


def test_interval_helpers():
  assert budget_interval(0.03, 0.1, 0.01) == pytest.approx(30.0)
  assert seconds_interval(2.0, 0.1, 10**6) == 20
  assert seconds_interval(2.05, 0.1, 10**6) == 21
  assert seconds_interval(0.01, 0.1, 10**6) == 1
  assert seconds_interval(1e9, 0.1, 50) == 50


# ---- options and configs -------------------------------------------------------
LOCAL = {"directory": "/dev/shm/x"}
PERSISTENT = {"directory": "/tmp/p"}

INVALID = [
  ({"save_interval_steps": "Auto"}, "local.save_interval_steps must be an integer >= 1 or 'auto'"),
  ({"save_interval_steps": "10"}, "local.save_interval_steps"),
  ({"save_interval_s": 0}, "local.save_interval_s must be a number of seconds > 0"),
  ({"save_interval_s": -1.5}, "local.save_interval_s"),
  ({"save_interval_s": True}, "local.save_interval_s"),
  ({"save_interval_s": float("inf")}, "local.save_interval_s"),
  ({"save_interval_s": 60, "save_interval_steps": 50}, "ambiguous"),
  ({"save_interval_s": 60, "save_interval_steps": "auto"}, "ambiguous"),
  ({"save_interval_steps": "auto", "overhead_budget": 0}, "local.overhead_budget"),
  ({"save_interval_steps": "auto", "overhead_budget": 1.0}, "local.overhead_budget"),
  ({"save_interval_steps": "auto", "overhead_budget": "1%"}, "local.overhead_budget"),
  ({"overhead_budget": 0.05}, "only tunes local.save_interval_steps: auto"),
]


@pytest.mark.parametrize("fields,message", INVALID)
def test_invalid_local_cadence_options(fields, message):
  with pytest.raises(InvalidOptionsError, match=message.replace("(", r"\(").replace(")", r"\)")):
    ec.LocalTierOptions(**{**LOCAL, **fields})


@pytest.mark.parametrize(
  "fields,message",
  [
    ({"save_interval_s": 600, "save_interval_steps": 1000}, "ambiguous"),
    ({"mean_time_between_failures_s": 3600}, "only tunes persistent.save_interval_steps: auto"),
    (
      {"save_interval_steps": "auto", "mean_time_between_failures_s": 0},
      "persistent.mean_time_between_failures_s must be",
    ),
  ],
)
def test_invalid_persistent_cadence_options(fields, message):
  with pytest.raises(InvalidOptionsError, match=message):
    ec.PersistentTierOptions(**{**PERSISTENT, **fields})


def test_valid_cadence_options_and_yaml(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text(
    "local:\n  directory: /dev/shm/x\n  save_interval_steps: auto\n  overhead_budget: 0.02\n"
    "persistent:\n  directory: /tmp/p\n  save_interval_steps: auto\n"
    "  mean_time_between_failures_s: 86400\n"
  )
  o = ec.load_config(path)
  assert o.local.save_interval_steps == "auto" and o.local.overhead_budget == 0.02
  assert o.persistent.save_interval_steps == "auto"
  assert o.persistent.mean_time_between_failures_s == 86400
  o = ec.load_config(path, overrides=["local.save_interval_steps=7", "local.overhead_budget=0.01"])
  assert o.local.save_interval_steps == 7
  o = options_from_dict(
    {
      "local": {**LOCAL, "save_interval_s": 30},
      "persistent": {**PERSISTENT, "save_interval_s": 900},
    }
  )
  assert o.local.save_interval_s == 30 and o.persistent.save_interval_s == 900
  assert ec.PersistentTierOptions(directory="/p", save_interval_s=1.5).save_interval_steps == 100


def test_run_record_with_a_chosen_persistent_interval():
  fixed = options_from_dict({"local": LOCAL, "persistent": PERSISTENT})
  auto = options_from_dict(
    {"local": LOCAL, "persistent": {**PERSISTENT, "save_interval_steps": "auto"}}
  )
  for options, want in ((fixed, 100), (auto, 1)):
    assert cadence_job.run_record(options)["persistent_save_interval_steps"] == want
  assert cadence_job.run_record(auto)["persistent_save_cadence"] == "auto"
  json.dumps(cadence_job.run_record(auto))


def test_the_primary_names_its_persistent_steps_for_state_retention():
  # warm-up: the first step, then every 100; a forced save is one too
  plans = {"local": TierPlan(fixed=1), "persistent": TierPlan(auto=True, mtbf_s=3600.0)}
  p = run(Proc(plans, step_s=1.0, p_stall_s=5.0), 1, 150)
  p.step(151, force=True)
  assert p.saved["persistent"] == [1, 101, 151]
  assert p.cad.persistent_steps(None) == [1, 101, 151]
  assert p.cad.persistent_steps(101) == [151]  # finalized up to 101: forgotten
  assert p.cad.persistent_steps(None) == [151]


def test_lane_busy():
  import threading  # noqa: PLC0415

  bg = Background()
  assert not bg.busy("local-write")
  gate = threading.Event()
  fut = bg.submit("local-write", gate.wait)
  assert bg.busy("local-write")
  gate.set()
  fut.result(5)
  assert not bg.busy("local-write")
  bg.close()


# ---- the manager -----------------------------------------------------------------
def test_manager_in_one_process_follows_the_cadence(shm_dir, mesh):
  from tests.scenarios import make_state  # noqa: PLC0415

  options = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=os.path.join(shm_dir, "l"), save_interval_steps="auto"),
    persistent=ec.PersistentTierOptions(directory=os.path.join(shm_dir, "p"), save_interval_s=3600),
    run_id="cadence",
    event_log=os.path.join(shm_dir, "events.jsonl"),
  )
  with ec.CheckpointManager(options, mesh=mesh) as m:
    saved = [s for s in range(1, 13) if m.save(s, make_state(mesh, s))]
    assert m.save(13, make_state(mesh, 13), force=True)
    m.wait_until_finished()
    steps = m.all_steps()
  # local warm-up: the first step, then every 5; persistent: the first step only
  assert saved == [1, 6, 11] and 13 in steps and 1 in steps
  events = [json.loads(line) for line in open(options.event_log)]
  cadence = [e for e in events if e["event"] == "cadence"]
  assert (cadence[0]["tier"], cadence[0]["interval_steps"]) == ("local", LOCAL_WARMUP_STEPS)
  assert {e["tier"] for e in cadence} == {"local"}  # seconds in one process: no schedule
  run = json.load(open(os.path.join(shm_dir, "p", "run.json")))
  assert run["persistent_save_interval_steps"] == 1 and run["starts"] == 1


def test_persistent_auto_keeps_the_state_of_its_persistent_steps_only(shm_dir, mesh, monkeypatch):
  """While the upload of step 1 (persistent "auto" saves the first step)
  hangs, the state store holds step 1's state and what the local rules
  keep, not the state of every step since."""
  import threading  # noqa: PLC0415
  import time  # noqa: PLC0415

  from etils import epath  # noqa: PLC0415

  from emergency_ckpt.core import failpoints, layout  # noqa: PLC0415
  from emergency_ckpt.retention.plans import LOCAL_LAG_STEPS  # noqa: PLC0415
  from emergency_ckpt.state.store import StateStore  # noqa: PLC0415
  from tests.scenarios import make_state  # noqa: PLC0415

  gate, hit = threading.Event(), failpoints.hit

  def hold(name, step):  # the upload thread of step 1 waits for the gate
    if (name, step) == ("persistent.before_save", 1):
      gate.wait(120)
    hit(name, step)

  monkeypatch.setattr(failpoints, "hit", hold)
  root = os.path.join(shm_dir, "p")
  options = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(
      directory=os.path.join(shm_dir, "l"), save_interval_steps=1, max_to_keep=2
    ),
    persistent=ec.PersistentTierOptions(directory=root, save_interval_steps="auto"),
    run_id="cadence-state",
  )
  store = StateStore(layout.state_dir(epath.Path(root)), process_index=0, process_count=1)
  last = 30
  want = {1, *range(last - 2 - LOCAL_LAG_STEPS + 1, last + 1)}  # step 1 and the newest 2 + 2
  with ec.CheckpointManager(options, mesh=mesh) as m:
    try:
      for s in range(1, last + 1):
        m.save(s, make_state(mesh, s))
      deadline = time.monotonic() + 30
      while (held := set(store.listed_steps())) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    finally:
      gate.set()
    m.wait_until_finished()
    restorable = m.all_steps()
  assert held == want  # the interval-1 retention kept all of 1..30 here
  assert 1 in restorable  # the uploaded step's state was kept for it


# ---- a real job --------------------------------------------------------------------
def test_two_processes_with_different_costs_save_the_same_steps(shm_dir):
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415

  args = {
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "event_log": os.path.join(shm_dir, "events_{process}.jsonl"),
    "steps": 90,
    # process 1 trains faster and saves slower: it runs ahead of the primary
    "step_s": {"0": 0.03, "1": 0.005},
    "extra_after_save_s": {"0": 0.0, "1": 0.02},
  }
  results = run_job("tests.cadence_scenarios:train_auto", 2, args, timeout_s=150).check()
  assert results[0]["saved"] == results[1]["saved"], results
  assert len(results[0]["saved"]) >= 10
  for r in results:
    intervals = [c["interval_steps"] for c in r["cadence"]]
    assert intervals[0] == LOCAL_WARMUP_STEPS and len(intervals) >= 2, r["cadence"]
  # a change that starts past the last step may reach the primary's log only
  within = [[c for c in r["cadence"] if c["from_step"] <= args["steps"]] for r in results]
  assert within[0] == within[1]
  assert results[0]["saved"][-1] in results[0]["restorable"]  # every process's JSON: committed
