"""The soak's driver: one training run restarted round after round, each
round a real multi-process jax.distributed job (tests/soak/job.py) that is
killed at a seeded moment, after which seeded damage is done to what it left.

One integer seed decides everything: round r's choices come from
random.Random(f"{seed}/{r}") (drawn before the round starts, so they do not
depend on what earlier rounds left behind, only which files a choice lands
on does). Timing (where exactly a SIGKILL lands) is the machine's: a replay
runs the same plan, not the same bytes.

Invariants checked every round (a failure names the seed, the round, the
configuration and what broke):
- every process restores the same step, bit-exact, with its own data_state;
- never below the newest intact committed persistent step ("lost");
- after a round in which no local file was damaged and whose incarnation
  re-saved no committed step, never below the newest committed step
  ("regressed": the ramdisks hold it);
- restore() raises only emergency_ckpt's typed errors, and only when nothing
  restorable exists; saves never raise before the kill ("a failing tier
  never stops training");
- no hang: restore within RESTORE_BOUND_S, training progresses, the job
  ends before run_job's timeout;
- retention: per ramdisk folder and in the bucket, no more than the options
  keep plus what is in flight; once a restarted job saved max_to_keep + 2
  steps and waited: nothing in flight, no leftovers in a process folder it
  adopted from another host ("orphans"), no damaged step folder left behind
  ("torn").

Faults: the kill (every process at once, or one and the rest later; during
training or during the manager's start and restore); then ramdisks wiped
(one host, two, a slice, all), local files flipped, truncated or removed
(any file under the local root: shards, manifests, partner copies, parity
blocks, group files, spares), hosts shuffled, a bit flipped in a data file
of the newest persistent step; with gs://, the bucket hung (uploads held by
the proxy for seconds) or answering 503s and resets during the next round.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import signal
import threading
import time
from typing import Any

from emergency_ckpt.demo import job_process, launcher
from tests.soak import files
from tests.soak.files import PROGRESS, QUIET, RESTORED, TRAIN_ERROR

RESTORE_BOUND_S = 150.0  # a restore (manager start included) slower than this is a hang
STALL_S = 90.0  # no process saved a step for this long: a hang
JOB_TIMEOUT_S = 420.0  # run_job's own limit (the monitor above acts first)
TENSORSTORE = "tensorstore/"
GCSFS = "python-gcsfs"


@dataclasses.dataclass(frozen=True)
class Config:
  """One soak configuration: the job's shape, its redundancy and tiers."""

  redundancy: str = "partner"
  slices: int = 1
  processes: int = 4
  gcs: bool = False  # persistent tier on fake-gcs-server through the fault proxy
  local_keep: int = 2
  persistent_keep: int = 2
  collective_timeout_s: float = 30.0
  state_commit_timeout_s: float = 10.0

  def __post_init__(self):
    per, rest = divmod(self.processes, self.slices)
    if rest or per < 1 or self.redundancy not in ("none", "partner", "xor"):
      raise ValueError(f"soak: no such configuration: {self}")
    if self.redundancy != "none" and per < 2:
      raise ValueError(f"soak: local.redundancy={self.redundancy!r} needs 2+ processes a slice")

  @property
  def name(self) -> str:
    per = self.processes // self.slices
    return f"{self.redundancy}-{self.slices}x{per}-{'gcs' if self.gcs else 'fs'}"

  def slice_hosts(self, s: int) -> list[int]:
    per = self.processes // self.slices
    return list(range(s * per, (s + 1) * per))


# ---- the plan ----------------------------------------------------------------------------


@dataclasses.dataclass
class RoundPlan:
  round: int
  train_steps: int  # saves before the wait and the retention listing
  kill_after: int  # the kill comes once every process saved this many steps
  step_s: float
  persistent_interval: int
  kill_when: str  # "train", "restore" (during the manager's start and restore) or "never"
  kill_delay_s: float
  kill_mode: str  # "all" (every process at once) or "staggered"
  victim: int  # staggered: killed first
  stagger_s: float
  bucket: dict[str, Any]  # faults of the bucket during this round (gs:// only)
  damage: dict[str, Any]  # done after this round's kill


