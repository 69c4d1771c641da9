"""MaxText trains on emergency_ckpt, loses a slice's ramdisk, and resumes (issue 19);
and the Orbax-compatible facade it runs on, in one process.

Real parts only: MaxText 0.2.5's own train entry point
(`maxtext.trainers.pre_train.train.main`, tests/maxtext_scenarios.py) on a
2-layer decoder with synthetic data, as a 2-process jax.distributed job on
CPU (2 slices x 1 process x 2 devices: mesh data=2 (the replica axis) x
fsdp=2), emergency checkpointing on (`enable_emergency_checkpoint=true`,
local every step, persistent every 3rd), made emergency_ckpt by
`emergency_ckpt.integrations.maxtext.install()`.

1. reference: 8 steps, uninterrupted, started as a user would:
   `python -m emergency_ckpt.integrations.maxtext <MaxText args>` per
   process, with MaxText's own jax.distributed set-up for CPU (its fixed
   coordinator port 1234: one such job at a time); the two runs below go
   through emergency_ckpt.demo.launcher (jax.distributed on a free port);
2. the same run, SIGKILLed once step 5's checkpoint is durable; slice 1's
   ramdisk (its simulated host's folder on /dev/shm) is wiped;
3. the same command again: MaxText restores step 5 (slice 0 from its
   ramdisk, slice 1 from slice 0 over the peer transfer; the persistent tier
   has only step 3) and trains steps 6-7, whose losses must equal the
   reference's bit for bit.

Runs in the `maxtext` test environment only (scripts/test; skipped on
floor and latest, and where MaxText is not installed); there, a missing
MaxText fails it. One job at a time (each job takes ~15-40 s on 2 cores).
"""

from __future__ import annotations

import os

import pytest

# MaxText (Python >= 3.12) is installed only in the `maxtext` test environment
# (scripts/test sets EC_TEST_ENV there, and a missing MaxText then fails this
# module); elsewhere the module is skipped, with the reason in the summary.
if os.environ.get("EC_TEST_ENV") in ("floor", "latest"):
  pytest.skip(
    f"runs in the 'maxtext' test environment, not {os.environ['EC_TEST_ENV']!r}",
    allow_module_level=True,
  )
if os.environ.get("EC_TEST_ENV") != "maxtext":
  pytest.importorskip("maxtext", reason="MaxText is not installed here (scripts/setup-env maxtext)")

import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from orbax.checkpoint.experimental.emergency import checkpoint_manager as orbax_emergency  # noqa: E402

import emergency_ckpt as ec  # noqa: E402
from emergency_ckpt.core.telemetry import read_events  # noqa: E402
from emergency_ckpt.demo.job_process import read_pid  # noqa: E402
from emergency_ckpt.demo.launcher import run_job  # noqa: E402
from emergency_ckpt.integrations import orbax_emergency as facade  # noqa: E402
from emergency_ckpt.integrations.replica_axis import find_replica_axis  # noqa: E402
from tests.maxtext_scenarios import maxtext_argv, read_jsonl  # noqa: E402

STEPS = 8
KILL_AFTER = 5  # a local-only step: the persistent tier holds step 3
PROCESSES = 2
DEVICES = 2
JOB_TIMEOUT_S = 300


def _args(root: str, tag: str, run: str, **extra) -> dict:
  return {
    "run_name": "mx",
    "output_dir": os.path.join(root, run),
    "local_root": os.path.join(root, run + "_ramdisk"),
    "steps": STEPS,
    "processes": PROCESSES,
    "devices_per_process": DEVICES,
    "local_period": 1,
    "persistent_period": 3,
    "tag": tag,
    **extra,
  }


def _job(args: dict, out_dir: str):
  os.makedirs(args["output_dir"], exist_ok=True)
  return run_job(
    "tests.maxtext_scenarios:train",
    PROCESSES,
    args,
    devices_per_process=DEVICES,
    timeout_s=JOB_TIMEOUT_S,
    out_dir=out_dir,
  )


MAXTEXT_CPU_PORT = 1234  # MaxText's CPU coordinator port, fixed (max_utils.initialize_jax_for_cpu)


