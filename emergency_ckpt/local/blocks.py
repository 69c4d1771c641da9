"""The redundancy data a process folder keeps for other processes: where it
lives on the ramdisk, and how it is stored, listed and read.

Beside a process's own steps (tier.py) its folder may hold
  <process dir>/partner/process_<sender>/step_<N>/   a partner copy: `sender`'s
                                                      step folder, local format
  <process dir>/xor/step_<N>/parity.bin   this member's parity block of step N
  <process dir>/xor/step_<N>/group.json   the group, every member's size and
                                          manifest, the block's CRC32C
each committed by renaming a `.tmp-step_<N>-<hex>` folder into place. What
goes into them and when is the redundancy schemes' business
(redundancy/partner.py, redundancy/xor_wire.py); this module only knows the
files, so the local tier (below redundancy) can find and read them.

Called by: redundancy/partner.py and redundancy/xor_wire.py (they write
here), discovery.py (lists what this host holds), tier.py (maps a parity
block for a rebuild), redundancy/xor.py. Per process; no collective, no JAX.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
from collections.abc import Callable, Sequence

import crc32c
import numpy as np

from emergency_ckpt.core import layout
from emergency_ckpt.core import parity as xp
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local import folders, schema
from emergency_ckpt.local import format as local_format

XOR_DIR = layout.XOR_DIR
PARTNER_DIR = layout.PARTNER_DIR
PARITY_FILE = "parity.bin"
GROUP_FILE = "group.json"


# ---- partner copies -------------------------------------------------------------------
def partner_dir(process_dir: str, sender: int) -> str:
  """Where a process keeps `sender`'s steps.

  Args:
    process_dir: the receiving process's folder.
    sender: the process whose steps it keeps.

  Returns:
    `<process_dir>/partner/process_<sender>`.
  """
  return os.path.join(process_dir, PARTNER_DIR, layout.process_dir_name(sender))


def partner_folders(dirs: Sequence[str]) -> list[str]:
  """The `partner/process_<i>` folders inside process folders (real folders
  only, never links).

  Args:
    dirs: process folders of this host.

  Returns:
    Their partner folders, in order (by name within each).
  """
  out = []
  for folder in dirs:
    root = os.path.join(folder, PARTNER_DIR)
    try:
      names = sorted(os.listdir(root))
    except OSError:
      continue
    for name in names:
      path = os.path.join(root, name)
      if layout.process_of_dir_name(name) is not None and not os.path.islink(path):
        out.append(path)
  return out


def redundancy_folders(process_dir: str) -> list[tuple[str, str]]:
  """The folders in a process folder that hold other processes' steps, each
  with the file that makes a step folder a step there (real folders only,
  never links).

  Args:
    process_dir: a process folder.

  Returns:
    [(`partner/process_<i>` folder, manifest.json)...] by name, then
    (`xor` folder, group.json) if present.
  """
  root = os.path.join(process_dir, PARTNER_DIR)
  out = [] if os.path.islink(root) else partner_folders([process_dir])
  out = [(f, local_format.MANIFEST) for f in out if os.path.isdir(f)]
  xor = xor_dir(process_dir)
  if not os.path.islink(xor) and os.path.isdir(xor):
    out.append((xor, GROUP_FILE))
  return out


# ---- parity blocks: listing and reading -----------------------------------------------
def xor_dir(process_dir: str) -> str:
  """Where a process keeps its parity blocks.

  Args:
    process_dir: the member's process folder.

  Returns:
    `<process_dir>/xor`.
  """
  return os.path.join(process_dir, XOR_DIR)


def parity_steps(folder: str) -> list[int]:
  """Steps with a parity block in an `xor` folder.

  Args:
    folder: an `xor` folder (absent: none).

  Returns:
    The steps whose folder holds a group.json, oldest first.
  """
  out = []
  for name in os.listdir(folder) if os.path.isdir(folder) else ():
    step = layout.step_of_dir_name(name)
    if step is not None and os.path.isfile(os.path.join(folder, name, GROUP_FILE)):
      out.append(step)
  return sorted(out)


def read_group(step_dir: str) -> dict:
  """A parity folder's group.json, checked.

  Args:
    step_dir: an `xor/step_<N>` folder.

  Returns:
    Its body: step, group (processes), member, sizes, manifests,
    parity_nbytes, parity_crc32c.

  Raises:
    OSError: the file is absent.
    CorruptCheckpointError: it is torn or altered.
  """
  path = os.path.join(step_dir, GROUP_FILE)
  with open(path, "rb") as f:
    return decode_group(f.read(), path)


def decode_group(raw: bytes, where: str) -> dict:
  """read_group of a group.json's bytes. Called by: read_group; no I/O.

  Args:
    raw: the file's bytes.
    where: names it in errors.

  Returns:
    Its body.

  Raises:
    CorruptCheckpointError: it is torn, altered or malformed (check_group).
  """
  try:
    doc = json.loads(raw)
    body, crc = doc["body"], doc["crc32c"]
    if not isinstance(body, dict):
      raise TypeError(f"the body is a {type(body).__name__}")
  except (ValueError, KeyError, TypeError, RecursionError) as e:
    raise CorruptCheckpointError(f"{where}: unreadable ({e})") from None
  if crc32c.crc32c(json.dumps(body, sort_keys=True).encode()) != crc:
    raise CorruptCheckpointError(f"{where}: checksum mismatch")
  check_group(body, where)
  return body


def check_group(body: dict, where: str) -> None:
  """Checks a group.json body's every field a reader uses: the group's
  processes, this member's place in it, every other member's size and
  manifest (hex), and the block's length against what those sizes make it.
  Called by: decode_group; no I/O. Raises CorruptCheckpointError (naming
  `where`) if a field is missing, mistyped or inconsistent."""
  field, step = schema.field, schema.field(body, "step", int, where)
  group = schema.ints(field(body, "group", list, where), where, "group")
  member = field(body, "member", int, where)
  if step < 0 or len(group) < 2 or len(set(group)) != len(group) or not 0 <= member < len(group):
    raise CorruptCheckpointError(f"{where}: step {step}, member {member} of group {group!r:.80}")
  others = {str(i) for i in range(len(group)) if i != member}
  sizes, manifests = field(body, "sizes", dict, where), field(body, "manifests", dict, where)
  if set(sizes) != others or set(manifests) != others:
    raise CorruptCheckpointError(f"{where}: sizes or manifests do not name the other members")
  if not all(schema.is_a(n, int) and n >= 0 for n in sizes.values()):
    raise CorruptCheckpointError(f"{where}: a member's size is not a byte count")
  for raw in manifests.values():
    try:
      bytes.fromhex(raw)
    except (TypeError, ValueError):
      raise CorruptCheckpointError(f"{where}: a member's manifest is not hex") from None
  length = xp.block_length([sizes.get(str(i), 0) for i in range(len(group))], member)
  if field(body, "parity_nbytes", int, where) != length:
    raise CorruptCheckpointError(
      f"{where}: parity_nbytes is {body['parity_nbytes']}; the members' sizes make {length}"
    )
  field(body, "parity_crc32c", int, where)


def map_parity(step_dir: str, body: dict, on_map: Callable[[os.stat_result], None]) -> np.ndarray:
  """A parity block's bytes, mapped privately and checked against the CRC32C
  its group.json records.

  Args:
    step_dir: the block's `xor/step_<N>` folder.
    body: its group.json body (read_group).
    on_map: called with the file's stat before it is mapped (the local tier
      never lets such a file be written over).

  Returns:
    The block as a uint8 array.

  Raises:
    OSError: the file is absent.
    CorruptCheckpointError: it fails its checksum.
  """
  with open(os.path.join(step_dir, PARITY_FILE), "rb") as f:
    st = os.fstat(f.fileno())
    on_map(st)
    block = local_format.map_open(f, st.st_size, step_dir)
  if len(block) != body.get("parity_nbytes") or crc32c.crc32c(block) != body.get("parity_crc32c"):
    raise CorruptCheckpointError(f"{step_dir}/{PARITY_FILE} fails its checksum")
  return block


# ---- parity blocks: storing -----------------------------------------------------------
class ParityBlock:
  """A step's parity block while its chunks arrive, added straight into the
  pages of its file (a shared mapping of `<tmp>/parity.bin`): the receiver's
  spare (a retired block: its tmpfs pages exist, so nothing is allocated,
  and nothing is copied into the file at the end) when it keeps one, else a
  fresh file. Every chunk is sent from its first byte to its last, so the
  bytes the chunks reached so far are [0, hw): a piece below `hw` is XORed
  in, one beyond it is copied (over the spare's old bytes: no zeroing).

  Made by open_block; the caller serializes add/grow/store/discard."""

  def __init__(self, tmp: str, reused: bool, length: int):
    """`tmp`: the step's temporary folder; `reused`: `<tmp>/parity.bin` is
    a spare (else it is made); `length`: bytes to map at first."""
    self.tmp = tmp
    path = os.path.join(tmp, PARITY_FILE)
    self._f = open(path, "r+b" if reused else "w+b")  # noqa: SIM115 - closed by finish/discard
    self._mm: mmap.mmap | None = None
    self.acc = np.zeros(0, np.uint8)
    self.hw = 0
    self.grow(length)

  def add(self, pos: int, data: np.ndarray) -> None:
    """One piece of a chunk, at `pos` of the block. The caller sends each
    chunk's pieces in order from 0.

    Args:
      pos: the piece's offset in the block.
      data: its bytes (uint8).
    """
    end = pos + len(data)
    split = min(max(self.hw, pos), end)
    if split > pos:
      xp.xor_into(self.acc[pos:split], data[: split - pos])
    if end > split:
      self.acc[split:end] = data[split - pos :]
    self.hw = max(self.hw, end)

  def grow(self, length: int) -> None:
    """At least `length` bytes mapped (a longer file is mapped whole; a
    shorter one is extended: the kernel zero-fills the new bytes).

    Args:
      length: the bytes the block must hold.
    """
    if length <= len(self.acc):
      return
    fd = self._f.fileno()
    size = os.fstat(fd).st_size
    if size < length:
      os.ftruncate(fd, length)
      size = length
    self._release()
    self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    self.acc = np.frombuffer(self._mm, np.uint8)

  def _release(self) -> None:
    mm, self._mm = self._mm, None
    self.acc = np.zeros(0, np.uint8)
    if mm is not None:
      with contextlib.suppress(BufferError):  # a view still alive: the collector closes it
        mm.close()

  def _finish(self, length: int) -> int:
    """The block's first `length` bytes as the file (longer files are cut),
    durable (bytes no chunk reached are zero); returns their CRC32C."""
    self.grow(length)
    if self.hw < length:
      self.acc[self.hw : length] = 0
    crc = crc32c.crc32c(self.acc[:length])
    self._release()
    fd = self._f.fileno()
    if os.fstat(fd).st_size != length:
      os.ftruncate(fd, length)
    os.fsync(fd)
    self._f.close()
    return crc

  def store(self, final: str, length: int, body: dict) -> None:
    """Commits the block: its first `length` bytes made durable, then
    group.json (`body` plus parity_nbytes and parity_crc32c, signed), then
    the folder renamed to `final` (replacing what was there). On any
    failure the block and its folder are dropped.

    Args:
      final: the step's `xor/step_<N>` folder.
      length: the block's bytes.
      body: step, group, member, sizes, manifests.

    Raises:
      OSError: a write or the rename failed.
    """
    try:
      crc = self._finish(length)
      body = {**body, "parity_nbytes": length, "parity_crc32c": crc}
      with open(os.path.join(self.tmp, GROUP_FILE), "wb") as f:
        f.write(_signed(body))
        f.flush()
        os.fsync(f.fileno())
      folders.replace_step(self.tmp, final)
    except BaseException:
      self.discard()
      raise

  def discard(self) -> None:
    """Drops the block and its folder (a torn or abandoned step)."""
    self._release()
    self._f.close()
    shutil.rmtree(self.tmp, ignore_errors=True)


def _signed(body: dict) -> bytes:
  raw = json.dumps(body, sort_keys=True).encode()
  return json.dumps({"body": body, "crc32c": crc32c.crc32c(raw)}).encode()


def open_block(
  folder: str, step: int, length: int, mapped: Callable[[os.stat_result], bool]
) -> ParityBlock:
  """A new parity block of `step` in a fresh temporary folder, written over
  the folder's spare (retire_blocks) if one fits.

  Args:
    folder: the member's `xor` folder (created if absent).
    step: the step.
    length: bytes to map at first.
    mapped: whether a restore mapped a file (such a spare is never reused).

  Returns:
    The block; its folder goes with discard() or store().

  Raises:
    OSError: the folder or file cannot be made.
  """
  os.makedirs(folder, mode=0o700, exist_ok=True)
  tmp = os.path.join(folder, layout.tmp_step_dir_name(step))
  os.mkdir(tmp, 0o700)
  try:
    dest = os.path.join(tmp, PARITY_FILE)
    reused = folders.take_spare(folder, PARITY_FILE, dest, mapped)
    return ParityBlock(tmp, reused, length)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def retire_blocks(folder: str, keep: int, mapped: Callable[[os.stat_result], bool]) -> None:
  """Drops the parity steps beyond the newest `keep`, keeping the newest of
  those as the spare the next step's block is written into (writing a
  fresh block to tmpfs costs page allocation on the save's path). A block
  a restore mapped is never reused.

  Args:
    folder: the member's `xor` folder.
    keep: steps kept.
    mapped: whether a restore mapped a file.

  Raises:
    OSError: a step could not be dropped (left for the next call).
  """
  retired = parity_steps(folder)[:-keep]
  folders.retire_steps(folder, retired, PARITY_FILE, mapped)
