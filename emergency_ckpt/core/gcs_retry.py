"""GCS failures: which paths are on GCS, which of its errors are worth
retrying, the bounded retry loop around one storage call, and the
translation of a storage failure into a StorageError naming the bucket.

What the clients retry on their own (read from their sources, proven through
a fault-injecting proxy in tests/test_gcs_faults.py):

- gcsfs (the state store, through etils.epath): every JSON-API request
  (`GCSFileSystem._request`: uploads, downloads, listings, object gets,
  deletes) up to 6 attempts, sleeping min(2**(k-1) + U(0, 1), 32) s between
  them (about 31 s in all), on HTTP 408, 429, 500-504 (502 as
  requests.ProxyError), any aiohttp ClientError (connection reset, server
  disconnected, truncated body), requests connection errors, google.auth
  RefreshError and checksum mismatches. Never retried: 401 (except "Invalid
  Credentials"), 403 (an OSError "Forbidden"), 404 (FileNotFoundError), other
  4xx, and a request that times out (asyncio.TimeoutError).
- tensorstore (the tensors, through Orbax; `gcs` kvstore, which Orbax opens
  with the default context): every read, write, list and delete request, on
  HTTP 408, 409, 429, 500, 502, 503, 504 and curl transport errors
  (connection reset or refused, empty or partial reply), with the
  `gcs_request_retries` defaults: 32 retries, 1 s * 2**k apart plus jitter,
  at most 32 s apart (about 15 minutes in all). Never retried: 401, 403,
  other 4xx (a 404 on a read is "no such key", not an error).

This module adds, on GCS only, one outer loop (`RetryPolicy`: 4 attempts,
1-2-4 s of jittered backoff, no new attempt after 180 s) for what outlives
gcsfs's own retries or is not retried by it (a timeout, a longer outage), and
makes repeated operations idempotent where a lost response would otherwise
turn a retry into an error (a DELETE that succeeded but whose answer was lost
is retried by gcsfs and then gets 404). Each retry is logged at WARNING with
the bucket and the operation. A permanent error (403, 401, 400, a missing
bucket) is never retried: it raises StorageError at once, naming the bucket
and the operation. Off GCS every call runs once; translate() still names
the path and the cause of a failed upload.

Called by: storage.py (around every call the library makes itself: the
state store's JSON, COMMIT markers, listings, deletions), the persistent
tier (translating what Orbax's upload raised) and the persistent layout
(is_gcs). Any thread; pure policy, no I/O of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import random
import time
from collections.abc import Callable
from typing import TypeVar

from etils import epath

from emergency_ckpt.errors import StorageError, StorageNotFoundError

logger = logging.getLogger("emergency_ckpt")

T = TypeVar("T")

TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth retrying (Google's retry strategy for Cloud Storage)."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  """Bounded exponential backoff with jitter for transient GCS errors.

  Attempt k (k >= 1) failing transiently sleeps U(0.5, 1) * min(max_delay_s,
  initial_delay_s * 2**(k-1)) before attempt k+1; no attempt starts once
  `deadline_s` passed since the first. Each attempt already includes gcsfs's
  own retries (up to ~31 s for a burst of 5xx)."""

  attempts: int = 4
  initial_delay_s: float = 1.0
  max_delay_s: float = 10.0
  deadline_s: float = 180.0

  def delay(self, attempt: int) -> float:
    """The jittered sleep after failed attempt `attempt`.

    Args:
      attempt: the attempt that failed (1 = the first).

    Returns:
      Seconds to sleep before the next attempt.
    """
    base = min(self.max_delay_s, self.initial_delay_s * 2 ** (attempt - 1))
    return base * random.uniform(0.5, 1.0)


DEFAULT_RETRY = RetryPolicy()


def is_gcs(path: epath.PathLike) -> bool:
  """Whether a path is on GCS.

  Args:
    path: any path.

  Returns:
    True for gs:// paths.
  """
  return os.fspath(path).startswith("gs://")


def bucket_of(path: epath.PathLike) -> str:
  """The bucket of a gs:// path.

  Args:
    path: a gs:// path.

  Returns:
    The bucket's name.
  """
  return os.fspath(path).removeprefix("gs://").split("/", 1)[0]


# ---- error classification ---------------------------------------------------
TRANSIENT, MISSING, PERMANENT = "transient", "missing", "permanent"


def _status_of(exc: BaseException) -> int | None:
  """The HTTP status an exception carries (gcsfs HttpError.code, aiohttp
  ClientResponseError.status), or None."""
  for attr in ("code", "status"):
    value = getattr(exc, attr, None)
    if isinstance(value, str) and value.isdigit():
      value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
      return value
  return None


def _transport_errors() -> tuple[type[BaseException], ...]:
  """Exception types of the HTTP stacks under gcsfs that mean "the network or
  the server hiccuped": retry them."""
  out: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
  try:
    import aiohttp  # noqa: PLC0415 - only on an error path

    out.append(aiohttp.ClientError)
  except ImportError:  # pragma: no cover - gcsfs depends on it
    pass
  try:
    import requests  # noqa: PLC0415

    out += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    out += [requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError]
  except ImportError:  # pragma: no cover
    pass
  try:
    from google.auth import exceptions as auth_exceptions  # noqa: PLC0415

    out += [auth_exceptions.TransportError, auth_exceptions.RefreshError]
  except ImportError:  # pragma: no cover
    pass
  try:
    from gcsfs.retry import ChecksumError  # noqa: PLC0415

    out.append(ChecksumError)
  except ImportError:  # pragma: no cover
    pass
  return tuple(out)


