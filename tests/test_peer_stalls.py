"""A redundancy peer that stops answering at save time never stops training
(real 1 slice x 4 processes, each its own simulated host).

The job trains at 0.5 s per step, saving locally every step with partner
copies or XOR parity; process 0 stops one of its peers (SIGSTOP: the process
neither answers nor dies, as a wedged host) for 8 s, then lets it go on.
What must hold on every process that was not stopped:
- the steps trained while the peer was stopped are at least 90% of the
  pace before it, and no save() waited for the peer (the copies go on the
  background lane);
- host memory stays at its budget: the saves queued behind the stuck copy
  do not each keep a staging buffer (at most 3 ever allocated);
- the copies queued behind the stuck one are skipped, not queued: the
  process that sends to the stopped peer reports skipped steps in health(),
  and its newest step is protected again;
- afterwards the steps commit again: a step saved after the peer came back
  is restorable, with state_commit_timeout_s at 600 s (a step a process
  gave up is given up by the commit at once, never waited for).
"""

from __future__ import annotations

import os

import pytest

from emergency_ckpt.demo.launcher import run_job

STEP_S = 0.5
STOP_AT, STOP_S = 8, 8.0
STEPS = 40


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_training_keeps_its_pace_while_a_peer_is_stopped(scheme, shm_dir, fault_matrix):
  args = {
    "slices": 1,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "persistent_interval": 1000,
    "local_keep": 3,
    "redundancy": scheme,
    "sim_hosts": True,
    "steps": STEPS,
    "step_s": STEP_S,
    "stopped": 1,
    "stop_at": STOP_AT,
    "stop_s": STOP_S,
    "collective_timeout_s": 30,
    "state_commit_timeout_s": 600,  # a step a process gave up is given up at once
    "big_mib": 8,
    "redundancy_overlap": True,  # sent from the snapshot beside the write (many-core hosts)
  }
  got = run_job("tests.redundancy_scenarios:train_while_a_peer_stops", 4, args, timeout_s=300)
  results = got.check()
  window = results[0]["window"]
  start, end = window["start"], window["end"]
  report, paces, worst_saves, buffers = [], [], [], []
  for p, r in enumerate(results):
    if p == args["stopped"]:
      continue
    steps = r["steps"]
    before = [s for s in steps if 2 < s["step"] < STOP_AT]
    pace = (len(before) - 1) / (before[-1]["end"] - before[0]["end"])
    during = sum(1 for s in steps if start <= s["end"] < end)
    worst = max(s["save_s"] for s in steps if s["step"] > 2)
    paces.append(during / (pace * (end - start)))
    worst_saves.append(worst)
    buffers.append(r["buffers_allocated"])
    report.append(
      f"process {p}: {during} steps in the {end - start:.1f}s stop (pace before {pace:.2f}/s);"
      f" worst save {worst * 1e3:.1f} ms; {r['buffers_allocated']} staging buffers;"
      f" health {r['health'].get(scheme)}"
    )
  text = "\n".join(report)
  after = [s["step"] for s in results[0]["steps"] if s["end"] > end + 2]
  restorable = results[0]["all_steps"]
  skipped = results[0]["health"][scheme]["skipped_steps"]  # process 0 sends to process 1
  ok = (
    bool(skipped)
    and max(skipped) < STEPS
    and min(paces) >= 0.9
    and max(worst_saves) < STOP_S / 4
    and max(buffers) <= 3
    and any(step in restorable for step in after)
  )
  fault_matrix.check(
    f"sick.peer.{scheme}",
    f"{min(paces):.0%}-{max(paces):.0%} of the pace while stopped; worst save()"
    f" {max(worst_saves) * 1e3:.0f} ms; at most {max(buffers)} staging buffers; copies skipped"
    f" (not queued) {len(skipped)}; restorable afterwards: {restorable}",
    ok,
  )
  print(text)
