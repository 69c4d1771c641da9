"""A full persistent directory (a local path): the tier degrades, training
goes on, and every error says what is wrong and what to do.

Where the persistent directory is a local filesystem (an NFS or Lustre
mount, a local disk), a full disk fails Orbax's upload (tensorstore's
RESOURCE_EXHAUSTED) and the state store's files (OSError ENOSPC). Real
faults: a small tmpfs filled up (RLIMIT_FSIZE where no tmpfs can be
mounted), or RLIMIT_FSIZE on one process of two.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from emergency_ckpt.demo.launcher import run_job
from tests.fault_matrix import check_restored, job_failure
from tests.helpers import mount_tmpfs


@pytest.mark.parametrize("path", ["snapshot", "inline"])
def test_persistent_disk_full(shm_dir, fault_matrix, path):
  """A local-path persistent tier whose filesystem fills up: the upload's
  failure reaches wait_until_finished as a StorageError naming the step, the
  path, the OS error and the fix (never tensorstore's raw ValueError),
  save() goes on (a failed Orbax save call once left Orbax's "save in
  progress" mark set, and the next persistent save() raised), and once
  space is freed the next persistent step uploads and restores bit-exact.
  Both upload paths: from the snapshot, and Orbax's copy inside save()."""
  name = "disk.persistent_enospc"
  mount = os.path.join(shm_dir, f"pdisk-{path}")
  args = {
    "inline": path == "inline",
    "slices": 1,
    "local_root": os.path.join(shm_dir, "local"),
    "persistent": os.path.join(mount, "p"),
    "persistent_interval": 2,
    "persistent_keep": 1,
    "local_keep": 2,
    "big": 1 << 20,
  }
  forced = os.environ.get("EC_FAULT_ENOSPC_MODE")
  mounted = forced != "rlimit" and mount_tmpfs(mount, "6m")
  if mounted:
    args["mode"] = "tmpfs"
    how, errno_text = "a real 6 MiB tmpfs as the persistent directory, filled up", "No space left"
  else:
    os.makedirs(mount, exist_ok=True)
    args.update(mode="rlimit", rlimit_bytes=512 << 10)
    how, errno_text = "RLIMIT_FSIZE (EFBIG) on the one process", "File too large"
  try:
    job = run_job(
      "tests.fault_scenarios:persistent_full_run",
      1,
      args,
      timeout_s=180,
      out_dir=os.path.join(shm_dir, f"job-{path}"),
    )
  finally:
    if mounted:
      subprocess.run(["umount", "-l", mount], check=False)
  if job.returncodes != [0]:
    fault_matrix.check(name, f"job failed: {job_failure(job)}", False)
  rv = job.results[0]
  waits = {int(k): v for k, v in rv["waits"].items()}
  problems = []
  failed = waits.get(4)
  if not failed or failed["type"] != "StorageError":
    problems.append(f"wait_until_finished after step 4 gave {failed} (want a StorageError)")
  else:
    text = failed["message"]
    for part in ("step 4", args["persistent"], errno_text, "persistent.max_to_keep"):
      if part not in text:
        problems.append(f"the error does not name {part!r}: {text}")
  untyped = {s: w for s, w in waits.items() if w is not None and not w["typed"]}
  if untyped:
    problems.append(f"untyped errors from wait_until_finished: {untyped}")
  if waits.get(2) is not None or waits.get(8) is not None:
    problems.append(f"steps 2 or 8 (disk not full) raised: {waits.get(2)}, {waits.get(8)}")
  if not all(rv["saved"].values()):
    problems.append(f"save() returned {rv['saved']}")
  if not rv["health_while_full"] or errno_text not in rv["health_while_full"]:
    problems.append(f"health while full: {rv['health_while_full']}")
  if rv["health_after"] != 0:
    problems.append(f"persistent failures in a row after the disk was freed: {rv['health_after']}")
  if "8" not in (rv["tensors"] or []) or "4" in (rv["tensors"] or []):
    problems.append(f"persistent tier lists {rv['tensors']} (want step 8, never step 4)")
  ok, text = check_restored([dict(rv["restored"], process=0, slice=0)], 8, "persistent")
  if not ok:
    problems.append(text)
  observed = (
    f"{path} upload, {how}: wait_until_finished raised StorageError '{(failed or {}).get('message', '')[:90]}...';"
    f" save() returned {sorted(rv['saved'].values())[0]} throughout; persistent tier"
    f" {rv['tensors']} after space was freed; {text}"
  )
  fault_matrix.check(name, "; ".join(problems) or observed, not problems)


def test_persistent_disk_full_on_one_process(shm_dir, fault_matrix):
  """1 slice x 2 processes, both upload: only process 1's writes fail
  (RLIMIT_FSIZE, EFBIG; as one host whose disk or credentials fail) while
  steps 3-6 save. Process 1's wait raises StorageError naming the cause;
  process 0, whose part of the upload went through, raises a typed error in
  bounded time (Orbax's barriers end at collective_timeout_s) saying that
  another process's part failed, not that one was slow; neither
  save() raises; once the limit is lifted step 8 uploads and both restore
  it bit-exact from the persistent tier."""
  name = "disk.persistent_one_process"
  root = os.path.join(shm_dir, "pone")
  args = {
    "slices": 1,
    "local_root": os.path.join(root, "local"),
    "persistent": os.path.join(root, "p"),
    "persistent_interval": 2,
    "persistent_keep": 1,
    "local_keep": 2,
    "big": 4 << 20,
    "big_sharded": True,  # 2 MiB per process: each writes its own part
    "mode": "rlimit",
    "rlimit_bytes": 512 << 10,
    "victim": 1,
    "collective_timeout_s": 15,
    "state_commit_timeout_s": 10,
  }
  job = run_job(
    "tests.fault_scenarios:persistent_full_run",
    2,
    args,
    timeout_s=240,
    out_dir=os.path.join(shm_dir, "job-one"),
  )
  if job.returncodes != [0, 0]:
    fault_matrix.check(name, f"job failed: {job_failure(job)}", False)
  problems, seen = [], []
  for rv in job.results:
    p = rv["process"]
    waits = {int(k): v for k, v in rv["waits"].items()}
    failed = {s: w for s, w in waits.items() if w is not None}
    untyped = {s: w for s, w in failed.items() if not w["typed"]}
    if untyped:
      problems.append(f"process {p}: untyped errors from wait_until_finished: {untyped}")
    if p == 1 and not any("File too large" in w["message"] for w in failed.values()):
      problems.append(f"process 1's waits never named its error: {failed}")
    if p == 0 and failed and not any("failed its part" in w["message"] for w in failed.values()):
      problems.append(f"process 0's timeouts never named process 1's failure: {failed}")
    if not all(rv["saved"].values()):
      problems.append(f"process {p}: save() returned {rv['saved']}")
    if max(rv["save_s"]) > 5:
      problems.append(f"process {p}: a save() took {max(rv['save_s']):.1f}s")
    if waits.get(8) is not None:
      problems.append(f"process {p}: the wait after step 8 raised {waits[8]}")
    seen.append(f"process {p} waits raised at steps {sorted(failed)}")
  tensors = job.results[0]["tensors"] or []
  if "8" not in tensors:
    problems.append(f"persistent tier lists {tensors} (want step 8)")
  recs = [dict(r["restored"], process=r["process"], slice=0) for r in job.results]
  ok, text = check_restored(recs, 8, "persistent")
  if not ok:
    problems.append(text)
  observed = (
    f"RLIMIT_FSIZE on process 1 only: {'; '.join(seen)}, every error typed; save() never"
    f" raised; persistent tier {tensors} once lifted; {text}"
  )
  fault_matrix.check(name, "; ".join(problems) or observed, not problems)
