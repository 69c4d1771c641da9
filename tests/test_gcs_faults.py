"""Faults on the wire to GCS, injected by tests/harness/gcs_proxy.py in front of
fake-gcs-server: what gcsfs and tensorstore retry on their own, what
emergency_ckpt.core.storage adds, and multi-process jobs through 503s, resets,
permission loss, a slow bucket and a kill -9 in the middle of an upload.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import urllib.parse
import urllib.request

import pytest
from etils import epath

from emergency_ckpt.core import gcs_retry, storage
from emergency_ckpt.core.gcs_retry import RetryPolicy
from emergency_ckpt.core.storage import StorageNotFoundError
from emergency_ckpt.demo.launcher import run_job
from emergency_ckpt.errors import StorageError
from tests.harness.gcs_proxy import ENV_VAR
from tests.harness.gcs_server import list_objects

NO_OUTER_RETRY = RetryPolicy(attempts=1)  # success then proves the client retried


def _objects(server, bucket_url: str, prefix: str) -> dict[str, str]:
  """{name: md5Hash} under `prefix`, listed straight from the server."""
  return list_objects(server, bucket_url, prefix)


def _get(server, bucket_url: str, name: str) -> bytes | None:
  bucket = bucket_url.removeprefix("gs://")
  url = f"{server.url}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
  try:
    with urllib.request.urlopen(url, timeout=10) as r:
      return r.read()
  except urllib.error.HTTPError:
    return None


@pytest.fixture
def via_proxy(gcs_proxy, monkeypatch):
  """gcsfs (and so epath) in this process talks to the proxy."""
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_proxy.url)
  return gcs_proxy


@pytest.fixture
def gcsfs_sleeps(monkeypatch):
  """Records gcsfs's retry sleeps and shortens them 50x (the attempt count
  and the schedule it asks for are unchanged): a burst that exhausts gcsfs's
  6 attempts then takes ~0.6 s instead of ~31 s."""
  import gcsfs.retry  # noqa: PLC0415

  asked: list[float] = []
  real_sleep = asyncio.sleep

  class _FastAsyncio:
    def __getattr__(self, name):
      return getattr(asyncio, name)

    @staticmethod
    async def sleep(seconds, *args, **kwargs):
      asked.append(seconds)
      await real_sleep(seconds / 50)

  monkeypatch.setattr(gcsfs.retry, "asyncio", _FastAsyncio())
  return asked


GCSFS = "python-gcsfs"
TENSORSTORE = "tensorstore/"


# ---- gcsfs on its own ----------------------------------------------------------
def test_gcsfs_retries_5xx_and_resets_by_itself(via_proxy, gcs_server, gcs_bucket, gcsfs_sleeps):
  """Every kind of request the state store makes survives 503/500/502/504/429/408 and
  connection resets (before the request, after it, mid-body) with NO retry of
  ours (attempts=1): gcsfs retried each, sleeping 2**(k-1) + U(0,1) s."""
  proxy = via_proxy
  path = epath.Path(f"{gcs_bucket}/run/state/1/process_0-of-2.json")
  data = json.dumps({"x": list(range(200))}).encode()
  rules = [
    proxy.fail(times=2, status=503, method="POST", path="uploadType=multipart", client=GCSFS),
    proxy.reset(times=1, method="POST", path="uploadType=multipart", client=GCSFS),
  ]
  storage.write_bytes(path, data, policy=NO_OUTER_RETRY)
  assert _get(gcs_server, gcs_bucket, "run/state/1/process_0-of-2.json") == data
  rules += [
    proxy.fail(times=1, status=429, method="GET", path="alt=media", client=GCSFS),
    proxy.reset(times=1, when="response", after_bytes=20, method="GET", path="alt=media"),
  ]
  assert storage.read_bytes(path, policy=NO_OUTER_RETRY) == data
  rules += [
    proxy.fail(times=1, status=500, method="GET", path="prefix=run/state/1/", client=GCSFS),
    proxy.fail(times=1, status=502, method="GET", path="prefix=run/state/1/", client=GCSFS),
    proxy.reset(times=1, when="response", method="GET", path="prefix=run/state/1/"),
  ]
  assert storage.list_names(path.parent, policy=NO_OUTER_RETRY) == [path.name]
  rules.append(proxy.fail(times=1, status=504, method="GET", path="/o/run%2Fstate", client=GCSFS))
  assert storage.exists(path, policy=NO_OUTER_RETRY)
  rules.append(proxy.fail(times=1, status=408, method="DELETE", client=GCSFS))
  storage.unlink(path, policy=NO_OUTER_RETRY)
  assert _get(gcs_server, gcs_bucket, "run/state/1/process_0-of-2.json") is None
  assert [r.hits for r in rules] == [r.times for r in rules], [r.to_json() for r in rules]
  # gcsfs's schedule: attempt k+1 after min(2**(k-1) + U(0, 1), 32) s.
  assert gcsfs_sleeps, "gcsfs never slept: it did not retry"
  for s in gcsfs_sleeps:
    assert any(2**k <= s <= 2**k + 1 for k in range(6)), gcsfs_sleeps


@pytest.mark.parametrize("status", [403, 401, 400])
def test_gcsfs_does_not_retry_permanent_errors(via_proxy, gcs_bucket, status, gcsfs_sleeps):
  """403/401/400: no retry by gcsfs (it never sleeps); ours raises StorageError at once,
  naming bucket and operation (even with a 4-attempt policy)."""
  proxy = via_proxy
  rule = proxy.fail(times=None, status=status, client=GCSFS)
  bucket = gcs_bucket.removeprefix("gs://")
  path = epath.Path(f"{gcs_bucket}/run/state/3/COMMIT")
  t0 = time.monotonic()
  for call, what in (
    (lambda: storage.write_bytes(path, b"{}"), "writing"),
    (lambda: storage.read_bytes(path), "reading"),
    (lambda: storage.list_names(path.parent), "listing"),
    (lambda: storage.exists(path), "checking"),
    (lambda: storage.rmtree(path.parent), "deleting"),
  ):
    before = rule.hits
    with pytest.raises(StorageError) as err:
      call()
    msg = str(err.value)
    assert bucket in msg and what in msg and "not retried" in msg, msg
    # one request per call (exists() asks for the object and its listing at
    # once, then the bucket): no retry
    assert rule.hits - before <= 3, (what, rule.hits - before)
  assert time.monotonic() - t0 < 10
  assert gcsfs_sleeps == []


def test_missing_object_is_not_retried(via_proxy, gcs_bucket):
  proxy = via_proxy
  path = epath.Path(f"{gcs_bucket}/run/state/9/process_0-of-1.json")
  with pytest.raises(StorageNotFoundError) as err:
    storage.read_bytes(path)
  assert isinstance(err.value, FileNotFoundError)
  assert "reading" in str(err.value) and gcs_bucket.removeprefix("gs://") in str(err.value)
  assert proxy.stats()["seen"] == 1
  assert storage.list_names(path.parent) == []
  assert not storage.exists(path)
  storage.unlink(path)  # absent is fine
  storage.rmtree(path.parent)


def test_write_to_a_missing_bucket_names_it(via_proxy):
  with pytest.raises(StorageError, match="'no-such-bucket-ec' does not exist"):
    storage.write_bytes("gs://no-such-bucket-ec/run/run.json", b"{}")
  assert via_proxy.stats()["seen"] == 1


# ---- what storage.py adds ---------------------------------------------------------
def test_lost_delete_answer_breaks_plain_unlink_not_ours(via_proxy, gcs_server, gcs_bucket):
  """A DELETE whose answer is lost (reset after the server deleted): gcsfs
  retries it, gets 404, and epath's unlink() raises FileNotFoundError (what
  StateStore.delete calls today); storage.unlink/rmtree treat it as done."""
  proxy = via_proxy
  d = epath.Path(f"{gcs_bucket}/run/state/5")
  for name in ("COMMIT", "process_0-of-1.json"):
    storage.write_bytes(d / name, b"{}")
  proxy.reset(times=1, when="response", method="DELETE", path="COMMIT")
  with pytest.raises(FileNotFoundError):
    (d / "COMMIT").unlink()
  assert _get(gcs_server, gcs_bucket, "run/state/5/COMMIT") is None  # it was deleted
  storage.write_bytes(d / "COMMIT", b"{}")
  proxy.reset(times=1, when="response", method="DELETE", path="COMMIT")
  storage.unlink(d / "COMMIT")
  proxy.reset(times=1, when="response", method="DELETE")
  storage.rmtree(d)
  assert _objects(gcs_server, gcs_bucket, "run/state/5/") == {}


def test_outer_retry_after_gcsfs_gives_up(via_proxy, gcs_server, gcs_bucket, gcsfs_sleeps, caplog):
  """Seven 503s in a row: gcsfs gives up after its 6th attempt (5 sleeps);
  gcs_retry.retrying logs a WARNING naming bucket and operation and tries
  again, which succeeds."""
  proxy = via_proxy
  rule = proxy.fail(times=7, status=503, method="POST", client=GCSFS)
  path = epath.Path(f"{gcs_bucket}/run/run.json")
  policy = RetryPolicy(attempts=3, initial_delay_s=0.05)
  with caplog.at_level(logging.WARNING, logger="emergency_ckpt"):
    storage.write_bytes(path, b'{"ok": 1}', policy=policy)
  assert rule.hits == 7
  assert _get(gcs_server, gcs_bucket, "run/run.json") == b'{"ok": 1}'
  assert len(gcsfs_sleeps) == 5 + 1, gcsfs_sleeps  # 5 in the first call, 1 in the second
  warnings = [r.getMessage() for r in caplog.records if r.name == "emergency_ckpt"]
  assert len(warnings) == 1, warnings
  assert gcs_bucket.removeprefix("gs://") in warnings[0] and "writing" in warnings[0], warnings


def test_outer_retry_is_bounded(via_proxy, gcs_bucket, gcsfs_sleeps, caplog):
  proxy = via_proxy
  rule = proxy.fail(times=None, status=503, method="GET", client=GCSFS)
  policy = RetryPolicy(attempts=2, initial_delay_s=0.05)
  with caplog.at_level(logging.WARNING, logger="emergency_ckpt"), pytest.raises(StorageError) as e:
    storage.list_names(f"{gcs_bucket}/run/state", policy=policy)
  assert rule.hits == 2 * 6  # 2 of ours x 6 of gcsfs
  assert "after 2 attempts" in str(e.value) and "listing" in str(e.value)


def test_check_bucket_retries_transient_and_names_permanent(via_proxy, gcs_bucket, gcsfs_sleeps):
  proxy = via_proxy
  proxy.fail(times=7, status=503, method="GET", client=GCSFS)
  storage.check_bucket(f"{gcs_bucket}/run", "opening", policy=RetryPolicy(initial_delay_s=0.05))
  proxy.clear()
  proxy.fail(times=None, status=403, client=GCSFS)
  with pytest.raises(StorageError) as e:
    storage.check_bucket(f"{gcs_bucket}/run", "opening the persistent directory")
  assert "opening the persistent directory" in str(e.value)
  assert gcs_bucket.removeprefix("gs://") in str(e.value)
  assert "permissions" in str(e.value)


# ---- retrying(), no network ------------------------------------------------------------
class _Flaky:
  def __init__(self, *errors):
    self.errors = list(errors)
    self.calls = 0

  def __call__(self):
    self.calls += 1
    if self.errors:
      raise self.errors.pop(0)
    return "ok"


def test_retrying_policy_and_classification(monkeypatch, caplog):
  from gcsfs.retry import HttpError  # noqa: PLC0415

  slept = []
  monkeypatch.setattr(gcs_retry.time, "sleep", slept.append)
  policy = RetryPolicy(attempts=4, initial_delay_s=1.0, max_delay_s=3.0)
  path = "gs://bkt/run/x"
  flaky = _Flaky(HttpError({"code": 503}), ConnectionResetError(), TimeoutError())
  with caplog.at_level(logging.WARNING, logger="emergency_ckpt"):
    assert gcs_retry.retrying(flaky, what="writing", path=path, policy=policy) == "ok"
  assert flaky.calls == 4
  assert 0.5 <= slept[0] <= 1 and 1 <= slept[1] <= 2 and 1.5 <= slept[2] <= 3, slept
  logged = [r.getMessage() for r in caplog.records if r.name == "emergency_ckpt"]
  assert len(logged) == 3, logged
  assert all("'bkt'" in m and "writing gs://bkt/run/x" in m for m in logged), logged
  for error in (HttpError({"code": 403, "message": "no"}), OSError("Forbidden: x"), ValueError()):
    flaky = _Flaky(error)
    with pytest.raises(StorageError, match="bkt"):
      gcs_retry.retrying(flaky, what="reading", path=path, policy=policy)
    assert flaky.calls == 1
  flaky = _Flaky(TypeError("a bug"))
  with pytest.raises(TypeError):
    gcs_retry.retrying(flaky, what="reading", path=path, policy=policy)
  flaky = _Flaky(FileNotFoundError("gone"))
  with pytest.raises(StorageNotFoundError):
    gcs_retry.retrying(flaky, what="reading", path=path, policy=policy)
  flaky = _Flaky(*[HttpError({"code": 500})] * 5)
  with pytest.raises(StorageError, match="after 4 attempts"):
    gcs_retry.retrying(flaky, what="writing", path=path, policy=policy)
  assert flaky.calls == 4
  # Off GCS: once, errors unchanged.
  flaky = _Flaky(ConnectionResetError())
  with pytest.raises(ConnectionResetError):
    gcs_retry.retrying(flaky, what="writing", path="/tmp/x", policy=policy)
  assert flaky.calls == 1


def test_retrying_deadline(monkeypatch):
  from gcsfs.retry import HttpError  # noqa: PLC0415

  clock = [0.0]
  monkeypatch.setattr(gcs_retry.time, "monotonic", lambda: clock[0])

  def sleep(s):
    clock[0] += s

  monkeypatch.setattr(gcs_retry.time, "sleep", sleep)

  def slow_failure():
    clock[0] += 70
    raise HttpError({"code": 503})

  with pytest.raises(StorageError, match="after 2 attempts"):
    gcs_retry.retrying(
      slow_failure, what="x", path="gs://b/x", policy=RetryPolicy(attempts=9, deadline_s=120)
    )


# ---- tensorstore on its own -----------------------------------------------------------
def _ts_kvstore(bucket_url: str, proxy_url: str, monkeypatch, **context):
  import tensorstore as ts  # noqa: PLC0415

  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy_url)
  spec = {"driver": "gcs", "bucket": bucket_url.removeprefix("gs://"), "path": "ts/"}
  return ts.KvStore.open(spec, context=ts.Context(context)).result()


def test_tensorstore_default_retry_settings():
  """What Orbax runs with: it sets no gcs_request_retries, so these apply."""
  import tensorstore as ts  # noqa: PLC0415

  ctx = ts.Context()
  assert ctx["gcs_request_retries"].to_json(include_defaults=True) == {
    "initial_delay": "1s",
    "max_delay": "32s",
    "max_retries": 32,
  }


def test_tensorstore_retries_5xx_and_resets_by_itself(gcs_proxy, gcs_bucket, monkeypatch):
  """Four concurrent writes, each hit by one fault (503, 429, a reset before
  the request, a reset after the server stored it), then two reads (500, a
  reset mid-body): all retried by tensorstore, after its 1 s (+ jitter)
  backoff, and the bytes come back exact."""
  proxy = gcs_proxy
  kv = _ts_kvstore(gcs_bucket, proxy.url, monkeypatch)
  data = {k: os.urandom(100_000) for k in "abcd"}
  rules = [
    proxy.fail(times=1, status=503, method="POST", client=TENSORSTORE),
    proxy.fail(times=1, status=429, method="POST", client=TENSORSTORE),
    proxy.reset(times=1, method="POST", client=TENSORSTORE),
    proxy.reset(times=1, when="response", method="POST", client=TENSORSTORE),
  ]
  t0 = time.monotonic()
  for f in [kv.write(k, v) for k, v in data.items()]:
    f.result()
  write_s = time.monotonic() - t0
  rules += [
    proxy.fail(times=1, status=500, method="GET", client=TENSORSTORE),
    proxy.reset(times=1, when="response", after_bytes=5000, method="GET", client=TENSORSTORE),
  ]
  reads = {k: kv.read(k) for k in "ab"}
  assert {k: f.result().value for k, f in reads.items()} == {k: data[k] for k in "ab"}
  assert [r.hits for r in rules] == [1] * 6, [r.to_json() for r in rules]
  assert write_s >= 1.0, write_s  # initial_delay 1 s before the retry


def test_tensorstore_retry_count_and_permanent_errors(gcs_proxy, gcs_bucket, monkeypatch):
  proxy = gcs_proxy
  kv = _ts_kvstore(
    gcs_bucket,
    proxy.url,
    monkeypatch,
    gcs_request_retries={"max_retries": 2, "initial_delay": "50ms", "max_delay": "100ms"},
  )
  rule = proxy.fail(times=None, status=503, method="POST", client=TENSORSTORE)
  with pytest.raises(Exception, match="503") as e:
    kv.write("b", b"x").result()
  assert rule.hits == 3, e.value  # the attempt and max_retries=2 retries
  proxy.clear()
  for status in (403, 401):
    rule = proxy.fail(times=None, status=status, client=TENSORSTORE)
    with pytest.raises(Exception, match=str(status)):
      kv.write("c", b"x").result()
    assert rule.hits == 1  # not retried
    proxy.clear()


# ---- multi-process jobs ---------------------------------------------------------------
JOB_TIMEOUT_S = 240


def _restore_and_check(args: dict, expect: dict[str, tuple[int, str]], env=None) -> list:
  """Runs restore_variants; every process must restore expect[name] = (step,
  source) with every bit and its own data_state exact."""
  args = dict(args, variants=[{"name": n, **v} for n, v in VARIANTS.items() if n in expect])
  out = run_job("tests.scenarios:restore_variants", 4, args, env=env, timeout_s=JOB_TIMEOUT_S)
  results = out.check()
  for proc, records in enumerate(results):
    by_name = {r["name"]: r for r in records}
    assert set(by_name) == set(expect), records
    for name, (step, source) in expect.items():
      r = by_name[name]
      assert "error" not in r, (proc, r)
      assert (r["step"], r["source"]) == (step, source), (proc, r)
      assert r["mismatches"] == [], (proc, r)
      assert r["data_state"] == r["expected_data_state"], (proc, r)
  return results


VARIANTS = {"all_wiped": {"wipe_slices": [0, 1]}, "intact": {}}


def test_transient_faults_on_both_clients_bit_exact(gcs_server, gcs_proxy, gcs_bucket, shm_dir):
  """2 slices x 2 processes, both clients through the proxy. Saving: 503s,
  a 429, resets before and after the server handled the request, on state
  JSON/COMMIT uploads and listings (gcsfs) and tensor uploads (tensorstore).
  Restoring: 503s and a reset mid-body on tensor and JSON reads. Every fault
  is injected (rule counts) and retried; the restore is bit-exact."""
  proxy = gcs_proxy
  env = {i: proxy.env for i in range(4)}
  args = {
    "slices": 2,
    "local_root": shm_dir,
    "persistent": f"{gcs_bucket}/run",
    "steps": [1, 2, 3, 4],
    "persistent_keep": 2,
    # one persistent step: a second one, saved while the retried upload of
    # the first still runs, would be skipped (never waited for)
    "persistent_interval": 4,
  }
  save_rules = [
    proxy.fail(times=2, status=503, method="POST", path="uploadType=multipart", client=GCSFS),
    proxy.reset(times=1, when="response", method="POST", path="uploadType=multipart", client=GCSFS),
    proxy.fail(times=1, status=500, method="GET", path="prefix=run/state/", client=GCSFS),
    proxy.reset(times=1, method="GET", path="prefix=run/state/", client=GCSFS),
    proxy.fail(times=2, status=503, method="POST", path="/upload/", client=TENSORSTORE),
    proxy.fail(times=1, status=429, method="POST", path="/upload/", client=TENSORSTORE),
    proxy.reset(times=1, method="POST", path="/upload/", client=TENSORSTORE),
    proxy.reset(
      times=1, when="response", method="POST", path=["/upload/", "/d/"], client=TENSORSTORE
    ),
  ]
  saved = run_job("tests.scenarios:save_steps", 4, args, env=env, timeout_s=JOB_TIMEOUT_S).check()
  assert [r["saved"] for r in saved] == [[1, 2, 3, 4]] * 4
  assert [r.hits for r in save_rules] == [r.times for r in save_rules], [
    r.to_json() for r in save_rules
  ]
  names = _objects(gcs_server, gcs_bucket, "run/")
  assert "run/tensors/4/commit_success.txt" in names and "run/state/4/COMMIT" in names
  proxy.clear()
  restore_rules = [
    proxy.fail(times=2, status=503, method="GET", path="alt=media", client=TENSORSTORE),
    proxy.reset(
      times=1, when="response", after_bytes=100, method="GET", path="alt=media", client=TENSORSTORE
    ),
    proxy.fail(times=1, status=503, method="GET", path="alt=media", client=GCSFS),
    proxy.reset(times=1, method="GET", path="prefix=run/", client=GCSFS),
  ]
  _restore_and_check(args, {"all_wiped": (4, "persistent"), "intact": (4, "local")}, env=env)
  assert [r.hits for r in restore_rules] == [r.times for r in restore_rules], [
    r.to_json() for r in restore_rules
  ]


def test_permission_lost_mid_run_fails_fast_nothing_committed_lost(
  gcs_server, gcs_proxy, gcs_bucket, shm_dir
):
  """Steps 1-2 saved; then every request to the bucket gets 403 (permission
  revoked) and steps 3-4 are saved. Every process fails with a StorageError
  naming the bucket and the operation, none hangs; after access returns,
  step 2 restores bit-exactly from either tier.

  Sometimes a primary-slice process learns of its failed step-3 write only
  after its upload thread entered Orbax's save of step 4, whose barrier
  process 0 (already failed) never joins: wait_until_finished still raises
  the first background error at once, and close() abandons that upload
  (before, such a process sat in the barrier until process 0 exited, and was
  then aborted by the JAX runtime: rc -6)."""
  proxy = gcs_proxy
  bucket = gcs_bucket.removeprefix("gs://")
  args = {
    "slices": 2,
    "local_root": shm_dir,
    "persistent": f"{gcs_bucket}/run",
    "bucket": bucket,
    "steps_before": [1, 2],
    "steps_after": [3, 4],
    "state_commit_timeout_s": 20,
  }
  job = run_job(
    "tests.gcs_fault_scenarios:revoke_mid_run",
    4,
    args,
    env={i: proxy.env for i in range(4)},
    timeout_s=JOB_TIMEOUT_S,
  )
  logs = "\n".join(
    f"--- {i}: {e}\n{log[-3000:]}" for i, (e, log) in enumerate(zip(job.errors, job.logs))
  )
  assert not job.timed_out, f"hung for {job.wall_s:.0f}s:\n{logs}"
  assert job.wall_s < 150, f"took {job.wall_s:.0f}s to fail:\n{logs}"
  assert job.returncodes == [1] * 4, logs
  for error in job.errors:
    assert "StorageError" in (error or ""), logs
    assert bucket in error and "not retried" in error, error
    assert any(op in error for op in ("writing", "reading", "listing", "checking")), error
  proxy.clear()
  names = _objects(gcs_server, gcs_bucket, "run/")
  assert "run/state/2/COMMIT" in names and "run/tensors/2/commit_success.txt" in names, names
  _restore_and_check(args, {"all_wiped": (2, "persistent"), "intact": (2, "local")})


def test_failure_while_upload_held_raises_at_once_and_close_does_not_wait(
  gcs_server, gcs_proxy, gcs_bucket, shm_dir
):
  """Step 2's tensor upload is held by the proxy and its state JSON is refused
  (403). wait_until_finished() raises that StorageError at once, not when the
  upload ends; close() then returns without waiting for the held upload (in a
  multi-slice job that upload may wait in Orbax's barrier for a process that
  failed the same way and exited). Step 2 is never committed anywhere."""
  proxy = gcs_proxy
  hold = proxy.hold(method="POST", path=["/upload/", "tensors/2/"], client=TENSORSTORE)
  args = {
    "slices": 1,
    "local_root": shm_dir,
    "persistent": f"{gcs_bucket}/run",
    "persistent_interval": 2,
    "step": 2,
    "hold_rule": hold.id,
  }
  safety = threading.Timer(120, hold.release)  # a hang fails, not blocks the suite
  safety.start()
  try:
    job = run_job(
      "tests.gcs_fault_scenarios:fail_while_upload_held",
      1,
      args,
      env={0: proxy.env},
      timeout_s=JOB_TIMEOUT_S,
    )
  finally:
    safety.cancel()
  hold.release()
  (r,) = job.check()
  assert r["refused"] >= 1, r
  assert r["error"] and r["error"].startswith("StorageError"), r
  assert "state/2/" in r["error"] and "Forbidden" in r["error"], r
  assert r["held_after_wait"] >= 1 and r["held_after_close"] >= 1, r  # never released
  assert r["wait_s"] < 30 and r["close_s"] < 30, r
  assert "run/tensors/2/commit_success.txt" not in _objects(gcs_server, gcs_bucket, "run/")


def test_slow_bucket_local_saves_stay_prompt_and_durable(
  gcs_server, gcs_proxy, gcs_bucket, shm_dir
):
  """Tensorstore goes through the proxy, which holds step 5's tensor uploads;
  gcsfs (state store) goes straight to the server. While the upload is held,
  the local-only steps 6-8 are saved, committed and listed as restorable;
  then the upload is released and step 5 lands in the persistent tier."""
  proxy = gcs_proxy
  hold = proxy.hold(method="POST", path=["/upload/", "tensors/5/"], client=TENSORSTORE)
  env = {i: {"TENSORSTORE_GCS_HTTP_URL": proxy.url, ENV_VAR: proxy.url} for i in range(4)}
  args = {
    "slices": 2,
    "local_root": shm_dir,
    "persistent": f"{gcs_bucket}/run",
    "persistent_interval": 5,
    "persistent_step": 5,
    "local_steps": [6, 7, 8],
    "local_keep": 4,
    "hold_rule": hold.id,
  }
  safety = threading.Timer(150, hold.release)  # a deadlock fails, not hangs
  safety.start()
  try:
    job = run_job(
      "tests.gcs_fault_scenarios:slow_bucket_saves", 4, args, env=env, timeout_s=JOB_TIMEOUT_S
    )
  finally:
    safety.cancel()
  results = job.check()
  for proc, r in enumerate(results):
    assert r["saves_returned_while_held"], (proc, r)
    assert {6, 7, 8} <= set(r["committed_while_held"]), (proc, r)
    assert {6, 7, 8} <= set(r["all_steps_while_held"]), (proc, r)
    assert {"step_6", "step_7", "step_8"} <= set(r["local_entries_while_held"]), (proc, r)
    assert 5 not in r["persistent_while_held"], (proc, r)
    assert r["held_now_after_checks"] >= 1 and not r["released_before_checks"], (proc, r)
    assert r["persistent_after"] == [5], (proc, r)
    assert {5, 6, 7, 8} <= set(r["all_steps_after"]), (proc, r)
  assert hold.hits >= 1
  _restore_and_check(args, {"all_wiped": (5, "persistent"), "intact": (8, "local")})


def test_kill9_mid_upload_partial_step_never_listed_then_cleaned(
  gcs_server, gcs_proxy, gcs_bucket, shm_dir
):
  """Step 2 is persistent; step 4's upload is held at its manifests (its data
  files land) when every process SIGKILLs itself. The partial step 4 is never
  listed; restore picks the newest restorable step bit-exactly (2 from the
  bucket with wiped ramdisks, 4 from the ramdisks otherwise); and the restart
  removes step 4's objects without touching step 2's."""
  from emergency_ckpt.persistent.tier import list_steps  # noqa: PLC0415

  proxy = gcs_proxy
  hold = proxy.hold(
    method="POST", path=["/upload/", "tensors/4/", "manifest.ocdbt"], client=TENSORSTORE
  )
  env = {i: {"TENSORSTORE_GCS_HTTP_URL": proxy.url, ENV_VAR: proxy.url} for i in range(4)}
  args = {
    "slices": 2,
    "local_root": shm_dir,
    "persistent": f"{gcs_bucket}/run",
    "steps_before": [1, 2],
    "steps_after": [3, 4],
    "hold_rule": hold.id,
    "local_keep": 3,
  }
  job = run_job(
    "tests.gcs_fault_scenarios:kill_mid_upload", 4, args, env=env, timeout_s=JOB_TIMEOUT_S
  )
  logs = "\n".join(
    f"--- {i}: {e}\n{log[-3000:]}" for i, (e, log) in enumerate(zip(job.errors, job.logs))
  )
  assert job.returncodes == [-9] * 4, logs
  assert hold.hits >= 1
  proxy.clear()  # drops the held manifests: they never reach the bucket
  names = _objects(gcs_server, gcs_bucket, "run/tensors/")
  partial = sorted(n for n in names if n.startswith("run/tensors/4/"))
  assert any("/d/" in n for n in partial), partial  # tensor data of step 4 landed
  assert "run/tensors/4/commit_success.txt" not in names
  step2 = {n: md5 for n, md5 in names.items() if n.startswith("run/tensors/2/")}
  assert "run/tensors/2/commit_success.txt" in step2
  assert list_steps(f"{gcs_bucket}/run/tensors") == [2]  # the partial step is never listed

  results = _restore_and_check(args, {"all_wiped": (2, "persistent"), "intact": (4, "local")})
  for records in results:
    by_name = {r["name"]: r for r in records}
    assert 4 not in by_name["all_wiped"]["all_steps"], records
    assert by_name["all_wiped"]["all_steps"][-1] == 2, records
  after = _objects(gcs_server, gcs_bucket, "run/tensors/")
  assert not [n for n in after if n.startswith("run/tensors/4/")], sorted(after)
  assert {n: md5 for n, md5 in after.items() if n.startswith("run/tensors/2/")} == step2
  assert list_steps(f"{gcs_bucket}/run/tensors") == [2]
