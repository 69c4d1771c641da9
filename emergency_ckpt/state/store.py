"""Non-tensor state: one JSON file per process per step, and a COMMIT marker.

Layout (under the persistent directory's state/, so it survives losing any
ramdisk; names in core/layout.py):
  <root>/<step>/process_<i>-of-<n>.json   {"data_state": ..., "crc32": ...}
  <root>/<step>/SHARDS                    persistent steps: the shard table (shard_records.py)
  <root>/<step>/COMMIT                    written by the primary process last

A step's state is committed iff its COMMIT record is valid (one small read
per step, no listing: at thousands of processes a step folder holds
thousands of files). That is safe because the primary writes COMMIT only
after it saw every file, delete() removes COMMIT first, and every process
verifies its own file where it is read (restore): a file missing, torn or
edited after COMMIT makes restore skip the step, never load it (each file
carries a CRC32 of its payload: format.py). Offline tools (`emergency-ckpt
verify`, `gc`) ask fully_committed(): COMMIT valid and every file it lists
present (one listing of the step folder). Writes are atomic: a rename on
filesystems, a single-object upload on GCS. What data_state may hold is
data_state.py's.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from etils import epath

from emergency_ckpt.core import failpoints, layout, storage
from emergency_ckpt.errors import CorruptCheckpointError, StorageError
from emergency_ckpt.state import format as state_format
from emergency_ckpt.state import shard_records

logger = logging.getLogger("emergency_ckpt")

READ_THREADS = 16  # COMMIT records read at once (on GCS each is a round-trip)


def _concurrently(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
  """[fn(x) for x in items], READ_THREADS at once (a pool for this call only;
  none for a single item). The first exception raised propagates."""
  items = list(items)
  if len(items) <= 1:
    return [fn(x) for x in items]
  with concurrent.futures.ThreadPoolExecutor(min(READ_THREADS, len(items)), "ec-state") as pool:
    return list(pool.map(fn, items))


def _read_verified(path: epath.Path, step: int, key: str, crc_key: str) -> Any:
  """doc[key] of the state file at `path`, checked against its CRC32 in
  doc[crc_key] (and its format and step). CorruptCheckpointError if the file
  is missing, torn or edited; StorageError if the bucket is unreachable."""
  try:
    raw = storage.read_bytes(path)
  except FileNotFoundError:
    raise CorruptCheckpointError(f"{path} is missing") from None
  except StorageError:
    raise
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CorruptCheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
  return state_format.decode_verified(raw, step, key, crc_key, path)


def _parsed(parse: Callable[..., Any], *args: Any) -> Any:
  """parse(*args), whose last argument names the file: any error of the
  document's shape (a list for an object, an infinite index) is damage,
  CorruptCheckpointError naming the file, never an untyped error."""
  try:
    return parse(*args)
  except (ArithmeticError, AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
    raise CorruptCheckpointError(f"{args[-1]} is malformed ({type(e).__name__}: {e})") from None


class StateStore:
  """The JSON-per-process store under one root (local path or gs://).

  Args:
    root: the store's root (the persistent directory's state/).
    process_index: this process's index (names the file it writes).
    process_count: the job's process count (names the files, and how many
      a step needs before it commits).
  """

  def __init__(self, root: epath.PathLike, *, process_index: int, process_count: int):
    self.root = epath.Path(root)
    self._me = process_index
    self._n = process_count
    self._known_commits: dict[int, dict] = {}
    """Valid COMMIT records read so far (see committed_records)."""

  def step_dir(self, step: int) -> epath.Path:
    """The folder of a step's state: <root>/<step>.

    Args:
      step: the step.

    Returns:
      The folder's path.
    """
    return layout.state_step_dir(self.root, step)

  def write(self, step: int, data_state: dict | None, shard_crc32c: dict | None = None) -> None:
    """Writes this process's file for a step. Called by: every process.

    Args:
      step: the step saved.
      data_state: the encoded data state (data_state.encode_data_state).
      shard_crc32c: at a persistent step, on the primary slice, the CRC32C
        of each shard this process holds (checksums.snapshot_crcs); else None.
    """
    failpoints.hit("state.before_write", step)
    d = self.step_dir(step)
    d.mkdir(parents=True, exist_ok=True)
    doc = state_format.encode_process_file(step, self._me, self._n, data_state, shard_crc32c)
    storage.write_bytes(d / layout.state_file_name(self._me, self._n), doc)

  def write_shard_table(self, step: int, table: dict) -> None:
    """Writes the SHARDS file of a persistent step. Called by: the primary, before commit().

    Args:
      step: the persistent step.
      table: its SHARDS document (checksums.shard_table).
    """
    d = self.step_dir(step)
    d.mkdir(parents=True, exist_ok=True)
    storage.write_bytes(d / layout.SHARD_TABLE_FILE, json.dumps(table).encode())

  def expected_crcs(self, step: int, count: int) -> shard_records.Expected:
    """The recorded shard checksums of a persistent step. Called by: any process reading it.

    Reads its SHARDS file now, and the JSONs of the recording processes as
    needed, READ_THREADS at once.

    Args:
      step: the persistent step.
      count: how many processes saved it.

    Returns:
      The step's recorded checksums.

    Raises:
      CorruptCheckpointError: the SHARDS file is absent or damaged.
      StorageError: the bucket is unreachable.
    """
    path = self.step_dir(step) / layout.SHARD_TABLE_FILE
    try:
      doc = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
      raise CorruptCheckpointError(
        f"{path} is missing: persistent step {step} has no shard checksums and cannot be"
        " verified. Restore another step."
      ) from None
    except StorageError:
      raise
    except (OSError, ValueError, RecursionError) as e:
      raise CorruptCheckpointError(f"{path} is unreadable ({e})") from None
    table = _parsed(shard_records.parse_table, doc, step, path)

    def fetch(processes: list[int]) -> dict:
      docs = _concurrently(lambda p: self._shard_crcs(step, p, count), processes)
      return dict(zip(processes, docs))

    return shard_records.Expected(step, table, fetch, str(self.step_dir(step)))

  def _shard_crcs(self, step: int, process: int, count: int) -> dict:
    path = self.step_dir(step) / layout.state_file_name(process, count)
    raw = _read_verified(path, step, "shard_crc32c", "shard_crc32c_crc32")
    return _parsed(shard_records.parse_crcs, raw, path)

  def missing(self, step: int, count: int | None = None) -> list[int]:
    """Processes whose file for a step is absent: one fresh listing of its folder.

    storage.list_names pages the listing on GCS. Called by: the primary's
    commit(), and fully_committed() (offline tools).

    Args:
      step: the step.
      count: how many processes saved it; None: this job's process count.

    Returns:
      The missing processes' indices, ascending.
    """
    count = self._n if count is None else count
    present = set(storage.list_names(self.step_dir(step)))  # fresh: others write here
    return [p for p in range(count) if layout.state_file_name(p, count) not in present]

  def commit(
    self,
    step: int,
    *,
    timeout_s: float,
    poll_s: float = 0.05,
    metrics: dict | None = None,
    info: dict | None = None,
    written: Callable[[float], bool] | None = None,
  ) -> bool:
    """Writes COMMIT once every process's file exists, polling up to `timeout_s`.

    Called by: the primary process only.

    Args:
      step: the step to commit.
      timeout_s: how long to wait for the files.
      poll_s: the first wait between listings (it grows).
      metrics: the step's metrics, kept in the record (keep_best, best_step).
      info: topology, bytes and save time, kept in the record (metadata()).
      written: a hint that every process wrote its file (the coordination
        service's counter, so the primary does not list the folder over and
        over while thousands of files arrive), given `timeout_s`; waited for
        first, then the listing decides (normally once per commit; polled as
        before if the hint was wrong or timed out).

    Returns:
      True if committed; False if it gave up (the step stays unrestorable).
    """
    deadline = time.monotonic() + timeout_s
    if written is not None:
      written(timeout_s)
    while True:
      missing = self.missing(step)
      if not missing:
        break
      if time.monotonic() > deadline:
        logger.warning(
          "state of step %d not committed: processes %s never wrote their"
          " JSON within %.0fs; the step stays unrestorable.",
          step,
          missing,
          timeout_s,
        )
        return False
      time.sleep(poll_s)
      poll_s = min(poll_s * 1.5, 2.0)
    failpoints.hit("state.before_commit", step)
    marker = state_format.encode_commit(
      step, self._n, committed_at=time.time(), metrics=metrics or {}, info=info or {}
    )
    storage.write_bytes(self.step_dir(step) / layout.COMMIT_FILE, marker)
    failpoints.hit("state.after_commit", step)
    return True

  def record(self, step: int) -> dict | None:
    """The COMMIT record of a step.

    Args:
      step: the step.

    Returns:
      Its record (process_count, files, metrics, info, committed_at), or
      None if it has no valid COMMIT (its files may still be missing: see
      fully_committed).

    Raises:
      StorageError: the bucket is unreachable.
    """
    try:
      raw = storage.read_bytes(self.step_dir(step) / layout.COMMIT_FILE)
    except FileNotFoundError:
      return None
    except StorageError:
      raise  # an unreachable bucket is not "uncommitted"
    except (OSError, ValueError):
      return None
    return state_format.decode_commit(raw, step)

  def saved_process_count(self, step: int) -> int | None:
    """How many processes saved a step, from its COMMIT.

    Args:
      step: the step.

    Returns:
      The count, or None if the step is uncommitted.
    """
    marker = self.record(step)
    return None if marker is None else marker["process_count"]

  def listed_steps(self) -> list[int]:
    """Every step folder, committed or not: one listing of the root.

    Returns:
      The steps, oldest first (other names are ignored).
    """
    steps = layout.steps_of_names(storage.list_names(self.root))
    listed = set(steps)
    for step in [s for s in self._known_commits if s not in listed]:
      del self._known_commits[step]  # deleted (maybe by another tool, e.g. gc)
    return steps

  def committed_records(self, steps: Iterable[int] | None = None) -> dict[int, dict]:
    """The COMMIT records of the committed steps (valid COMMIT).

    Called by: the primary process (inventory at restore, retention, the
    cleanup after restore). Blocks on one small read per step not read
    before, READ_THREADS at once; never lists a step's folder (the module
    docstring says why COMMIT alone is enough; fully_committed_records()
    also checks the files).

    Args:
      steps: the steps to ask about; None: one listing of the root.

    Returns:
      {step: COMMIT record}, oldest first.
    """
    steps = sorted(set(self.listed_steps() if steps is None else steps))
    # A valid COMMIT never changes until delete(): read each step's once.
    known = self._known_commits
    unread = [s for s in steps if s not in known]
    for step, record in zip(unread, _concurrently(self.record, unread)):
      if record is not None:
        known[step] = record
    return {s: known[s] for s in steps if s in known}

  def committed_steps(self, steps: Iterable[int] | None = None) -> list[int]:
    """Steps whose COMMIT is valid (see committed_records).

    Args:
      steps: the steps to ask about; None: one listing of the root.

    Returns:
      The committed steps, oldest first.
    """
    return list(self.committed_records(steps))

  def has_commit(self, step: int) -> bool:
    """Whether a step has a valid COMMIT: one small read, no listing.

    What local retention asks after every save on every process, so it must
    not list a folder of one file per process. The files COMMIT names are
    checked where they are read (restore) and by fully_committed().

    Args:
      step: the step.

    Returns:
      True if its COMMIT is valid.
    """
    return self.record(step) is not None

  def is_committed(self, step: int) -> bool:
    """Same as has_commit. Called by: the primary process (metadata()).

    Args:
      step: the step.

    Returns:
      True if its COMMIT is valid.
    """
    return self.has_commit(step)

  def fully_committed(self, step: int) -> bool:
    """Whether COMMIT is valid and every file it lists present.

    One read and one listing of the step's folder (paged on GCS). Called
    by: offline tools (`emergency-ckpt verify`, `gc`), never on a job's path.

    Args:
      step: the step.

    Returns:
      True if the step is fully committed.
    """
    marker = self.record(step)
    return marker is not None and not self.missing(step, marker["process_count"])

  def fully_committed_records(self, steps: Iterable[int] | None = None) -> dict[int, dict]:
    """The COMMIT records of the fully_committed() steps.

    What the offline tools (persistent_layout.scan) report and collect by.
    One listing per step folder, several steps at once.

    Args:
      steps: the steps to ask about; None: one listing of the root.

    Returns:
      {step: COMMIT record}, oldest first.
    """
    records = self.committed_records(steps)
    full = _concurrently(lambda s: not self.missing(s, records[s]["process_count"]), records)
    return {s: r for (s, r), ok in zip(records.items(), full) if ok}

  def read(self, step: int, process: int | None = None, count: int | None = None) -> dict | None:
    """A process's data_state of a step, checksum-verified.

    Args:
      step: the step.
      process: whose file; None: this process's.
      count: how many processes saved the step; None: this job's count.

    Returns:
      The stored (encoded) data state.

    Raises:
      CorruptCheckpointError: the file is missing, torn or edited.
      StorageError: the bucket is unreachable.
    """
    process = self._me if process is None else process
    count = self._n if count is None else count
    path = self.step_dir(step) / layout.state_file_name(process, count)
    return _read_verified(path, step, "data_state", "crc32")

  def delete(self, step: int) -> None:
    """Removes a step's state, COMMIT first. Called by: the primary process.

    Args:
      step: the step.
    """
    d = self.step_dir(step)
    self._known_commits.pop(step, None)
    storage.unlink(d / layout.COMMIT_FILE)
    storage.rmtree(d)
