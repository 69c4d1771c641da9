"""Storage calls the library makes itself, on a local filesystem or gs://
(through etils.epath / gcsfs): whole-object writes, fresh reads and
listings, idempotent deletions, GCS listing-cache control and a fail-fast
bucket probe. On GCS each runs inside gcs_retry.retrying (bounded retries of
transient errors, typed errors naming the bucket; gcs_retry.py says what
the clients retry on their own); off GCS each runs once, errors unchanged.

Called by: the state store, the persistent tier and its layout, and the
CLI's offline tools. Any thread.
"""

from __future__ import annotations

import os
import uuid

from etils import epath

from emergency_ckpt.core.gcs_retry import RetryPolicy, bucket_of, is_gcs, retrying
from emergency_ckpt.errors import StorageError, StorageNotFoundError


def forget_listings(path: epath.PathLike) -> None:
  """Drops this process's cached GCS listings of `path`, its parents and
  everything under it.

  gcsfs (behind epath on gs://) caches every directory listing for the life of
  the process and refreshes it only after its own writes, so objects that
  OTHER processes wrote since stay invisible: a COMMIT waiting for them would
  time out. Call before listing or probing a shared directory. No-op off GCS.

  Args:
    path: a folder or object.
  """
  if not is_gcs(path):
    return
  fs = epath.backend.fsspec_backend.fs(path)
  fs.invalidate_cache(os.fspath(path))  # the path and its parents
  prefix = fs._strip_protocol(os.fspath(path)).rstrip("/") + "/"
  for key in [k for k in list(fs.dircache) if k.startswith(prefix)]:
    fs.dircache.pop(key, None)


