"""The soak's view of what a run leaves behind, and the damage it does to it.

No JAX and no library module: only the documented on-disk layout
(emergency_ckpt/core/layout.py's docstring), read as files and objects.

Local root: one folder per simulated host, `host_<i>`, each holding
`<run_id>/process_<k>/` (step_<N>/ folders, `.tmp-*` entries, partner/ and
xor/ folders of the redundancy schemes).

Persistent root (a path or gs://bucket/prefix):
  tensors/<N>/commit_success.txt   an Orbax step, finalized
  tensors/<N>.orbax-checkpoint-tmp-<t>/..., tensors/<N>/ without the marker:
                                   an upload in progress (or abandoned)
  state/<N>/COMMIT                 the step's non-tensor state is committed
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import urllib.parse
import urllib.request
from typing import Any

from tests.harness.gcs_server import list_objects

RUN_ID = "test-run"  # tests.scenarios.options' run id
# What a process of a round reports (tests/soak/job.py), by process index.
PROGRESS = "progress_{}.json"
RESTORED = "restored_{}.json"
QUIET = "quiet_{}.json"
TRAIN_ERROR = "train_error_{}.json"


def read_report(out_dir: str, name: str) -> dict[str, Any] | None:
  """What a process of the job in `out_dir` reported as `name`, or None."""
  try:
    with open(os.path.join(out_dir, name)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def number(text: str) -> int | None:
  """A canonical step number ("12"; not "012", "12.orbax-...")."""
  return int(text) if text.isascii() and text.isdigit() and str(int(text)) == text else None


# ---- local root ------------------------------------------------------------------------


def host_dir(local_root: str, host: int) -> str:
  return os.path.join(local_root, f"host_{host}")


def host_listing(host: str) -> dict[str, dict[str, list[str]]]:
  """Every folder under a host's run folder that holds step folders or
  `.tmp-*` entries: {path relative to the run folder: {"steps": [names],
  "tmp": [names], "unmarked": [step folders without their marker file]}}
  (process folders, their partner/ and xor/ folders). A step folder gets
  its name only once its marker is written: one without it is damaged."""
  run = os.path.join(host, RUN_ID)
  out: dict[str, dict[str, list[str]]] = {}
  for folder, dirs, files in os.walk(run):
    steps = sorted(d for d in dirs if d.startswith("step_"))
    tmp = sorted(n for n in dirs + files if n.startswith(".tmp-"))
    marker = "group.json" if os.path.basename(folder) == "xor" else "manifest.json"
    unmarked = [d for d in steps if not os.path.exists(os.path.join(folder, d, marker))]
    if steps or tmp:
      out[os.path.relpath(folder, run)] = {"steps": steps, "tmp": tmp, "unmarked": unmarked}
    dirs[:] = sorted(d for d in dirs if not d.startswith(("step_", ".tmp-")))
  return out


def over_budget(folder: str, ent: dict, own: str, keep: int) -> list[str]:
  """What one of this process's folders of host_listing holds beyond what
  local retention allows at a quiet point (empty: within it): its own folder
  max_to_keep + 2 steps and no entry in progress, the folders other
  processes send to (partner/, xor/) max_to_keep + 3 steps and one; one
  spare each.

  Args:
    folder: the folder's path relative to the run folder ("process_1",
      "process_1/partner/process_0", ...).
    ent: its host_listing entry.
    own: this process's folder name ("process_1").
    keep: local.max_to_keep.
  """
  limit, tmp_limit = (keep + 2, 0) if folder == own else (keep + 3, 1)
  spares = [t for t in ent["tmp"] if t.startswith(".tmp-spare-")]
  other = [t for t in ent["tmp"] if t not in spares]
  out = []
  if len(ent["steps"]) > limit:
    out.append(f"{len(ent['steps'])} steps {ent['steps']} (max_to_keep={keep})")
  if len(spares) > 1 or len(other) > tmp_limit:
    out.append(f"leftovers {ent['tmp']}")
  return out


def local_files(local_root: str) -> list[str]:
  """Every file under the local root (data, manifests, partner copies,
  parity blocks, group files, spares), sorted; not the `.owner` lock files."""
  out = []
  for folder, dirs, files in os.walk(local_root):
    dirs.sort()
    out += [os.path.join(folder, f) for f in sorted(files) if f != ".owner"]
  return out


def flip_bit(data: bytes, at: int, bit: int) -> bytes:
  out = bytearray(data)
  out[at] ^= 1 << bit
  return bytes(out)


def damage_file(path: str, op: str, u: float, bit: int) -> str:
  """Damages one file: "flip" a bit (at fraction `u` of it), "truncate" it
  (to fraction `u` of its size) or "remove" it. Returns what it did."""
  size = os.path.getsize(path)
  if op == "remove" or (op != "truncate" and size == 0):
    os.remove(path)
    return f"removed ({size} B)"
  if op == "truncate":
    keep = int(size * u)
    os.truncate(path, keep)
    return f"truncated {size} -> {keep} B"
  at = min(size - 1, int(size * u))
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(flip_bit(data, at, bit))
  return f"flipped bit {bit} of byte {at}/{size}"


def wipe_host(local_root: str, host: int) -> None:
  """The host's ramdisk is gone (a replaced machine)."""
  shutil.rmtree(host_dir(local_root, host), ignore_errors=True)


