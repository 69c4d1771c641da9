"""Non-tensor state: one JSON file per process per step, and a COMMIT marker.

Layout (under the persistent directory's state/, so it survives losing any
ramdisk; names in layout.py):
  <root>/<step>/process_<i>-of-<n>.json   {"data_state": ..., "crc32": ...}
  <root>/<step>/SHARDS                    persistent steps: the shard table (checksums.py)
  <root>/<step>/COMMIT                    written by the primary process last

A step's state is committed iff its COMMIT record is valid (one small read
per step, no listing: at thousands of processes a step folder holds
thousands of files). That is safe because the primary writes COMMIT only
after it saw every file, delete() removes COMMIT first, and every process
verifies its own file where it is read (restore): a file missing, torn or
edited after COMMIT makes restore skip the step, never load it. Each file
carries a CRC32 of its payload, checked on read. Offline tools (`emergency-ckpt
verify`, `gc`) ask fully_committed(): COMMIT valid and every file it lists
present (one listing of the step folder). Writes are atomic: a rename on
filesystems, a single-object upload on GCS.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import logging
import math
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from etils import epath

from emergency_ckpt.core import failpoints, layout, storage
from emergency_ckpt.errors import CorruptCheckpointError, DataStateError, StorageError
from emergency_ckpt.persistent import checksums

logger = logging.getLogger("emergency_ckpt")

FORMAT = "emergency_ckpt.state/1"
READ_THREADS = 16  # COMMIT records read at once (on GCS each is a round-trip)


def _find_bad(value: Any, where: str) -> str | None:
  if value is None or isinstance(value, (str, bool, int)):
    return None
  if isinstance(value, float):
    return None if math.isfinite(value) else f"{where} (non-finite float {value})"
  if isinstance(value, dict):
    for k, v in value.items():
      if not isinstance(k, str):
        return f"{where}[{k!r}] (key is {type(k).__name__}, must be str)"
      bad = _find_bad(v, f"{where}[{k!r}]")
      if bad:
        return bad
    return None
  if isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      bad = _find_bad(v, f"{where}[{i}]")
      if bad:
        return bad
    return None
  return f"{where} (a {type(value).__name__})"


def validate_data_state(data_state: Any) -> None:
  """Raises DataStateError naming the first value JSON cannot hold exactly."""
  if data_state is None:
    return
  if not isinstance(data_state, dict):
    raise DataStateError(
      f"data_state must be a dict of JSON values or None, got a"
      f" {type(data_state).__name__}. Use e.g. {{'iterator': it.get_state()}}."
    )
  bad = _find_bad(data_state, "data_state")
  if bad:
    raise DataStateError(
      f"data_state is not JSON-serialisable at {bad}. Convert it to str, int,"
      " float, bool, None, list or dict (numpy scalars: .item(); bytes: base64)."
    )


OBJECT_KEY = "__ec_get_state__"


def encode_data_state(source: Any) -> dict | None:
  """What save(data_state=...) stores: a dict (or None) as it is; for an
  object with get_state() (a grain iterator, say), its state, wrapped so
  that bytes survive JSON. Raises DataStateError naming what cannot be stored."""
  if source is None or isinstance(source, dict):
    validate_data_state(source)
    return source
  get_state = getattr(source, "get_state", None)
  if not callable(get_state):
    raise DataStateError(
      f"data_state must be a dict of JSON values, None, or an object with"
      f" get_state()/set_state() (like a grain iterator); got a {type(source).__name__}."
    )
  value = get_state()
  if isinstance(value, (bytes, bytearray)):
    return {OBJECT_KEY: {"bytes_b64": base64.b64encode(bytes(value)).decode()}}
  bad = _find_bad(value, f"{type(source).__name__}.get_state()")
  if bad:
    raise DataStateError(
      f"data_state is not JSON-serialisable at {bad}. Return str, int, float,"
      " bool, None, list, dict or bytes from get_state()."
    )
  return {OBJECT_KEY: {"json": value}}


def decode_data_state(stored: Any) -> Any:
  """Inverse of encode_data_state: an object's state comes back as get_state()
  returned it (bytes included); a dict as it was saved."""
  if isinstance(stored, dict) and set(stored) == {OBJECT_KEY}:
    wrapped = stored[OBJECT_KEY]
    if "bytes_b64" in wrapped:
      return base64.b64decode(wrapped["bytes_b64"])
    return wrapped["json"]
  return stored


def _concurrently(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
  """[fn(x) for x in items], READ_THREADS at once (a pool for this call only;
  none for a single item). The first exception raised propagates."""
  items = list(items)
  if len(items) <= 1:
    return [fn(x) for x in items]
  with concurrent.futures.ThreadPoolExecutor(min(READ_THREADS, len(items)), "ec-state") as pool:
    return list(pool.map(fn, items))


_canonical = checksums.canonical  # the bytes a file's CRC32 covers


def _read_verified(path: epath.Path, step: int, key: str, crc_key: str) -> Any:
  """doc[key] of the state file at `path`, checked against its CRC32 in
  doc[crc_key] (and its format and step). CorruptCheckpointError if the file
  is missing, torn or edited; StorageError if the bucket is unreachable."""
  try:
    doc = json.loads(storage.read_bytes(path))
    value = doc[key]
    ok = (
      doc.get("format") == FORMAT
      and doc.get("step") == step
      and zlib.crc32(_canonical(value)) == doc.get(crc_key)
    )
  except FileNotFoundError:
    raise CorruptCheckpointError(f"{path} is missing") from None
  except StorageError:
    raise
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CorruptCheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
  if not ok:
    raise CorruptCheckpointError(f"{path} fails its checksum (torn or edited)")
  return value


class StateStore:
  """The JSON-per-process store under one root (local path or gs://)."""

  def __init__(self, root: epath.PathLike, *, process_index: int, process_count: int):
    self.root = epath.Path(root)
    self._me = process_index
    self._n = process_count
    self._known_commits: dict[int, dict] = {}
    """Valid COMMIT records read so far (see committed_records)."""

  def step_dir(self, step: int) -> epath.Path:
    return layout.state_step_dir(self.root, step)

  def write(self, step: int, data_state: dict | None, shard_crc32c: dict | None = None) -> None:
    """Writes this process's file for `step`. Called by: every process.
    `shard_crc32c`: at a persistent step, on the primary slice, the CRC32C
    of each shard this process holds (checksums.snapshot_crcs)."""
    failpoints.hit("state.before_write", step)
    d = self.step_dir(step)
    d.mkdir(parents=True, exist_ok=True)
    doc = {
      "format": FORMAT,
      "step": step,
      "process_index": self._me,
      "process_count": self._n,
      "data_state": data_state,
      "crc32": zlib.crc32(_canonical(data_state)),
    }
    if shard_crc32c is not None:
      doc["shard_crc32c"] = shard_crc32c
      doc["shard_crc32c_crc32"] = zlib.crc32(_canonical(shard_crc32c))
    storage.write_bytes(d / layout.state_file_name(self._me, self._n), json.dumps(doc).encode())

  def write_shard_table(self, step: int, table: dict) -> None:
    """Writes the SHARDS file of a persistent step (checksums.shard_table).
    Called by: the primary process, before commit()."""
    d = self.step_dir(step)
    d.mkdir(parents=True, exist_ok=True)
    storage.write_bytes(d / layout.SHARD_TABLE_FILE, json.dumps(table).encode())

  def expected_crcs(self, step: int, count: int) -> checksums.Expected:
    """The recorded shard checksums of persistent step `step` (saved by
    `count` processes): reads its SHARDS file now (CorruptCheckpointError if
    absent or damaged) and the JSONs of the recording processes as needed,
    READ_THREADS at once. Called by: any process reading the step."""
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
    except (OSError, ValueError) as e:
      raise CorruptCheckpointError(f"{path} is unreadable ({e})") from None
    table = checksums.parse_table(doc, step, path)

    def fetch(processes: list[int]) -> dict:
      docs = _concurrently(lambda p: self._shard_crcs(step, p, count), processes)
      return dict(zip(processes, docs))

    return checksums.Expected(step, table, fetch, str(self.step_dir(step)))

  def _shard_crcs(self, step: int, process: int, count: int) -> dict:
    path = self.step_dir(step) / layout.state_file_name(process, count)
    raw = _read_verified(path, step, "shard_crc32c", "shard_crc32c_crc32")
    return checksums.parse_crcs(raw, path)

  def missing(self, step: int, count: int | None = None) -> list[int]:
    """Processes whose file for `step` is absent: one fresh listing of the
    step's folder (storage.list_names; gcsfs pages it, 1,000 names a page).
    Called by: the primary's commit(), and fully_committed() (offline tools)."""
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
    """Writes COMMIT once every process's file exists. Called by: the primary
    process only. Blocks (polling) up to `timeout_s`; False if it gave up.

    `written(timeout_s)`: a hint that every process wrote its file (the
    coordination service's counter, so the primary does not list the folder
    over and over while thousands of files arrive); waited for first, then
    the listing decides (normally once per commit; polled as before if the
    hint was wrong or timed out). The COMMIT record also holds the step's
    `metrics` (for keep_best and best_step) and `info` (topology, bytes,
    save time) for metadata()."""
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
    marker = {
      "format": FORMAT,
      "step": step,
      "process_count": self._n,
      "files": [layout.state_file_name(p, self._n) for p in range(self._n)],
      "committed_at": time.time(),
      "metrics": metrics or {},
      "info": info or {},
    }
    storage.write_bytes(self.step_dir(step) / layout.COMMIT_FILE, json.dumps(marker).encode())
    return True

  def record(self, step: int) -> dict | None:
    """The COMMIT record of `step` (process_count, files, metrics, info,
    committed_at), or None if it has no valid COMMIT (its files may still
    be missing: see fully_committed). An unreachable bucket raises StorageError."""
    try:
      doc = json.loads(storage.read_bytes(self.step_dir(step) / layout.COMMIT_FILE))
    except FileNotFoundError:
      return None
    except StorageError:
      raise  # an unreachable bucket is not "uncommitted"
    except (OSError, ValueError):
      return None
    if not isinstance(doc, dict):
      return None
    count = doc.get("process_count")
    valid = (
      doc.get("format") == FORMAT
      and doc.get("step") == step
      and isinstance(count, int)
      and not isinstance(count, bool)
      and count >= 1
    )
    return doc if valid else None

  def saved_process_count(self, step: int) -> int | None:
    """How many processes saved `step` (from its COMMIT), or None if uncommitted."""
    marker = self.record(step)
    return None if marker is None else marker["process_count"]

  def listed_steps(self) -> list[int]:
    """Every step folder, committed or not, oldest first (other names ignored).
    One listing of the root (one entry per step, not per file)."""
    steps = layout.steps_of_names(storage.list_names(self.root))
    listed = set(steps)
    for step in [s for s in self._known_commits if s not in listed]:
      del self._known_commits[step]  # deleted (maybe by another tool, e.g. gc)
    return steps

  def committed_records(self, steps: Iterable[int] | None = None) -> dict[int, dict]:
    """{step: COMMIT record} of the committed steps (valid COMMIT), oldest
    first. Called by: the primary process (inventory at restore, retention,
    the cleanup after restore). Blocks on one listing of the root (none if
    the caller passes the `steps` it listed) and one small read per step,
    READ_THREADS at once; never lists a step's folder (see the module
    docstring for why COMMIT alone is enough; fully_committed_records() also
    checks the files)."""
    steps = sorted(set(self.listed_steps() if steps is None else steps))
    # A valid COMMIT never changes until delete(): read each step's once.
    known = self._known_commits
    unread = [s for s in steps if s not in known]
    for step, record in zip(unread, _concurrently(self.record, unread)):
      if record is not None:
        known[step] = record
    return {s: known[s] for s in steps if s in known}

  def committed_steps(self, steps: Iterable[int] | None = None) -> list[int]:
    """Steps whose COMMIT is valid, oldest first (see committed_records)."""
    return list(self.committed_records(steps))

  def has_commit(self, step: int) -> bool:
    """`step` has a valid COMMIT (one small read, no listing): what local
    retention asks after every save on every process, so it must not list a
    folder of one file per process. The files COMMIT names are checked where
    they are read (restore) and by fully_committed()."""
    return self.record(step) is not None

  def is_committed(self, step: int) -> bool:
    """Same as has_commit (one small read, no listing). Called by: the
    primary process (metadata())."""
    return self.has_commit(step)

  def fully_committed(self, step: int) -> bool:
    """COMMIT valid and every file it lists present: one read and one
    listing of the step's folder (paged: 1,000 names a page on GCS). Called
    by: offline tools (`emergency-ckpt verify`, `gc`), never on a job's path."""
    marker = self.record(step)
    return marker is not None and not self.missing(step, marker["process_count"])

  def fully_committed_records(self, steps: Iterable[int] | None = None) -> dict[int, dict]:
    """{step: COMMIT record} of the steps that are fully_committed(), oldest
    first: what the offline tools (persistent_layout.scan) report and
    collect by. One listing per step folder, several steps at once."""
    records = self.committed_records(steps)
    full = _concurrently(lambda s: not self.missing(s, records[s]["process_count"]), records)
    return {s: r for (s, r), ok in zip(records.items(), full) if ok}

  def read(self, step: int, process: int | None = None, count: int | None = None) -> dict | None:
    """This process's (or `process`'s) data_state of `step`, checksum-verified.

    Raises CorruptCheckpointError if the file is missing, torn or edited.
    """
    process = self._me if process is None else process
    count = self._n if count is None else count
    path = self.step_dir(step) / layout.state_file_name(process, count)
    return _read_verified(path, step, "data_state", "crc32")

  def delete(self, step: int) -> None:
    """Removes a step's state, COMMIT first. Called by: the primary process."""
    d = self.step_dir(step)
    self._known_commits.pop(step, None)
    storage.unlink(d / layout.COMMIT_FILE)
    storage.rmtree(d)


class SavedDataStates(Mapping):
  """{saved process index: its data state (decoded)} of one committed step,
  each file read and verified when first accessed (then kept): what
  CheckpointManager.restore's data_state_remap receives. Read-only."""

  def __init__(self, store: StateStore, step: int, count: int):
    self._store, self._step, self._count = store, step, count
    self._read: dict[int, Any] = {}

  def __getitem__(self, process: int) -> Any:
    if not isinstance(process, int) or not 0 <= process < self._count:
      raise KeyError(process)
    if process not in self._read:
      stored = self._store.read(self._step, process=process, count=self._count)
      self._read[process] = decode_data_state(stored)
    return self._read[process]

  def __iter__(self):
    return iter(range(self._count))

  def __len__(self) -> int:
    return self._count
