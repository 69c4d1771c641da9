"""End to end: the flax/grain example restarts onto fewer slices (issue 16,
part 3; `python -m examples.flax_grain --shrink`).

Real jax.distributed CPU jobs, with elastic data (the dataset cut into 2
logical shards for the whole run, one grain iterator each): a 2-slice x
1-process reference; a checkpointed 2-slice run SIGKILLed after step 18
(local saves at 5, 10, 15; persistent at 10); slice 1 gone for good (its
ramdisk wiped, its host not in the job; the run died once its saves were
durable, so the newest save is the restored step); a restart as ONE slice
of one process on slice 0's host. It must restore step 15, the newest, from its own
ramdisk (source "local": the persistent tier holds only step 10), and its
iterator from both saved processes' states through
restore(data_state_remap=remap_data_shards), so that training resumes at
global example 240 (15 batches x 16): at every step 16-24 it feeds exactly
the example ids the uninterrupted run fed, in the same order, and the run's
consumed examples (crashed run 1-15, then the restart 16-24) are the
reference's, each epoch (12 steps = the 192 examples) feeding every example
exactly once.

The losses are checked finite and within 1e-5 (relative) of the reference,
not bit-for-bit, and no bit-exact 1-slice reference exists: the restored
state is bit-exact (what the library guarantees and its own tests check) and
the batches are identical, but the step then runs on 2 devices instead of 4,
so XLA sums each gradient and the loss over another reduction tree (4
partial sums across slices and devices, against 2 of 8 rows), and float32
addition is not associative: the results differ by about 1 ulp (a 1-slice
run from scratch already differs from the 2-slice one at step 2; one trained
on 1 slice up to step 15 would not even start from the restored state).
Wrong batches differ by percents (the negative control at the end: same
files, iterator not restored; 8-47% here).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import pytest

from examples import flax_grain
from examples.flax_grain_trainer import data_shards_of, remap_data_shards

STEPS, CRASH_AT = 24, 18  # local saves at 5, 10, 15 (crash at 18); persistent at 10
RESTORED = 15
GLOBAL_BATCH, EXAMPLES = 16, 192  # flax_grain_trainer.DEFAULTS: 12 steps per epoch


def test_flax_grain_example_resumes_on_one_slice_at_the_same_global_example_count(tmp_path):
  run = flax_grain.Run(
    steps=STEPS, crash_at=CRASH_AT, procs_per_slice=1, timeout_s=300, elastic=True
  )
  try:
    reference = run.reference()
    returncodes = run.crash(settle=True)  # step 15 durable when it dies: restored step fixed
    assert all(rc != 0 for rc in returncodes), returncodes
    run.wipe_lost_slice()  # slice 1 (host 1) is gone for good
    assert os.listdir(run.ramdisk_root) == ["host_0"]
    # The newest step lives only on the ramdisk: persistent holds step 10.
    assert sorted(os.listdir(os.path.join(run.persistent, "tensors"))) == ["10"]
    run.snapshot(str(tmp_path))

    resumed = run.resume_on_one_slice()
    summary = flax_grain.verify_shrink(run, reference, returncodes, resumed)
    assert summary["problems"] == [], summary
    assert summary["ok"]

    # One process, slice 0, restored the newest step from its own ramdisk.
    assert len(resumed) == 1 and resumed[0]["process"] == 0 and resumed[0]["slice"] == 0
    [proc] = summary["processes"]
    assert (proc["restored_step"], proc["source"]) == (RESTORED, "local"), proc

    # The data state: each crashed process saved its own shard's grain state
    # at step 15; the single process now reads both, each where it stopped.
    saved = [run.trace("crashed", i)[RESTORED]["iterator"] for i in range(2)]
    assert saved == [
      {"data_shards": 2, "batches": RESTORED, "shards": {str(i): {"next_index": RESTORED}}}
      for i in range(2)
    ]
    merged = {
      "data_shards": 2,
      "batches": RESTORED,
      "shards": {"0": {"next_index": RESTORED}, "1": {"next_index": RESTORED}},
    }
    assert proc["iterator_in_checkpoint"] == merged  # what restore() returned
    assert proc["iterator_after_restore"] == merged  # where the iterator stands

    # The examples: step s feeds global batch s (shard 0's rows, then shard
    # 1's), whatever the process count.
    ref_ids = run.global_ids("reference", 2)
    before = run.global_ids("crashed", 2)
    after = run.global_ids("shrunk", 1)
    assert sorted(ref_ids) == list(range(1, STEPS + 1))
    assert sorted(after) == list(range(RESTORED + 1, STEPS + 1))
    assert after == {s: ref_ids[s] for s in after}  # same ids, same order, step for step
    consumed = {s: before[s] for s in range(1, RESTORED + 1)} | after
    assert consumed == ref_ids  # the run's examples are the uninterrupted run's
    assert (
      sum(len(consumed[s]) for s in range(1, RESTORED + 1)) == 240 == summary["examples_at_restore"]
    )
    assert all(len(ids) == GLOBAL_BATCH for ids in consumed.values())
    for first in range(1, STEPS + 1, EXAMPLES // GLOBAL_BATCH):  # each epoch: every example once
      epoch = [x for s in range(first, first + EXAMPLES // GLOBAL_BATCH) for x in consumed[s]]
      assert sorted(epoch) == list(range(EXAMPLES)), first
    # The steps the crash threw away (16-18) were fed again, not skipped.
    assert [before[s] for s in range(16, CRASH_AT + 1)] == [after[s] for s in range(16, 19)]

    # Training goes on: finite losses, within float32 rounding of the reference.
    ref = {int(k): v for k, v in reference[0]["losses"].items()}
    losses = {int(k): v for k, v in resumed[0]["losses"].items()}
    assert sorted(losses) == list(range(RESTORED + 1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values()), losses
    for s, v in losses.items():
      assert math.isclose(v, ref[s], rel_tol=1e-5), (s, v, ref[s])
    assert summary["losses_max_rel_diff"] <= 1e-5

    # Negative control: the same restart from the same files, but the trainer
    # does not restore the iterator. The tensors are right, the examples are
    # not, and the check must say so (ids and losses alike).
    run.put_back(str(tmp_path))
    faulty = run.resume_on_one_slice(fault="fresh-iterator", name="shrunk-faulty")
    bad = flax_grain.verify_shrink(run, reference, returncodes, faulty, name="shrunk-faulty")
    assert not bad["ok"]
    assert [p["source"] for p in bad["processes"]] == ["local"]
    assert any("data iterator after restore" in p for p in bad["problems"]), bad["problems"]
    assert any("examples" in p and "differ" in p for p in bad["problems"]), bad["problems"]
    assert any("resumed losses differ" in p for p in bad["problems"]), bad["problems"]
    assert bad["losses_max_rel_diff"] > 1e-2
  finally:
    run.cleanup()


class _Saved(Mapping):
  """Saved states as restore() hands them over, recording which are read."""

  def __init__(self, states: list[dict]):
    self.states, self.read = states, set()

  def __getitem__(self, i: int) -> dict:
    self.read.add(i)
    return self.states[i]

  def __iter__(self):
    return iter(range(len(self.states)))

  def __len__(self) -> int:
    return len(self.states)


def _saved_by(count: int, num_shards: int, batches: int = 7) -> _Saved:
  """What `count` processes of a run with `num_shards` shards saved: shard
  s's grain state is {"next_index": 100 * s + batches} (distinct per shard)."""
  return _Saved(
    [
      {
        "data_shards": num_shards,
        "batches": batches,
        "shards": {
          str(s): {"next_index": 100 * s + batches} for s in data_shards_of(i, count, num_shards)
        },
      }
      for i in range(count)
    ]
  )


