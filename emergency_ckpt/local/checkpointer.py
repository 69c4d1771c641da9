"""Orbax's checkpointer over one process's local folder: synchronous, with
no process sync, barrier or shared Orbax state, and the tier's own names.

`LocalCheckpointer` drives the handler (handler.py) on the local tier's
writer thread. Against the plain writer thread it replaced, a save is
durable about as soon, with a small fixed cost per save, no extra stall, no
barrier and no thread (../shared/notes/orbax-local-handler.md). That holds
only with the settings here:
- every process is its own Orbax world (`primary_host=None`,
  `active_processes={this process}`, a per-process barrier prefix): each
  process sync in Orbax's checkpointer paths is skipped;
- `synchronize_next_awaitable_signal_operation_id` does nothing: Orbax's
  operation id is one counter per process, shared with the persistent
  tier's checkpointer, whose signal keys between processes carry it (the
  primary announces the step folder's creation under its id); a local save
  that moved it on one process only (uneven saves, or one racing the upload
  thread) made the persistent tier's barriers time out;
- a metadata store that writes nothing (no `_CHECKPOINT_METADATA`, no
  warnings) and `LocalTemporaryPath`: a `.tmp-<name>-<hex>` folder created
  0700, which the tier's start-up cleanup removes after a crash, finalized
  by one plain rename (no `commit_success.txt`).

Imports Orbax (through handler.py): the tier loads this module when it
first writes.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from emergency_ckpt.core import failpoints, layout
from emergency_ckpt.local.handler import LocalShardsHandler


# ---- the temporary folder ------------------------------------------------------------
def _tmp_name(final_name: str) -> str:
  step = layout.step_of_dir_name(final_name)
  if step is not None:
    return layout.tmp_step_dir_name(step)  # .tmp-step_<N>-<hex>
  return f"{layout.TMP_PREFIX}{final_name}-{os.urandom(4).hex()}"


def _final_name(tmp_name: str) -> str:
  if not tmp_name.startswith(layout.TMP_PREFIX) or "-" not in tmp_name[len(layout.TMP_PREFIX) :]:
    raise ValueError(f"{tmp_name!r} is not a local temporary folder (.tmp-<name>-<hex>)")
  return tmp_name[len(layout.TMP_PREFIX) :].rsplit("-", 1)[0]


class LocalTemporaryPath(ocp.path.atomicity.AtomicRenameTemporaryPath):
  """Orbax's atomic-rename protocol with the local tier's names: a save
  writes into `.tmp-<name>-<hex>` beside the final folder (a `.tmp-*` name:
  never listed as a step, removed by the tier's start-up cleanup), created
  0700, renamed into place once complete. Adds no file (no
  commit_success.txt, no step metadata) and starts no thread.

  Called by: Orbax's Checkpointer.save, on the saving thread."""

  @classmethod
  def from_final(
    cls,
    final_path: epath.PathLike,
    *,
    checkpoint_metadata_store: Any = None,
    file_options: Any = None,
    snapshot_type: Any = None,
  ) -> LocalTemporaryPath:
    """Returns the temporary path of a save into `final_path` (a fresh
    `.tmp-<name>-<hex>` beside it); the other arguments are Orbax's."""
    final = epath.Path(final_path)
    return cls(
      final.parent / _tmp_name(final.name),
      final,
      checkpoint_metadata_store=checkpoint_metadata_store,
      file_options=file_options,
    )

  @classmethod
  def from_temporary(
    cls, temporary_path: epath.PathLike, *, file_options: Any = None, snapshot_type: Any = None
  ) -> LocalTemporaryPath:
    """Returns the path object of an existing temporary folder (its final
    name read back from it); the other arguments are Orbax's.

    Raises:
      ValueError: `temporary_path` is no local temporary name.
    """
    tmp = epath.Path(temporary_path)
    return cls(tmp, tmp.parent / _final_name(tmp.name), file_options=file_options)

  @classmethod
  async def validate(cls, temporary_path: epath.PathLike) -> None:
    """Checks a temporary folder.

    Args:
      temporary_path: the folder.

    Raises:
      ValidationError: a link, no `.tmp-*` name, or no folder.
    """
    path = os.fspath(temporary_path)
    name = os.path.basename(path)
    if os.path.islink(path) or not layout.is_tmp_name(name) or not os.path.isdir(path):
      raise ocp.path.atomicity.ValidationError(f"{path} is not a local temporary folder")

  @classmethod
  async def validate_final(cls, final_path: epath.PathLike) -> None:
    """Checks a finished step folder.

    Args:
      final_path: the folder.

    Raises:
      ValidationError: a link, a temporary name, or no folder.
    """
    path = os.fspath(final_path)
    name = os.path.basename(path)
    if (
      os.path.islink(path)
      or layout.is_tmp_name(name)
      or layout.ORBAX_TMP_MARK in name
      or not os.path.isdir(path)
    ):
      raise ocp.path.atomicity.ValidationError(
        f"{path} is not a finished local step folder (a symlink, a temporary name, or no folder)"
      )

  async def create(self) -> epath.Path:
    """Creates the temporary folder, 0700.

    Returns:
      Its path.

    Raises:
      FileExistsError: it exists (its name is fresh: never expected).
    """
    os.mkdir(self.get(), 0o700)
    return self.get()

  async def finalize(self) -> None:
    """Renames the finished folder into place (the commit: the step is listed
    from now on).

    Raises:
      OSError: the final name is taken by a folder that is not empty.
    """
    failpoints.hit("local.before_rename", layout.step_of_dir_name(self.get_final().name))
    os.rename(self.get(), self.get_final())


# ---- the checkpointer ------------------------------------------------------------------
class LocalCheckpointer(ocp.Checkpointer):
  """A synchronous Orbax checkpointer for one process's own folder: no
  collective, no barrier, no thread, and Orbax's shared operation id left
  alone. save() on failure removes its temporary folder.

  Called by: the local tier's writer thread (save) and restoring threads
  (restore); blocks on the file I/O only."""

  def __init__(
    self,
    *,
    process_index: int,
    barrier_prefix: str = "ec_local",
    handler: LocalShardsHandler | None = None,
  ):
    """`process_index`: this process's index (Orbax's process_index(), i.e.
    jax.process_index()); it alone takes part in each save."""
    super().__init__(
      LocalShardsHandler() if handler is None else handler,
      multiprocessing_options=ocp.options.MultiprocessingOptions(
        primary_host=None,  # every process writes its own folder
        active_processes={process_index},  # so Orbax skips every process sync
        barrier_sync_key_prefix=f"{barrier_prefix}_p{process_index}",
      ),
      checkpoint_metadata_store=ocp.metadata.metadata_store(
        enable_write=False, blocking_write=True
      ),
      temporary_path_class=LocalTemporaryPath,
    )
    self._saving = threading.local()

  def synchronize_next_awaitable_signal_operation_id(self) -> None:
    """Does nothing. Orbax's version advances the process-wide operation id
    that the persistent tier's checkpointer puts in the keys its processes
    signal each other under: a local save on one process only (or one that
    raced the upload thread) would make them look for each other's signals
    under different ids, and the persistent barriers time out
    (tests/test_local_handler.py). A save with no barrier needs no id."""

  def get_temporary_path(self, directory: epath.Path) -> Any:
    """Orbax's, remembering the path so a failed save can remove it.

    Args:
      directory: the save's final folder.

    Returns:
      The LocalTemporaryPath.
    """
    tmp = super().get_temporary_path(directory)
    self._saving.tmp = tmp.get()
    return tmp

  def save(self, directory: epath.PathLike, *args: Any, **kwargs: Any) -> None:
    """Orbax's save; if it raises, the temporary folder (and whatever was
    written into it) is removed.

    Args:
      directory: the step's final folder.
      *args: Orbax's (the LocalShardsSave).
      **kwargs: Orbax's.

    Raises:
      ValueError: `directory` exists.
      OSError: the write or the rename failed.
    """
    self._saving.tmp = None
    try:
      super().save(directory, *args, **kwargs)
    except BaseException:
      tmp = self._saving.tmp
      if tmp is not None:
        shutil.rmtree(os.fspath(tmp), ignore_errors=True)
      raise
    finally:
      self._saving.tmp = None
