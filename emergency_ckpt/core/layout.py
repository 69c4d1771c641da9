"""Every path and name of the on-disk layout (pure: names and paths only).

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
ignores them the same way. Names and paths only here: no JAX, no I/O. The
walker of a local root and the moves and deletions of its folders are the
local tier's (local/folders.py); the persistent tier's rules that read
storage are in persistent/layout.py. Called by: every tier, the state
store, the transfers and the CLI.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable

from etils import epath


# ---- numbers in names ---------------------------------------------------------
def parse_number(text: str) -> int | None:
  """A step or process number, as written in a name.

  Args:
    text: the part of a name after its prefix.

  Returns:
    Its value if `text` is canonical ASCII decimal ("0", "12"; not "007",
    "+1", "1_0", "x", "²"), else None.
  """
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
"""A local step's marker: the tree, shards and checksums (local/format.py)."""
TMP_PREFIX = ".tmp-"
"""Every local name that is not (yet, or any more) a step starts with it."""
TMP_STEP_PREFIX = ".tmp-step_"
SPARE_PREFIX = ".tmp-spare-"
DELETING_LOCAL_PREFIX = ".tmp-delete-"
PARTNER_DIR = "partner"
"""In a process folder: the steps its partners sent it (redundancy/partner.py)."""
XOR_DIR = "xor"
"""In a process folder: its XOR parity blocks (redundancy/xor.py)."""
OWNER_FILE = ".owner"
"""In a process folder: flock()ed by the process using it, so another process
on the host never takes a live folder's copies as its own (local/owner.py)."""


def process_dir_name(process_index: int) -> str:
  """The name of a process's folder.

  Args:
    process_index: the process.

  Returns:
    `process_<i>`.
  """
  return f"{PROCESS_PREFIX}{process_index}"


def process_of_dir_name(name: str) -> int | None:
  """The process a folder name belongs to.

  Args:
    name: a folder name.

  Returns:
    i of `process_<i>`, or None for any other name.
  """
  return _number_after(name, PROCESS_PREFIX)


def step_dir_name(step: int) -> str:
  """The name of a local step's folder.

  Args:
    step: the step.

  Returns:
    `step_<N>`.
  """
  return f"{STEP_PREFIX}{step}"


def step_of_dir_name(name: str) -> int | None:
  """The step a local folder name holds.

  Args:
    name: a folder name.

  Returns:
    N of `step_<N>`, or None for any other name (`step_x`, `step_007`).
  """
  return _number_after(name, STEP_PREFIX)


def run_dir(root: str, run_id: str) -> str:
  """One run's folder in a local root.

  Args:
    root: the local root (a host's `local.directory`).
    run_id: the run.

  Returns:
    <root>/<run_id>.
  """
  return os.path.join(root, run_id)


def process_dir(root: str, run_id: str, process_index: int) -> str:
  """One process's folder (only it reads and writes there).

  Args:
    root: the local root.
    run_id: the run.
    process_index: the process.

  Returns:
    <root>/<run_id>/process_<i>.
  """
  return os.path.join(root, run_id, process_dir_name(process_index))


def local_step_dir(proc_dir: str, step: int) -> str:
  """One local step's folder.

  Args:
    proc_dir: a process folder (or a partner's or XOR folder in it).
    step: the step.

  Returns:
    <proc_dir>/step_<N>.
  """
  return os.path.join(proc_dir, step_dir_name(step))


def shards_path(step_dir: str) -> str:
  """A local step's shard bytes.

  Args:
    step_dir: the step's folder.

  Returns:
    <step_dir>/shards.bin.
  """
  return os.path.join(step_dir, SHARDS_FILE)


def manifest_path(step_dir: str) -> str:
  """A local step's marker.

  Args:
    step_dir: the step's folder.

  Returns:
    <step_dir>/manifest.json.
  """
  return os.path.join(step_dir, MANIFEST_FILE)


def _hex(n: int) -> str:
  return uuid.uuid4().hex[:n]


def tmp_step_dir_name(step: int) -> str:
  """A fresh name for the folder a save of `step` writes into.

  Args:
    step: the step being saved.

  Returns:
    `.tmp-step_<N>-<hex>`.
  """
  return f"{TMP_STEP_PREFIX}{step}-{_hex(8)}"