@pytest.mark.parametrize(("shards", "old", "new"), [(2, 2, 1), (4, 4, 2), (4, 4, 1), (4, 2, 4)])
def test_remap_data_shards_hands_each_shard_on_from_its_old_reader(shards, old, new):
  """Fewer and more processes: every shard goes, with its own saved state, to
  exactly one new process, which reads only the saved states it needs."""
  given = {}
  for i in range(new):
    saved = _saved_by(old, shards)
    got = remap_data_shards(saved, i, new)
    mine = list(data_shards_of(i, new, shards))
    assert got == {
      "data_shards": shards,
      "batches": 7,
      "shards": {str(s): {"next_index": 100 * s + 7} for s in mine},
    }
    assert saved.read == {s * old // shards for s in mine}  # the old readers of its shards only
    given.update(got["shards"])
  assert sorted(given, key=int) == [str(s) for s in range(shards)]  # none lost, none twice


def test_remap_data_shards_refuses_states_that_do_not_fit():
  saved = _saved_by(2, 2)
  saved.states[1]["batches"] = 8  # the processes drew different numbers of batches
  with pytest.raises(ValueError, match="different numbers of batches"):
    remap_data_shards(saved, 0, 1)
  saved = _saved_by(2, 2)
  del saved.states[1]["shards"]["1"]  # a shard nobody saved
  with pytest.raises(ValueError, match="not shard 1"):
    remap_data_shards(saved, 0, 1)
  with pytest.raises(ValueError, match="split evenly"):
    remap_data_shards(_saved_by(2, 2), 0, 3)  # 2 shards over 3 processes