def shuffle_hosts(local_root: str, perm: list[int]) -> None:
  """The ramdisk of host i becomes host perm[i]'s (processes restart on other machines)."""
  moved = {}
  for i in range(len(perm)):
    src = host_dir(local_root, i)
    if os.path.isdir(src):
      moved[i] = src + ".shuffling"
      os.rename(src, moved[i])
  for i, tmp in moved.items():
    os.rename(tmp, host_dir(local_root, perm[i]))


# ---- persistent root -------------------------------------------------------------------


@dataclasses.dataclass
class Persistent:
  """What the persistent tier holds, from one listing."""

  names: dict[str, str]  # object or file name under the root -> md5

  def _steps(self, folder: str, marker: str | None = None) -> set[int]:
    out = set()
    for name in self.names:
      parts = name.split("/")
      if len(parts) < 3 or parts[0] != folder or (n := number(parts[1])) is None:
        continue
      if marker is None or parts[2:] == [marker]:
        out.add(n)
    return out

  @property
  def finalized(self) -> set[int]:
    """Tensor steps Orbax finalized."""
    return self._steps("tensors", "commit_success.txt")

  @property
  def unfinalized(self) -> set[str]:
    """Tensor folders of uploads in progress or abandoned."""
    folders = {n.split("/")[1] for n in self.names if n.startswith("tensors/") and n.count("/") > 1}
    done = {str(s) for s in self.finalized}
    return {f for f in folders if f not in done and not f.startswith(".deleting-")}

  @property
  def committed(self) -> set[int]:
    """Steps whose state is committed (COMMIT)."""
    return self._steps("state", "COMMIT")

  @property
  def state_steps(self) -> set[int]:
    return self._steps("state")

  def data_files(self, step: int) -> list[str]:
    """The tensor data files of a step (Orbax's ocdbt `d/` files)."""
    return sorted(n for n in self.names if n.startswith(f"tensors/{step}/") and "/d/" in n)


class FileRoot:
  """A persistent root on a file system."""

  def __init__(self, path: str):
    self.path = path

  def list(self) -> Persistent:
    names = {}
    for folder, dirs, files in os.walk(self.path):
      dirs.sort()
      for f in files:
        full = os.path.join(folder, f)
        with open(full, "rb") as fh:
          names[os.path.relpath(full, self.path)] = hashlib.md5(fh.read()).hexdigest()
    return Persistent(names)

  def read(self, name: str) -> bytes:
    with open(os.path.join(self.path, name), "rb") as f:
      return f.read()

  def write(self, name: str, data: bytes) -> None:
    with open(os.path.join(self.path, name), "r+b") as f:
      f.write(data)


class BucketRoot:
  """A persistent root gs://bucket/prefix on fake-gcs-server, reached
  directly (not through the fault-injecting proxy)."""

  def __init__(self, server_url: str, url: str):
    self.server = server_url
    self.bucket, _, self.prefix = url.removeprefix("gs://").partition("/")
    self.prefix = self.prefix.rstrip("/") + "/"

  def list(self) -> Persistent:
    found = list_objects(self.server, f"gs://{self.bucket}", self.prefix)
    return Persistent({n.removeprefix(self.prefix): md5 for n, md5 in found.items()})

  def _object(self, name: str) -> str:
    return urllib.parse.quote(self.prefix + name, safe="")

  def read(self, name: str) -> bytes:
    url = f"{self.server}/storage/v1/b/{self.bucket}/o/{self._object(name)}?alt=media"
    with urllib.request.urlopen(url, timeout=30) as r:
      return r.read()

  def write(self, name: str, data: bytes) -> None:
    url = f"{self.server}/upload/storage/v1/b/{self.bucket}/o?uploadType=media&name={self._object(name)}"
    req = urllib.request.Request(
      url, data=data, method="POST", headers={"Content-Type": "application/octet-stream"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
      r.read()
