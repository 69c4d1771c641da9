"""gcs_retry.translate: what an upload we do not drive (Orbax's) raises."""

from __future__ import annotations

import pytest

from emergency_ckpt.core import gcs_retry
from emergency_ckpt.errors import StorageError


def test_forbidden_on_gcs_names_bucket_and_operation():
  e = gcs_retry.translate(
    OSError("Forbidden: http://x/upload (403)"), what="uploading step 4 to", path="gs://bkt/run"
  )
  assert isinstance(e, StorageError)
  text = str(e)
  assert "'bkt'" in text and "uploading step 4 to gs://bkt/run" in text
  assert "not retried" in text and "IAM" in text


def test_transient_error_says_retries_ran_out():
  e = gcs_retry.translate(ConnectionResetError("reset"), what="uploading", path="gs://bkt/run")
  assert isinstance(e, StorageError)
  assert "outlasted" in str(e)


@pytest.mark.parametrize(
  "exc, path",
  [
    (RuntimeError("DEADLINE_EXCEEDED: barrier timed out"), "gs://bkt/run"),  # not storage
    (TypeError("a bug"), "gs://bkt/run"),
    (ValueError("a shape mismatch"), "/tmp/run"),  # not storage, off GCS
  ],
)
def test_other_errors_pass_unchanged(exc, path):
  assert gcs_retry.translate(exc, what="uploading", path=path) is exc


def test_storage_error_passes_unchanged():
  e = StorageError("already translated")
  assert gcs_retry.translate(e, what="uploading", path="gs://bkt/run") is e


def test_a_full_local_disk_names_the_path_the_cause_and_the_fix():
  ts_error = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database at local file "/p/tensors/4": '
    + "x" * 400
    + ": Failed to write 1179855 bytes to file 5: No space left on device [os_error_code='28']"
  )
  for exc in (ts_error, OSError(28, "No space left on device")):
    e = gcs_retry.translate(exc, what="uploading step 4 to", path="/mnt/ckpt/run")
    assert isinstance(e, StorageError)
    text = str(e)
    assert "uploading step 4 to /mnt/ckpt/run failed" in text
    assert "No space left on device" in text  # the cause survives the shortening
    assert "free space" in text and "persistent.max_to_keep" in text


def test_a_local_permission_error_says_to_check_the_owner():
  e = gcs_retry.translate(PermissionError(13, "Permission denied"), what="opening", path="/ro")
  assert isinstance(e, StorageError) and "owner and mode" in str(e)