def classify(exc: BaseException) -> str:
  """What a storage error means.

  Args:
    exc: what a storage call raised.

  Returns:
    TRANSIENT (retry it), MISSING (404: the object or prefix is absent) or
    PERMANENT (403, 401, other 4xx, anything unknown: retrying cannot help).
  """
  if isinstance(exc, StorageError):
    return MISSING if isinstance(exc, FileNotFoundError) else PERMANENT
  if isinstance(exc, FileNotFoundError):
    return MISSING
  status = _status_of(exc)
  if status is not None:
    if status in (404, 410):
      return MISSING
    if status in TRANSIENT_HTTP:
      return TRANSIENT
    if status == 401 and "invalid credentials" in str(exc).lower():
      return TRANSIENT  # an expired token: gcsfs refreshes it on the next try
    return PERMANENT
  if isinstance(exc, PermissionError):
    return PERMANENT
  if isinstance(exc, _transport_errors()):
    return TRANSIENT
  return PERMANENT


def _brief(exc: BaseException) -> str:
  text = " ".join(str(exc).split())
  if len(text) > 300:  # the cause is often at the end (tensorstore's OS error)
    text = f"{text[:180]} ... {text[-120:]}"
  return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _hint(exc: BaseException) -> str:
  status = _status_of(exc)
  text = str(exc)
  if status in (401, 403) or "Forbidden" in text or isinstance(exc, PermissionError):
    return " Check the credentials and the bucket's IAM permissions (storage.objects.*)."
  return ""


# ---- the retry loop ------------------------------------------------------------
def retrying(
  fn: Callable[[], T],
  *,
  what: str,
  path: epath.PathLike,
  policy: RetryPolicy | None = None,
) -> T:
  """Runs `fn` (one operation on `path`), retrying transient GCS errors.

  Off GCS, runs `fn` once and lets its errors through unchanged. On GCS,
  transient errors are retried per `policy`, each retry logged at WARNING
  with bucket and operation.

  Args:
    fn: the operation.
    what: its name for logs and errors ("writing", "listing"...).
    path: what it works on.
    policy: the retry policy (default: DEFAULT_RETRY).

  Returns:
    What `fn` returned.

  Raises:
    StorageNotFoundError: on GCS, a missing object (a FileNotFoundError), at
      once.
    StorageError: on GCS, transient errors that outlasted the policy, or
      any other storage error at once.
    Exceptions that are not storage errors (a bug: TypeError, say)
      propagate unchanged.
  """
  if not is_gcs(path):
    return fn()
  policy = policy or DEFAULT_RETRY
  bucket = bucket_of(path)
  where = f"{what} {os.fspath(path)}"
  t0 = time.monotonic()
  attempt = 0
  while True:
    attempt += 1
    try:
      return fn()
    except StorageError:
      raise
    except Exception as e:  # noqa: BLE001 - classified below
      kind = classify(e)
      if kind == MISSING:
        raise StorageNotFoundError(
          f"{where} failed: not found in GCS bucket {bucket!r} ({_brief(e)})."
        ) from e
      if kind == PERMANENT:
        if not _is_storage_exception(e):
          raise  # not a storage error at all (a bug): unchanged
        raise StorageError(
          f"{where} failed on GCS bucket {bucket!r}: {_brief(e)} (a permanent error; not"
          f" retried).{_hint(e)}"
        ) from e
      elapsed = time.monotonic() - t0
      delay = policy.delay(attempt)
      if attempt >= policy.attempts or elapsed + delay > policy.deadline_s:
        raise StorageError(
          f"{where} failed on GCS bucket {bucket!r} after {attempt} attempts in"
          f" {elapsed:.0f}s of transient errors (each attempt includes the client's own"
          f" retries); the last: {_brief(e)}. Check the bucket's availability and the"
          " network."
        ) from e
      logger.warning(
        "GCS bucket %r: %s failed (attempt %d of %d: %s); retrying in %.1fs",
        bucket,
        where,
        attempt,
        policy.attempts,
        _brief(e),
        delay,
      )
      time.sleep(delay)


