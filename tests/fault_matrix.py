"""The fault matrix: every fault scenario, what it must do, what it did.

- `SCENARIOS`: the registry (id, what is done, what must happen). The table
  in docs/guarantees.md lists them in this order.
- `Recorder`: the `fault_matrix` fixture (tests/conftest.py). Each fault test
  calls `fault_matrix.check(id, observed, ok)`, which records the row (to
  JSON lines at $EC_FAULT_MATRIX_OUT, if set) and asserts `ok`.
- `python -m tests.fault_matrix`: runs the fault tests (and the local tier's
  1000-trial bit-flip test), writes build/fault_matrix.json and rewrites
  docs/guarantees.md (the docs site's Guarantees page) between
  `<!-- fault-matrix:begin -->` and `<!-- fault-matrix:end -->`.
  `--no-run` rebuilds the table from the last run's rows.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"
FAULT_TESTS = [
  "tests/test_faults_crash.py",
  "tests/test_faults_damage.py",
  "tests/test_persistent_disk_full.py",
  "tests/test_faults_multislice.py",
  "tests/test_faults_api.py",
  "tests/test_persistent_verify.py",
  "tests/test_persistent_shared_read.py",
  "tests/test_elastic_reshard.py",
  "tests/test_partner_redundancy.py",
  "tests/test_xor_redundancy.py",
  "tests/test_redundancy_close.py",
  "tests/test_tier_outage.py",
  "tests/test_peer_stalls.py",
  "tests/test_bounded_wait.py",
  "tests/test_fault_soak.py",
  "tests/test_hostile_restore.py",
]
BITFLIP_TEST = "tests/test_local_tier.py::test_random_bit_flips_are_never_silent"


@dataclasses.dataclass(frozen=True)
class Scenario:
  id: str
  what: str
  expected: str


RESTORE_OLDER = "restart restores the previous committed step bit-exactly (values + data_state)"


def _s(id_: str, what: str, expected: str) -> Scenario:
  return Scenario(id_, what, expected)


SCENARIOS: list[Scenario] = [
  # ---- SIGKILL during a save (2 slices x 1 process unless said) ----
  _s(
    "crash.local.before_write",
    "SIGKILL process 1 before its local write of step 3 starts",
    f"step 3 never listed; {RESTORE_OLDER}; training continues and re-saves 3+",
  ),
  _s(
    "crash.local.mid_write",
    "SIGKILL process 1 halfway through writing step 3's shards.bin",
    f"torn .tmp folder never listed, removed at restart; {RESTORE_OLDER}",
  ),
  _s(
    "crash.local.before_rename",
    "SIGKILL process 1 after shards + manifest are written, before the rename",
    f"step 3 never listed, .tmp removed at restart; {RESTORE_OLDER}",
  ),
  _s(
    "crash.local.after_rename",
    "SIGKILL process 1 right after step 3's folder is renamed into place",
    f"its JSON is missing, so step 3 is never committed; {RESTORE_OLDER}",
  ),
  _s(
    "crash.state.before_write",
    "SIGKILL process 1 before it writes its JSON of step 3",
    f"step 3 not committed; {RESTORE_OLDER}",
  ),
  _s(
    "crash.state.before_commit",
    "SIGKILL the primary process after every JSON of step 3 exists, before COMMIT",
    f"COMMIT missing but all files present: the step is skipped (not repaired); {RESTORE_OLDER}",
  ),
  _s(
    "crash.persistent.before_save",
    "SIGKILL the primary process before the Orbax save of step 4",
    f"step 4 not committed; {RESTORE_OLDER}",
  ),
  _s(
    "crash.persistent.after_save_call",
    "SIGKILL the primary process while step 4's upload is in flight",
    f"the partial Orbax step is removed at restart; {RESTORE_OLDER}; the persistent"
    " tier saves step 4 again",
  ),
  _s(
    "crash.persistent.unfinalized",
    "SIGKILL the primary process inside Orbax's finalize of step 4 (all files"
    " written, folder not renamed; Orbax finalize patched)",
    f"the unfinalized step is never listed and is removed at restart; {RESTORE_OLDER}",
  ),
  _s(
    "crash.persistent.after_finalize",
    "SIGKILL the primary process right after Orbax finalized step 4",
    "restart restores step 4 if its COMMIT was written, else step 3, bit-exactly;"
    " training continues (step 4 saved again)",
  ),
  _s(
    "crash.stale_incarnation",
    "the primary dies before COMMIT of step 3 (all files of 3 exist); the restarted job"
    " saves step 3 again with other values and process 1 dies before writing it",
    "never a step mixing both incarnations: step 2 restored, or step 3 with every"
    " process's values and data_state from the same incarnation",
  ),
  _s(
    "crash.slice_mid_save",
    "2 slices x 2 processes: SIGKILL both processes of slice 1 mid-write of step 3;"
    " slice 1 comes back on new hosts (empty ramdisks)",
    "restart restores step 2: slice 0 from its ramdisk, slice 1 from slice 0 (peer), bit-exact",
  ),
  _s(
    "crash.primary_mid_commit",
    "2 slices x 2 processes: SIGKILL the primary process before COMMIT of step 3",
    f"step 3 skipped; {RESTORE_OLDER} on all 4 processes",
  ),
  # ---- hangs ----
  _s(
    "hang.local_save",
    "SIGSTOP process 1 in the middle of its local write of step 3",
    "the primary gives up committing step 3 after state_commit_timeout_s; the next"
    " collective raises CollectiveTimeoutError naming process 1 within its timeout;"
    f" {RESTORE_OLDER}",
  ),
  _s(
    "hang.persistent_upload",
    "2 slices x 2 processes: SIGSTOP process 1 (primary slice) while step 2 uploads",
    "wait_until_finished() on the primary raises a typed error naming process 1"
    " within ~collective_timeout_s (no 20-minute Orbax barrier wait)",
  ),
  _s(
    "hang.restore_agreement",
    "SIGSTOP process 1 at restore()'s status exchange (after the inventory agreement)",
    "restore() on process 0 raises CollectiveTimeoutError naming process 1 within"
    " collective_timeout_s",
  ),
  # ---- a sick tier: training goes on ----
  *[
    _s(
      f"sick.bucket.{kind}",
      f"2 slices x 2 processes at 0.5 s per step, persistent every 3rd step: the bucket {how}"
      " for 20 s (persistent.when_busy=skip)",
      "every process trains >= 90% of its own pace during the outage and no save() waits for"
      " the bucket; health() and `emergency-ckpt report` name the skipped steps and the"
      " outage; a step saved after the outage reaches the bucket; each process's ramdisk"
      " folder holds at most its budget of steps (local retention never waits on the bucket)",
    )
    for kind, how in (
      ("hang", "holds every request (no answer)"),
      ("refuse", "resets every connection"),
      ("503", "answers 503 to every request"),
      ("crawl", "moves every body at 1 MB/s"),
    )
  ],
  *[
    _s(
      f"sick.peer.{scheme}",
      f"1 slice x 4 processes with {scheme} redundancy at 0.5 s per step: process 1"
      " stops (SIGSTOP) for 8 s at save time",
      "every other process trains >= 90% of its pace while it is stopped, no save()"
      " waits for it and host memory stays at its budget; once it goes on, steps commit"
      " again",
    )
    for scheme in ("partner", "xor")
  ],
  _s(
    "sick.upload_one_process",
    "1 slice x 2 processes, persistent every 2nd step (when_busy=skip): process 1's upload"
    " of step 2 fails at once (an injected EIO before its Orbax save); process 0's waits in"
    " Orbax's barriers",
    "no save() waits for it; process 0 never enters Orbax's save of step 2 alone (skipped,"
    " in health()), process 1's health() names the error; step 2 never listed; every later"
    " persistent step reaches the bucket and, every ramdisk wiped, the newest is restored"
    " bit-exact",
  ),
  _s(
    "sick.bucket.job_end",
    "a program ends (close(timeout_s=3)) while the bucket holds its upload of step 2",
    "close() raises PendingWorkTimeoutError naming step 2 as never reaching the bucket;"
    " the interpreter exits at once, without waiting for the bucket",
  ),
  *[
    _s(
      f"soak.{name}",
      f"seeded fault soak, {what}: restarts with kills, wiped and shuffled hosts, flipped,"
      " truncated or removed local files, a damaged newest persistent step, a sick bucket",
      "every round restores the same step on every process, bit-exact with its data_state,"
      " never below the newest intact persistent step; no hang, no untyped error; the"
      " ramdisk and the bucket hold no more than retention allows",
    )
    for name, what in (
      ("partner-1x4-fs", "partner redundancy, 1 slice x 4 processes"),
      ("xor-1x4-gcs", "XOR redundancy, 1 slice x 4 processes, gs://"),
      ("none-2x2-gcs", "no redundancy, 2 slices x 2 processes, gs://"),
      ("partner-2x2-fs", "partner redundancy, 2 slices x 2 processes"),
    )
  ],
  # ---- preemption ----
  _s(
    "preempt.sigterm",
    "SIGTERM to process 1 at step 5 (reached_preemption() polled every step)",
    "reached_preemption() is True on every process at the same step; that step is"
    " saved (force=True) and restored bit-exactly after the restart",
  ),
  # ---- damaged state store ----
  _s(
    "state.json_torn",
    "process 1's JSON of the newest step (5) truncated",
    "checksum/parse failure detected; step 5 skipped, step 4 restored bit-exactly",
  ),
  _s(
    "state.json_edited",
    "process 0's JSON of step 5 edited (valid JSON, checksum not updated)",
    "checksum mismatch detected; step 5 skipped, step 4 restored bit-exactly",
  ),
  _s(
    "state.json_missing",
    "process 1's JSON of step 5 deleted (COMMIT present, a listed file missing)",
    "process 1's read of its JSON fails at restore (COMMIT is trusted, no listing);"
    " step 5 skipped, step 4 restored bit-exactly",
  ),
  _s(
    "state.commit_torn",
    "COMMIT of step 5 truncated (invalid JSON)",
    "step 5 not committed; step 4 restored bit-exactly",
  ),
  _s(
    "state.commit_missing",
    "COMMIT of step 5 deleted, every JSON present",
    "step 5 skipped (a COMMIT is never inferred); step 4 restored bit-exactly",
  ),
  # ---- damaged local copies ----
  _s(
    "local.flip_one_slice",
    "one bit flipped in process 1's shards.bin of step 5",
    "CRC32C mismatch detected; slice 1 gets step 5 from slice 0 (peer), bit-exact",
  ),
  _s(
    "local.flip_primary_slice",
    "one bit flipped in the primary process's shards.bin of step 5",
    "detected; slice 0 gets step 5 from slice 1 (peer), bit-exact",
  ),
  _s(
    "local.truncated_shard",
    "process 1's shards.bin of step 5 truncated to half",
    "size mismatch detected; slice 1 gets step 5 from the peer, bit-exact",
  ),
  _s(
    "local.deleted_shard",
    "process 1's shards.bin of step 5 deleted",
    "detected; slice 1 gets step 5 from the peer, bit-exact",
  ),
  _s(
    "local.corrupt_manifest",
    "one bit flipped in process 1's manifest.json of step 5",
    "manifest CRC mismatch: the copy is not listed; slice 1 gets step 5 from the peer",
  ),
  _s(
    "local.flip_all_slices_fallback",
    "step 5 (local only) corrupted on both slices",
    "step 5 rejected after verification; step 4 restored bit-exactly",
  ),
  _s(
    "local.flip_all_slices_persistent",
    "steps 4 and 5 corrupted on both slices; step 4 is in the persistent tier",
    "step 5 rejected; step 4 restored from the persistent tier, bit-exact",
  ),
  _s(
    "local.nothing_good",
    "every local copy corrupted on both slices and the persistent tier deleted",
    "NoRestorableCheckpointError on every process naming each rejected step and why",
  ),
  _s(
    "local.bit_flip_trial",
    "1000 random single-bit flips in a saved step (manifest or shards), one per trial",
    "0 silent corruptions: every flip is detected or hits unused padding",
  ),
  # ---- persistent tier damaged (every ramdisk lost; persistent steps 3 and 6) ----
  _s(
    "persistent.bit_flip_trial",
    "100 random single-bit flips in step 6's data files, one per restore (2 slices x 1"
    " process, the shared read: slice 0 reads every shard and serves slice 1)",
    "0 loaded: each restore returns step 6 bit-exactly or skips it for step 3, bit-exactly",
  ),
  _s(
    "persistent.damaged_newest",
    "16 bytes flipped in the middle of every data file of step 6",
    "step 6 skipped on every process; step 3 restored from the persistent tier, bit-exact",
  ),
  _s(
    "persistent.damaged_all",
    "as above, and 16 bytes flipped in step 3's tensor data",
    "CorruptCheckpointError on every process, naming the leaf that failed its CRC32C",
  ),
  _s(
    "persistent.shared_read_wire",
    "shared read of step 2 (2 slices x 2 processes, GCS): process 0 flips one bit on the wire",
    "the receiver's check fails it; every process reads its own shards from the bucket;"
    " step 2 restored bit-exactly everywhere",
  ),
  # ---- cross-slice transfer (2 slices x 2 processes, slice 1's ramdisks wiped) ----
  _s(
    "peer.damaged_in_transit",
    "the stream transfer of step 5 to slice 1 flips one bit on the wire (step 5 has no"
    " persistent copy)",
    "the receiver's CRC32C check fails it; every process agrees the transfer failed and"
    " moves on to step 4; nothing damaged is loaded",
  ),
  _s(
    "peer.sender_refuses",
    "then slice 0's processes drop the connection for step 4 (persistent has step 4)",
    "every process agrees it failed; every slice reads step 4 from the persistent tier,"
    " bit-exact (values + data_state)",
  ),
  # ---- the ramdisk directory ----
  _s(
    "disk.enospc",
    "the primary's ramdisk is full (real tmpfs filled to ENOSPC) at steps 3-4",
    "local save fails with a warning, nothing half-written is listed, training goes on,"
    " the persistent tier still saves; step 4 restores (primary slice from its peer)",
  ),
  _s(
    "disk.persistent_enospc",
    "the persistent directory (a local path) is full (real tmpfs filled to ENOSPC) while"
    " step 4 uploads",
    "wait_until_finished raises StorageError naming the step, the path, the OS error and"
    " the fix; save() goes on; once space is freed the next persistent step uploads and"
    " restores bit-exact with the ramdisk wiped",
  ),
  _s(
    "disk.persistent_one_process",
    "one process of the primary slice cannot write to the persistent directory"
    " (RLIMIT_FSIZE) while steps 3-6 save; the other can",
    "each process's wait_until_finished raises a typed error in bounded time, naming the"
    " cause on the failing one; save() never raises; once lifted the next persistent step"
    " uploads and both restore it bit-exact",
  ),
  _s(
    "dir.foreign_run",
    "another run's folder in the same ramdisk root, and another run's step 5 planted"
    " in process 1's folder",
    "the other run's folder is never read; the planted step is rejected (run id) and"
    " slice 1 gets step 5 from the peer, bit-exact",
  ),
  _s(
    "dir.symlink",
    "process 1's <local.directory>/<run_id> replaced by a symlink",
    "UnsafeDirectoryError on process 1 naming the path; process 0's restore raises"
    " CollectiveTimeoutError naming process 1",
  ),
  _s(
    "dir.loose_permissions",
    "every process folder chmod 0755",
    "UnsafeDirectoryError on every process naming the path and the chmod 700 fix",
  ),
  _s(
    "dir.foreign_owner",
    "every process folder chown'ed to uid 4242 (real when the suite runs as root)",
    "UnsafeDirectoryError on every process naming the owner uid",
  ),
  _s(
    "dir.shared_root",
    "local.directory is a shared sticky folder (mode 1777, like /dev/shm itself); a symlink"
    " to it; a world-writable folder without the sticky bit; a sticky folder owned by"
    " another user",
    "the sticky folder (root's or ours) is accepted and the run/process folders below it"
    " are 0700; the other three are refused with UnsafeDirectoryError",
  ),
  _s(
    "dir.foreign_owner_fake_stat",
    "secure_makedirs on a folder whose lstat reports another owner (fake stat: chown needs root)",
    "UnsafeDirectoryError naming the owner uid and the path",
  ),
  # ---- restart on another topology ----
  _s(
    "restart.other_slice_count",
    "saved by 2 slices x 1 process, restored by 1 slice x 2 processes",
    "the ramdisk copies are resharded onto the new mesh: step 5 (the newest; persistent"
    " has 4) from each process's own host, bit-exact, data_state kept (same process count)",
  ),
  _s(
    "restart.other_slice_count_local_only",
    "as above, persistent tier deleted",
    "step 5 from the ramdisk copies alone, resharded, bit-exact: no persistent read needed",
  ),
  _s(
    "redundancy.partner_host_lost",
    "1 slice x 4 processes, local.redundancy=partner; host 1's ramdisk wiped",
    "step 5 (the newest) restored bit-exactly, process 1 from its partner's copy on host 2,"
    " no persistent read",
  ),
  *[
    _s(
      f"redundancy.{scheme}_close_lagging",
      f"1 slice x 4 processes, local.redundancy={scheme}: process 0 lags 3 s (its state"
      " write of step 4), so the others close their managers before it sends step 5",
      "step 5 (the last) commits: every receiver stays open until its slice is done sending",
    )
    for scheme in ("partner", "xor")
  ],
  _s(
    "redundancy.partner_damaged",
    "as above, plus one bit flipped in the partner's copy of step 5",
    "the copy fails its checksum: step 4 from the partner's copy, bit-exact",
  ),
  _s(
    "redundancy.partner_pair_lost",
    "as above, hosts 1 and 2 (a process and its partner) wiped",
    "step 3 from the persistent tier, bit-exact",
  ),
  _s(
    "redundancy.xor_host_lost",
    "1 slice x 4 processes, local.redundancy=xor (one group of 4); host 1's ramdisk wiped",
    "step 5 restored bit-exactly, process 1 rebuilt from the 3 others' data and parity,"
    " no persistent read",
  ),
  _s(
    "redundancy.xor_parity_damaged",
    "as above, plus one bit flipped in member 2's parity block of step 5",
    "the block fails its checksum: step 4, rebuilt, bit-exact",
  ),
  _s(
    "redundancy.xor_group_file_edited",
    "as above, member 3's group.json of step 5 edited instead",
    "the file fails its checksum: step 4, rebuilt, bit-exact",
  ),
  _s(
    "redundancy.xor_two_lost",
    "as above, hosts 1 and 2 (two members of the group) wiped",
    "step 3 from the persistent tier, bit-exact",
  ),
  _s(
    "reshard.damaged_copy",
    "saved by 2 slices x 2 processes x 2 devices, restored as 2 slices x 4 processes x 1"
    " device (ramdisk copies resharded); one bit flipped in saved process 0's copy",
    "the copy fails its checksum and drops saved slice 0; saved slice 1's copies serve"
    " every process: step 5, bit-exact, never a wrong byte",
  ),
  _s(
    "reshard.piece_lost",
    "as above, hosts 1 and 3 lost (slice position 1 of both saved slices: a piece held"
    " by no ramdisk)",
    "no saved slice is complete: step 3 from the persistent tier, resharded, bit-exact",
  ),
  _s(
    "restart.fewer_processes",
    "saved by 2 slices x 2 processes, restored by 1 process (4 devices)",
    "local copy refused; step 2 from the persistent tier, resharded, bit-exact;"
    " data_state None with a warning; training continues",
  ),
  _s(
    "restart.fewer_processes_local_only",
    "as above, persistent tier deleted",
    "NoRestorableCheckpointError naming the topology mismatch",
  ),
  # ---- a hostile neighbour (issue 37) ----
  _s(
    "hostile.mitm_restore",
    "2 slices x 1 process, step 5 also persistent; slice 1's ramdisk lost step 5, and every"
    " peer connection of slice 1 goes through a relay that changes one byte of the first"
    " shard in the listener's reply and fixes its CRC32C",
    "the MAC fails the shard (CorruptCheckpointError, logged, never loaded); every process"
    " agrees the transfer failed and reads step 5 from the persistent tier, bit-exact (values"
    " + data_state); no untyped error",
  ),
  _s(
    "hostile.forged_group",
    "1 slice x 4 processes, local.redundancy=xor; host 1 wiped and member 3's group.json of"
    " step 5 forged with its checksum recomputed: the members' order changed, the lost"
    " member's size off by 8 (parity_nbytes made to agree), the body a list",
    "the forged file is a damaged copy (no untyped error, no crash): step 5 cannot be rebuilt,"
    " step 4 on every process, process 1 rebuilt from parity, bit-exact with its data_state",
  ),
  # ---- bad input at the API ----
  _s(
    "api.abstract_dtype",
    "restore() with a leaf's dtype wrong (2 processes, local copies)",
    "StateMismatchError on every process naming the leaf and both dtypes",
  ),
  _s(
    "api.abstract_shape",
    "restore() with a leaf's shape wrong (2 processes, local copies)",
    "StateMismatchError on every process naming the leaf and both shapes",
  ),
  _s(
    "api.abstract_tree",
    "restore() with a leaf missing from abstract_state",
    "StateMismatchError on every process naming the missing leaf",
  ),
  _s(
    "api.abstract_dtype_persistent",
    "restore() from the persistent tier with a leaf's dtype wrong (int32 asked as float32)",
    "StateMismatchError (never a silent cast)",
  ),
  _s(
    "api.abstract_shape_persistent",
    "restore() from the persistent tier with a leaf's shape wrong",
    "StateMismatchError naming the leaf",
  ),
  _s(
    "api.data_state_not_json",
    "save(data_state={'rng': np.uint32(7)}) and other non-JSON values",
    "DataStateError naming the key path",
  ),
  _s("api.data_state_not_dict", "save(data_state=[1, 2])", "DataStateError"),
  _s("api.step_negative", "save(step=-1)", "StepError"),
  _s("api.step_not_int", "save(step=2.0) and save(step=True)", "StepError"),
  _s("api.step_not_monotonic", "save(3) after save(4)", "StepError naming both steps"),
  _s("api.step_exists", "save(4) twice", "StepAlreadyExistsError"),
  _s(
    "api.replica_axis_name",
    "replica_axis='slices' on a mesh with axes (replica, data)",
    "TopologyError naming the axis and the mesh's axes",
  ),
  _s("api.replica_axis_index", "replica_axis=5 on a 2-axis mesh", "TopologyError"),
  _s(
    "api.impossible_options",
    "interval 0, max_to_keep 0, timeouts <= 0, a URL as local.directory, a bad run_id",
    "InvalidOptionsError naming the field, for each",
  ),
  _s(
    "api.restore_unrestorable_step",
    "restore(step=3) of a step never saved",
    "StepNotRestorableError",
  ),
  _s(
    "api.nothing_to_restore",
    "restore() in an empty run",
    "NoRestorableCheckpointError (a FileNotFoundError) naming both directories",
  ),
  _s("api.closed_manager", "save()/restore() after close()", "EmergencyCheckpointError"),
  _s(
    "api.abstract_not_sharded",
    "restore() with a numpy array as an abstract leaf",
    "StateMismatchError naming the leaf",
  ),
  _s(
    "api.bad_failpoint_spec",
    "EC_FAILPOINTS with a typo ('local.mid_write3')",
    "ValueError at import: a typo never silently disarms a crash test",
  ),
  _s(
    "code.no_pickle",
    "scan of emergency_ckpt/*.py",
    "no pickle/cloudpickle/dill/shelve import, no allow_pickle=True, no Orbax pickle path",
  ),
]

BY_ID = {s.id: s for s in SCENARIOS}
assert len(BY_ID) == len(SCENARIOS), "duplicate scenario id"


class Recorder:
  """What the `fault_matrix` fixture gives each test."""

  def __init__(self, path: str | None):
    self.path = path
    self.rows: list[dict] = []
    self._lock = threading.Lock()

  def record(self, scenario_id: str, observed: str, ok: bool) -> dict:
    scenario = BY_ID[scenario_id]  # KeyError: add the scenario to SCENARIOS
    row = {"id": scenario.id, "observed": observed, "ok": bool(ok), "at": time.time()}
    with self._lock:
      self.rows.append(row)
      if self.path:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
          f.write(json.dumps(row) + "\n")
    return row

  def check(self, scenario_id: str, observed: str, ok: bool) -> None:
    """Records the row, then asserts `ok`."""
    self.record(scenario_id, observed, ok)
    assert ok, f"[{scenario_id}] expected: {BY_ID[scenario_id].expected}\n  observed: {observed}"


# ---- helpers for the tests ------------------------------------------------------------


def run_jobs(specs: dict[str, dict], parallel: int = 3) -> dict:
  """run_job(**spec) for each named spec, `parallel` at a time (jobs mostly
  wait on timeouts and start-up, so overlapping them saves wall time)."""
  from emergency_ckpt.demo.launcher import run_job  # noqa: PLC0415

  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    futures = {name: pool.submit(run_job, **spec) for name, spec in specs.items()}
    return {name: f.result() for name, f in futures.items()}


def job_failure(job) -> str:
  """A short account of a job whose processes did not all succeed."""
  parts = [f"timed_out={job.timed_out} rc={job.returncodes}"]
  for i, (err, log) in enumerate(zip(job.errors, job.logs)):
    if err:
      parts.append(f"process {i}: {err.strip().splitlines()[-1]}")
    elif job.returncodes[i] not in (0, -9):
      parts.append(f"process {i} log tail: {log[-600:]}")
  return "; ".join(parts)


def sources_text(records: Sequence[dict]) -> str:
  by_slice: dict[int, set] = {}
  for r in records:
    by_slice.setdefault(r.get("slice"), set()).add(r.get("source"))
  return ", ".join(
    f"slice {s}: {'/'.join(sorted(map(str, v)))}" for s, v in sorted(by_slice.items(), key=str)
  )


def check_restored(
  records: Sequence[dict],
  step: int,
  sources: dict[int, str] | str | None = None,
  *,
  data_state: str = "same",
) -> tuple[bool, str]:
  """(ok, text) for per-process restore records: every process restored `step`
  from `sources` (per slice, or one for all), bit-exact values, and its own
  data_state (data_state="none": None expected)."""
  problems = []
  for r in records:
    if r is None:
      problems.append("no result")
      continue
    p = r.get("process")
    if "error" in r:
      problems.append(f"process {p}: {r.get('error')}: {str(r.get('message'))[:300]}")
      continue
    if r["step"] != step:
      problems.append(f"process {p} restored step {r['step']}")
    want = sources if isinstance(sources, str) or sources is None else sources[r["slice"]]
    if want is not None and r["source"] != want:
      problems.append(f"process {p} (slice {r['slice']}) from {r['source']}, not {want}")
    if r["mismatches"]:
      problems.append(f"process {p} bit mismatches {r['mismatches'][:4]}")
    expect_ds = None if data_state == "none" else r["expected_data_state"]
    if r["data_state"] != expect_ds:
      problems.append(f"process {p} data_state {r['data_state']} != {expect_ds}")
  if problems:
    return False, "; ".join(problems)
  exact = "bit-exact values and data_state" if data_state == "same" else "bit-exact values"
  if data_state == "none":
    exact += ", data_state None"
  return True, (
    f"step {step} restored on {len(records)}/{len(records)} processes"
    f" ({sources_text(records)}), {exact}"
  )


def excerpt(message: str, around: str | None = None, n: int = 160) -> str:
  """Part of an error message (its start, or around `around`), temporary
  test paths shortened."""
  text = re.sub(r"/\S*?/ec(fault|test)-[^/\s]+", "<tmp>", str(message))
  start = max(0, text.find(around) - n // 3) if around and around in text else 0
  part = text[start : start + n]
  return ("..." if start else "") + part + ("..." if start + n < len(text) else "")


def check_errors(
  records: Iterable[dict], expected: dict[int, tuple[str, Iterable[str]]]
) -> tuple[bool, str]:
  """Every process p in `expected` raised error type expected[p][0] whose
  message contains each of expected[p][1]."""
  by_process = {r["process"]: r for r in records if r}
  problems, seen = [], []
  for p, (kind, needles) in sorted(expected.items()):
    needles = list(needles)
    r = by_process.get(p)
    if r is None:
      problems.append(f"process {p}: no result")
      continue
    if r.get("error") != kind:
      got = r.get("error") or f"no error (restored step {r.get('step')} from {r.get('source')})"
      problems.append(f"process {p}: {got} instead of {kind}: {str(r.get('message'))[:300]}")
      continue
    missing = [n for n in needles if n not in r.get("message", "")]
    if missing:
      problems.append(f"process {p}: {kind} message lacks {missing}: {r['message'][:300]}")
      continue
    seen.append(
      f"process {p}: {kind} in {r.get('elapsed_s', 0):.1f} s ({excerpt(r['message'], needles[-1] if needles else None)})"
    )
  if problems:
    return False, "; ".join(problems)
  return True, "; ".join(seen)


# ---- README generation ------------------------------------------------------------------


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict], meta: dict) -> str:
  latest = {}
  for row in rows:
    latest[row["id"]] = row
  lines = [
    BEGIN,
    "",
    f"Generated by `python -m tests.fault_matrix` on {meta['date']} ({meta['platform']}):"
    f" {meta['passed']}/{len(SCENARIOS)} scenarios as promised, fault suite"
    f' {meta["suite_s"]:.0f} s wall time. "Observed" is what that run measured.',
    "",
    "| # | Scenario | Promised outcome | Observed | |",
    "| --- | --- | --- | --- | --- |",
  ]
  for i, s in enumerate(SCENARIOS, 1):
    row = latest.get(s.id)
    if row is None:
      observed, mark = "not run (the test errored before recording)", "**FAIL**"
    else:
      observed, mark = row["observed"], ("ok" if row["ok"] else "**FAIL**")
    lines.append(
      f"| {i} | `{s.id}`: {_cell(s.what)} | {_cell(s.expected)} | {_cell(observed)} | {mark} |"
    )
  lines += ["", END]
  return "\n".join(lines)


def rewrite_readme(readme: str, section: str) -> None:
  with open(readme) as f:
    text = f.read()
  if BEGIN not in text or END not in text:
    raise SystemExit(f"{readme} lacks the {BEGIN} ... {END} markers")
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  with open(readme, "w") as f:
    f.write(head + section + tail)


def _bitflip_row(python: str, env: dict) -> dict:
  """Runs the local tier's 1000-trial bit-flip test and turns its summary
  line into a matrix row."""
  proc = subprocess.run(
    [python, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", BITFLIP_TEST],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
  )
  m = re.search(r"bit-flip trials=(\d+) (\{[^}]*\}).*?other=(\d+)", proc.stdout)
  if proc.returncode != 0 or m is None:
    return {
      "id": "local.bit_flip_trial",
      "observed": f"test failed (rc {proc.returncode}): {proc.stdout[-500:]}",
      "ok": False,
    }
  counts = json.loads(m.group(2).replace("'", '"'))
  return {
    "id": "local.bit_flip_trial",
    "observed": f"{m.group(1)} trials: {counts['detected']} detected, {counts['harmless']}"
    f" in padding (values unchanged), {counts['silent']} silent, {m.group(3)} other errors",
    "ok": counts["silent"] == 0 and m.group(3) == "0",
  }


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--no-run", action="store_true", help="rebuild from build/fault_matrix.jsonl")
  ap.add_argument("--readme", default=os.path.join(REPO, "docs", "guarantees.md"))
  ap.add_argument("--out", default=os.path.join(REPO, "build", "fault_matrix.json"))
  ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
  args = ap.parse_args(argv)
  rows_path = os.path.splitext(args.out)[0] + ".jsonl"
  meta_path = os.path.splitext(args.out)[0] + ".meta.json"
  python = sys.executable
  if not args.no_run:
    os.makedirs(os.path.dirname(rows_path), exist_ok=True)
    if os.path.exists(rows_path):
      os.remove(rows_path)
    env = dict(os.environ, EC_FAULT_MATRIX_OUT=rows_path)
    t0 = time.monotonic()
    rc = subprocess.call(
      [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAULT_TESTS, *args.pytest_args],
      cwd=REPO,
      env=env,
    )
    suite_s = time.monotonic() - t0
    with open(rows_path, "a") as f:
      f.write(json.dumps(_bitflip_row(python, env)) + "\n")
    meta = {
      "date": datetime.date.today().isoformat(),
      "platform": f"{os.cpu_count()} CPU cores, CPU-only JAX jobs",
      "suite_s": suite_s,
      "pytest_rc": rc,
    }
    with open(meta_path, "w") as f:
      json.dump(meta, f)
  with open(meta_path) as f:
    meta = json.load(f)
  with open(rows_path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  latest = {r["id"]: r for r in rows}
  meta["passed"] = sum(1 for s in SCENARIOS if latest.get(s.id, {}).get("ok"))
  table = [
    {
      "id": s.id,
      "scenario": s.what,
      "expected": s.expected,
      "observed": latest.get(s.id, {}).get("observed"),
      "ok": latest.get(s.id, {}).get("ok", False),
    }
    for s in SCENARIOS
  ]
  with open(args.out, "w") as f:
    json.dump({"meta": meta, "scenarios": table}, f, indent=1)
  rewrite_readme(args.readme, render(rows, meta))
  print(f"{meta['passed']}/{len(SCENARIOS)} scenarios as promised; {args.readme} table rewritten")
  return 0 if meta["passed"] == len(SCENARIOS) else 1


if __name__ == "__main__":
  sys.exit(main())
