"""Code that runs inside the fault-injection jobs (tests/test_faults_*.py).

Each function is a job target (`run_job("tests.fault_scenarios:fn", ...)`):
it returns raw facts (steps, sources, bit mismatches, error types, messages,
elapsed times); the tests decide whether they are what the scenario promises.

Several scenarios share one job to pay JAX's start-up once. Each gets its own
directories (or a fresh copy of pristine ones) and its own collective
namespace (`use_namespace`), so an error that leaves one process behind in a
scenario cannot shift the exchange keys of the next one.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt.cluster import collectives as collectives_lib
from emergency_ckpt.cluster import rendezvous as rendezvous_lib
from emergency_ckpt.cluster import topology as topology_lib
from emergency_ckpt.demo.job_process import job_output_dir, read_pid
from tests import scenarios as sc
from tests.helpers import barrier

# ---- plumbing -------------------------------------------------------------------

_ORIG_NEXT_KEY = rendezvous_lib._next_key  # noqa: SLF001


def use_namespace(tag: str) -> None:
  """Puts every later exchange of this process under `tag` (all processes call
  it with the same tag at the same point)."""
  rendezvous_lib._next_key = lambda ns, name, client: _ORIG_NEXT_KEY(f"{ns}.{tag}", name, client)  # noqa: SLF001


def me() -> int:
  return jax.process_index()


def sibling_pid(process: int) -> int:
  pid = read_pid(job_output_dir(), process)
  assert pid is not None, f"process {process} never reported its pid"
  return pid


def kill_sibling(process: int) -> None:
  """SIGKILLs a (possibly SIGSTOPped) sibling of this job."""
  try:
    os.kill(sibling_pid(process), signal.SIGKILL)
  except ProcessLookupError:
    pass


def _error(rec: dict, e: BaseException, t0: float) -> dict:
  rec.update(error=type(e).__name__, message=str(e), elapsed_s=round(time.monotonic() - t0, 2))
  return rec


# ---- train state ------------------------------------------------------------------


def _big_values(step: int, n: int) -> np.ndarray:
  return ((np.arange(n, dtype=np.uint64) * 2654435761 + step) >> 7).astype(np.uint8)


def make_state(mesh, step: int, big: int = 0, big_spec: P | None = None) -> dict:
  """scenarios.make_state, plus a uint8 leaf of `big` bytes (replicated, or
  partitioned by `big_spec`)."""
  state = sc.make_state(mesh, step)
  if big:
    v = _big_values(step, big)
    state["big"] = jax.make_array_from_callback(
      (big,), NamedSharding(mesh, big_spec or P()), lambda idx: v[idx]
    )
  return state


def abstract_state(
  mesh, big: int = 0, variant: str | None = None, big_spec: P | None = None
) -> dict:
  """The abstract train state; `variant` makes it wrong on purpose."""
  out = sc.abstract_state(mesh)
  if big:
    sharding = NamedSharding(mesh, big_spec or P())
    out["big"] = jax.ShapeDtypeStruct((big,), jnp.uint8, sharding=sharding)
  w = out["w"]
  if variant == "dtype":
    out["w"] = jax.ShapeDtypeStruct(w.shape, jnp.float16, sharding=w.sharding)
  elif variant == "int_dtype":
    ids = out["ids"]
    out["ids"] = jax.ShapeDtypeStruct(ids.shape, jnp.float32, sharding=ids.sharding)
  elif variant == "shape":
    out["w"] = jax.ShapeDtypeStruct((8, 32), w.dtype, sharding=w.sharding)
  elif variant == "tree":
    del out["mask"]
  elif variant is not None:
    raise ValueError(variant)
  return out


def mismatches(state: dict, step: int, big: int = 0) -> list[str]:
  bad = sc.mismatches({k: v for k, v in state.items() if k != "big"}, step)
  if big:
    want = _big_values(step, big)
    for shard in state["big"].addressable_shards:
      if not np.array_equal(np.asarray(shard.data), want[shard.index]):
        bad.append(f"big{shard.index}")
  return bad


def _listing(path: str) -> list[str] | None:
  try:
    return sorted(os.listdir(path))
  except OSError:
    return None


def _restore_record(
  mngr, mesh, big: int = 0, variant: str | None = None, big_spec: P | None = None
) -> dict:
  t0 = time.monotonic()
  r = mngr.restore(abstract_state(mesh, big, variant, big_spec))
  return {
    "step": r.step,
    "source": r.source,
    "data_state": r.data_state,
    "expected_data_state": sc.data_state(r.step),
    "mismatches": mismatches(r.state, r.step, big),
    "restore_s": round(time.monotonic() - t0, 2),
  }


# ---- crash jobs --------------------------------------------------------------------


def _arm_orbax_finalize_kill(step: int) -> None:
  """Test-only fault: SIGKILL this process when Orbax is about to finalize
  `step` (every file written, the folder not yet renamed into place)."""
  from orbax.checkpoint._src.path import atomicity  # noqa: PLC0415

  cls = atomicity.AtomicRenameTemporaryPath
  original = cls.finalize

  async def finalize(self, *a, **kw):
    if self.get_final().name == str(step):
      os.kill(os.getpid(), signal.SIGKILL)
    return await original(self, *a, **kw)

  cls.finalize = finalize


def save_run(args: dict) -> dict:
  """Saves args['steps'] (waiting after each: the previous step is durable
  when the next starts, as with minutes between saves). Failpoints come from
  each process's EC_FAILPOINTS. Options: 'orbax_finalize_kill': step (the
  primary process dies inside Orbax's finalize); 'then_latest': call
  latest_step() afterwards and report how it failed (a sibling hangs), then
  SIGKILL the processes in 'kill_after'."""
  mesh = sc.mesh_for(args["slices"])
  if args.get("orbax_finalize_kill") is not None and me() == 0:
    _arm_orbax_finalize_kill(args["orbax_finalize_kill"])
  out: dict[str, Any] = {"process": me(), "saved": []}
  mngr = ec.CheckpointManager(sc.options(args), mesh=mesh)
  out["slice"] = mngr.topology.slice_index
  for step in args["steps"]:
    if mngr.save(step, make_state(mesh, step), data_state=sc.data_state(step)):
      out["saved"].append(step)
    mngr.wait_until_finished()
  if args.get("then_latest"):
    t0 = time.monotonic()
    try:
      out["latest"] = mngr.latest_step()
    except ec.EmergencyCheckpointError as e:
      _error(out, e, t0)
    for p in args.get("kill_after", ()):
      kill_sibling(p)
  mngr.close()
  return out


def preempt_run(args: dict) -> dict:
  """The README's preemption loop: every step asks reached_preemption(step);
  at 'sigterm_at' process 'sigterm_sender' sends SIGTERM to process
  'sigterm_target'. On True: save(force=True), wait, close, stop."""
  mesh = sc.mesh_for(args["slices"])
  out: dict[str, Any] = {"process": me(), "preempted_at": None, "saved": []}
  mngr = ec.CheckpointManager(sc.options(args), mesh=mesh)
  for step in range(1, args["max_steps"] + 1):
    state = make_state(mesh, step)
    if mngr.reached_preemption(step):
      mngr.save(step, state, data_state=sc.data_state(step), force=True)
      out["saved"].append(step)
      mngr.wait_until_finished()
      mngr.close()
      out["preempted_at"] = step
      return out
    if mngr.save(step, state, data_state=sc.data_state(step)):
      out["saved"].append(step)
    if step == args["sigterm_at"] and me() == args["sigterm_sender"]:
      os.kill(sibling_pid(args["sigterm_target"]), signal.SIGTERM)
      out["sent_sigterm_at"] = step
    time.sleep(args.get("step_sleep_s", 0.05))
  mngr.close()
  return out


def hang_in_upload_run(args: dict) -> dict:
  """A primary-slice process hangs (failpoint ':stop') inside a persistent
  save. Every process then waits for its saves in a watchdog thread (bounded
  by 'wait_bound_s', so the job itself never hangs) and asks latest_step();
  process 0 finally SIGKILLs the processes in 'kill_after'."""
  mesh = sc.mesh_for(args["slices"])
  out: dict[str, Any] = {"process": me(), "saved": []}
  mngr = ec.CheckpointManager(sc.options(args), mesh=mesh)
  for step in args["steps"]:
    if mngr.save(step, make_state(mesh, step), data_state=sc.data_state(step)):
      out["saved"].append(step)
  box: dict[str, Any] = {}

  def wait() -> None:
    try:
      mngr.wait_until_finished()
      box["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported
      box["error"] = e

  t0 = time.monotonic()
  worker = threading.Thread(target=wait, daemon=True)
  worker.start()
  worker.join(args["wait_bound_s"])
  if worker.is_alive():
    out["wait"] = f"still blocked after {args['wait_bound_s']} s"
  elif "error" in box:
    out["wait"] = f"{type(box['error']).__name__}: {box['error']}"
    out["wait_error"] = type(box["error"]).__name__
  else:
    out["wait"] = "returned"
  out["wait_s"] = round(time.monotonic() - t0, 2)
  t0 = time.monotonic()
  try:
    out["latest"] = mngr.latest_step()
  except ec.EmergencyCheckpointError as e:
    _error(out, e, t0)
  if me() == 0:
    for p in args.get("kill_after", ()):
      kill_sibling(p)
  return out  # no close(): it would wait for the hung upload again


def upload_error_run(args: dict) -> dict:
  """One primary-slice process's upload of a step fails at once (failpoint
  ':raise' before its Orbax save) while the job trains on with
  `persistent.when_busy: skip`: the other primary processes' uploads of that
  step wait in Orbax's barriers until their timeout. Every process records
  its save() stalls, the steps the persistent tier took, what the first and
  a second bounded wait_until_finished() said and its health; then, with
  every ramdisk wiped, a fresh manager restores (the persistent tier's
  newest step). args["inline"]: Orbax copies inside save() (the path of
  accelerators without pinned host memory) instead of from the snapshot."""
  mesh = sc.mesh_for(args["slices"])
  out: dict[str, Any] = {"process": me(), "stalls": {}}
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    if args.get("inline"):
      mngr._saves._upload_snapshots = False  # noqa: SLF001 - the accelerator path
    for step in args["steps"]:
      t0 = time.monotonic()
      mngr.save(step, make_state(mesh, step), data_state=sc.data_state(step))
      out["stalls"][step] = round(time.monotonic() - t0, 3)
      time.sleep(args["step_s"])
    for attempt in ("first_wait", "second_wait"):
      t0 = time.monotonic()
      try:
        mngr.wait_until_finished(timeout_s=args["wait_bound_s"])
        out[attempt] = "returned"
      except ec.EmergencyCheckpointError as e:
        out[attempt] = f"{type(e).__name__}: {e}"
      out[f"{attempt}_s"] = round(time.monotonic() - t0, 2)
    out["health"] = mngr.health()["persistent"].as_dict()
  out["tensors"] = _listing(os.path.join(args["persistent"], "tensors"))
  barrier("upload-error-closed")
  shutil.rmtree(sc.host_dir(args), ignore_errors=True)  # every host replaced
  barrier("upload-error-wiped")
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    out["restored"] = _restore_record(mngr, mesh)
  return out


def _fill(path: str) -> int:
  """Writes zeros into `path` until the filesystem is full (a real ENOSPC)."""
  chunk = b"\0" * (64 << 10)
  written = 0
  with open(path, "wb", buffering=0) as f:
    while True:
      try:
        n = f.write(chunk)
      except OSError as e:
        assert e.errno == 28, e  # ENOSPC
        return written
      written += n
      if n < len(chunk):
        continue


def enospc_run(args: dict) -> dict:
  """Steps 1-2 save normally; then the victim's ramdisk is full ('tmpfs': a
  real small tmpfs mounted by the test, filled up; 'rlimit': RLIMIT_FSIZE,
  EFBIG, where no tmpfs can be mounted) while steps 3-4 save (4 also to the
  persistent tier). Then space is freed and a fresh manager restores."""
  mesh = sc.mesh_for(args["slices"])
  big = args.get("big", 0)
  victim = args["victim"]
  out: dict[str, Any] = {"process": me(), "saved": []}
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    out["slice"] = mngr.topology.slice_index
    for step in (1, 2):
      mngr.save(step, make_state(mesh, step, big), data_state=sc.data_state(step))
      mngr.wait_until_finished()
    filler = os.path.join(sc.host_dir(args), "filler")
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if me() == victim:
      if args["mode"] == "tmpfs":
        out["filled_bytes"] = _fill(filler)
      else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args["rlimit_bytes"], old_limit[1]))
    barrier("enospc-full")
    try:
      for step in (3, 4):
        if mngr.save(step, make_state(mesh, step, big), data_state=sc.data_state(step)):
          out["saved"].append(step)
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - a raise here is the failure under test
      out["save_error"] = f"{type(e).__name__}: {e}"
    out["local_entries_while_full"] = _listing(mngr.local_directory)
    if me() == victim:
      if args["mode"] == "tmpfs":
        os.remove(filler)
      else:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    barrier("enospc-freed")
  out["tensors"] = _listing(os.path.join(args["persistent"], "tensors"))
  use_namespace("after")
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    out.update(_restore_record(mngr, mesh, big))
    out["all_steps"] = mngr.all_steps()
  return out


def persistent_full_run(args: dict) -> dict:
  """The persistent directory's filesystem fills up ('tmpfs': a small tmpfs
  the test mounted, filled; 'rlimit': RLIMIT_FSIZE, EFBIG, where no tmpfs
  can be mounted) while step 4 uploads; wait_until_finished's error is
  recorded, training saves on (5, 6 with the disk still full); then space is
  freed, step 8 uploads, and a fresh manager with the ramdisk wiped restores
  from the persistent tier. args["inline"]: Orbax copies inside save().
  args["victim"]: the one process whose disk is full (rlimit) or that fills
  the shared tmpfs (default 0)."""
  mesh = sc.mesh_for(args["slices"])
  big = args["big"]
  big_spec = P("data") if args.get("big_sharded") else None  # each process writes its part
  out: dict[str, Any] = {"process": me(), "saved": {}, "waits": {}}
  old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
  filler = os.path.join(args["persistent"], "..", "filler")

  def save_and_wait(mngr, step):
    t0 = time.monotonic()
    out["saved"][step] = mngr.save(
      step, make_state(mesh, step, big, big_spec), data_state=sc.data_state(step)
    )
    out.setdefault("save_s", []).append(time.monotonic() - t0)
    try:
      mngr.wait_until_finished()
      out["waits"][step] = None
    except Exception as e:  # noqa: BLE001 - the error under test
      out["waits"][step] = {
        "type": type(e).__name__,
        "typed": isinstance(e, ec.EmergencyCheckpointError),
        "message": str(e),
      }

  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    if args.get("inline"):
      mngr._saves._upload_snapshots = False  # noqa: SLF001 - the accelerator path
    for step in (1, 2):
      save_and_wait(mngr, step)
    victim = me() == args.get("victim", 0)
    if victim and args["mode"] == "tmpfs":
      out["filled_bytes"] = _fill(filler)
    elif victim:
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      resource.setrlimit(resource.RLIMIT_FSIZE, (args["rlimit_bytes"], old_limit[1]))
    barrier("persistent-full")
    for step in (3, 4, 5, 6):
      save_and_wait(mngr, step)
    out["health_while_full"] = mngr.health()["persistent"].last_error
    if victim and args["mode"] == "tmpfs":
      os.remove(filler)
    elif victim:
      resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    barrier("persistent-freed")
    for step in (7, 8):
      save_and_wait(mngr, step)
    out["health_after"] = mngr.health()["persistent"].consecutive_failures
  out["tensors"] = _listing(os.path.join(args["persistent"], "tensors"))
  shutil.rmtree(sc.host_dir(args))
  use_namespace("after")
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    out["restored"] = _restore_record(mngr, mesh, big, big_spec=big_spec)
  return out


def state_write_fails_run(args: dict) -> dict:
  """Saves args['steps'] (local every step), waiting after each and
  recording wait_until_finished's errors (a process's failed state write,
  from its EC_FAILPOINTS); then the committed steps and a restore."""
  mesh = sc.mesh_for(args["slices"])
  out: dict[str, Any] = {"process": me(), "errors": {}}
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in args["steps"]:
      mngr.save(step, make_state(mesh, step), data_state=sc.data_state(step))
      try:
        mngr.wait_until_finished()
      except ec.EmergencyCheckpointError as e:
        out["errors"][step] = f"{type(e).__name__}: {e}"
    out["all_steps"] = mngr.all_steps()
    out["restored"] = _restore_record(mngr, mesh)
  return out


def lacking_copy_run(args: dict) -> dict:
  """Steps 1..args['steps'] every args['step_s'] (local every step, keep 1,
  persistent every 4th); the test slows process 1's state lane at step 3
  (so retention deletes its copy of step 4 before that step's state file
  is written) and holds step 4's upload. While the upload is held, and
  again once it ended, records whether step 4's COMMIT exists, whether
  its persistent copy is finalized, and whether this process holds it."""
  mesh = sc.mesh_for(args["slices"])
  out: dict[str, Any] = {"process": me(), "samples": []}
  commit = os.path.join(args["persistent"], "state", "4", "COMMIT")
  final = os.path.join(args["persistent"], "tensors", "4")

  def sample(mngr, when):
    local = os.path.join(mngr.local_directory, "step_4")
    out["samples"].append(
      {
        "when": when,
        "committed": os.path.exists(commit),
        "finalized": os.path.isdir(final),
        "held": os.path.isdir(local),
      }
    )

  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in range(1, args["steps"] + 1):
      mngr.save(step, make_state(mesh, step), data_state=sc.data_state(step))
      time.sleep(args["step_s"])
    time.sleep(args["settle_s"])
    sample(mngr, "upload held")
    try:
      mngr.wait_until_finished(timeout_s=120)
    except ec.EmergencyCheckpointError as e:
      out["wait_error"] = f"{type(e).__name__}: {e}"
    sample(mngr, "after the wait")
    out["all_steps"] = mngr.all_steps()
  use_namespace("after")
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    out["restored"] = _restore_record(mngr, mesh)
  return out


# ---- restart after a fault ---------------------------------------------------------


def resume_and_save(args: dict) -> dict:
  """Restores, then saves args['resave_steps'] again with other values (a
  non-deterministic trainer: state + args['value_offset'], data_state tagged
  incarnation 2). Failpoints come from EC_FAILPOINTS."""
  mesh = sc.mesh_for(args["slices"])
  out: dict[str, Any] = {"process": me()}
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    out["restored"] = mngr.restore(abstract_state(mesh)).step
    for step in args["resave_steps"]:
      data = dict(sc.data_state(step), incarnation=2)
      mngr.save(step, make_state(mesh, step + args["value_offset"]), data_state=data)
      mngr.wait_until_finished()
  return out


def restore_batch(args: dict) -> list[dict]:
  """For each scenario in args['scenarios'] (own directories): restore with a
  fresh manager, then (if 'continue_steps') save that many more steps, and
  restore again with another fresh manager. Scenarios are independent."""
  out = []
  for i, cfg in enumerate(args["scenarios"]):
    use_namespace(f"batch{i}")
    rec: dict[str, Any] = {"name": cfg["name"], "process": me()}
    t0 = time.monotonic()
    try:
      rec.update(_restore_and_continue(cfg))
    except ec.EmergencyCheckpointError as e:
      _error(rec, e, t0)
    barrier(f"batch-{i}")
    out.append(rec)
  return out


def _restore_and_continue(cfg: dict) -> dict:
  mesh = sc.mesh_for(cfg["slices"])
  slice_index = topology_lib.topology_from_mesh(mesh, "replica").slice_index
  if slice_index in cfg.get("wipe_slices", ()):
    shutil.rmtree(sc.host_dir(cfg), ignore_errors=True)  # a replaced host
  rec: dict[str, Any] = {"slice": slice_index}
  local_dir = None
  with ec.CheckpointManager(sc.options(cfg), mesh=mesh) as mngr:
    local_dir = mngr.local_directory
    rec["entries_at_start"] = _listing(local_dir)
    rec["all_steps"] = mngr.all_steps()
    rec.update(_restore_record(mngr, mesh))
    if cfg.get("value_offset"):  # which incarnation's values came back
      r = mngr.restore(abstract_state(mesh), step=rec["step"])
      rec["mismatches_other"] = mismatches(r.state, rec["step"] + cfg["value_offset"])
    if mngr.topology.process_count != cfg.get("saved_process_count", mngr.topology.process_count):
      rec["expected_data_state"] = None
    first = rec["step"]
    for step in range(first + 1, first + 1 + cfg.get("continue_steps", 0)):
      mngr.save(step, make_state(mesh, step), data_state=sc.data_state(step))
    mngr.wait_until_finished()
  rec["tensors"] = _listing(os.path.join(cfg["persistent"], "tensors"))
  if cfg.get("continue_steps"):
    with ec.CheckpointManager(sc.options(cfg), mesh=mesh) as mngr:
      rec["after_continue"] = _restore_record(mngr, mesh)
    rec["entries_at_end"] = _listing(local_dir)
  return rec


# ---- damaged checkpoints -----------------------------------------------------------


def damage_base(args: dict) -> dict:
  """The pristine run the damage variants start from, plus another run
  ('other-run', other values) saved into the same ramdisk roots."""
  mesh = sc.mesh_for(args["slices"])
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in args["steps"]:
      mngr.save(step, make_state(mesh, step), data_state=sc.data_state(step))
      mngr.wait_until_finished()
    local_dir = mngr.local_directory
  other = dict(args, run_id="other-run", persistent=args["other_persistent"])
  with ec.CheckpointManager(sc.options(other), mesh=mesh) as mngr:
    for step in args["steps"]:
      mngr.save(step, make_state(mesh, step + 1000), data_state={"other": True})
      mngr.wait_until_finished()
  return {
    "local_entries": _listing(local_dir),
    "other_entries": _listing(os.path.join(sc.host_dir(args), "other-run", f"process_{me()}")),
    "tensors": _listing(os.path.join(args["persistent"], "tensors")),
    "state": _listing(os.path.join(args["persistent"], "state")),
  }


def _step_dir(args: dict, step: int, run_id: str | None = None) -> str:
  run_id = run_id or args.get("run_id", "test-run")
  return os.path.join(sc.host_dir(args), run_id, f"process_{me()}", f"step_{step}")


def _local_steps(args: dict) -> list[int]:
  names = os.listdir(os.path.dirname(_step_dir(args, 0)))
  return sorted(int(n[5:]) for n in names if n.startswith("step_"))


def _state_file(args: dict, step: int, process: int) -> str:
  n = jax.process_count()
  return os.path.join(args["persistent"], "state", str(step), f"process_{process}-of-{n}.json")


def _flip(path: str, offset: int, bit: int = 3) -> None:
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ (1 << bit)]))


def _truncate(path: str, keep: float = 0.5) -> None:
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(max(1, int(size * keep)))


def _first_data_offset(step_dir: str) -> int:
  """An offset inside a shard's bytes (not alignment padding) of shards.bin."""
  with open(os.path.join(step_dir, "manifest.json")) as f:
    body = json.load(f)["body"]
  shard = body["leaves"][0]["shards"][0]
  return shard["offset"] + shard["nbytes"] // 2