def _is_storage_exception(exc: BaseException) -> bool:
  """OSError (gcsfs's 403, 404, 412), ValueError (its 400), gcsfs's HttpError
  (a bare Exception) and the transport errors: what a storage call raises."""
  if isinstance(exc, (OSError, ValueError, *_transport_errors())):
    return True
  try:
    from gcsfs.retry import HttpError  # noqa: PLC0415
  except ImportError:  # pragma: no cover
    return False
  return isinstance(exc, HttpError)


def translate(exc: BaseException, *, what: str, path: epath.PathLike) -> BaseException:
  """The error to raise for `exc` from a storage call we do not drive
  ourselves (Orbax's upload, which retries through its own clients).

  Args:
    exc: what the call raised.
    what: the operation, for the message ("uploading step 4 to").
    path: what it worked on.

  Returns:
    For a storage failure, a StorageError naming the operation and, on GCS,
    the bucket (off GCS: an OSError, or tensorstore's status error such as
    RESOURCE_EXHAUSTED for a full disk); anything else (a barrier timeout, a
    bug) unchanged.
  """
  if isinstance(exc, StorageError):
    return exc
  if not is_gcs(path):
    return _translate_local(exc, what=what, path=path)
  if not _is_storage_exception(exc):
    return exc
  bucket = bucket_of(path)
  if classify(exc) == TRANSIENT:
    detail = "transient errors outlasted the client's own retries"
    hint = " Check the bucket's availability and the network."
  else:
    detail = "a permanent error; not retried"
    hint = _hint(exc)
  return StorageError(
    f"{what} {os.fspath(path)} failed on GCS bucket {bucket!r}: {_brief(exc)} ({detail}).{hint}"
  )


# tensorstore's errors off GCS: a ValueError whose text starts with an absl
# status code (e.g. 'RESOURCE_EXHAUSTED: Error writing ... No space left on
# device [os_error_code=28]'); other ValueErrors are bugs, left unchanged
_TS_STORAGE_CODES = (
  "RESOURCE_EXHAUSTED",
  "PERMISSION_DENIED",
  "UNAVAILABLE",
  "DATA_LOSS",
  "NOT_FOUND",
  "ABORTED",
  "OUT_OF_RANGE",  # a file size limit (EFBIG)
)
_FULL = ("No space left on device", "RESOURCE_EXHAUSTED", "Disk quota exceeded", "File too large")
_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _translate_local(exc: BaseException, *, what: str, path: epath.PathLike) -> BaseException:
  """translate() off GCS: an OSError or tensorstore's storage status error
  becomes a StorageError naming the operation, the path and, for a full
  disk or a permission error, what to do."""
  text = str(exc)
  storage = isinstance(exc, OSError) or (
    isinstance(exc, ValueError) and text.startswith(_TS_STORAGE_CODES)
  )
  if not storage:
    return exc
  if getattr(exc, "errno", None) in _FULL_ERRNOS or any(k in text for k in _FULL):
    hint = (
      " The filesystem holding it is full (or a file size limit was hit): free space there or lower"
      " persistent.max_to_keep (the next persistent step tries again)."
    )
  elif isinstance(exc, PermissionError) or "PERMISSION_DENIED" in text:
    hint = " Check that this process may write there (owner and mode)."
  else:
    hint = ""
  return StorageError(f"{what} {os.fspath(path)} failed: {_brief(exc)}.{hint}")