def _cli_job(args: dict, out_dir: str) -> list[str]:
  """Runs the job the way a user does: `python -m emergency_ckpt.integrations.maxtext
  <MaxText args>` per process, MaxText's own jax.distributed set-up for CPU
  (its env variables, coordinator 127.0.0.1:1234). Returns each process's log;
  asserts every process exited 0."""
  with socket.socket() as s:  # a clear failure, not a hang, if another job holds it
    s.settimeout(1)
    if s.connect_ex(("127.0.0.1", MAXTEXT_CPU_PORT)) == 0:
      raise AssertionError(
        f"port {MAXTEXT_CPU_PORT} is in use: another MaxText CPU job runs here (MaxText's"
        " coordinator port is fixed); run one at a time"
      )
  os.makedirs(args["output_dir"], exist_ok=True)
  os.makedirs(out_dir, exist_ok=True)
  procs, logs = [], []
  for i in range(PROCESSES):
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
      JAX_COORDINATOR_ADDRESS="127.0.0.1",
      JOB_INDEX="0",
      JOB_COMPLETION_INDEX=str(i),
      PROCESSES_IN_JOB=str(PROCESSES),
      JAX_PROCESS_COUNT=str(PROCESSES),
      PYTHONUNBUFFERED="1",
    )
    logs.append(os.path.join(out_dir, f"log_{i}.txt"))
    with open(logs[-1], "wb") as log:
      procs.append(
        subprocess.Popen(
          [sys.executable, "-m", "emergency_ckpt.integrations.maxtext", *maxtext_argv(args, i)[1:]],
          stdout=log,
          stderr=subprocess.STDOUT,
          env=env,
          start_new_session=True,
        )
      )
  deadline = time.monotonic() + JOB_TIMEOUT_S
  for p in procs:
    try:
      p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      for q in procs:
        if q.poll() is None:
          os.kill(q.pid, signal.SIGKILL)
          q.wait()
  texts = []
  for path in logs:
    with open(path, errors="replace") as f:
      texts.append(f.read())
  codes = [p.returncode for p in procs]
  if codes != [0] * PROCESSES:
    tails = "\n".join(
      f"--- process {i} rc={c}\n{_tail(t)}" for i, (c, t) in enumerate(zip(codes, texts))
    )
    raise AssertionError(f"the MaxText job failed (-9: killed after {JOB_TIMEOUT_S} s):\n{tails}")
  return texts


def _tail(log: str, lines: int = 60) -> str:
  """The end of a MaxText log, without its per-parameter config dump."""
  kept = [line for line in log.splitlines() if "Config param" not in line and "[NO-OP]" not in line]
  return "\n".join(kept[-lines:])


def _losses(args: dict, process: int) -> dict[int, float]:
  path = os.path.join(args["output_dir"], f"metrics_{args['tag']}_{process}.jsonl")
  return {int(m["step"]): m["learning/loss"] for m in read_jsonl(path)}


def _run_and_kill(args: dict, out_dir: str):
  """Runs the job until every process marked step KILL_AFTER durable, then
  SIGKILLs each process by pid. Returns the job's result."""
  box = {}
  thread = threading.Thread(target=lambda: box.setdefault("job", _job(args, out_dir)))
  thread.start()
  markers = [os.path.join(out_dir, f"stopped_{i}") for i in range(PROCESSES)]
  deadline = time.monotonic() + JOB_TIMEOUT_S
  while not all(map(os.path.exists, markers)) and thread.is_alive():
    assert time.monotonic() < deadline, "the job never reached its kill point"
    time.sleep(0.2)
  if thread.is_alive():
    for i in range(PROCESSES):
      os.kill(read_pid(out_dir, i), signal.SIGKILL)
  thread.join()
  return box["job"]


def test_maxtext_resumes_from_peer_with_the_same_losses(shm_dir):
  t0 = time.monotonic()
  ref = _args(shm_dir, "ref", "reference")
  # the reference run is the user's command, MaxText's own multi-process set-up
  logs = _cli_job(ref, os.path.join(shm_dir, "job_ref"))
  assert all("emergency_ckpt manager ready" in log for log in logs), logs[0][-3000:]
  reference = [_losses(ref, i) for i in range(PROCESSES)]
  assert sorted(reference[0]) == list(range(STEPS)), reference[0]

  run = _args(shm_dir, "killed", "run", stop_after_step=KILL_AFTER)
  killed = _run_and_kill(run, os.path.join(shm_dir, "job_killed"))
  assert killed.returncodes == [-signal.SIGKILL] * PROCESSES, "\n".join(
    [str(killed.returncodes), *(_tail(log) for log in killed.logs)]
  )
  # slice 1's host is replaced: its ramdisk is empty
  wiped = os.path.join(run["local_root"], "host1")
  assert os.listdir(wiped), "slice 1 saved nothing to wipe"
  shutil.rmtree(wiped)

  resumed = dict(run, tag="resumed", stop_after_step=None)
  _job(resumed, os.path.join(shm_dir, "job_resumed")).check()

  restores = {}
  for i in range(PROCESSES):
    log = os.path.join(run["output_dir"], f"events_resumed_{i}.jsonl")
    (event,) = [e for e in read_events(log) if e["event"] == "restore"]
    restores[i] = (event["step"], event["source"])
  assert restores == {0: (KILL_AFTER, "local"), 1: (KILL_AFTER, "peer")}

  for i in range(PROCESSES):
    after = _losses(resumed, i)
    assert sorted(after) == list(range(KILL_AFTER + 1, STEPS)), after
    expected = {s: reference[i][s] for s in after}
    assert after == expected, f"process {i}: resumed losses {after} != reference {expected}"
  print(
    f"maxtext: restored step {KILL_AFTER} (process 0 local, process 1 peer);"
    f" losses of steps {KILL_AFTER + 1}-{STEPS - 1}: {[after[s] for s in sorted(after)]}"
    f" == reference; {time.monotonic() - t0:.1f} s"
  )


# ---- the facade and its pieces, in one process -------------------------------


