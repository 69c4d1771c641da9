"""Every path and name of the on-disk layout, and the one walker of a local root.

Local root (a host's `local.directory`; each process reads only its own folder):
  <root>/<run_id>/process_<i>/step_<N>/shards.bin      this process's shards
  <root>/<run_id>/process_<i>/step_<N>/manifest.json   the marker: a step exists iff present
  <root>/<run_id>/process_<i>/.tmp-step_<N>-<hex>/     a save in progress
  <root>/<run_id>/process_<i>/.tmp-spare-<hex>/        a retired step's shards.bin, reused
  <root>/<run_id>/process_<i>/.tmp-delete-<name>-<hex>/  a deletion in progress
  <root>/<run_id>/process_<i>/.owner                  flock()ed by the process using the folder

Persistent root (gs:// or any shared path):
  <root>/run.json                                   run id, topology, save intervals
  <root>/tensors/<N>/default/...                    an Orbax step (commit_success.txt on GCS)
  <root>/tensors/<N>.orbax-checkpoint-tmp-<t>/      Orbax's save in progress
  <root>/tensors/.deleting-<N>-<hex>/               a deletion in progress (filesystem)
  <root>/state/<N>/process_<i>-of-<n>.json          one process's non-tensor state
  <root>/state/<N>/COMMIT                           the marker: written last, by the primary

Names are strict: a step or process number is canonical ASCII decimal (no
sign, no leading zero), so `step_x`, `step_007`, `process_y` or `12abc` are not
part of the layout, and every reader (the tiers, the state store, the CLI)
ignores them the same way. Names only here: no JAX, no I/O beyond listing a
local root (`walk_local`, `list_local_steps`) and moving a local step folder
out of the step namespace (`rename_out_of_namespace`). The persistent tier's
rules that read storage are in persistent_layout.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Mapping

from etils import epath

# ---- numbers in names ---------------------------------------------------------


def parse_number(text: str) -> int | None:
  """`text` as a step or process number if it is canonical ASCII decimal
  ("0", "12"; not "007", "+1", "1_0", "x", "²"), else None."""
  if not text.isascii() or not text.isdigit():
    return None
  value = int(text)
  return value if str(value) == text else None


def _number_after(name: str, prefix: str) -> int | None:
  return parse_number(name[len(prefix) :]) if name.startswith(prefix) else None


# ---- local root: names ----------------------------------------------------------
PROCESS_PREFIX = "process_"
STEP_PREFIX = "step_"
SHARDS_FILE = "shards.bin"
"""The raw shard bytes of one local step."""
MANIFEST_FILE = "manifest.json"
"""A local step's marker: the tree, shards and checksums (local_format.py)."""
TMP_PREFIX = ".tmp-"
"""Every local name that is not (yet, or any more) a step starts with it."""
TMP_STEP_PREFIX = ".tmp-step_"
SPARE_PREFIX = ".tmp-spare-"
DELETING_LOCAL_PREFIX = ".tmp-delete-"
PARTNER_DIR = "partner"
"""In a process folder: the steps its partners sent it (peer/partner.py)."""
XOR_DIR = "xor"
"""In a process folder: its XOR parity blocks (peer/xor.py)."""
OWNER_FILE = ".owner"
"""In a process folder: flock()ed by the process using it, so another process
on the host never takes a live folder's copies as its own (local_owner)."""


def process_dir_name(process_index: int) -> str:
  """`process_<i>`."""
  return f"{PROCESS_PREFIX}{process_index}"


def process_of_dir_name(name: str) -> int | None:
  """i of `process_<i>`, or None for any other name."""
  return _number_after(name, PROCESS_PREFIX)


def step_dir_name(step: int) -> str:
  """`step_<N>`."""
  return f"{STEP_PREFIX}{step}"


def step_of_dir_name(name: str) -> int | None:
  """N of `step_<N>`, or None for any other name (`step_x`, `step_007`)."""
  return _number_after(name, STEP_PREFIX)


def run_dir(root: str, run_id: str) -> str:
  """<root>/<run_id>: one run's folder in a local root."""
  return os.path.join(root, run_id)


def process_dir(root: str, run_id: str, process_index: int) -> str:
  """<root>/<run_id>/process_<i>: one process's folder (only it reads and writes there)."""
  return os.path.join(root, run_id, process_dir_name(process_index))


def local_step_dir(proc_dir: str, step: int) -> str:
  """<proc_dir>/step_<N>."""
  return os.path.join(proc_dir, step_dir_name(step))


def shards_path(step_dir: str) -> str:
  return os.path.join(step_dir, SHARDS_FILE)


def manifest_path(step_dir: str) -> str:
  return os.path.join(step_dir, MANIFEST_FILE)


