"""Storage paths: local filesystem or gs:// (through etils.epath / gcsfs).

Whole-object writes, GCS listing-cache control, and a fail-fast bucket probe.
"""

from __future__ import annotations

import os
import uuid

from etils import epath

from emergency_ckpt.errors import StorageError


def is_gcs(path: epath.PathLike) -> bool:
  return os.fspath(path).startswith("gs://")


def forget_listings(path: epath.PathLike) -> None:
  """Drops this process's cached GCS listings of `path`, its parents and
  everything under it.

  gcsfs (behind epath on gs://) caches every directory listing for the life of
  the process and refreshes it only after its own writes, so objects that
  OTHER processes wrote since stay invisible: a COMMIT waiting for them would
  time out. Call before listing or probing a shared directory. No-op off GCS.
  """
  if not is_gcs(path):
    return
  fs = epath.backend.fsspec_backend.fs(path)
  fs.invalidate_cache(os.fspath(path))  # the path and its parents
  prefix = fs._strip_protocol(os.fspath(path)).rstrip("/") + "/"
  for key in [k for k in list(fs.dircache) if k.startswith(prefix)]:
    fs.dircache.pop(key, None)


def bucket_of(path: epath.PathLike) -> str:
  """The bucket of a gs:// path."""
  return os.fspath(path).removeprefix("gs://").split("/", 1)[0]


def check_bucket(path: epath.PathLike, operation: str) -> None:
  """Raises StorageError naming the bucket and `operation` unless `path`'s
  bucket exists and its objects can be listed (one request). No-op off GCS.

  Without it a missing bucket surfaces as a bare FileNotFoundError on an
  upload URL in one process, while the others wait in barriers."""
  if not is_gcs(path):
    return
  bucket = bucket_of(path)
  key = os.fspath(path).removeprefix("gs://").partition("/")[2].strip("/")
  fs = epath.backend.fsspec_backend.fs(path)
  try:
    # objects.list, not buckets.get: the library needs the former anyway, and
    # object-level roles (e.g. storage.objectAdmin) lack the latter.
    prefix = f"{key}/" if key else None
    fs.call("GET", "b/{}/o", bucket, maxResults=1, prefix=prefix, json_out=True)
  except FileNotFoundError:
    raise StorageError(
      f"{operation} failed: GCS bucket {bucket!r} does not exist (path {os.fspath(path)})."
      f" Create it (gcloud storage buckets create gs://{bucket}) or fix the persistent"
      " directory."
    ) from None
  except OSError as e:
    raise StorageError(
      f"{operation} failed: cannot list GCS bucket {bucket!r} (path {os.fspath(path)}):"
      f" {type(e).__name__}: {e}. Check credentials and permissions (storage.objects.list)."
    ) from e


def atomic_write(path: epath.Path, data: bytes) -> None:
  """Whole-or-nothing write: rename on filesystems, one upload on GCS."""
  if is_gcs(path):
    try:
      path.write_bytes(data)
    except StorageError:
      raise
    except OSError as e:
      raise StorageError(
        f"writing {path} failed (GCS bucket {bucket_of(path)!r}): {type(e).__name__}: {e}"
      ) from e
    return
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
  with open(os.fspath(tmp), "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(os.fspath(tmp), os.fspath(path))
