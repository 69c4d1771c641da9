"""Issue 2: real multi-process jax.distributed jobs on CPU, save then restart.

Each topology: one job saves steps 1..4 (local every step, keep 2; persistent
every 2nd step), then a restarted job restores under variants (a)-(e), and
(g) on 4 slices; a third
job is SIGKILLed mid local save (f) and a fourth restores after it.
"""

from __future__ import annotations

import os
import shutil

import pytest

from emergency_ckpt.demo.launcher import run_job

# (slices, processes, devices per process)
TOPOLOGIES = {
  "2x2": (2, 4, 2),
  "4x1": (4, 4, 2),
  "1slice": (1, 2, 2),
}


def _args(shm_dir: str, slices: int, **kw) -> dict:
  args = {
    "slices": slices,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "steps": [1, 2, 3, 4],
  }
  args.update(kw)
  return args


def _variants(slices: int, last: int) -> list[dict]:
  v = [{"name": "a_intact"}]
  if slices > 1:
    v.append({"name": "b_nonprimary_wiped", "wipe_slices": [slices - 1]})
  v.append({"name": "c_primary_wiped", "wipe_slices": [0]})
  v.append({"name": "d_all_wiped", "wipe_slices": list(range(slices))})
  if slices > 2:  # more lost slices than intact ones: several transfer rounds
    v.append({"name": "g_only_primary_left", "wipe_slices": list(range(1, slices))})
  v.append({"name": "e_json_missing", "delete_json": [[last, 4]]})  # last: it deletes
  return v


