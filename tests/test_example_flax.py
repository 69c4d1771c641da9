"""End to end: the flax nnx + optax + grain example (examples/flax_grain.py).

Real 2-slice x 1-process jax.distributed CPU jobs: a reference run, a
checkpointed run SIGKILLed after step 9, slice 1's ramdisk wiped, a restart
that must resume bit-exactly (slice 0 from its ramdisk, slice 1 from its
peer, grain's iterator from data_state). Then the same restart from the same
files, but with the data iterator not restored: the example must notice.
"""

from __future__ import annotations

import os
import shutil

from examples import flax_grain

STEPS, CRASH_AT = 12, 9  # local saves at 5, 10; persistent at 10: restore step 5


def _snapshot(run: flax_grain.Run, dest: str) -> None:
  shutil.copytree(run.ramdisk_root, os.path.join(dest, "ramdisk"), symlinks=True)
  shutil.copytree(run.persistent, os.path.join(dest, "persistent"), symlinks=True)


def _put_back(run: flax_grain.Run, src: str) -> None:
  shutil.rmtree(run.ramdisk_root)
  shutil.rmtree(run.persistent)
  shutil.copytree(os.path.join(src, "ramdisk"), run.ramdisk_root, symlinks=True)
  shutil.copytree(os.path.join(src, "persistent"), run.persistent, symlinks=True)


def test_flax_grain_example_resumes_bit_exactly_and_notices_a_lost_iterator(tmp_path):
  run = flax_grain.Run(steps=STEPS, crash_at=CRASH_AT, procs_per_slice=1, timeout_s=300)
  try:
    reference = run.reference()
    returncodes = run.crash(settle=True)  # the newest save before the crash is durable
    run.wipe_lost_slice()
    _snapshot(run, str(tmp_path))

    resumed = run.resume()
    summary = flax_grain.verify(run, reference, returncodes, resumed)
    assert summary["problems"] == [], summary
    assert summary["ok"]
    assert all(rc != 0 for rc in returncodes), returncodes
    assert summary["restored_step"] == 5

    ref = {int(k): v for k, v in reference[0]["losses"].items()}
    for r in resumed:
      # the resumed loss curve is the uninterrupted one, bit for bit
      assert {int(k): v for k, v in r["losses"].items()} == {s: ref[s] for s in range(6, STEPS + 1)}
    by_slice = {p["slice"]: p for p in summary["processes"]}
    assert by_slice[0]["source"] == "local"
    assert by_slice[1]["source"] == "peer"
    for p in summary["processes"]:
      # grain's own state, saved at step 5 by the crashed run, is where the
      # restarted iterator stands (and what restore() returned)
      saved = run.trace("crashed", p["process"])[5]["iterator"]
      assert saved == {"next_index": 5}
      assert p["iterator_after_restore"] == saved
      assert p["iterator_in_checkpoint"] == saved

    # Same restart, same files, but the trainer forgets the data iterator:
    # the tensors are right, the batches are not, and the check must say so.
    _put_back(run, str(tmp_path))
    faulty = run.resume(fault="fresh-iterator", name="faulty")
    bad = flax_grain.verify(run, reference, returncodes, faulty)
    assert not bad["ok"]
    assert any("data iterator after restore" in p for p in bad["problems"]), bad["problems"]
    assert any("resumed losses differ" in p for p in bad["problems"]), bad["problems"]
    assert {p["source"] for p in bad["processes"]} == {"local", "peer"}
  finally:
    run.cleanup()