# ---- the calls: what the state store and the persistent tier make ------------
def write_bytes(path: epath.PathLike, data: bytes, *, policy: RetryPolicy | None = None) -> None:
  """Whole-or-nothing write: rename on filesystems, one upload on GCS (an
  overwrite, so a retry after a lost answer is harmless).

  Args:
    path: the file or object.
    data: its bytes.
    policy: the GCS retry policy (default: gcs_retry.DEFAULT_RETRY).

  Raises:
    StorageError: on GCS, a permanent error or transient errors that
      outlasted the retries (naming the bucket and the operation).
    OSError: off GCS, what the filesystem raises.
  """
  path = epath.Path(path)
  if is_gcs(path):
    # One multipart upload (gcsfs's file objects use two requests, a
    # resumable session and its chunk, whose retry can hit a finished session).
    fs = epath.backend.fsspec_backend.fs(path)
    try:
      retrying(
        lambda: fs.pipe_file(os.fspath(path), bytes(data)), what="writing", path=path, policy=policy
      )
    except StorageNotFoundError as e:  # an upload gets 404 only without a bucket
      raise StorageError(
        f"writing {os.fspath(path)} failed: GCS bucket {bucket_of(path)!r} does not exist."
      ) from e.__cause__
    return
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
  with open(os.fspath(tmp), "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(os.fspath(tmp), os.fspath(path))


def read_bytes(path: epath.PathLike, *, policy: RetryPolicy | None = None) -> bytes:
  """The object's bytes, read fresh.

  Args:
    path: the file or object.
    policy: the GCS retry policy (default: gcs_retry.DEFAULT_RETRY).

  Returns:
    Its bytes.

  Raises:
    FileNotFoundError: it is absent (on GCS a StorageNotFoundError, which
      also names bucket and operation).
    StorageError: on GCS, another permanent error or transient errors that
      outlasted the retries.
  """
  path = epath.Path(path)

  if not is_gcs(path):
    return path.read_bytes()
  fs = epath.backend.fsspec_backend.fs(path)

  def read() -> bytes:
    return fs.cat_file(os.fspath(path))  # one GET, no listing (so no stale cache)

  return retrying(read, what="reading", path=path, policy=policy)


def list_names(path: epath.PathLike, *, policy: RetryPolicy | None = None) -> list[str]:
  """The entries of a folder, listed fresh (never gcsfs's cache).

  Args:
    path: the folder.
    policy: the GCS retry policy (default: gcs_retry.DEFAULT_RETRY).

  Returns:
    Their names, sorted; [] if the folder is absent.

  Raises:
    StorageError: on GCS, a permanent error or transient errors that
      outlasted the retries (naming the bucket and the operation).
  """
  path = epath.Path(path)

  def listing() -> list[str]:
    forget_listings(path)
    try:
      return sorted(p.name for p in path.iterdir())
    except FileNotFoundError:
      return []

  return retrying(listing, what="listing", path=path, policy=policy)


def exists(path: epath.PathLike, *, policy: RetryPolicy | None = None) -> bool:
  """Whether an object or a non-empty folder exists, asked fresh.

  Args:
    path: the object or folder.
    policy: the GCS retry policy (default: gcs_retry.DEFAULT_RETRY).

  Returns:
    True if it exists.

  Raises:
    StorageError: on GCS, a permanent error or transient errors that
      outlasted the retries (naming the bucket and the operation).
  """
  path = epath.Path(path)

  def probe() -> bool:
    forget_listings(path)
    return path.exists()

  return retrying(probe, what="checking", path=path, policy=policy)


def unlink(path: epath.PathLike, *, policy: RetryPolicy | None = None) -> None:
  """Deletes one object; absent is fine (a retried DELETE whose first answer
  was lost gets 404).

  Args:
    path: the file or object.
    policy: the GCS retry policy (default: gcs_retry.DEFAULT_RETRY).

  Raises:
    StorageError: on GCS, a permanent error or transient errors that
      outlasted the retries (naming the bucket and the operation).
  """
  path = epath.Path(path)
  retrying(lambda: path.unlink(missing_ok=True), what="deleting", path=path, policy=policy)


def rmtree(path: epath.PathLike, *, policy: RetryPolicy | None = None) -> None:
  """Deletes a folder and everything under it; absent is fine. A retry lists
  afresh, so it deletes only what an interrupted attempt left.

  Args:
    path: the folder.
    policy: the GCS retry policy (default: gcs_retry.DEFAULT_RETRY).

  Raises:
    StorageError: on GCS, a permanent error or transient errors that
      outlasted the retries (naming the bucket and the operation).
  """
  path = epath.Path(path)

  def remove() -> None:
    forget_listings(path)
    path.rmtree(missing_ok=True)

  retrying(remove, what="deleting", path=path, policy=policy)


def check_bucket(
  path: epath.PathLike, operation: str, *, policy: RetryPolicy | None = None
) -> None:
  """Checks that `path`'s bucket exists and its objects can be listed (one
  request, retried if transient). No-op off GCS. Without it a missing
  bucket surfaces as a bare FileNotFoundError on an upload URL in one
  process, while the others wait in barriers.

  Args:
    path: a gs:// path in the bucket.
    operation: what the caller is doing, for the message.
    policy: the GCS retry policy (default: gcs_retry.DEFAULT_RETRY).

  Raises:
    StorageError: the bucket is missing or cannot be listed (naming it and
      `operation`).
  """
  if not is_gcs(path):
    return
  bucket = bucket_of(path)
  key = os.fspath(path).removeprefix("gs://").partition("/")[2].strip("/")
  fs = epath.backend.fsspec_backend.fs(path)
  # objects.list, not buckets.get: the library needs the former anyway, and
  # object-level roles (e.g. storage.objectAdmin) lack the latter.
  prefix = f"{key}/" if key else None
  try:
    retrying(
      lambda: fs.call("GET", "b/{}/o", bucket, maxResults=1, prefix=prefix, json_out=True),
      what=operation,
      path=path,
      policy=policy,
    )
  except StorageNotFoundError:
    raise StorageError(
      f"{operation} failed: GCS bucket {bucket!r} does not exist (path {os.fspath(path)})."
      f" Create it (gcloud storage buckets create gs://{bucket}) or fix the persistent"
      " directory."
    ) from None
