"""The machine-wide staging window (colocated.py): pure flock logic, real files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from emergency_ckpt.cluster.colocated import StagingWindow


def _hold_for(window: StagingWindow, seconds: float) -> threading.Thread:
  entered = threading.Event()

  def run():
    with window.staging():
      entered.set()
      time.sleep(seconds)

  t = threading.Thread(target=run, daemon=True)
  t.start()
  assert entered.wait(5)
  return t


def test_background_work_waits_until_every_copy_is_done(tmp_path):
  a, b = (
    StagingWindow("run", directory=str(tmp_path)),
    StagingWindow("run", directory=str(tmp_path)),
  )
  assert a.enabled and b.enabled
  t = _hold_for(a, 0.3)
  waited = b.wait_closed(10)
  t.join()
  assert 0.2 <= waited < 5
  assert b.wait_closed(10) < 0.1  # nobody staging: no wait


def test_two_processes_share_the_window(tmp_path):
  """flock across real processes: another process inside save() holds us back."""
  code = (
    "import sys, time; from emergency_ckpt.cluster.colocated import StagingWindow;"
    f" w = StagingWindow('run', directory={str(tmp_path)!r});"
    " cm = w.staging(); cm.__enter__(); print('in', flush=True); time.sleep(0.4); cm.__exit__(None, None, None)"
  )
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "in"
    waited = StagingWindow("run", directory=str(tmp_path)).wait_closed(10)
  finally:
    proc.wait(10)
  assert 0.2 <= waited < 5


def test_the_wait_is_capped(tmp_path):
  a, b = (
    StagingWindow("run", directory=str(tmp_path)),
    StagingWindow("run", directory=str(tmp_path)),
  )
  t = _hold_for(a, 1.0)
  waited = b.wait_closed(0.1)
  assert 0.09 <= waited < 0.5
  t.join()


def test_other_runs_do_not_interact(tmp_path):
  a, b = (
    StagingWindow("run", directory=str(tmp_path)),
    StagingWindow("other", directory=str(tmp_path)),
  )
  t = _hold_for(a, 0.5)
  assert b.wait_closed(5) < 0.1
  t.join()


def test_staging_never_blocks_on_a_held_exclusive_lock(tmp_path):
  """save() must not stall on the window: a stuck holder of the exclusive
  lock (never ours for longer than an instant) only costs a few ms."""
  import fcntl  # noqa: PLC0415

  w = StagingWindow("run", directory=str(tmp_path))
  fd = os.open(w.path, os.O_RDWR)
  fcntl.flock(fd, fcntl.LOCK_EX)
  try:
    t0 = time.monotonic()
    with w.staging():
      pass
    assert time.monotonic() - t0 < 0.5
  finally:
    os.close(fd)


@pytest.mark.parametrize("plant", ["symlink", "open_folder"])
def test_a_planted_or_open_lock_is_never_used(tmp_path, plant):
  folder = tmp_path / f"emergency_ckpt-{os.geteuid()}"
  if plant == "symlink":
    folder.mkdir(mode=0o700)
    (tmp_path / "elsewhere").write_text("")
    os.symlink(tmp_path / "elsewhere", folder / "run.staging")
  else:
    folder.mkdir()
    os.chmod(folder, 0o777)
  w = StagingWindow("run", directory=str(tmp_path))
  assert not w.enabled
  with w.staging():  # still usable: coordination is only off
    pass
  assert w.wait_closed(5) == 0.0


def test_the_lock_folder_is_private(tmp_path):
  w = StagingWindow("run", directory=str(tmp_path))
  st = os.stat(os.path.dirname(w.path))
  assert st.st_mode & 0o777 == 0o700
  assert os.stat(w.path).st_mode & 0o777 == 0o600
  w.close()


def test_a_single_process_job_has_no_window(tmp_path):
  w = StagingWindow(None, directory=str(tmp_path))
  assert not w.enabled
  assert w.wait_closed(5) == 0.0


def test_close_removes_the_lock_file_unless_held(tmp_path):
  a, b = (
    StagingWindow("job", directory=str(tmp_path)),
    StagingWindow("job", directory=str(tmp_path)),
  )
  t = _hold_for(a, 0.5)
  b.close()  # a is staging: the file stays
  assert os.path.exists(a.path)
  t.join()
  a.close()
  assert not os.path.exists(a.path)


def test_job_key_is_shared_by_one_job_only(monkeypatch):
  import jax  # noqa: PLC0415

  from emergency_ckpt.cluster import topology  # noqa: PLC0415

  state = jax._src.distributed.global_state  # noqa: SLF001
  assert topology.job_key() is None  # this test process is a single-process job
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  monkeypatch.setattr(state, "coordinator_address", "10.0.0.1:1234", raising=False)
  first = topology.job_key()
  assert first is not None and first == topology.job_key()
  monkeypatch.setattr(state, "coordinator_address", "10.0.0.1:1235", raising=False)
  assert topology.job_key() != first


def test_a_dead_jobs_lock_file_is_swept_a_live_or_recent_one_kept(tmp_path):
  """A killed job leaves its <job>.staging behind; the next job's open
  removes such files once STALE_S old and unlocked, never one that a
  process has locked, a recent one, or its own."""
  import fcntl  # noqa: PLC0415

  from emergency_ckpt.cluster import colocated  # noqa: PLC0415

  folder = tmp_path / f"emergency_ckpt-{os.geteuid()}"
  folder.mkdir(mode=0o700)
  old = time.time() - colocated.STALE_S - 60
  for name in ("dead", "locked", "recent"):
    (folder / f"{name}.staging").write_text("")
  for name in ("dead", "locked"):
    os.utime(folder / f"{name}.staging", (old, old))
  held = os.open(folder / "locked.staging", os.O_RDWR)
  fcntl.flock(held, fcntl.LOCK_SH)
  try:
    w = StagingWindow("new", directory=str(tmp_path))
    assert w.enabled
    assert sorted(os.listdir(folder)) == ["locked.staging", "new.staging", "recent.staging"]
    w.close()
  finally:
    os.close(held)


def test_a_process_stuck_in_its_copy_costs_one_capped_wait_not_one_per_save(tmp_path):
  """A co-located process stopped inside save() (SIGSTOP, a wedged host
  thread) keeps the window open: the first wait runs out, the next ones do
  not wait at all until the window is seen closed again; then they wait
  as before."""
  stuck = StagingWindow("job", directory=str(tmp_path))
  other = StagingWindow("job", directory=str(tmp_path))
  with stuck.staging():
    assert other.wait_closed(0.3) >= 0.3  # ran out
    assert other.wait_closed(0.3) < 0.05  # no second full wait
    assert other.wait_closed(0.3) < 0.05
  assert other.wait_closed(0.3) < 0.05  # closed: seen, so the next waits are full again
  with stuck.staging():
    assert other.wait_closed(0.3) >= 0.3
  stuck.close()
  other.close()
