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
    (OSError("disk full"), "/tmp/run"),  # not GCS: local errors speak for themselves
  ],
)
def test_other_errors_pass_unchanged(exc, path):
  assert gcs_retry.translate(exc, what="uploading", path=path) is exc


def test_storage_error_passes_unchanged():
  e = StorageError("already translated")
  assert gcs_retry.translate(e, what="uploading", path="gs://bkt/run") is e
