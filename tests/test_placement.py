"""Replica placement: no machine may run processes of two slices."""

from __future__ import annotations

import os

import pytest

from emergency_ckpt.cluster import placement
from emergency_ckpt.cluster.topology import host_identity
from emergency_ckpt.demo.launcher import run_job

# 2 slices x 2 processes: slice 0 = processes 0, 1; slice 1 = processes 2, 3.
SLICES = ((0, 1), (2, 3))


@pytest.mark.parametrize(
  "hosts, want",
  [
    ({0: "a", 1: "b", 2: "c", 3: "d"}, {}),  # one process per host
    ({0: "a", 1: "a", 2: "b", 3: "b"}, {}),  # a host per slice: 8-GPU nodes
    ({0: "a", 1: "b", 2: "a", 3: "b"}, {"a": {0: (0,), 1: (2,)}, "b": {0: (1,), 1: (3,)}}),
    ({0: "a", 1: "a", 2: "a", 3: "b"}, {"a": {0: (0, 1), 1: (2,)}}),
    ({0: "a", 1: None, 2: None, 3: "b"}, {}),  # unknown hosts are not guessed at
  ],
)
def test_shared_hosts(hosts, want):
  assert placement.shared_hosts(hosts, SLICES) == want


def test_a_single_slice_shares_nothing():
  assert placement.shared_hosts({0: "a", 1: "a"}, ((0, 1),)) == {}


def test_describe_names_host_slices_processes_and_the_fix():
  assert placement.describe({}) is None
  text = placement.describe(placement.shared_hosts({0: "a", 1: "b", 2: "a", 3: "c"}, SLICES))
  assert "host 'a' runs slice 0 (processes [0]), slice 1 (processes [2])" in text
  assert "persistent tier" in text and "host_id" in text and "replica-axis entry" in text
  assert "more hosts" not in text
  shared = placement.shared_hosts({0: "a", 2: "a"}, SLICES)
  assert "; and 4 more hosts run processes of two" in placement.describe(shared, more=4)


def test_host_identity_is_stable_per_machine_and_overridable():
  assert host_identity() == host_identity()  # two processes of a machine agree (same boot)
  assert host_identity("rack3-node7") == "rack3-node7"


def test_slices_on_one_machine_are_reported_and_named_hosts_are_not(shm_dir):
  """A real 2-slice job on this one machine: by default the check sees one
  host under both slices (warning, event, property); with a host_id per
  process it sees none."""
  args = {
    "slices": 2,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(shm_dir, "persistent"),
    "events": os.path.join(shm_dir, "events_{process}.jsonl"),
  }
  results = run_job("tests.retention_scenarios:placement_job", 2, args, timeout_s=120).check()
  for r in results:
    same = r["same_machine"]
    assert same is not None and "slice 0 (processes [0]), slice 1 (processes [1])" in same, r
    assert r["named_hosts"] is None, r
  assert results[0]["placement_events"] == 1  # the primary records it, once
  assert results[1]["placement_events"] == 0