def plan_round(seed: int, r: int, config: Config, last: bool) -> RoundPlan:
  rng = random.Random(f"{seed}/{r}")
  n = config.processes
  train_steps = rng.randint(2, 6)
  plan = RoundPlan(
    round=r,
    train_steps=train_steps,
    kill_after=train_steps + rng.randint(1, 6),
    step_s=round(rng.uniform(0.02, 0.2), 3),
    persistent_interval=rng.randint(2, 5),
    kill_when="restore" if rng.random() < 0.1 else "train",
    kill_delay_s=round(rng.uniform(0.0, 0.6), 3),
    kill_mode=rng.choice(["all", "staggered"]),
    victim=rng.randrange(n),
    stagger_s=round(rng.uniform(0.05, 1.0), 3),
    bucket={},
    damage={},
  )
  if plan.kill_when == "restore":
    plan.kill_delay_s = round(rng.uniform(0.0, 4.0), 3)
  if config.gcs and r > 0:
    if rng.random() < 0.3:
      plan.bucket["hang"] = round(rng.uniform(2.0, 6.0), 2)
    if rng.random() < 0.2:
      plan.bucket["5xx"] = rng.randint(1, 3)
  if last:
    plan.kill_when = "never"
    return plan
  if rng.random() < 0.3:
    how = rng.random()
    if how < 0.5:
      hosts = [rng.randrange(n)]
    elif how < 0.75 and config.slices > 1:
      hosts = config.slice_hosts(rng.randrange(config.slices))
    elif how < 0.9:
      hosts = rng.sample(range(n), 2)
    else:
      hosts = list(range(n))
    plan.damage["wipe"] = sorted(hosts)
  if rng.random() < 0.35:
    plan.damage["files"] = [
      (rng.random(), rng.choice(["flip", "truncate", "remove"]), rng.random(), rng.randrange(8))
      for _ in range(rng.randint(1, 3))
    ]
  if rng.random() < 0.2:
    perm = list(range(n))
    while perm == list(range(n)):
      rng.shuffle(perm)
    plan.damage["shuffle"] = perm
  if rng.random() < 0.25:
    plan.damage["persistent"] = (rng.random(), rng.random(), rng.randrange(8))
  return plan


# ---- the kill ------------------------------------------------------------------------------


