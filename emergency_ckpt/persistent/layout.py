"""The persistent root's storage rules, without JAX or Orbax.

Which tensor steps Orbax finalized (its own rule, reimplemented: on GCS a
step is final once its commit file exists, on a filesystem once renamed to
its number), waiting for finalization, deleting a step so that no listing
ever sees it half-deleted, a step's size, the cleanup of what crashed saves
left, and `scan`: the one reader of a whole persistent root (tensor steps,
state steps, COMMIT records, run.json) for the CLI. Names come from
core/layout.py; persistent/tier.py wraps Orbax and calls these.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from etils import epath

from emergency_ckpt.core import gcs_retry, layout, storage
from emergency_ckpt.errors import CorruptCheckpointError, StorageError
from emergency_ckpt.local import schema
from emergency_ckpt.state.store import StateStore

logger = logging.getLogger("emergency_ckpt")

_PROBE_THREADS = 16
"""Commit-file probes in flight at once when listing a GCS tensors/ folder."""


def is_finalized(step_dir: epath.PathLike) -> bool:
  """Whether Orbax finalized a tensor step.

  Orbax's rule: on GCS a step is final once its commit file exists; on a
  filesystem once it was renamed from its temporary name to its number.

  Args:
    step_dir: the step's folder under tensors/.

  Returns:
    True if the step is final.
  """
  step_dir = epath.Path(step_dir)
  if gcs_retry.is_gcs(step_dir):
    return storage.exists(step_dir / layout.GCS_COMMIT_FILE)
  return layout.step_of_name(step_dir.name) is not None and step_dir.exists()


def list_steps(directory: epath.PathLike) -> list[int]:
  """Finalized steps under a tensors/ folder. Any process may call it.

  A filesystem is listed directly (Orbax's checkpoint_steps starts a thread
  pool per call, which is slow on busy cores, and every process then waits
  for the slowest in the inventory exchange). On GCS one fresh listing, then
  one probe of each step's commit file, several at once (as Orbax's
  checkpoint_steps does).

  Args:
    directory: the tensors/ folder.

  Returns:
    The finalized steps, oldest first.
  """
  directory = epath.Path(directory)
  if gcs_retry.is_gcs(directory):
    candidates = layout.steps_of_names(storage.list_names(directory))
    if len(candidates) <= 1:
      return [s for s in candidates if is_finalized(layout.tensor_step_dir(directory, s))]
    with concurrent.futures.ThreadPoolExecutor(min(_PROBE_THREADS, len(candidates))) as pool:
      final = pool.map(lambda s: is_finalized(layout.tensor_step_dir(directory, s)), candidates)
      return [s for s, ok in zip(candidates, list(final)) if ok]
  if not directory.exists():
    return []
  steps = ((layout.step_of_name(p.name), p) for p in directory.iterdir())
  return sorted(s for s, p in steps if s is not None and p.is_dir())


def wait_finalized(
  directory: epath.PathLike,
  step: int,
  timeout_s: float,
  failed: Callable[[], bool] = lambda: False,
) -> bool:
  """Polls until a step is finalized, its upload failed, or a timeout.

  Orbax runs its post-finalization callback BEFORE its rename / commit
  file: the step is not final then, and normally is shortly after. Polls
  every 10-50 ms for the first 2 s (one existence check each: the step is
  durable no later than 50 ms after Orbax finalized it), then backing off
  to 0.5 s.

  Args:
    directory: the tensors/ folder.
    step: the step.
    timeout_s: how long to poll.
    failed: whether the step's upload failed: once True, a step not
      finalized never will be (a finalize that failed after Orbax's
      callback, e.g. a full disk).

  Returns:
    True once finalized; False once its upload failed without it, or
    after `timeout_s`.
  """
  step_dir = layout.tensor_step_dir(directory, step)
  start = time.monotonic()
  deadline = start + timeout_s
  poll = 0.01
  while not is_finalized(step_dir):
    if failed() and not is_finalized(step_dir):
      return False
    if time.monotonic() > deadline:
      return False
    time.sleep(poll)
    poll = min(poll * 2, 0.05 if time.monotonic() - start < 2.0 else 0.5)
  return True


def delete_step(directory: epath.PathLike, step: int) -> None:
  """Deletes one tensor step so that no listing ever sees it half-deleted as finalized.

  On GCS the commit file goes first, on a filesystem the folder is renamed
  out of the step namespace first. Called by: one process.

  Args:
    directory: the tensors/ folder.
    step: the step.
  """
  step_dir = layout.tensor_step_dir(directory, step)
  if gcs_retry.is_gcs(step_dir):
    storage.unlink(step_dir / layout.GCS_COMMIT_FILE)
    storage.rmtree(step_dir)
    return
  if not step_dir.exists():
    return
  doomed = step_dir.parent / layout.deleting_tensor_name(step)
  os.rename(os.fspath(step_dir), os.fspath(doomed))
  doomed.rmtree()


def step_bytes(directory: epath.PathLike, step: int) -> int | None:
  """Total size of a tensor step's files.

  Args:
    directory: the tensors/ folder.
    step: the step.

  Returns:
    The size in bytes, or None if the step is absent.
  """
  step_dir = layout.tensor_step_dir(directory, step)
  storage.forget_listings(step_dir)
  if not step_dir.exists():
    return None
  if gcs_retry.is_gcs(step_dir):
    fs = epath.backend.fsspec_backend.fs(os.fspath(step_dir))
    return int(fs.du(os.fspath(step_dir), total=True))
  return sum(
    os.path.getsize(os.path.join(root, name))
    for root, _, files in os.walk(os.fspath(step_dir))
    for name in files
  )


def cleanup_unfinalized(directory: epath.PathLike) -> list[str]:
  """Removes what crashed saves and deletions left under tensors/.

  That is step folders Orbax never finalized, its temporary folders, and
  half-done deletions; finalized steps are never touched. Called by: the
  primary process, before any save of this job.

  Args:
    directory: the tensors/ folder.

  Returns:
    The names removed.
  """
  directory = epath.Path(directory)
  removed = []
  for name in storage.list_names(directory):
    entry = directory / name
    partial = layout.is_partial_tensor_name(name) or (
      layout.step_of_name(name) is not None and entry.is_dir() and not is_finalized(entry)
    )
    if partial:
      storage.rmtree(entry) if entry.is_dir() else storage.unlink(entry)
      removed.append(name)
  if removed:
    logger.warning("removed partial persistent saves left by a crash: %s", sorted(removed))
  return removed


# ---- a whole root, for tools ----------------------------------------------------------
def looks_persistent(root: epath.PathLike) -> bool:
  """Whether a root holds a persistent layout (tensors/, state/ or run.json).

  Args:
    root: the folder (path or gs://).

  Returns:
    True if any of the three exists.
  """
  root = epath.Path(root)
  return any(
    storage.exists(p)
    for p in (layout.state_dir(root), layout.tensors_dir(root), layout.run_file(root))
  )


def write_run_info(root: epath.PathLike, info: Mapping[str, Any]) -> None:
  """Writes run.json, creating the root. Called by: the primary process, when its manager starts.

  Args:
    root: the persistent root.
    info: which run and topology own the root, the save intervals (read by
      `emergency-ckpt gc` and `inspect`).
  """
  root = epath.Path(root)
  root.mkdir(parents=True, exist_ok=True)
  storage.write_bytes(layout.run_file(root), json.dumps(dict(info), indent=1).encode())


def read_run_info(root: epath.PathLike) -> dict[str, Any] | None:
  """run.json's record.

  Args:
    root: the persistent root.

  Returns:
    The record (run_id, topology, save intervals), or None if run.json is
    absent or unreadable.

  Raises:
    StorageError: the bucket is unreachable.
  """
  try:
    doc = json.loads(storage.read_bytes(layout.run_file(root)))
  except StorageError as e:
    if isinstance(e, FileNotFoundError):
      return None
    raise
  except (OSError, ValueError, RecursionError):
    return None
  try:  # a field of another type: as unreadable
    for key, kind in (("run_id", str), ("topology", dict), ("persistent_save_interval_steps", int)):
      schema.field(doc, key, (kind, type(None)), "run.json", None)
  except CorruptCheckpointError:
    return None
  return doc


@dataclasses.dataclass(frozen=True, kw_only=True)
class PersistentListing:
  """One persistent root, read once."""

  root: epath.Path
  tensor_steps: tuple[int, ...]
  """Finalized tensor steps, oldest first."""
  state_steps: tuple[int, ...]
  """Every `state/<N>` folder, committed or not, oldest first."""
  records: Mapping[int, dict]
  """{step: COMMIT record} of the committed state steps (metrics, info)."""
  run: Mapping[str, Any] | None
  """run.json's record, or None."""

  @property
  def committed(self) -> frozenset[int]:
    """State steps whose COMMIT is valid and whose files are all present."""
    return frozenset(self.records)

  @property
  def metrics(self) -> dict[int, dict]:
    """{step: metrics} from the COMMIT records that carry a metrics dict."""
    out = {}
    for step, record in self.records.items():
      values = record.get("metrics")
      if isinstance(values, dict):
        out[step] = values
    return out

  @property
  def run_id(self) -> str | None:
    """run.json's run_id, or None."""
    run_id = (self.run or {}).get("run_id")
    return run_id if isinstance(run_id, str) else None

  @property
  def persistent_interval(self) -> int | None:
    """run.json's persistent save interval (written by the manager), or None."""
    value = (self.run or {}).get("persistent_save_interval_steps")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

  def state_store(self) -> StateStore:
    """A reader of this root's state store (deletes too; writes nothing else).

    Returns:
      reader_store(root).
    """
    return reader_store(self.root)


def reader_store(root: epath.PathLike) -> StateStore:
  """The state store of a persistent root, for a tool that only reads and deletes.

  Args:
    root: the persistent root.

  Returns:
    A StateStore of its state/ folder.
  """
  return StateStore(layout.state_dir(root), process_index=0, process_count=1)


def scan(root: epath.PathLike) -> PersistentListing:
  """THE reader of a whole persistent root.

  Args:
    root: the persistent root (path or gs://).

  Returns:
    Its finalized tensor steps, state steps and their COMMIT records, and
    run.json.
  """
  root = epath.Path(root)
  tensors = layout.tensors_dir(root)
  store = reader_store(root)
  state_steps = store.listed_steps()
  return PersistentListing(
    root=root,
    tensor_steps=tuple(list_steps(tensors)),
    state_steps=tuple(state_steps),
    # Offline: every file a COMMIT lists is checked too (a job trusts COMMIT
    # alone and verifies each file where it reads it).
    records=store.fully_committed_records(state_steps),
    run=read_run_info(root),
  )
