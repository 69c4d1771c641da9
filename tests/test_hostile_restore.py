"""Issue 37 in live jobs: a hostile neighbour inside a real restore.

1. A man in the middle: a 2-slice job (one process per slice) saves steps
   1-5 (local every step, persistent at step 5); then slice 1's ramdisk loses
   step 5, so it must pull it from slice 0, and every peer connection of
   slice 1's process goes through a TCP relay in that process
   (tests/harness/mitm.py) that changes one byte of the first shard in the
   listener's reply and fixes its CRC32C. The MAC catches it; every process
   falls back to the persistent tier and restores step 5 bit-exact.
2. A forged XOR group file: 1 slice x 4 processes (each a host of its own),
   local.redundancy = "xor"; host 1 wiped, and member 3's group.json of
   step 5 rewritten with its checksum recomputed (a well-formed but wrong
   file). It is skipped as a damaged copy: step 5 cannot be rebuilt without
   member 3's block, so every process restores step 4, process 1 rebuilt
   from parity, bit-exact.

One job per scenario (the save, then the restores, in one jax.distributed
job: one start-up each); the job functions below run inside the job's
processes (run_job imports this module there).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any

import pytest

from emergency_ckpt.demo.launcher import run_job
from tests.fault_matrix import check_restored, job_failure

MITM_STEP = 5

FORGERIES = {
  # the members' order changed: member 3's block now claims to be process 2's
  "group_order": lambda body: body.update(group=[0, 1, 3, 2]),
  # the lost member's size off by 8, parity_nbytes made to agree with it
  "size_off_by_8": lambda body: body["sizes"].update({"1": body["sizes"]["1"] + 8}),
  "body_list": None,  # the body itself a list
}
FORGER, WIPED, FORGED_STEP = 3, 1, 5


# ---- inside the job ------------------------------------------------------------------


def _logged_restore(mngr_args: dict, mesh, rec: dict) -> None:
  """A fresh manager's restore (fault_scenarios._restore_record) into `rec`;
  a typed error is recorded, an untyped one flagged; with the library's
  warnings meanwhile, and the saved processes it rebuilt from parity."""
  import emergency_ckpt as ec  # noqa: PLC0415
  from tests import fault_scenarios as fs  # noqa: PLC0415
  from tests import scenarios as sc  # noqa: PLC0415
  from tests.elastic_scenarios import _logged  # noqa: PLC0415

  t0 = time.monotonic()
  with _logged() as logged:
    try:
      with ec.CheckpointManager(sc.options(mngr_args), mesh=mesh) as mngr:
        rec["slice"] = mngr.topology.slice_index
        rec.update(fs._restore_record(mngr, mesh))
    except ec.EmergencyCheckpointError as e:
      fs._error(rec, e, t0)
    except Exception as e:  # noqa: BLE001 - an untyped error is a finding, recorded
      fs._error(rec, e, t0)
      rec["untyped"] = True
  rec["warnings"] = [text for level, text in logged if level >= logging.WARNING]
  rec["rebuilt"] = sorted(
    int(m.group(1))
    for _, text in logged
    if (m := re.search(r"rebuilt saved process (\d+)'s step", text))
  )


def _save_steps(args: dict, mesh) -> None:
  import emergency_ckpt as ec  # noqa: PLC0415
  from tests import scenarios as sc  # noqa: PLC0415

  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    for step in args["steps"]:
      mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
      mngr.wait_until_finished()  # each step durable (and sent) before the next


def mitm_restore(args: dict) -> dict:
  """Saves args['steps']; slice 1 (process 1) loses its step 5; then a
  fresh manager restores with process 1's peer connections relayed by a
  man in the middle that changes one byte of the first shard of each reply
  and fixes its CRC32C."""
  from emergency_ckpt.transport import protocol  # noqa: PLC0415
  from tests import fault_scenarios as fs  # noqa: PLC0415
  from tests import scenarios as sc  # noqa: PLC0415
  from tests.harness import mitm  # noqa: PLC0415
  from tests.helpers import barrier  # noqa: PLC0415

  mesh = sc.mesh_for(args["slices"])
  _save_steps(args, mesh)
  fs.use_namespace("restore")
  me = fs.me()
  rec: dict[str, Any] = {"process": me}
  if me in args["relayed"]:
    lost = fs._step_dir(args, MITM_STEP)
    shutil.rmtree(lost)  # slice 1's ramdisk lost step 5
    rec["lost"] = not os.path.exists(lost)
  barrier("step-lost")
  router, undo = None, None
  if me in args["relayed"]:
    router = mitm.Router(mitm.tamper_first_shard(fix_header=False))
    undo = router.install(protocol)  # every protocol.connect of this process
  try:
    _logged_restore(args, mesh, rec)
  finally:
    if undo is not None:
      undo()
  if router is not None:
    exchanges = router.exchanges
    rec["relay"] = {
      "targets": sorted(f"{h}:{p}" for h, p in router.relays),
      "connections": len(exchanges),
      "tampered": router.tampered,
      "relay_errors": [ex.error for ex in exchanges if ex.error],
    }
    router.close()
  return rec


def _signed(body) -> bytes:
  """A group.json with `body` and its checksum recomputed (local/blocks.py)."""
  import crc32c  # noqa: PLC0415

  raw = json.dumps(body, sort_keys=True).encode()
  return json.dumps({"body": body, "crc32c": crc32c.crc32c(raw)}).encode()


def _forge_group(args: dict, step: int, forgery: str) -> dict:
  """Rewrites this process's xor/step_<step>/group.json as `forgery` says,
  its checksum recomputed. Returns what was done (and whether the file
  still passes decode_group)."""
  import crc32c  # noqa: PLC0415

  from emergency_ckpt.core import parity as xp  # noqa: PLC0415
  from emergency_ckpt.errors import CorruptCheckpointError  # noqa: PLC0415
  from emergency_ckpt.local import blocks  # noqa: PLC0415
  from tests import fault_scenarios as fs  # noqa: PLC0415

  process_dir = os.path.dirname(fs._step_dir(args, step))
  path = os.path.join(process_dir, blocks.XOR_DIR, f"step_{step}", blocks.GROUP_FILE)
  with open(path, "rb") as f:
    before = f.read()
  body = blocks.decode_group(before, path)
  edit = FORGERIES[forgery]
  if edit is None:
    body = [body]
  else:
    edit(body)
    sizes = [body["sizes"].get(str(i), 0) for i in range(len(body["group"]))]
    body["parity_nbytes"] = xp.block_length(sizes, body["member"])  # consistent
  after = _signed(body)
  with open(path, "wb") as f:
    f.write(after)
  doc = json.loads(after)  # well-formed, its checksum right
  crc_ok = doc["crc32c"] == crc32c.crc32c(json.dumps(doc["body"], sort_keys=True).encode())
  try:
    blocks.decode_group(after, path)
    decodes, why = "accepted", None
  except CorruptCheckpointError as e:
    decodes, why = "refused", str(e)
  return {"changed": after != before, "checksum_ok": crc_ok, "decode_group": decodes, "why": why}


def forged_group_restores(args: dict) -> list[dict]:
  """Saves args['steps'] with XOR redundancy; then, for each forgery: every
  disk reset to the saved run, host WIPED's ramdisk wiped, FORGER's group
  file of FORGED_STEP forged, and a fresh manager restores."""
  from tests import fault_scenarios as fs  # noqa: PLC0415
  from tests import scenarios as sc  # noqa: PLC0415
  from tests.helpers import barrier  # noqa: PLC0415

  mesh = sc.mesh_for(args["slices"])
  _save_steps(args, mesh)
  me = fs.me()
  host, persistent = sc.host_dir(args), args["persistent"]
  shutil.copytree(host, host + ".pristine", symlinks=True)
  if me == 0:
    shutil.copytree(persistent, persistent + ".pristine", symlinks=True)
  barrier("pristine")
  out = []
  for i, forgery in enumerate(args["forgeries"]):
    fs._reset(host, host + ".pristine")
    if me == 0:
      fs._reset(persistent, persistent + ".pristine")
    rec: dict[str, Any] = {"name": forgery, "process": me}
    if me == WIPED:
      shutil.rmtree(host)  # a replaced host: its ramdisk is empty
    if me == FORGER:
      rec["forged"] = _forge_group(args, FORGED_STEP, forgery)
    barrier(f"g{i}-damaged")
    fs.use_namespace(f"g{i}")
    _logged_restore(args, mesh, rec)
    out.append(rec)
    barrier(f"g{i}-done")
  return out


# ---- the tests -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mitm_job(module_shm_dir):
  root = os.path.join(module_shm_dir, "mitm")
  args = {
    "slices": 2,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "persistent"),
    "steps": [1, 2, 3, 4, 5],
    "local_keep": 3,
    "persistent_interval": 5,  # step 5 persistent too
    "collective_timeout_s": 30,
    "sim_hosts": True,  # each slice a host of its own
    "relayed": [1],
  }
  job = run_job(
    f"{__name__}:mitm_restore", 2, args, timeout_s=240, out_dir=os.path.join(root, "job")
  )
  return job


@pytest.fixture(scope="module")
def forged_group_job(module_shm_dir):
  root = os.path.join(module_shm_dir, "xor")
  args = {
    "slices": 1,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "persistent"),
    "steps": [1, 2, 3, 4, 5],
    "local_keep": 3,
    "persistent_interval": 3,  # step 3 persistent
    "redundancy": "xor",
    "redundancy_overlap": True,
    "sim_hosts": True,
    "collective_timeout_s": 30,
    "forgeries": list(FORGERIES),
  }
  job = run_job(
    f"{__name__}:forged_group_restores",
    4,
    args,
    timeout_s=300,
    out_dir=os.path.join(root, "job"),
  )
  return job


def _mitm_records(job) -> list[dict]:
  if any(r is None for r in job.results):
    pytest.fail(f"no result from every process: {job_failure(job)}")
  return sorted(job.results, key=lambda r: r["process"])


def test_a_man_in_the_middle_in_a_restore_is_caught_and_persistent_serves(mitm_job, fault_matrix):
  records = _mitm_records(mitm_job)
  relayed = records[1]
  relay = relayed.get("relay", {})
  typed = not any(r.get("untyped") for r in records)
  ok, text = check_restored(records, MITM_STEP, {0: "persistent", 1: "persistent"})
  mac = [w for w in relayed["warnings"] if "fail their MAC" in w]
  fell_back = all(
    any("reading the step from the persistent tier" in w for w in r["warnings"]) for r in records
  )
  observed = (
    f"{text}; the relay carried {relay.get('connections')} connections of process 1 and changed"
    f" {relay.get('tampered')} replies (a shard byte, its CRC32C fixed); MAC failures logged"
    f" on process 1: {len(mac)}; every process fell back to the persistent tier: {fell_back}"
  )
  if not ok:
    observed = f"{text}; warnings: {[r.get('warnings') for r in records]}"
  fault_matrix.check(
    "hostile.mitm_restore",
    observed,
    bool(ok and typed and relayed.get("lost") and relay.get("tampered", 0) >= 1 and mac)
    and fell_back,
  )


def test_the_relay_changed_replies_and_each_was_refused_by_its_mac(mitm_job):
  records = _mitm_records(mitm_job)
  relayed = records[1]
  assert relayed["slice"] == 1 and relayed["lost"], relayed
  relay = relayed["relay"]
  assert relay["relay_errors"] == [], relay
  assert relay["tampered"] >= 1, relay  # the man in the middle did change a reply
  assert relay["connections"] >= relay["tampered"], relay
  # the peer transfer failed on a CorruptCheckpointError, from the MAC (the
  # CRC32C alone would have passed), and every process agreed
  failed = [w for w in relayed["warnings"] if "peer transfer of step 5 failed" in w]
  assert any("fail their MAC (altered on the wire)" in w for w in failed), relayed["warnings"]
  for r in records:
    assert any(
      "(CorruptCheckpointError)" in w and "reading the step from the persistent tier" in w
      for w in r["warnings"]
    ), (r["process"], r["warnings"])
  # every tampered reply was refused: none was loaded (bit-exact results)
  assert len([w for w in relayed["warnings"] if "fail their MAC" in w]) >= relay["tampered"], (
    relay,
    relayed["warnings"],
  )
  assert all(r["mismatches"] == [] for r in records), records


def _group_records(job) -> dict[str, dict[int, dict]]:
  if any(r is None for r in job.results):
    pytest.fail(f"no result from every process: {job_failure(job)}")
  by_name: dict[str, dict[int, dict]] = {}
  for per_process in job.results:
    for rec in per_process:
      by_name.setdefault(rec["name"], {})[rec["process"]] = rec
  return by_name


def _group_outcome(recs: dict[int, dict]) -> tuple[bool, str]:
  records = [recs[p] for p in sorted(recs)]
  if len(records) != 4 or any(r.get("untyped") for r in records):
    return False, f"records {records}"
  ok, text = check_restored(records, 4, None)
  sources = {r["process"]: r.get("source") for r in records}
  want = {p: "parity" if p == WIPED else "local" for p in range(4)}
  if sources != want:
    return False, f"{text}; sources {sources}, expected {want}"
  if recs[WIPED].get("rebuilt") != [WIPED]:
    return False, f"{text}; process {WIPED} rebuilt {recs[WIPED].get('rebuilt')}"
  return ok, text


def test_forged_group_files_are_skipped_in_a_live_job(forged_group_job, fault_matrix):
  by_name = _group_records(forged_group_job)
  parts, all_ok = [], True
  for name in FORGERIES:
    recs = by_name.get(name, {})
    forged = recs.get(FORGER, {}).get("forged", {})
    ok, text = _group_outcome(recs) if len(recs) == 4 else (False, "no record from every process")
    ok = ok and forged.get("changed") and forged.get("checksum_ok")
    all_ok = all_ok and ok
    parts.append(f"{name} (decode_group {forged.get('decode_group')} it): {text}")
  fault_matrix.check("hostile.forged_group", "; ".join(parts), all_ok)


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_group_file_is_a_damaged_copy(forged_group_job, name):
  """Each forgery: written with a valid checksum, no untyped error, and
  step 4 (step 5 needs member 3's block) on every process, process 1
  rebuilt from parity, bit-exact with its data_state."""
  recs = _group_records(forged_group_job).get(name, {})
  if len(recs) < 4:
    pytest.fail(f"{name}: no record from every process: {job_failure(forged_group_job)}")
  forged = recs[FORGER]["forged"]
  assert forged["changed"] and forged["checksum_ok"], forged
  assert not any(r.get("untyped") for r in recs.values()), recs
  ok, text = _group_outcome(recs)
  assert ok, text
  assert len({r["step"] for r in recs.values()}) == 1  # every process on one step
