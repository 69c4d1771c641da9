"""Forged local manifests in a real 2-slice job (issue 37, item 3): each edit
made with the manifest's checksum recomputed (a well-formed but wrong file)
is a damaged copy: slice 1 skips it and restores step 5 bit-exact from the
peer slice, never crashes.

The job functions below run inside the job's processes (run_job imports this
module there): fault_scenarios.damage_variants, with its damage operation
extended by `forge_manifest`.
"""

from __future__ import annotations

import os

import pytest

from emergency_ckpt.demo.launcher import run_job
from tests import fault_scenarios
from tests.fault_matrix import check_restored, job_failure
from tests.fault_scenarios import read_records

FORGERIES = {
  "topology_list": lambda b: b.update(topology=[1, 2]),
  "size_off_by_8": lambda b: b["leaves"][0]["shards"][0].update(
    nbytes=b["leaves"][0]["shards"][0]["nbytes"] + 8
  ),
  "body_list": None,  # the body itself a list
  "offset_past_end": lambda b: b["leaves"][0]["shards"][0].update(offset=b["nbytes"]),
}


def _forge(op: dict, args: dict) -> None:
  from emergency_ckpt.local import format as local_format  # noqa: PLC0415

  path = os.path.join(fault_scenarios._step_dir(args, op["step"]), "manifest.json")
  with open(path, "rb") as f:
    body = local_format.decode_manifest(f.read(), path)
  edit = FORGERIES[op["forgery"]]
  if edit is None:
    body = [body]
  else:
    edit(body)
  with open(path, "wb") as f:
    f.write(local_format.encode_manifest(body))  # checksum recomputed


def forged_variants(args: dict) -> list[dict]:
  """damage_variants, with `forge_manifest` operations."""
  original = fault_scenarios.apply_damage

  def apply_damage(op: dict, a: dict) -> None:
    if op["op"] == "forge_manifest":
      _forge(op, a)
    else:
      original(op, a)

  fault_scenarios.apply_damage = apply_damage
  return fault_scenarios.damage_variants(args)


@pytest.fixture(scope="module")
def forged_runs(module_shm_dir):
  args = {
    "slices": 2,
    "local_root": os.path.join(module_shm_dir, "local"),
    "persistent": os.path.join(module_shm_dir, "persistent"),
    "other_persistent": os.path.join(module_shm_dir, "other_persistent"),
    "steps": [1, 2, 3, 4, 5],
    "local_keep": 3,
    "persistent_interval": 2,
  }
  base = run_job(
    "tests.fault_scenarios:damage_base",
    2,
    args,
    timeout_s=180,
    out_dir=os.path.join(module_shm_dir, "base_job"),
  )
  base.check()
  args["variants"] = [
    {"name": name, "damage": [{"op": "forge_manifest", "by": [1], "step": 5, "forgery": name}]}
    for name in FORGERIES
  ]
  out_dir = os.path.join(module_shm_dir, "forged_job")
  job = run_job("tests.test_forged_files:forged_variants", 2, args, timeout_s=300, out_dir=out_dir)
  by_name: dict = {}
  for p in range(2):
    for rec in read_records(out_dir, p):
      by_name.setdefault(rec["name"], {})[p] = rec
  return job, by_name


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_manifest_is_skipped_and_the_peer_restores(forged_runs, name):
  job, by_name = forged_runs
  recs = by_name.get(name, {})
  if len(recs) < 2:
    pytest.fail(f"{name}: no record from every process: {job_failure(job)}")
  records = [recs[p] for p in sorted(recs)]
  assert not any(r.get("untyped") for r in records), records
  ok, text = check_restored(records, 5, {0: "local", 1: "peer"})
  assert ok, text


def test_the_forged_copy_was_the_one_refused(forged_runs):
  """Slice 1 reported its own copy unusable, as damage, for every forgery."""
  _, by_name = forged_runs
  for name in FORGERIES:
    rec = by_name[name][1]
    assert rec["slice"] == 1 and rec["source"] == "peer", (name, rec)