def _expected(name: str, slice_index: int, slices: int) -> tuple[int, str]:
  """(step, source) a process of `slice_index` must restore in variant `name`."""
  if name == "a_intact":
    return 4, "local"
  if name == "b_nonprimary_wiped":
    return 4, "peer" if slice_index == slices - 1 else "local"
  if name == "c_primary_wiped":
    if slices == 1:
      return 4, "persistent"
    return 4, "peer" if slice_index == 0 else "local"
  if name == "d_all_wiped":
    return 4, "persistent"
  if name == "g_only_primary_left":
    return 4, "local" if slice_index == 0 else "peer"
  if name == "e_json_missing":
    # Step 4's COMMIT is trusted (no listing of its folder, issue 15), so
    # latest_step() names it; the process whose JSON is gone fails to read
    # it at restore, which skips step 4 on every process: step 3 wins.
    return 3, "local"
  raise AssertionError(name)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_save_restart_restore(shm_dir, topology):
  slices, nproc, ndev = TOPOLOGIES[topology]
  args = _args(shm_dir, slices)
  saved = run_job("tests.scenarios:save_steps", nproc, args, devices_per_process=ndev).check()
  assert all(r["saved"] == [1, 2, 3, 4] for r in saved)
  assert sorted(r["slice"] for r in saved) == sorted(
    s for s in range(slices) for _ in range(nproc // slices)
  )
  # Persistent tier: every 2nd step, Orbax-committed (by the primary slice,
  # through Orbax's barriers over its processes) ...
  assert sorted(os.listdir(os.path.join(args["persistent"], "tensors"))) == ["2", "4"]
  # ... without Orbax's start-up all-gathers of every process (N^2 values on
  # the coordination service), which its defaults do not need.
  assert [r["orbax_all_gathers"] for r in saved] == [[]] * nproc

  args["variants"] = _variants(slices, nproc - 1)
  results = run_job(
    "tests.scenarios:restore_variants", nproc, args, devices_per_process=ndev
  ).check()
  for process, records in enumerate(results):
    for rec in records:
      where = f"process {process} variant {rec['name']}"
      assert "error" not in rec, f"{where}: {rec.get('message')}"
      step, source = _expected(rec["name"], rec["slice"], slices)
      assert (rec["step"], rec["source"]) == (step, source), where
      # latest_step() goes by markers (COMMIT): a JSON lost after COMMIT is
      # found only at restore, like a torn one.
      latest = 4 if rec["name"] == "e_json_missing" else step
      assert rec["latest"] == latest, where
      assert rec["mismatches"] == [], where
      assert rec["data_state"] == rec["expected_data_state"], where
      assert rec["data_state"]["pos"] == step * 1000 + process, where


def test_orbax_flagged_to_translate_process_ids_gets_its_table(shm_dir):
  """With Orbax's experimental flag to use distributed process ids, its
  translation table is built (its own all-gather) before the persistent
  tier's first save, and the primary slice's saves go through."""
  args = _args(shm_dir, 2, orbax_distributed_ids=True)
  saved = run_job("tests.scenarios:save_steps", 4, args).check()
  assert all(r["saved"] == [1, 2, 3, 4] for r in saved)
  assert sorted(os.listdir(os.path.join(args["persistent"], "tensors"))) == ["2", "4"]
  assert [r["orbax_all_gathers"] for r in saved] == [
    ["runtime_to_distributed_ids", "jax/process_id/"]
  ] * 4


def test_primary_slice_uploads_from_the_snapshot_in_pinned_host_memory(shm_dir):
  """The accelerators' persistent upload (arrays in pinned host memory built
  from the staged snapshot, on the upload thread), run on CPU devices: the
  primary slice's processes save through Orbax's subset barriers, and with
  every ramdisk wiped each process restores the newest persistent step
  bit-exactly."""
  args = _args(shm_dir, 2, upload_memory_kind="pinned_host")
  saved = run_job("tests.scenarios:save_steps", 4, args).check()
  assert all(r["saved"] == [1, 2, 3, 4] for r in saved)
  assert [r["upload"] for r in saved] == [[True, "pinned_host"]] * 4
  assert sorted(os.listdir(os.path.join(args["persistent"], "tensors"))) == ["2", "4"]
  args["variants"] = [{"name": "all_wiped", "wipe_slices": [0, 1]}]
  for rec, *_ in run_job("tests.scenarios:restore_variants", 4, args).check():
    assert "error" not in rec, rec.get("message")
    assert (rec["step"], rec["source"]) == (4, "persistent")
    assert rec["mismatches"] == [] and rec["data_state"] == rec["expected_data_state"]


def test_collective_peer_transport(shm_dir):
  """peer_transport="collective" (the XLA permute) serves a wiped slice too."""
  args = _args(shm_dir, 2)
  run_job("tests.scenarios:save_steps", 4, args).check()
  args["variants"] = [
    {"name": "collective", "wipe_slices": [1], "args": {"peer_transport": "collective"}}
  ]
  for process, (rec,) in enumerate(run_job("tests.scenarios:restore_variants", 4, args).check()):
    assert "error" not in rec, rec.get("message")
    assert (rec["step"], rec["source"]) == (4, "peer" if process >= 2 else "local")
    assert rec["mismatches"] == [] and rec["data_state"] == rec["expected_data_state"]


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_sigkill_mid_local_save(shm_dir, topology):
  """(f) One process dies halfway through writing step 3's shards: step 3 is
  never listed anywhere, and the restart restores step 2 bit-exactly."""
  slices, nproc, ndev = TOPOLOGIES[topology]
  victim = 1
  # wait_each: step 2 is durable (committed) before step 3 starts, as with
  # minutes between saves; the victim then dies inside step 3's shard write.
  args = _args(
    shm_dir,
    slices,
    steps=[1, 2, 3],
    persistent_interval=10,
    state_commit_timeout_s=5,
    wait_each=True,
  )
  crashed = run_job(
    "tests.scenarios:save_steps",
    nproc,
    args,
    devices_per_process=ndev,
    env={victim: {"EC_FAILPOINTS": "local.mid_write@3"}},
  )
  assert crashed.returncodes[victim] == -9, crashed.returncodes
  victim_dir = os.path.join(args["local_root"], f"host_{victim}", "test-run", f"process_{victim}")
  leftovers = os.listdir(victim_dir)
  assert "step_3" not in leftovers and any(n.startswith(".tmp-step_3") for n in leftovers), (
    leftovers
  )

  args["variants"] = [{"name": "after_crash"}]
  results = run_job(
    "tests.scenarios:restore_variants", nproc, args, devices_per_process=ndev
  ).check()
  for process, (rec,) in enumerate(results):
    assert "error" not in rec, rec.get("message")
    assert rec["step"] == 2 and rec["source"] == "local", (process, rec)
    assert 3 not in rec["all_steps"], rec["all_steps"]
    assert rec["mismatches"] == []
    assert rec["data_state"] == rec["expected_data_state"]
    # The torn .tmp folder of step 3 was cleaned when the manager started.
    torn = [n for n in rec["local_entries"] if n.startswith(".tmp")]
    assert not torn, rec["local_entries"]


def test_reshard_restore_from_persistent_onto_another_topology(shm_dir):
  """Saved by 2 slices x 2 processes, restored by 1 slice x 4 processes (the
  data axis grows from 4 to 8) with every ramdisk lost (resharding ramdisk
  copies: test_elastic_reshard): the persistent tier serves the step
  resharded, bit-exactly."""
  args = _args(shm_dir, 2)
  run_job("tests.scenarios:save_steps", 4, args).check()
  for host in os.listdir(args["local_root"]):  # every ramdisk lost
    shutil.rmtree(os.path.join(args["local_root"], host, "test-run"))
  args.update(slices=1, variants=[{"name": "resharded"}])
  results = run_job("tests.scenarios:restore_variants", 4, args).check()
  for process, (rec,) in enumerate(results):
    assert "error" not in rec, rec.get("message")
    assert (rec["step"], rec["source"]) == (4, "persistent"), (process, rec)
    assert rec["mismatches"] == []
    assert rec["data_state"] == rec["expected_data_state"]  # same process count


def test_peer_ports_bound_the_senders_and_a_full_range_falls_back_to_persistent(shm_dir):
  """peer_ports with free ports: the wiped slice restores from its peer. A
  range of one port that something else holds: no sender can listen, every
  process falls back together, and step 4 comes from the persistent tier."""
  import socket  # noqa: PLC0415

  from tests.test_peer_stream import _free_port_run  # noqa: PLC0415

  args = _args(shm_dir, 2)
  run_job("tests.scenarios:save_steps", 4, args).check()
  low = _free_port_run(16)
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", low))  # bound, not listening: still "in use" to a bind
    args["variants"] = [
      {"name": "range", "wipe_slices": [1], "args": {"peer_ports": f"{low + 1}-{low + 15}"}},
      {"name": "full", "wipe_slices": [1], "args": {"peer_ports": str(low)}},
    ]
    results = run_job("tests.scenarios:restore_variants", 4, args).check()
  for process, (ranged, full) in enumerate(results):
    for rec in (ranged, full):
      assert "error" not in rec, rec.get("message")
      assert rec["mismatches"] == [] and rec["data_state"] == rec["expected_data_state"], rec
    assert (ranged["step"], ranged["source"]) == (4, "peer" if process >= 2 else "local")
    assert (full["step"], full["source"]) == (4, "persistent"), results