class Monitor(threading.Thread):
  """Watches a round's job through its reports; kills it as planned (SIGKILL
  by PID: every process at once, or one first and the rest `stagger_s`
  later), or, if it hangs, dumps its stacks into its logs and kills it."""

  def __init__(self, out_dir: str, n: int, plan: RoundPlan):
    super().__init__(daemon=True, name="soak-monitor")
    self.out_dir, self.n, self.plan = out_dir, n, plan
    self.kill_t: float | None = None  # monotonic time of the first SIGKILL
    self.did = "none"  # what it did, for the round's record
    self.hang: str | None = None
    self.stop = threading.Event()

  def _pids(self) -> list[int | None]:
    return [job_process.read_pid(self.out_dir, i) for i in range(self.n)]

  def _gone(self) -> bool:
    pids = self._pids()
    return all(p is not None and job_process.process_gone(p) for p in pids)

  def _reports(self, name: str) -> list[dict | None]:
    return [files.read_report(self.out_dir, name.format(i)) for i in range(self.n)]

  def _wait(self, done, deadline: float | None = None) -> bool:
    """Polls done() until true (True), the job ended or `deadline` passed (False)."""
    while not self.stop.is_set():
      if done():
        return True
      if self._gone() or (deadline is not None and time.monotonic() > deadline):
        return False
      time.sleep(0.02)
    return False

  def _kill(self, pids: list[int | None], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
      if pid is not None and not job_process.process_gone(pid):
        try:
          os.kill(pid, sig)
        except ProcessLookupError:
          pass

  def _hung(self, what: str) -> None:
    self.hang = self.did = what
    pids = self._pids()
    self._kill(pids, job_process.STACKS_SIGNAL)  # each child writes its stacks to its log
    time.sleep(2 * launcher.STACKS_WAIT_S)
    self.kill_t = self.kill_t or time.monotonic()
    self._kill(pids)

  def run(self) -> None:
    t0 = time.monotonic()
    plan = self.plan
    if plan.kill_when == "restore":
      started = lambda: all(r is not None for r in self._reports(PROGRESS))
      if self._wait(started, t0 + RESTORE_BOUND_S) and not self.stop.wait(plan.kill_delay_s):
        self._kill_as_planned()
      return
    restored = lambda: all(r is not None for r in self._reports(RESTORED))
    if not self._wait(restored, t0 + RESTORE_BOUND_S):
      if not self._gone() and not self.stop.is_set():
        self._hung(f"restore() had not returned on every process after {RESTORE_BOUND_S:.0f} s")
      return
    last = [None, time.monotonic()]

    def reached() -> bool:
      steps = [(r or {}).get("steps", 0) for r in self._reports(PROGRESS)]
      if steps != last[0]:
        last[:] = [steps, time.monotonic()]
      elif time.monotonic() - last[1] > STALL_S:
        raise TimeoutError(f"no process saved a step for {STALL_S:.0f} s (steps saved: {steps})")
      return plan.kill_when == "train" and min(steps) >= plan.kill_after

    try:
      if self._wait(reached) and not self.stop.wait(plan.kill_delay_s):
        self._kill_as_planned()
    except TimeoutError as e:
      self._hung(str(e))

  def _kill_as_planned(self) -> None:
    pids = self._pids()
    steps = [(r or {}).get("step") for r in self._reports(PROGRESS)]
    self.kill_t = time.monotonic()
    if self.plan.kill_mode == "staggered":
      self._kill([pids[self.plan.victim]])
      time.sleep(self.plan.stagger_s)
      self.did = (
        f"process {self.plan.victim} at steps {steps}, the rest {self.plan.stagger_s} s later"
      )
    else:
      self.did = f"all at steps {steps}"
    self._kill(pids)


# ---- the soak ------------------------------------------------------------------------------


@dataclasses.dataclass
class Expect:
  """What the next restore must reach: at least `floor` (the newest intact
  committed persistent step) and at least `strong` (the newest committed
  step, when no local file was damaged since it was saved); None: no bound."""

  floor: int | None = None
  strong: int | None = None


class Problems:
  """What broke in a round, each under a kind: hang, untyped, disagree,
  silent, lost, regressed, training, retention, orphans (leftovers in the
  folders of copies a restarted process adopted from another host), torn
  (damaged step folders left in place long after retention passed them)."""

  def __init__(self):
    self.items: list[tuple[str, str]] = []

  def add(self, kind: str, text: str) -> None:
    self.items.append((kind, text))

  @property
  def kinds(self) -> list[str]:
    return sorted({k for k, _ in self.items})

  def __bool__(self) -> bool:
    return bool(self.items)

  def text(self) -> str:
    return "; ".join(f"[{k}] {t}" for k, t in self.items)


class Soak:
  """One training run of `config`, restarted round after round under `seed`.

  `root`: a fresh folder (on /dev/shm: the ramdisks live there) for the local
  root, the persistent root (unless gs://) and every round's job folder
  (logs, pids, reports). `gcs`: (fake-gcs-server, GcsProxy) for a gs://
  configuration."""

  def __init__(self, config: Config, seed: int, root: str, gcs=None, log=print):
    self.config, self.seed, self.root, self.log = config, seed, root, log
    self.local_root = os.path.join(root, "local")
    self.jobs = os.path.join(root, "jobs")
    self.server, self.proxy = gcs if gcs is not None else (None, None)
    if config.gcs:
      if self.server is None:
        raise ValueError(f"{config.name} needs a fake-gcs-server and a proxy (gcs=...)")
      self.persistent = f"gs://{self.server.create_bucket()}/run"
      self.store = files.BucketRoot(self.server.url, self.persistent)
    else:
      self.persistent = os.path.join(root, "persistent")
      self.store = files.FileRoot(self.persistent)
    self.expect = Expect()
    self.damaged: dict[int, tuple[str, str]] = {}  # persistent step -> (data file, md5 after)
    self.committed: set[int] = set()  # COMMITs after the last round
    self.high = 0  # the newest step any round reported saving or restoring
    self.faults: collections.Counter = collections.Counter()
    self.sources: collections.Counter = collections.Counter()
    self.counts = dict(rounds=0, restores=0, lost=0, regressed=0, silent=0, fresh=0)
    self.failures: list[dict[str, Any]] = []  # {"round", "kinds", "text"}
    self.rounds: list[dict[str, Any]] = []

  # ---- running -------------------------------------------------------------------------
  def run(self, rounds: int, *, keep_going: bool = False) -> dict[str, Any]:
    """Runs `rounds` rounds (the last one stops cleanly instead of being
    killed); returns the summary. Stops at the first failing round unless
    `keep_going`."""
    t0 = time.monotonic()
    for r in range(rounds):
      plan = plan_round(self.seed, r, self.config, last=r == rounds - 1)
      problems, record = self.round(plan)
      self.counts["rounds"] += 1
      if problems:
        text = self._failure_text(plan, problems, record)
        self.failures.append({"round": r, "kinds": problems.kinds, "text": text})
        self.log(text)
        if not keep_going:
          break
    return self.summary(time.monotonic() - t0)

  def summary(self, wall_s: float) -> dict[str, Any]:
    return {
      "seed": self.seed,
      "config": dataclasses.asdict(self.config),
      "name": self.config.name,
      **self.counts,
      "faults": dict(sorted(self.faults.items())),
      "restores_by_source": dict(sorted(self.sources.items())),
      "failures": self.failures,
      "ok": not self.failures,
      "wall_s": round(wall_s, 1),
      "per_round": self.rounds,
    }

  def replay_command(self, rounds: int | None = None) -> str:
    c = self.config
    cmd = f"python -m tests.soak --seed {self.seed} --rounds {rounds or len(self.rounds)}"
    cmd += f" --redundancy {c.redundancy} --slices {c.slices} --processes {c.processes}"
    cmd += f" --local-keep {c.local_keep} --persistent-keep {c.persistent_keep}"
    return cmd + (" --gcs" if c.gcs else "")

  def _failure_text(self, plan: RoundPlan, problems: Problems, record: dict) -> str:
    head = f"soak {self.config.name} seed={self.seed} round={plan.round}"
    return (
      f"{head}: {problems.text()}\n  plan: {json.dumps(dataclasses.asdict(plan))}"
      f"\n  restore expected >= {record.get('expect')}, got {record.get('restored')}"
      f"\n  damage done after the previous round: {self._previous_damage(plan.round)}"
      f"\n  job folder: {os.path.join(self.jobs, f'round_{plan.round}')}"
      f"\n  replay: {self.replay_command(plan.round + 2)}"
    )

  def _previous_damage(self, r: int) -> list[str] | None:
    before = [x for x in self.rounds if x["round"] == r - 1]
    return before[0].get("damage") if before else None

  def _args(self, plan: RoundPlan) -> dict[str, Any]:
    c = self.config
    last = plan.kill_when == "never"
    return {
      "slices": c.slices,
      "local_root": self.local_root,
      "persistent": self.persistent,
      "redundancy": c.redundancy,
      "local_keep": c.local_keep,
      "persistent_keep": c.persistent_keep,
      "persistent_interval": plan.persistent_interval,
      "collective_timeout_s": c.collective_timeout_s,
      "state_commit_timeout_s": c.state_commit_timeout_s,
      "sim_hosts": True,  # each process a machine of its own (its host_<i> folder)
      "train_steps": plan.train_steps,
      "max_steps": plan.train_steps if last else plan.kill_after + 25,
      "step_s": plan.step_s,
      "step_barrier_s": STALL_S,
      "fresh_from": self.high + 2,
    }

  def round(self, plan: RoundPlan) -> tuple[Problems, dict[str, Any]]:
    """Runs one round; returns what broke (empty: nothing) and its record."""
    n = self.config.processes
    out_dir = os.path.join(self.jobs, f"round_{plan.round}")
    os.makedirs(out_dir, exist_ok=True)
    rules = self._arm_bucket(plan)
    monitor = Monitor(out_dir, n, plan)
    env = {i: self.proxy.env for i in range(n)} if self.config.gcs else None
    monitor.start()
    try:
      job = launcher.run_job(
        "tests.soak.job:soak_round",
        n,
        # each process's save/restore records beside its log (a restore's
        # rejected candidates and why: what a finding needs explained)
        dict(self._args(plan), event_log=os.path.join(out_dir, "events_{process}.jsonl")),
        timeout_s=JOB_TIMEOUT_S,
        env=env,
        out_dir=out_dir,
      )
    finally:
      monitor.stop.set()
      monitor.join()
      for rule in rules:
        rule.release()
      if self.proxy is not None:
        self.proxy.clear()
    problems = Problems()
    record: dict[str, Any] = {
      "round": plan.round,
      "wall_s": round(job.wall_s, 1),
      "kill": monitor.did,
      "exit_codes": job.returncodes,
    }
    tails = _log_tails(job)
    if job.timed_out:
      problems.add("hang", f"the job ran past run_job's timeout of {JOB_TIMEOUT_S:.0f} s{tails}")
    if monitor.hang:
      problems.add("hang", f"{monitor.hang} (stacks in the logs){tails}")
    first_saved = self._check_restore(plan, out_dir, monitor.kill_t, problems, record)
    self._check_training(plan, job, monitor, out_dir, problems)
    listing = self.store.list()
    self._forget_repaired(listing)
    self._check_retention(plan, out_dir, listing, problems)
    local_damage = self._damage(plan, listing, record) if plan.kill_when != "never" else False
    self._expect_next(plan, listing, first_saved, local_damage, record)
    progress = [files.read_report(out_dir, PROGRESS.format(i)) or {} for i in range(n)]
    self.high = max([self.high] + [p.get("step", 0) for p in progress])
    record["problems"] = problems.items
    self.rounds.append(record)
    self.log(
      f"[soak {self.config.name} seed={self.seed}] round {plan.round}: "
      + json.dumps({k: v for k, v in record.items() if k != "round"})
    )
    return problems, record

  # ---- faults ----------------------------------------------------------------------------
  def _arm_bucket(self, plan: RoundPlan) -> list:
    """The bucket's faults during this round: hung uploads (held by the
    proxy, released `hang` seconds after the first is held) and 503s."""
    if not plan.bucket:
      return []
    proxy = self.proxy
    if "5xx" in plan.bucket:
      self.faults["bucket_5xx"] += 1
      proxy.fail(times=plan.bucket["5xx"], status=503, method="POST", client=TENSORSTORE)
      proxy.fail(times=1, status=503, method="POST", path="uploadType=multipart", client=GCSFS)
      proxy.reset(times=1, method="GET", client=GCSFS)
    if "hang" not in plan.bucket:
      return []
    self.faults["bucket_hang"] += 1
    rule = proxy.hold(method="POST", path="/upload/", client=TENSORSTORE)

    def release_later() -> None:
      while rule.hits == 0 and rule.active:
        time.sleep(0.05)
      time.sleep(plan.bucket["hang"])
      rule.release()

    threading.Thread(target=release_later, daemon=True, name="soak-bucket-hang").start()
    return [rule]

  def _damage(self, plan: RoundPlan, listing: files.Persistent, record: dict) -> bool:
    """Does the plan's damage to what the killed job left; returns whether
    any local file was touched."""
    done: list[str] = []
    d = plan.damage
    local = False
    for u, op, pos, bit in d.get("files", ()):
      candidates = files.local_files(self.local_root)
      if not candidates:
        break
      path = candidates[min(len(candidates) - 1, int(u * len(candidates)))]
      what = files.damage_file(path, op, pos, bit)
      done.append(f"{op} {os.path.relpath(path, self.local_root)}: {what}")
      self.faults[f"local_{op}"] += 1
      local = True
    for host in d.get("wipe", ()):
      files.wipe_host(self.local_root, host)
    if "wipe" in d:
      done.append(f"wiped hosts {d['wipe']}")
      self.faults["wipe_all" if len(d["wipe"]) == self.config.processes else "wipe"] += 1
      local = True
    if "shuffle" in d:
      files.shuffle_hosts(self.local_root, d["shuffle"])
      done.append(f"hosts shuffled: host_i -> host_perm[i], perm={d['shuffle']}")
      self.faults["shuffle"] += 1
    if "persistent" in d and listing.finalized:
      step = max(listing.finalized)
      data = listing.data_files(step)
      u, pos, bit = d["persistent"]
      if data:
        name = data[min(len(data) - 1, int(u * len(data)))]
        blob = self.store.read(name)
        at = min(len(blob) - 1, int(pos * len(blob)))
        self.store.write(name, files.flip_bit(blob, at, bit))
        md5 = self.store.list().names.get(name, "")
        self.damaged[step] = (name, md5)
        done.append(f"persistent step {step}: flipped bit {bit} of byte {at} of {name}")
        self.faults["persistent_flip"] += 1
    self.faults[f"kill_{plan.kill_mode}" if plan.kill_when != "restore" else "kill_in_restore"] += 1
    record["damage"] = done
    return local

  def _forget_repaired(self, listing: files.Persistent) -> None:
    """A damaged persistent step whose damaged file is gone or changed was
    deleted or saved again: it is no longer known damaged."""
    for step, (name, md5) in list(self.damaged.items()):
      if listing.names.get(name) != md5:
        del self.damaged[step]

  # ---- checks ----------------------------------------------------------------------------
  def _check_restore(self, plan: RoundPlan, out_dir: str, kill_t, problems, record) -> int | None:
    """Checks every process's restore report against self.expect; returns the
    first step this round's incarnation saved (None if it saved nothing). An
    error raised once the kill began (a sibling died) is the kill's doing."""
    n = self.config.processes
    reports = {i: files.read_report(out_dir, RESTORED.format(i)) for i in range(n)}
    late = {
      i: f"{r['error']} in {r['in']}"
      for i, r in reports.items()
      if r is not None and "error" in r and kill_t is not None and r["t"] >= kill_t
    }
    got = {i: r for i, r in reports.items() if r is not None and i not in late}
    if late:
      record["raised_after_the_kill"] = late
    exp = self.expect
    record["expect"] = dataclasses.asdict(exp)
    if len(got) < n and plan.kill_when != "restore" and not problems:
      problems.add("hang", f"processes {sorted(set(range(n)) - set(got))} never reported a restore")
    for i, r in sorted(got.items()):
      if r.get("typed") is False:
        problems.add(
          "untyped",
          f"process {i}'s {r['in']} raised: {r['error']}: {r['message']}\n{r.get('traceback', '')}",
        )
    steps = {i: r["step"] for i, r in got.items() if "step" in r}
    errors = {i: f"{r['error']} in {r['in']}" for i, r in got.items() if "error" in r}
    record["restored"] = {
      i: (r["step"], r["source"]) if "step" in r else r["error"] for i, r in sorted(got.items())
    }
    record["restore_s"] = max([r.get("restore_s", 0) for r in got.values()], default=None)
    if len(set(steps.values())) > 1 or (steps and errors):
      problems.add("disagree", f"processes restored steps {steps}, raised {errors}")
    for r in got.values():
      self.sources[r.get("source", "none (raised " + r.get("error", "?") + ")")] += 1
    if steps:
      self.counts["restores"] += 1
      step = max(steps.values())
      silent = []
      for i, r in sorted(got.items()):
        if "step" not in r:
          continue
        if r["mismatches"]:
          silent.append(
            f"process {i} step {r['step']} ({r['source']}): bits differ in {r['mismatches']}"
          )
        if r["data_state"] != r["expected_data_state"]:
          silent.append(
            f"process {i} step {r['step']} ({r['source']}): data_state {r['data_state']}"
            f" != {r['expected_data_state']}"
          )
      if silent:
        self.counts["silent"] += 1
        problems.add("silent", "wrong bits loaded: " + "; ".join(silent))
      low = min(steps.values())
      if plan.round == 0 or (self.high == 0 and not self.committed):
        problems.add("silent", f"restored step {step} although nothing was ever saved")
      if exp.floor is not None and low < exp.floor:
        self.counts["lost"] += 1
        problems.add(
          "lost",
          f"restored step {low}, below the newest intact committed persistent step {exp.floor}",
        )
      elif exp.strong is not None and low < exp.strong:
        self.counts["regressed"] += 1
        problems.add(
          "regressed",
          f"restored step {low}, below the newest committed step {exp.strong}"
          " (no local file was damaged since it was saved)",
        )
      return low + 1
    if errors:
      raised = sorted(set(errors.values()))
      if exp.floor is not None:
        self.counts["lost"] += 1
        problems.add(
          "lost",
          f"restore raised {raised} while persistent step {exp.floor} was intact and committed",
        )
      elif exp.strong is not None:
        self.counts["regressed"] += 1
        problems.add(
          "regressed",
          f"restore raised {raised} while step {exp.strong} was committed (no"
          " local file was damaged since it was saved)",
        )
      else:
        self.counts["fresh"] += 1
      return self.high + 2
    return None

  def _check_training(self, plan, job, monitor: Monitor, out_dir: str, problems: Problems) -> None:
    n = self.config.processes
    kill_t = monitor.kill_t
    for i in range(n):
      err = files.read_report(out_dir, TRAIN_ERROR.format(i))
      if err is not None and (kill_t is None or err["t"] < kill_t):
        problems.add(
          "training",
          f"training stopped: process {i}'s save or wait raised {err['error']}"
          f" ({'typed' if err['typed'] else 'untyped'}) before the kill: {err['message']}\n"
          f"{err['traceback']}",
        )
      elif err is None and job.errors[i] and kill_t is None:
        problems.add("training", f"process {i} raised: {job.errors[i]}")
    if plan.kill_when == "never" and not problems and job.returncodes != [0] * n:
      problems.add(
        "training", f"a clean stop ended with exit codes {job.returncodes}{_log_tails(job)}"
      )

  def _check_retention(self, plan, out_dir: str, listing: files.Persistent, problems) -> None:
    """What the ramdisks and the bucket hold, against the options' retention."""
    c = self.config
    keep = c.local_keep
    found, orphans, torn = [], [], []
    # at the quiet point: every save of this incarnation durable, none in flight
    for i in range(c.processes):
      q = files.read_report(out_dir, QUIET.format(i))
      if q is None:
        continue
      own = f"process_{i}"
      for folder, ent in q["folders"].items():
        top = folder.split("/")[0]
        spares = [t for t in ent["tmp"] if t.startswith(".tmp-spare-")]
        where = f"process {i} after {q['saved_since_restore']} saves and a wait, {folder}"
        if top != own:
          if q["saved_since_restore"] >= keep + 2 and (ent["steps"] or spares):
            orphans.append(f"{where}: an adopted folder still holds {ent['steps'] + spares}")
          continue
        # partner copies or parity blocks other processes send may be in flight
        found += [f"{where}: {p}" for p in files.over_budget(folder, ent, own, keep)]
        old = [s for s in ent["unmarked"] if int(s[5:]) <= q["step"] - keep - 2]
        if old:
          torn.append(f"{where}: step folders without their marker, never removed: {old}")
    # after the job: whatever a kill can leave in flight, never an accumulation.
    # Steps above the newest commit are this job's saves whose commit was in
    # flight (claimed: kept until they commit, retention/claims.py); as many
    # as the state lane lagged behind the saves. Anything a job leaves behind
    # for good sits at or below a later job's commits: counted there.
    newest_commit = max(listing.committed, default=-1)
    for host in range(c.processes):
      per_host = files.host_listing(files.host_dir(self.local_root, host))
      for folder, ent in per_host.items():
        settled = [s for s in ent["steps"] if int(s[5:]) <= newest_commit]
        if len(settled) > keep + 4 or len(ent["tmp"]) > 3:
          found.append(
            f"after the job, host_{host}/{folder}: {ent} (newest commit {newest_commit})"
          )
    finalized = listing.finalized
    restorable = finalized & listing.committed
    newest = max(restorable) if restorable else None
    above = sorted(s for s in finalized if newest is None or s > newest)
    # retention keeps the newest restorable step, max_to_keep - 1 older and at
    # most max_to_keep + 1 newer ones (their commits may be in flight)
    if len(finalized) > c.persistent_keep + 1 + len(above) or len(above) > c.persistent_keep + 1:
      found.append(
        f"the bucket holds finalized steps {sorted(finalized)} (persistent.max_to_keep="
        f"{c.persistent_keep}, committed {sorted(listing.committed)})"
      )
    if len(listing.unfinalized) > 2:
      found.append(f"the bucket holds unfinalized uploads {sorted(listing.unfinalized)}")
    if len(listing.state_steps) > len(finalized) + keep + 8:
      found.append(
        f"the state store holds {len(listing.state_steps)} steps: {sorted(listing.state_steps)}"
      )
    if found:
      problems.add("retention", "; ".join(found))
    if orphans:
      problems.add("orphans", "; ".join(orphans))
    if torn:
      problems.add("torn", "; ".join(torn))

  def _expect_next(
    self, plan, listing: files.Persistent, first_saved, local_damage, record
  ) -> None:
    """What the next round's restore must reach, from what this one left."""
    committed = listing.committed
    intact = (listing.finalized & committed) - set(self.damaged)
    floor = max(intact) if intact else None
    if first_saved is None:  # killed before any restore returned: nothing new was saved
      strong = None if local_damage else self.expect.strong
    else:
      clean = not self.committed or first_saved > max(self.committed)
      strong = max(committed) if committed and clean and not local_damage else None
    self.expect = Expect(floor, strong)
    self.committed = committed
    record["left"] = {
      "finalized": sorted(listing.finalized),
      "committed": sorted(committed)[-6:],
      "damaged_persistent": sorted(self.damaged),
    }


def _log_tails(job: launcher.JobResult) -> str:
  return "".join(f"\n--- process {i} log\n{log[-3000:]}" for i, log in enumerate(job.logs))


def run_soak(
  config: Config,
  seed: int,
  rounds: int,
  root: str,
  *,
  gcs=None,
  keep_going: bool = False,
  log=print,
) -> dict[str, Any]:
  """Runs a soak of `rounds` rounds in the fresh folder `root`; returns its
  summary (summary["ok"]: no failure; summary["failures"]: what broke)."""
  return Soak(config, seed, root, gcs=gcs, log=log).run(rounds, keep_going=keep_going)