def _fake_mesh(shape, names, procs):
  """What find_replica_axis reads of a mesh: axis names and devices that
  know their process (a jax Mesh of several processes needs a job)."""
  devices = np.array([types.SimpleNamespace(process_index=p) for p in procs], dtype=object).reshape(
    shape
  )
  return types.SimpleNamespace(axis_names=names, devices=devices)


def _leaf(spec):
  return types.SimpleNamespace(sharding=types.SimpleNamespace(spec=spec))


MAXTEXT_AXES = ("diloco", "data", "fsdp")


def test_replica_axis_skips_maxtexts_size_one_diloco_axis():
  # 2 processes x 2 devices; MaxText's mesh (diloco=1, data=2, fsdp=2)
  mesh = _fake_mesh((1, 2, 2), MAXTEXT_AXES, [0, 0, 1, 1])
  state = {"w": _leaf(P("fsdp", None)), "b": _leaf(P())}
  assert find_replica_axis(mesh, state, preferred=0) == "data"
  assert find_replica_axis(mesh, state) == "data"


def test_replica_axis_never_splits_a_process_nor_a_sharded_axis():
  # fsdp spans the processes but the state is sharded over it; data splits them
  mesh = _fake_mesh((1, 2, 2), MAXTEXT_AXES, [0, 1, 0, 1])
  state = {"w": _leaf(P("fsdp"))}
  assert find_replica_axis(mesh, state, preferred=0) == "diloco"  # one slice
  with pytest.raises(ec.TopologyError, match="sharded over axis 'fsdp'"):
    find_replica_axis(mesh, state, preferred="fsdp")
  with pytest.raises(ec.TopologyError, match="splits a process"):
    find_replica_axis(mesh, state, preferred=1)


def _state(mesh, value: float):
  w = jax.device_put(np.full((4, 2), value, np.float32), NamedSharding(mesh, P(None, "data")))
  key = jax.device_put(jax.random.key(int(value)), NamedSharding(mesh, P()))
  return {"w": w, "rng": key}


def _abstract(mesh):
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(mesh, 1.0)
  )


def _orbax_options(local: int, persistent: int):
  return facade.OrbaxOptions(
    local=facade.LocalCheckpointOptions(save_interval_steps=local, max_to_keep=2),
    persistent=facade.PersistentCheckpointOptions(save_interval_steps=persistent),
  )


def test_facade_is_orbaxs_emergency_manager_to_isinstance_and_round_trips(shm_dir, mesh):
  abstract = _abstract(mesh)
  with facade.CheckpointManager(
    os.path.join(shm_dir, "local"),
    os.path.join(shm_dir, "persistent"),
    global_mesh=mesh,
    abstract_state=abstract,
    options=_orbax_options(2, 4),
  ) as mngr:
    assert isinstance(mngr, orbax_emergency.CheckpointManager)
    assert [mngr.should_save(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    save = lambda step, value, **kw: mngr.save(  # noqa: E731
      step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(mesh, value))), **kw
    )
    assert save(1, 1.0) is False  # no interval hit
    assert save(2, 2.0) is True
    assert save(3, 3.0, force=True) is True
    assert mngr.latest_step() == 3  # as Orbax: listed while its save is in flight
    assert save(3, 3.0) is False  # as Orbax: not newer than the last save
    with pytest.raises(ec.StepAlreadyExistsError):
      save(3, 3.0, force=True)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3] and mngr.latest_step() == 3
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(abstract, restore_args=restore_args))
    restored = mngr.restore(2, args=args).state
    assert mngr.last_restore.source == "local" and mngr.last_restore.step == 2
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4, 2), 2.0, np.float32))
    assert restored["rng"].dtype == abstract["rng"].dtype
    np.testing.assert_array_equal(
      jax.random.key_data(restored["rng"]), jax.random.key_data(jax.random.key(2))
    )
    assert save(3, 3.0) is False  # step 3 was saved here: not saved again after restoring 2
    assert save(4, 4.0) is True
    mngr.wait_until_finished()
    latest = mngr.restore(None).state  # no args: onto the constructor's abstract_state
    assert mngr.last_restore.step == 4
    np.testing.assert_array_equal(np.asarray(latest["w"]), np.full((4, 2), 4.0, np.float32))


def test_facade_refuses_what_it_cannot_honour_by_name(shm_dir, mesh):
  abstract = _abstract(mesh)
  options = facade.OrbaxOptions(
    local=facade.LocalCheckpointOptions(save_interval_steps=1, should_save_fn=lambda s, _: True)
  )
  dirs = (os.path.join(shm_dir, "local"), os.path.join(shm_dir, "persistent"))
  with pytest.raises(ec.InvalidOptionsError, match="local.should_save_fn"):
    facade.CheckpointManager(*dirs, global_mesh=mesh, abstract_state=abstract, options=options)
  with facade.CheckpointManager(
    *dirs, global_mesh=mesh, abstract_state=abstract, options=_orbax_options(1, 2)
  ) as mngr:
    state = ocp.args.PyTreeSave(_state(mesh, 1.0))
    with pytest.raises(ec.InvalidOptionsError, match=r"\['dataset'\]"):
      mngr.save(1, args=ocp.args.Composite(state=state, dataset=state))