def spare_dir_name() -> str:
  """A fresh name for a retired step's folder kept for its shards.bin.

  Returns:
    `.tmp-spare-<hex>`.
  """
  return f"{SPARE_PREFIX}{_hex(12)}"


def deleting_dir_name(name: str) -> str:
  """A fresh name for a folder being deleted.

  Args:
    name: the folder's name now.

  Returns:
    `.tmp-delete-<name>-<hex>`.
  """
  return f"{DELETING_LOCAL_PREFIX}{name}-{_hex(8)}"


def is_tmp_name(name: str) -> bool:
  """Whether a local name is a save, spare or deletion in progress: never a step.

  Args:
    name: a folder or file name.

  Returns:
    True if it starts with `.tmp-`.
  """
  return name.startswith(TMP_PREFIX)


def is_spare_name(name: str) -> bool:
  """Whether a local name is a spare's folder.

  Args:
    name: a folder name.

  Returns:
    True if it starts with `.tmp-spare-`.
  """
  return name.startswith(SPARE_PREFIX)


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
"""A persistent step's shard table (its checksums), written by the primary before COMMIT."""


def tensors_dir(root: epath.PathLike) -> epath.Path:
  """Orbax's step folders.

  Args:
    root: the persistent root.

  Returns:
    <root>/tensors.
  """
  return epath.Path(root) / TENSORS_DIR


def state_dir(root: epath.PathLike) -> epath.Path:
  """The state store's step folders.

  Args:
    root: the persistent root.

  Returns:
    <root>/state.
  """
  return epath.Path(root) / STATE_DIR


def run_file(root: epath.PathLike) -> epath.Path:
  """The run id, topology and save intervals (written by the primary process).

  Args:
    root: the persistent root.

  Returns:
    <root>/run.json.
  """
  return epath.Path(root) / RUN_FILE


def step_name(step: int) -> str:
  """The name of a persistent step folder, under tensors/ and state/.

  Args:
    step: the step.

  Returns:
    `<N>`.
  """
  return str(step)


def step_of_name(name: str) -> int | None:
  """The step a persistent step folder's name holds.

  Args:
    name: a folder name.

  Returns:
    N of `<N>`, or None for any other name.
  """
  return parse_number(name)


def steps_of_names(names: Iterable[str]) -> list[int]:
  """The step numbers among folder names, others ignored.

  Args:
    names: folder names.

  Returns:
    The steps, sorted.
  """
  return sorted(s for s in map(step_of_name, names) if s is not None)


def tensor_step_dir(tensors: epath.PathLike, step: int) -> epath.Path:
  """One Orbax step's folder.

  Args:
    tensors: tensors_dir(root).
    step: the step.

  Returns:
    <tensors>/<N>.
  """
  return epath.Path(tensors) / step_name(step)


def deleting_tensor_name(step: int) -> str:
  """A fresh name for a tensor step folder being deleted.

  Args:
    step: the step.

  Returns:
    `.deleting-<N>-<hex>`.
  """
  return f"{DELETING_PERSISTENT_PREFIX}{step}-{_hex(8)}"


def is_partial_tensor_name(name: str) -> bool:
  """Whether a name under tensors/ is Orbax's temporary folder or a deletion
  in progress (an unfinalized `<N>` is partial too: persistent/layout.py).

  Args:
    name: a folder name.

  Returns:
    True if partial by its name.
  """
  return name.startswith(DELETING_PERSISTENT_PREFIX) or ORBAX_TMP_MARK in name


def state_step_dir(state_root: epath.PathLike, step: int) -> epath.Path:
  """One state step's folder.

  Args:
    state_root: state_dir(root).
    step: the step.

  Returns:
    <state>/<N>.
  """
  return epath.Path(state_root) / step_name(step)


def state_file_name(process_index: int, process_count: int) -> str:
  """One process's state file in a state step.

  Args:
    process_index: the process.
    process_count: the job's process count.

  Returns:
    `process_<i>-of-<n>.json`.
  """
  return f"{PROCESS_PREFIX}{process_index}-of-{process_count}{STATE_FILE_SUFFIX}"