def _hex(n: int) -> str:
  return uuid.uuid4().hex[:n]


def tmp_step_dir_name(step: int) -> str:
  """A fresh `.tmp-step_<N>-<hex>` name: the folder a save of `step` writes into."""
  return f"{TMP_STEP_PREFIX}{step}-{_hex(8)}"


def spare_dir_name() -> str:
  """A fresh `.tmp-spare-<hex>` name: a retired step's folder kept for its shards.bin."""
  return f"{SPARE_PREFIX}{_hex(12)}"


def deleting_dir_name(name: str) -> str:
  """A fresh `.tmp-delete-<name>-<hex>` name: a folder being deleted."""
  return f"{DELETING_LOCAL_PREFIX}{name}-{_hex(8)}"


def is_tmp_name(name: str) -> bool:
  """A save in progress, a spare, or a deletion in progress: never a step."""
  return name.startswith(TMP_PREFIX)


def is_spare_name(name: str) -> bool:
  return name.startswith(SPARE_PREFIX)


# ---- local root: the walker -------------------------------------------------------
def names(path: str) -> list[str]:
  """Sorted entries of a folder; [] if it is absent or not a folder (a
  ramdisk wiped or a gc running beside us)."""
  try:
    return sorted(os.listdir(path))
  except (FileNotFoundError, NotADirectoryError):
    return []


def _is_real_dir(path: str) -> bool:
  """A folder, not a link to one (a planted link is never followed)."""
  return not os.path.islink(path) and os.path.isdir(path)


def list_local_steps(proc_dir: str) -> list[int]:
  """The steps of one process folder, oldest first: `step_<N>` folders
  holding their manifest.json (renamed into place after both files were
  written). [] if the folder is absent. Called by: its process, or a tool."""
  return sorted(_scan_process(proc_dir)[0])


def _scan_process(proc_dir: str) -> tuple[dict[int, str], dict[int, str], list[str], list[str]]:
  steps: dict[int, str] = {}
  unmarked: dict[int, str] = {}
  tmp: list[str] = []
  strays: list[str] = []
  for name in names(proc_dir):
    path = os.path.join(proc_dir, name)
    step = step_of_dir_name(name)
    if step is not None and os.path.isfile(manifest_path(path)):
      steps[step] = path
    elif step is not None and os.path.isdir(path):
      unmarked[step] = path
    elif is_tmp_name(name):
      tmp.append(path)
    elif name in (OWNER_FILE, PARTNER_DIR, XOR_DIR):
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
  otherwise ignored. Tolerates folders vanishing while it walks."""
  processes: list[LocalProcessDir] = []
  strays: list[str] = []
  for run_id in names(root):
    run_path = run_dir(root, run_id)
    if not _is_real_dir(run_path):
      strays.append(run_path)
      continue
    for name in names(run_path):
      path = os.path.join(run_path, name)
      index = process_of_dir_name(name)
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


# ---- local root: leaving the step namespace -------------------------------------------
def replace_step(tmp: str, final: str) -> None:
  """Renames the finished folder `tmp` to `final`, removing what was there
  first (renamed out of the namespace, so no reader sees half of it)."""
  old = rename_out_of_namespace(final)
  if old is not None:
    remove_renamed(old)
  os.rename(tmp, final)


def remove_tmp(folder: str, also: Callable[[str], bool] = lambda name: False) -> None:
  """Removes what a crashed incarnation left in `folder`: saves or receipts
  in progress, spares and deletions (`.tmp-*`), and entries `also` names;
  a link goes, never its target."""
  for name in names(folder):
    if is_tmp_name(name) or also(name):
      path = os.path.join(folder, name)
      if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(OSError):
          os.unlink(path)
      else:
        shutil.rmtree(path, ignore_errors=True)


def retire_steps(folder: str, steps, file: str, mapped: Callable[[os.stat_result], bool]) -> None:
  """Drops these `step_<N>` folders of `folder`, keeping the newest one's as
  the spare (`.tmp-spare-<hex>`) whose `file` the next step is written
  into (its tmpfs pages exist: nothing to allocate; measured for the local
  tier: 0.05 against 0.13 cpu-s per 256 MiB), unless a spare exists
  or `mapped(stat)` says a restore mapped that file (restored arrays may
  alias its pages: never written over)."""
  steps = list(steps)
  if steps and not any(is_spare_name(n) for n in names(folder)):
    newest = local_step_dir(folder, steps[-1])
    with contextlib.suppress(OSError):
      st = os.stat(os.path.join(newest, file), follow_symlinks=False)
      if stat.S_ISREG(st.st_mode) and not mapped(st):
        os.rename(newest, os.path.join(folder, spare_dir_name()))
        steps.pop()
  drop_steps(folder, steps)


def take_spare(
  folder: str,
  file: str,
  dest: str,
  mapped: Callable[[os.stat_result], bool],
  nbytes: int | None = None,
) -> bool:
  """Moves a spare's `file` (retire_steps) to `dest` (True): a regular file
  no restore mapped, of `nbytes` if given. Every spare folder goes. False
  if none fits."""
  found = False
  for name in names(folder):
    if not is_spare_name(name):
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
  """Removes these `step_<N>` folders of `folder` (each renamed away first)."""
  for step in steps:
    gone = rename_out_of_namespace(local_step_dir(folder, step))
    if gone is not None:
      remove_renamed(gone)


def rename_out_of_namespace(path: str) -> str | None:
  """Renames a local step folder to a `.tmp-delete-` name beside it, so a
  crash mid-delete never leaves a listed, partial step (the leftover goes
  when a manager next starts); returns the new path, or None if absent."""
  path = os.path.abspath(path)
  if not os.path.lexists(path):
    return None
  parent, name = os.path.split(path)
  doomed = os.path.join(parent, deleting_dir_name(name))
  os.rename(path, doomed)
  return doomed


def remove_renamed(doomed: str) -> None:
  """Removes what rename_out_of_namespace returned; a link goes, never its target."""
  if os.path.islink(doomed):
    os.unlink(doomed)
  else:
    shutil.rmtree(doomed)


def delete_local_step_dir(path: str) -> None:
  """Deletes one local step folder: renamed out of the step namespace
  first, then removed. No-op if absent; OSError if it cannot be renamed or
  removed. For offline tools (`emergency-ckpt gc`) and the local tier."""
  doomed = rename_out_of_namespace(path)
  if doomed is not None:
    remove_renamed(doomed)


# ---- persistent root: names --------------------------------------------------------
RUN_FILE = "run.json"
TENSORS_DIR = "tensors"
STATE_DIR = "state"
ORBAX_ITEM = "default"
"""The item folder Orbax's CheckpointManager writes under tensors/<N>/."""
ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"
"""In the name of an Orbax step still being written (`<N>.orbax-checkpoint-tmp-<t>`)."""
GCS_COMMIT_FILE = "commit_success.txt"
"""Orbax's finalization marker of a step on GCS (no atomic rename there)."""
DELETING_PERSISTENT_PREFIX = ".deleting-"
COMMIT_FILE = "COMMIT"
"""A state step's marker, written by the primary process once every file exists."""
STATE_FILE_SUFFIX = ".json"
SHARD_TABLE_FILE = "SHARDS"
"""A persistent step's shard table (checksums.py), written by the primary before COMMIT."""


