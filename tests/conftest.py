"""Shared test set-up. GCS client settings must precede any gcsfs import."""

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("FSSPEC_GCS_TOKEN", "anon")
os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "dummy")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def shm_dir():
  """A fresh directory on a real tmpfs (/dev/shm), removed afterwards."""
  import shutil  # noqa: PLC0415

  base = "/dev/shm" if os.path.isdir("/dev/shm") else None
  path = tempfile.mkdtemp(prefix="ectest-", dir=base)
  yield path
  shutil.rmtree(path, ignore_errors=True)
