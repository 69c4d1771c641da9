"""The folders of a local root on disk: the one walker of a local root, and
every move and deletion of its step folders.

A local root holds `<run_id>/process_<i>/step_<N>/` folders (the names are
core/layout.py's). Reading it means walking those names without following
links and ignoring names outside the layout; changing it means renaming a
step folder out of the step namespace first (a `.tmp-` name), so that a
crash mid-way never leaves a listed, partial step. Spares (retired steps'
files kept for the next write) are taken and kept here too.

Called by: the local tier (its own folder), the partner and XOR
redundancy (their folders beside it), and the CLI's inspect and gc (any
folder of the root, offline). Any thread; no collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
from collections.abc import Callable, Mapping

from emergency_ckpt.core import layout
from emergency_ckpt.local import owner as local_owner


# ---- the walker ------------------------------------------------------------------
def names(path: str) -> list[str]:
  """The entries of a folder.

  Args:
    path: the folder.

  Returns:
    Their names, sorted; [] if it is absent or not a folder (a ramdisk
    wiped or a gc running beside us).
  """
  try:
    return sorted(os.listdir(path))
  except (FileNotFoundError, NotADirectoryError):
    return []


def _is_real_dir(path: str) -> bool:
  """A folder, not a link to one (a planted link is never followed)."""
  return not os.path.islink(path) and os.path.isdir(path)


def list_local_steps(proc_dir: str) -> list[int]:
  """The steps of one process folder: `step_<N>` folders holding their
  manifest.json (renamed into place after both files were written).
  Called by: its process, or a tool.

  Args:
    proc_dir: the process folder (or a partner's folder in it).

  Returns:
    The steps, oldest first; [] if the folder is absent.
  """
  return sorted(_scan_process(proc_dir)[0])


def _scan_process(proc_dir: str) -> tuple[dict[int, str], dict[int, str], list[str], list[str]]:
  steps: dict[int, str] = {}
  unmarked: dict[int, str] = {}
  tmp: list[str] = []
  strays: list[str] = []
  for name in names(proc_dir):
    path = os.path.join(proc_dir, name)
    step = layout.step_of_dir_name(name)
    if step is not None and os.path.isfile(layout.manifest_path(path)):
      steps[step] = path
    elif step is not None and os.path.isdir(path):
      unmarked[step] = path
    elif layout.is_tmp_name(name):
      tmp.append(path)
    elif name in (layout.OWNER_FILE, layout.PARTNER_DIR, layout.XOR_DIR):
      continue
    else:
      strays.append(path)
  return steps, unmarked, tmp, strays


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalProcessDir:
  """What one `<root>/<run_id>/process_<i>` folder holds."""

  run_id: str
  process_index: int
  path: str
  steps: Mapping[int, str]
  """{step: folder}: `step_<N>` folders with their manifest.json (the steps)."""
  unmarked: Mapping[int, str]
  """{step: folder}: `step_<N>` folders WITHOUT a manifest.json: not steps
  (every reader ignores them); only a damaged copy looks like this."""
  tmp: tuple[str, ...]
  """`.tmp-*` paths: saves in progress, spares, deletions in progress."""
  strays: tuple[str, ...]
  """Paths of names outside the layout (`step_x`, `step_007`, stray files): ignored."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalRootListing:
  """A local root, walked once: its process folders and what it ignored."""

  processes: tuple[LocalProcessDir, ...]
  """Sorted by (run_id, process_index)."""
  strays: tuple[str, ...]
  """Paths directly under the root or a run folder that are not a run or a
  `process_<i>` folder (files, links, `process_y`): ignored."""


def walk_local(root: str) -> LocalRootListing:
  """THE walker of a local root: runs -> `process_<i>` folders -> steps.

  Every folder directly under `root` is a run (its name the run id); links
  are never followed; names outside the layout are reported as strays and
  otherwise ignored. Tolerates folders vanishing while it walks.

  Args:
    root: the local root.

  Returns:
    What it holds.
  """
  processes: list[LocalProcessDir] = []
  strays: list[str] = []
  for run_id in names(root):
    run_path = layout.run_dir(root, run_id)
    if not _is_real_dir(run_path):
      strays.append(run_path)
      continue
    for name in names(run_path):
      path = os.path.join(run_path, name)
      index = layout.process_of_dir_name(name)
      if index is None or not _is_real_dir(path):
        strays.append(path)
        continue
      steps, unmarked, tmp, proc_strays = _scan_process(path)
      processes.append(
        LocalProcessDir(
          run_id=run_id,
          process_index=index,
          path=path,
          steps=steps,
          unmarked=unmarked,
          tmp=tuple(tmp),
          strays=tuple(proc_strays),
        )
      )
  processes.sort(key=lambda p: (p.run_id, p.process_index))
  return LocalRootListing(processes=tuple(processes), strays=tuple(strays))


# ---- moves and deletions -----------------------------------------------------------
def replace_step(tmp: str, final: str) -> None:
  """Renames a finished folder into place, removing what was there first
  (renamed out of the namespace, so no reader sees half of it).

  Args:
    tmp: the finished `.tmp-` folder.
    final: its `step_<N>` path.

  Raises:
    OSError: a rename or removal failed.
  """
  old = rename_out_of_namespace(final)
  if old is not None:
    remove_renamed(old)
  fd, name = local_owner.parent_fd(final)
  try:
    if os.path.dirname(os.path.abspath(tmp)) != os.path.dirname(os.path.abspath(final)):
      os.rename(tmp, final)
    else:
      os.rename(os.path.basename(tmp), name, src_dir_fd=fd, dst_dir_fd=fd)
  finally:
    os.close(fd)


def remove_tmp(folder: str, also: Callable[[str], bool] = lambda name: False) -> None:
  """Removes what a crashed incarnation left in a folder: saves or receipts
  in progress, spares and deletions (`.tmp-*`); a link goes, never its
  target. Failures are ignored.

  Args:
    folder: the process (or partner, or XOR) folder.
    also: names other entries to remove.
  """
  for name in names(folder):
    if layout.is_tmp_name(name) or also(name):
      path = os.path.join(folder, name)
      if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(OSError):
          os.unlink(path)
      else:
        shutil.rmtree(path, ignore_errors=True)


def retire_steps(folder: str, steps, file: str, mapped: Callable[[os.stat_result], bool]) -> None:
  """Drops `step_<N>` folders, keeping the newest one's as the spare
  (`.tmp-spare-<hex>`) whose `file` the next step is written into (its
  tmpfs pages exist: nothing to allocate, which costs less CPU than a fresh
  file), unless a spare exists or a restore mapped that file (restored
  arrays may alias its pages: never written over).

  Args:
    folder: the folder holding them.
    steps: the steps to drop, oldest first.
    file: the file a spare keeps (e.g. shards.bin).
    mapped: says whether a restore mapped a file (by its stat).

  Raises:
    OSError: a rename or removal failed.
  """
  steps = list(steps)
  if steps and not any(layout.is_spare_name(n) for n in names(folder)):
    newest = layout.local_step_dir(folder, steps[-1])
    with contextlib.suppress(OSError):
      st = os.stat(os.path.join(newest, file), follow_symlinks=False)
      if stat.S_ISREG(st.st_mode) and not mapped(st):
        os.rename(newest, os.path.join(folder, layout.spare_dir_name()))
        steps.pop()
  drop_steps(folder, steps)


def take_spare(
  folder: str,
  file: str,
  dest: str,
  mapped: Callable[[os.stat_result], bool],
  nbytes: int | None = None,
) -> bool:
  """Moves a spare's file (retire_steps) to `dest`: a regular file no
  restore mapped, of `nbytes` if given. Every spare folder goes.

  Args:
    folder: the folder holding the spares.
    file: the file a spare keeps.
    dest: where the file goes.
    mapped: says whether a restore mapped a file (by its stat).
    nbytes: the size it must have (None: any).

  Returns:
    True if a spare's file was moved; False if none fits.
  """
  found = False
  for name in names(folder):
    if not layout.is_spare_name(name):
      continue
    spare = os.path.join(folder, name)
    with contextlib.suppress(OSError):
      st = os.stat(os.path.join(spare, file), follow_symlinks=False)
      fits = stat.S_ISREG(st.st_mode) and nbytes in (None, st.st_size) and not mapped(st)
      if not found and fits:
        os.rename(os.path.join(spare, file), dest)
        found = True
    shutil.rmtree(spare, ignore_errors=True)
  return found


def drop_steps(folder: str, steps) -> None:
  """Removes `step_<N>` folders (each renamed away first).

  Args:
    folder: the folder holding them.
    steps: the steps.

  Raises:
    OSError: a rename or removal failed.
  """
  for step in steps:
    gone = rename_out_of_namespace(layout.local_step_dir(folder, step))
    if gone is not None:
      remove_renamed(gone)


def rename_out_of_namespace(path: str) -> str | None:
  """Renames a local step folder to a `.tmp-delete-` name beside it, so a
  crash mid-delete never leaves a listed, partial step (the leftover goes
  when a manager next starts). Through its parent's descriptor (owner.parent_fd):
  a symlink swapped in for a folder below the root is refused.

  Args:
    path: the step folder.

  Returns:
    The new path, or None if absent.

  Raises:
    UnsafeDirectoryError: a folder below the root is now a symlink.
    OSError: the rename failed.
  """
  fd, name = local_owner.parent_fd(path)
  try:
    try:
      os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
      return None
    doomed = layout.deleting_dir_name(name)
    os.rename(name, doomed, src_dir_fd=fd, dst_dir_fd=fd)
  finally:
    os.close(fd)
  return os.path.join(os.path.dirname(os.path.abspath(path)), doomed)


def remove_renamed(doomed: str) -> None:
  """Removes what rename_out_of_namespace returned, through its parent's
  descriptor (owner.parent_fd; shutil.rmtree with dir_fd never follows a link):
  a link goes, never its target.

  Args:
    doomed: the renamed path.

  Raises:
    UnsafeDirectoryError: a folder below the root is now a symlink.
    OSError: the removal failed.
  """
  fd, name = local_owner.parent_fd(doomed)
  try:
    if stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
      shutil.rmtree(name, dir_fd=fd)
    else:
      os.unlink(name, dir_fd=fd)
  finally:
    os.close(fd)


def delete_local_step_dir(path: str) -> None:
  """Deletes one local step folder: renamed out of the step namespace
  first, then removed. No-op if absent. For offline tools
  (`emergency-ckpt gc`) and the local tier.

  Args:
    path: the step folder.

  Raises:
    OSError: it cannot be renamed or removed.
  """
  doomed = rename_out_of_namespace(path)
  if doomed is not None:
    remove_renamed(doomed)


# ---- what no step needs ------------------------------------------------------------
def drop_unmarked(folder: str, marker: str) -> list[str]:
  """Removes the `step_<N>` folders (real folders: a link is left alone)
  that lack their marker file: torn or damaged, never restorable (the
  marker is written before a step folder is renamed into place, and goes
  only with it). Each is renamed away first and removed only if it is still
  the folder found without its marker (a step renamed into place under that
  name meanwhile is put back). Failures are ignored.

  Args:
    folder: a process, partner or XOR folder.
    marker: the file that makes a step folder a step there.

  Returns:
    The paths of the removed step folders.
  """
  gone = []
  for name in names(folder):
    path = os.path.join(folder, name)
    with contextlib.suppress(OSError):
      st = os.lstat(path)
      if (
        layout.step_of_dir_name(name) is None
        or not stat.S_ISDIR(st.st_mode)
        or os.path.lexists(os.path.join(path, marker))
      ):
        continue
      doomed = rename_out_of_namespace(path)
      if doomed is None:
        continue
      now = os.lstat(doomed)
      if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or os.path.lexists(
        os.path.join(doomed, marker)
      ):
        os.rename(doomed, path)  # not the torn folder: a step committed meanwhile
        continue
      gone.append(path)
      remove_renamed(doomed)
  return gone


def drop_older(folder: str, below: int, keep) -> list[str]:
  """Removes the `step_<N>` folders with N < `below` that `keep` lacks,
  marked or not (each renamed away first). Failures are ignored.

  Args:
    folder: a folder no live process holds, or one of its partner or XOR folders.
    below: the oldest step that stays whatever `keep` says.
    keep: steps that stay.

  Returns:
    The paths of the removed step folders.
  """
  return _drop(folder, lambda step: step < below and step not in keep)


def drop_newer(folder: str, above: int, keep) -> list[str]:
  """Removes the `step_<N>` folders with N > `above` that `keep` lacks,
  marked, damaged or not (each renamed away first). Failures are ignored.

  Args:
    folder: a folder no live process holds, or one of its partner or XOR folders.
    above: the newest step that stays whatever `keep` says.
    keep: steps that stay.

  Returns:
    The paths of the removed step folders.
  """
  return _drop(folder, lambda step: step > above and step not in keep)


def _drop(folder: str, doomed) -> list[str]:
  gone = []
  for name in names(folder):
    step = layout.step_of_dir_name(name)
    if step is not None and doomed(step):
      with contextlib.suppress(OSError):
        delete_local_step_dir(os.path.join(folder, name))
        gone.append(os.path.join(folder, name))
  return gone