def apply_damage(op: dict, args: dict) -> None:
  """One damage operation, run by the process that owns the files."""
  kind = op["op"]
  step = op.get("step")
  if kind == "flip_shard":
    steps = _local_steps(args) if step == "all" else [step]
    for s in steps:
      d = _step_dir(args, s)
      _flip(os.path.join(d, "shards.bin"), _first_data_offset(d))
  elif kind == "truncate_shard":
    _truncate(os.path.join(_step_dir(args, step), "shards.bin"))
  elif kind == "rm_local":
    os.remove(os.path.join(_step_dir(args, step), op["file"]))
  elif kind == "flip_manifest":
    path = os.path.join(_step_dir(args, step), "manifest.json")
    _flip(path, os.path.getsize(path) // 2)
  elif kind == "json_torn":
    _truncate(_state_file(args, step, op["process"]))
  elif kind == "json_edit":
    path = _state_file(args, step, op["process"])
    with open(path) as f:
      doc = json.load(f)
    doc["data_state"]["pos"] += 1  # a plausible value, checksum not updated
    with open(path, "w") as f:
      json.dump(doc, f)
  elif kind == "json_rm":
    os.remove(_state_file(args, step, op["process"]))
  elif kind == "commit_torn":
    _truncate(os.path.join(args["persistent"], "state", str(step), "COMMIT"))
  elif kind == "commit_rm":
    os.remove(os.path.join(args["persistent"], "state", str(step), "COMMIT"))
  elif kind == "rm_persistent":
    shutil.rmtree(os.path.join(args["persistent"], "tensors"))
  elif kind == "plant_foreign":
    mine = _step_dir(args, step)
    shutil.rmtree(mine)
    shutil.copytree(_step_dir(args, step, run_id="other-run"), mine)
  elif kind == "symlink_run_dir":
    run_dir = os.path.join(sc.host_dir(args), args.get("run_id", "test-run"))
    planted = os.path.join(sc.host_dir(args), "planted")
    shutil.move(run_dir, planted)
    os.symlink(planted, run_dir)
  elif kind == "chmod_process_dir":
    os.chmod(os.path.dirname(_step_dir(args, 0)), op["mode"])
  elif kind == "chown_process_dir":
    os.chown(os.path.dirname(_step_dir(args, 0)), op["uid"], op["uid"])
  else:
    raise ValueError(kind)


def _reset(path: str, pristine: str) -> None:
  if os.path.islink(path):
    os.unlink(path)
  elif os.path.exists(path):
    shutil.rmtree(path)
  shutil.copytree(pristine, path, symlinks=True)


def _stop_at_status_exchange() -> None:
  """This process SIGSTOPs itself when restore() reaches its per-step status
  exchange: after the inventory agreement, in the middle of the restore."""
  original = collectives_lib.Collectives.gather_sparse

  def gather_sparse(self, name, payload, **kw):
    while name.startswith("restore_status"):  # hangs for good (see failpoints.hit)
      signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    return original(self, name, payload, **kw)

  collectives_lib.Collectives.gather_sparse = gather_sparse


def _append_record(rec: dict) -> None:
  """Also keeps each record in <job out>/records_<process>.jsonl, so a process
  that a later variant kills (SIGSTOP, then SIGKILL) still reports the rest."""
  path = os.path.join(job_output_dir(), f"records_{me()}.jsonl")
  with open(path, "a") as f:
    f.write(json.dumps(rec) + "\n")


def read_records(out_dir: str, process: int) -> list[dict]:
  """What _append_record wrote for `process` in the job at `out_dir`."""
  path = os.path.join(out_dir, f"records_{process}.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def damage_variants(args: dict) -> list[dict]:
  """For each variant: reset every disk to the pristine run, apply its
  damage (each operation by the process named in 'by'), restore with a fresh
  manager (options and abstract state as the variant says), record."""
  host = sc.host_dir(args)
  persistent = args["persistent"]
  shutil.copytree(host, host + ".pristine", symlinks=True)
  if me() == 0:
    shutil.copytree(persistent, persistent + ".pristine", symlinks=True)
  barrier("pristine")
  out = []
  for i, v in enumerate(args["variants"]):
    _reset(host, host + ".pristine")
    if me() == 0:
      _reset(persistent, persistent + ".pristine")
    barrier(f"v{i}-reset")
    for op in v.get("damage", ()):
      if me() in op["by"]:
        apply_damage(op, args)
    barrier(f"v{i}-damaged")
    use_namespace(f"v{i}")
    cfg = dict(args, **v.get("options", {}))
    rec: dict[str, Any] = {"name": v["name"], "process": me()}
    if v.get("stop_at_status_exchange") == me():
      _stop_at_status_exchange()
    t0 = time.monotonic()
    try:
      mesh = sc.mesh_for(cfg["slices"])
      with ec.CheckpointManager(sc.options(cfg), mesh=mesh) as mngr:
        rec["slice"] = mngr.topology.slice_index
        rec.update(_restore_record(mngr, mesh, variant=v.get("abstract")))
        if v.get("saved_process_count", jax.process_count()) != jax.process_count():
          rec["expected_data_state"] = None
    except ec.EmergencyCheckpointError as e:
      _error(rec, e, t0)
    except Exception as e:  # noqa: BLE001 - an untyped error is a finding, recorded
      _error(rec, e, t0)
      rec["untyped"] = True
    rec["other_run_entries"] = _listing(os.path.join(host, "other-run", f"process_{me()}"))
    out.append(rec)
    _append_record(rec)
    if v.get("last"):
      if me() == 0:
        for p in v.get("kill_after", ()):
          kill_sibling(p)
      return out
    barrier(f"v{i}-done")
  return out


def sibling_alive_after(args: dict) -> bool | None:
  """Process 0 sleeps args['sleep_s'] seconds, then says whether process 1
  (which returned at once) is still alive; process 1 returns None."""
  from emergency_ckpt.demo import job_process  # noqa: PLC0415

  if me() != 0:
    return None
  time.sleep(args["sleep_s"])
  return not job_process.process_gone(job_process.read_pid(job_process.job_output_dir(), 1))


def sleep_then_return(args: dict) -> int:
  """Sleeps args['sleep_s'][process] seconds, then returns the process index."""
  time.sleep(args["sleep_s"][me()])
  return me()


# ---- commits that lag the saves ----------------------------------------------------


def commit_lag_run(args: dict) -> dict:
  """Phase "save": saves args['steps'], args['pace_s'] apart, while the
  primary's commit of one step lags and the primary dies after a later
  commit (EC_FAILPOINTS); the other processes wait to be torn down. Phase
  "save_close": the same, then waits for its saves and closes (a failpoint
  that kills must never fire). Phase "restore": restores and reports what
  came back."""
  mesh = sc.mesh_for(args["slices"])
  out: dict[str, Any] = {"process": me()}
  if args["phase"] in ("save", "save_close"):
    mngr = ec.CheckpointManager(sc.options(args), mesh=mesh)
    for step in args["steps"]:
      mngr.save(step, make_state(mesh, step), data_state=sc.data_state(step))
      time.sleep(args["pace_s"])
    if args["phase"] == "save_close":
      mngr.wait_until_finished()
      mngr.close()
      return out
    time.sleep(600)  # the primary's failpoint ends the job
    return out
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    out.update(_restore_record(mngr, mesh))
  return out