def tensors_dir(root: epath.PathLike) -> epath.Path:
  """<root>/tensors: Orbax's step folders."""
  return epath.Path(root) / TENSORS_DIR


def state_dir(root: epath.PathLike) -> epath.Path:
  """<root>/state: the state store's step folders."""
  return epath.Path(root) / STATE_DIR


def run_file(root: epath.PathLike) -> epath.Path:
  """<root>/run.json: the run id, topology and save intervals (primary process)."""
  return epath.Path(root) / RUN_FILE


def step_name(step: int) -> str:
  """The name of a persistent step folder, under tensors/ and state/: `<N>`."""
  return str(step)


def step_of_name(name: str) -> int | None:
  """N of a persistent step folder's name, or None for any other name."""
  return parse_number(name)


def steps_of_names(names: Iterable[str]) -> list[int]:
  """The step numbers among folder names, sorted, others ignored."""
  return sorted(s for s in map(step_of_name, names) if s is not None)


def tensor_step_dir(tensors: epath.PathLike, step: int) -> epath.Path:
  """<tensors>/<N>."""
  return epath.Path(tensors) / step_name(step)


def deleting_tensor_name(step: int) -> str:
  """A fresh `.deleting-<N>-<hex>` name: a tensor step folder being deleted."""
  return f"{DELETING_PERSISTENT_PREFIX}{step}-{_hex(8)}"


def is_partial_tensor_name(name: str) -> bool:
  """Orbax's temporary folder or a deletion in progress (judged by the name
  alone; an unfinalized `<N>` folder is partial too: persistent_layout)."""
  return name.startswith(DELETING_PERSISTENT_PREFIX) or ORBAX_TMP_MARK in name


def state_step_dir(state_root: epath.PathLike, step: int) -> epath.Path:
  """<state>/<N>."""
  return epath.Path(state_root) / step_name(step)


def state_file_name(process_index: int, process_count: int) -> str:
  """`process_<i>-of-<n>.json`: one process's state file in a state step."""
  return f"{PROCESS_PREFIX}{process_index}-of-{process_count}{STATE_FILE_SUFFIX}"
