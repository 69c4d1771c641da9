"""wait_until_finished() is bounded and says what it waited for: a
persistent upload that a hung bucket holds (one process, gs:// on
fake-gcs-server behind the fault-injecting proxy holding the upload); with
persistent.when_busy="skip", save() never waits for it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec

TENSORSTORE = "tensorstore/"


def _state(mesh, step: int) -> dict:
  return {"w": jax.device_put(np.full((8, 4), step, np.float32), NamedSharding(mesh, P("data")))}


def test_wait_and_close_give_up_in_time_naming_the_pending_upload(
  gcs_server, gcs_proxy, gcs_bucket, shm_dir, mesh, monkeypatch
):
  for key, value in gcs_proxy.env.items():
    monkeypatch.setenv(key, value)
  hold = gcs_proxy.hold(method="POST", path=["/upload/", "tensors/2/"], client=TENSORSTORE)
  safety = threading.Timer(120, hold.release)  # a hang fails the test, not the suite
  safety.start()
  options = ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=os.path.join(shm_dir, "local"), save_interval_steps=1),
    persistent=ec.PersistentTierOptions(
      directory=f"{gcs_bucket}/run", save_interval_steps=2, when_busy="skip"
    ),
    run_id="bounded",
  )
  mngr = ec.CheckpointManager(options, mesh=mesh)
  try:
    mngr.save(1, _state(mesh, 1))
    t0 = time.monotonic()
    mngr.save(2, _state(mesh, 2))  # persistent: its upload is held
    mngr.save(3, _state(mesh, 3))
    mngr.save(4, _state(mesh, 4))  # persistent again, while 2 is held: skipped
    saves_s = time.monotonic() - t0
    hold.wait_held(1, timeout=60)
    assert saves_s < 5, f"save() waited for the bucket: {saves_s:.1f}s"
    health = mngr.health()
    assert health["persistent"].skipped_steps == (4,), health
    assert health["persistent"].in_flight == ("upload of step 2",), health
    checked = mngr.check_for_errors()  # a sick tier is reported, never raised
    assert checked["persistent"].skipped_steps == (4,), checked
    assert any("persistent: 1 step(s) skipped" in p for p in checked.problems()), checked

    t0 = time.monotonic()
    with pytest.raises(ec.PendingWorkTimeoutError) as e:
      mngr.wait_until_finished(timeout_s=1.5)
    waited = time.monotonic() - t0
    assert 1.5 <= waited < 6, waited
    text = str(e.value)
    assert "upload of step 2" in text and "never reached the persistent tier: [2, 4]" in text, text
    assert isinstance(e.value, TimeoutError)

    hold.release()  # the bucket answers again: the upload ends, close() waits for it
    mngr.close()
    assert mngr.health()["persistent"].newest_durable_step == 2
  finally:
    hold.release()
    safety.cancel()
    mngr.close()  # a second close does nothing


def test_a_job_ending_while_the_bucket_hangs_exits_in_bounded_time(
  gcs_server, gcs_proxy, gcs_bucket, shm_dir, fault_matrix
):
  """A fresh interpreter (not a job process: the launcher's os._exit would
  hide a thread the interpreter joins at exit) closes with a 3 s timeout
  while its upload is held, then ends normally: it exits long before the
  bucket would answer (status 1: its last upload never finished), saying
  which steps never reached the bucket."""
  hold = gcs_proxy.hold(method="POST", path=["/upload/", "tensors/2/"], client=TENSORSTORE)
  safety = threading.Timer(240, hold.release)  # a hang fails the test, not the suite
  safety.start()
  code = (
    "from tests.outage_scenarios import end_while_the_bucket_hangs as f;"
    f"f({os.path.join(shm_dir, 'local')!r}, {gcs_bucket + '/run'!r}, 3.0)"
  )
  t0 = time.monotonic()
  try:
    out = subprocess.run(
      [sys.executable, "-c", code],
      env={**os.environ, **gcs_proxy.env},
      capture_output=True,
      text=True,
      timeout=200,
    )
  finally:
    took = time.monotonic() - t0
    held = hold.held_now  # read first: a hang-up counts in hung_up before held_now drops
    hung_up = hold.hung_up
    hold.release()
    safety.cancel()
  text = out.stdout + out.stderr[-3000:]
  assert out.returncode == 1, text  # its last upload never finished: never a success
  assert "CLOSED" in out.stdout and "never reached the persistent tier: [2]" in out.stdout, text
  # the upload was still held when the program ended (the proxy saw the
  # client hang up on a held request; it was never released)
  assert held + hung_up >= 1, (held, hung_up, text)
  fault_matrix.check(
    "sick.bucket.job_end",
    f"exited {took:.1f}s after it started (upload still held); close() said:"
    f" {out.stdout.split('CLOSE RAISED: ')[-1].splitlines()[0][:200]}",
    took < 120,
  )
