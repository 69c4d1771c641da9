"""Issue 16, part 1 (same slice shape): ramdisk copies are found by what
they hold, not by who wrote them. Saved: steps 1-5, local every step (3
kept), persistent every 3rd (step 3). Each restart must restore step 5 from
ramdisks, never from the persistent tier, bit-exactly:
- shuffled hosts: 2 slices x 2 processes restart with each host running
  the process of the other slice at the same slice position;
- fewer slices: 2 slices x 2 processes restart as 1 slice on hosts 0-1;
- more slices: 1 slice x 2 processes restart as 2 slices (new hosts 2-3).
Afterwards the run saves steps 6-8 under the new topology, and retention
removes the copies taken from other processes' folders once they drop out."""

from __future__ import annotations

import os
import shutil

from tests import restart_helpers as rh


def _save(root: str, processes: int, slices: int) -> dict:
  return rh.save_run(root, processes, slices)


def _restart(args: dict, processes: int, slices: int) -> list[dict]:
  return list(rh.restart(args, processes, slices).values())


def _swap(root: str, a: int, b: int) -> None:
  host_a, host_b = (os.path.join(root, "local", f"host_{i}") for i in (a, b))
  shutil.move(host_a, host_a + ".swap")
  shutil.move(host_b, host_a)
  shutil.move(host_a + ".swap", host_b)


def test_shuffled_hosts_restore_from_the_copies_they_hold(shm_dir):
  args = _save(shm_dir, 4, 2)
  _swap(shm_dir, 0, 2)  # host 0 now runs process 0 and holds process 2's copies
  _swap(shm_dir, 1, 3)
  results = _restart(dict(args, metadata_of_5=True), 4, 2)
  for r in results:
    assert (r["step"], r["source"], r["bad"]) == (5, "local", []), r
    assert r["local_slices_of_5"] == [0, 1], r  # metadata counts the copies hosts hold
    assert r["data_state"] == {
      "pos": 5000 + r["process"],
      "seed": [r["process"], 5],
      "tag": f"p{r['process']}-s5",
    }, r
    other = (r["process"] + 2) % 4  # whose folder this host held
    assert r["host_folders"][f"process_{r['process']}"] == ["step_6", "step_7", "step_8"], r
    # dropped by retention, then the emptied folder itself
    assert f"process_{other}" not in r["host_folders"], r


def test_fewer_slices_restore_from_the_surviving_ramdisks(shm_dir):
  args = _save(shm_dir, 4, 2)
  results = _restart(args, 2, 1)  # slice 1 (hosts 2-3) gone for good
  for r in results:
    assert (r["step"], r["source"], r["bad"]) == (5, "local", []), r
    assert r["data_state"] is None, r  # another process count (see data_state_remap)
    assert r["host_folders"][f"process_{r['process']}"] == ["step_6", "step_7", "step_8"], r
  assert results[0]["all_steps"][-3:] == [6, 7, 8]  # the run goes on under the new topology


def test_more_slices_restore_from_the_old_slice_and_its_peer(shm_dir):
  args = _save(shm_dir, 2, 1)
  results = _restart(args, 4, 2)  # hosts 2-3 are new: empty ramdisks
  for r in results:
    want = "local" if r["slice"] == 0 else "peer"
    assert (r["step"], r["source"], r["bad"]) == (5, want, []), r
    assert r["data_state"] is None, r


def test_processes_moved_across_the_mesh_with_their_hosts(shm_dir):
  """Same count, but each host now runs the process of its slice neighbour,
  which the mesh places where the host's old process sat (as a mesh built
  from physical device coordinates does after a host shuffle). The copies
  hold the right shards for the mesh coordinates, not for the process
  index: each process reads its own host's copy (resharded by the recorded
  slice grid), and gets the data state saved for its mesh coordinates."""
  args = _save(shm_dir, 4, 2)
  _swap(shm_dir, 0, 1)
  _swap(shm_dir, 2, 3)
  moved = dict(args, mesh_order=[1, 0, 3, 2])
  results = _restart(moved, 4, 2)
  for r in results:
    assert (r["step"], r["source"], r["bad"]) == (5, "local", []), r
    was = r["process"] ^ 1  # the process that held these mesh coordinates
    assert r["data_state"] == {"pos": 5000 + was, "seed": [was, 5], "tag": f"p{was}-s5"}, r
