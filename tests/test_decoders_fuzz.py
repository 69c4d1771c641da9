"""Property-based fuzzing of every on-disk decoder (issue 37, item 3).

Nothing read from the disk is trusted: for arbitrary bytes, arbitrary JSON,
and valid documents mutated field by field with their checksums recomputed
(a forged file), each decoder either raises CorruptCheckpointError or
returns a document its readers can use without an untyped error (the
readers' first steps run on every document that parses). The COMMIT record
reads as uncommitted (None) instead of raising: its documented contract.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib

import crc32c
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from emergency_ckpt.cluster import topology as topology_lib  # noqa: E402
from emergency_ckpt.core import parity as xp  # noqa: E402
from emergency_ckpt.core import reshard as reshard_lib  # noqa: E402
from emergency_ckpt.errors import CorruptCheckpointError  # noqa: E402
from emergency_ckpt.local import blocks  # noqa: E402
from emergency_ckpt.local import format as local_format  # noqa: E402
from emergency_ckpt.local import read as local_read  # noqa: E402
from emergency_ckpt.persistent import layout as persistent_layout  # noqa: E402
from emergency_ckpt.persistent import read as persistent_read  # noqa: E402
from emergency_ckpt.state import format as state_format  # noqa: E402
from emergency_ckpt.state.shard_records import canonical  # noqa: E402
from emergency_ckpt.state.store import StateStore  # noqa: E402

N = 800  # examples per strategy and decoder: about 20,000 cases in all
FUZZ = settings(
  max_examples=N,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
  database=None,
)

SCALARS = (
  st.none()
  | st.booleans()
  | st.integers(min_value=-(2**70), max_value=2**70)
  | st.floats()
  | st.text(max_size=12)
)
JSON = st.recursive(
  SCALARS,
  lambda inner: (
    st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
  ),
  max_leaves=12,
)


def _mutate(doc, data):
  """`doc` with one field, chosen along a random path, replaced by arbitrary
  JSON, removed, or nudged (an int +-8, a list emptied or as a dict)."""
  doc = json.loads(json.dumps(doc))
  parent, key, node = None, None, doc
  while isinstance(node, dict | list) and node and data.draw(st.integers(0, 3)):
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    parent, key = node, data.draw(st.sampled_from(keys))
    node = node[key]
  if parent is None:
    return data.draw(JSON)
  how = data.draw(st.sampled_from(["json", "drop", "nudge", "shape"]))
  if how == "drop" and isinstance(parent, dict):
    del parent[key]
  elif how == "nudge" and isinstance(node, int) and not isinstance(node, bool):
    parent[key] = node + data.draw(st.sampled_from([-8, -1, 1, 8, 2**40]))
  elif how == "shape":
    parent[key] = dict(enumerate(node)) if isinstance(node, list) else [node]
    parent[key] = json.loads(json.dumps(parent[key]))
  else:
    parent[key] = data.draw(JSON)
  return doc


# ---- the local step manifest ---------------------------------------------------------
def _manifest() -> dict:
  data = np.arange(24, dtype=np.uint8)
  return {
    "format": local_format.FORMAT,
    "step": 7,
    "run_id": "run",
    "process_index": 1,
    "slice_index": 1,
    "topology": {
      "process_count": 2,
      "slice_processes": [[0], [1]],
      "mesh_shape": [2, 1],
      "mesh_axis_names": ["replica", "data"],
      "replica_axis": "replica",
      "slice_grid": [0],
    },
    "nbytes": 24,
    "saved_at": 1.5e9,
    "leaves": [
      {
        "path": "['w']",
        "shape": [4, 2],
        "dtype": "float32",
        "spec": [None, ["data"]],
        "shards": [
          {"index": [[0, 2], [0, 2]], "offset": 0, "nbytes": 16, "crc32c": crc32c.crc32c(data[:16])}
        ],
      },
      {
        "path": "['b']",
        "shape": [],
        "dtype": "bfloat16",
        "shards": [{"index": [], "offset": 16, "nbytes": 2, "crc32": zlib.crc32(data[16:18])}],
      },
    ],
  }


def _use_manifest(body: dict) -> None:
  """What the readers do first with a parsed manifest: verify its shards
  against a buffer of its size, and read its topology and layout."""
  try:
    local_read.verify_buffer(body, np.zeros(min(body["nbytes"], 4096), np.uint8), "fuzz")
  except CorruptCheckpointError:
    pass
  fp = body.get("topology") or {}
  topology_lib.slice_shape(fp)
  topology_lib.slice_position_of(fp, body.get("process_index"))
  reshard_lib.SavedLayout.from_manifest(body)
  assert body["nbytes"] >= 0 and all(isinstance(leaf["shards"], list) for leaf in body["leaves"])


def _decode_manifest(raw: bytes) -> None:
  try:
    body = local_format.decode_manifest(raw, "fuzz/manifest.json")
  except CorruptCheckpointError:
    return
  _use_manifest(body)


def test_the_valid_manifest_parses():
  _use_manifest(local_format.decode_manifest(local_format.encode_manifest(_manifest()), "ok"))


@FUZZ
@given(st.binary(max_size=200))
def test_manifest_from_arbitrary_bytes(raw):
  _decode_manifest(raw)


@FUZZ
@given(JSON)
def test_manifest_from_arbitrary_json(doc):
  _decode_manifest(json.dumps(doc).encode())
  _decode_manifest(local_format.encode_manifest(doc))  # as the body, checksum right


@FUZZ
@given(st.data())
def test_manifest_mutated_with_its_checksum_recomputed(data):
  _decode_manifest(local_format.encode_manifest(_mutate(_manifest(), data)))


@pytest.mark.parametrize(
  "edit",
  [
    lambda b: b.update(topology=[1, 2]),
    lambda b: b["leaves"][0]["shards"][0].update(nbytes=24),
    lambda b: b["leaves"][0]["shards"][0].update(offset=16),
    lambda b: b["leaves"][0].update(dtype="object"),
  ],
  ids=["topology-list", "size-off-by-8", "past-the-end", "object-dtype"],
)
def test_forged_manifest_fields_are_named(edit):
  body = _manifest()
  edit(body)
  with pytest.raises(CorruptCheckpointError, match="fuzz"):
    local_format.decode_manifest(local_format.encode_manifest(body), "fuzz")


def test_a_manifest_body_that_is_a_list_is_corrupt():
  with pytest.raises(CorruptCheckpointError, match="unknown format"):
    local_format.decode_manifest(local_format.encode_manifest([1, 2]), "fuzz")


# ---- XOR group files -----------------------------------------------------------------
def _signed_group(body) -> bytes:
  raw = json.dumps(body, sort_keys=True).encode()
  return json.dumps({"body": body, "crc32c": crc32c.crc32c(raw)}).encode()


def _group() -> dict:
  hexed = local_format.encode_manifest(_manifest()).hex()
  sizes = {"0": 24, "2": 40}
  return {
    "step": 7,
    "group": [3, 5, 7],
    "member": 1,
    "sizes": sizes,
    "manifests": {"0": hexed, "2": hexed},
    "parity_nbytes": xp.block_length([24, 0, 40], 1),
    "parity_crc32c": 0,
  }


def _decode_group(raw: bytes) -> None:
  try:
    body = blocks.decode_group(raw, "fuzz/group.json")
  except CorruptCheckpointError:
    return
  group = [int(p) for p in body["group"]]  # what discovery and the rebuild read
  group[int(body["member"])]
  for i in range(len(group)):
    if i != body["member"]:
      int(body["sizes"][str(i)])
      bytes.fromhex(body["manifests"][str(i)])


def test_the_valid_group_parses():
  _decode_group(_signed_group(_group()))
  assert blocks.decode_group(_signed_group(_group()), "ok")["member"] == 1


@FUZZ
@given(st.binary(max_size=200))
def test_group_from_arbitrary_bytes(raw):
  _decode_group(raw)


@FUZZ
@given(JSON)
def test_group_from_arbitrary_json(doc):
  _decode_group(json.dumps(doc).encode())
  _decode_group(_signed_group(doc))


@FUZZ
@given(st.data())
def test_group_mutated_with_its_checksum_recomputed(data):
  _decode_group(_signed_group(_mutate(_group(), data)))


def test_a_group_whose_manifests_are_a_list_is_corrupt():
  body = _group()
  body["manifests"] = list(body["manifests"].values())
  with pytest.raises(CorruptCheckpointError, match="manifests"):
    blocks.decode_group(_signed_group(body), "fuzz")


# ---- state files and COMMIT records --------------------------------------------------
def _process_file() -> dict:
  return json.loads(
    state_format.encode_process_file(7, 0, 2, {"pos": [1, 2]}, {"['w']": [[[[0, 4]], 12]]})
  )


def _resign(doc) -> bytes:
  if isinstance(doc, dict):
    for key, crc_key in (("data_state", "crc32"), ("shard_crc32c", "shard_crc32c_crc32")):
      if key in doc:
        doc[crc_key] = zlib.crc32(canonical(doc[key]))
  return json.dumps(doc).encode()


def _decode_state(raw: bytes) -> None:
  for key, crc_key in (("data_state", "crc32"), ("shard_crc32c", "shard_crc32c_crc32")):
    try:
      state_format.decode_verified(raw, 7, key, crc_key, "fuzz/process_0-of-2.json")
    except CorruptCheckpointError:
      pass


def _commit() -> dict:
  raw = state_format.encode_commit(
    7, 2, committed_at=1.5e9, metrics={"loss": 0.5}, info={"topology": {"process_count": 2}}
  )
  return json.loads(raw)


def _decode_commit(raw: bytes) -> None:
  record = state_format.decode_commit(raw, 7)
  if record is not None:  # what the restore and the retainer read
    ((record.get("info") or {}).get("topology") or {}).get("process_origin")
    (record.get("metrics") or {}).get("loss")
    assert record["process_count"] >= 1


@FUZZ
@given(st.binary(max_size=200))
def test_state_files_from_arbitrary_bytes(raw):
  _decode_state(raw)
  _decode_commit(raw)


@FUZZ
@given(JSON)
def test_state_files_from_arbitrary_json(doc):
  _decode_state(json.dumps(doc).encode())
  _decode_state(_resign(doc))
  _decode_commit(json.dumps(doc).encode())


@FUZZ
@given(st.data())
def test_state_files_mutated_with_checksums_recomputed(data):
  _decode_state(_resign(_mutate(_process_file(), data)))
  _decode_commit(json.dumps(_mutate(_commit(), data)).encode())


# ---- files read through a path: the SHARDS table, Orbax's _METADATA, run.json ----------
_DIR = tempfile.mkdtemp(prefix="ec-fuzz-")


def _shard_table() -> dict:
  body = {
    "format": 1,
    "step": 7,
    "leaves": {"['w']": 0},
    "layouts": [[[[[0, 4]], 0]]],
    "arrays": {"['w']": [[4], "float32"]},
  }
  return {**body, "crc32": zlib.crc32(canonical(body))}


def _read_paths(raw: bytes) -> None:
  store = StateStore(os.path.join(_DIR, "state"), process_index=0, process_count=1)
  os.makedirs(store.step_dir(7), exist_ok=True)
  with open(os.path.join(store.step_dir(7), "SHARDS"), "wb") as f:
    f.write(raw)
  try:
    store.expected_crcs(7, 1)
  except CorruptCheckpointError:
    pass
  item = os.path.join(_DIR, "item")
  os.makedirs(item, exist_ok=True)
  with open(os.path.join(item, persistent_read.METADATA), "wb") as f:
    f.write(raw)
  try:
    meta = persistent_read._read_metadata(persistent_read.epath.Path(item))
    bool(meta.get("use_zarr3", False))
  except CorruptCheckpointError:
    pass
  with open(os.path.join(_DIR, "run.json"), "wb") as f:
    f.write(raw)
  listing = persistent_layout.PersistentListing(
    root=persistent_read.epath.Path(_DIR),
    tensor_steps=(),
    state_steps=(),
    records={},
    run=persistent_layout.read_run_info(_DIR),
  )
  listing.run_id, listing.persistent_interval  # noqa: B018


def test_the_shard_table_name_is_the_one_the_store_reads():
  from emergency_ckpt.core import layout  # noqa: PLC0415

  assert layout.SHARD_TABLE_FILE == "SHARDS"


@FUZZ
@given(st.binary(max_size=120))
def test_path_read_files_from_arbitrary_bytes(raw):
  _read_paths(raw)


@FUZZ
@given(JSON)
def test_path_read_files_from_arbitrary_json(doc):
  _read_paths(json.dumps(doc).encode())


@FUZZ
@given(st.data())
def test_shard_table_mutated_with_its_checksum_recomputed(data):
  doc = _mutate(_shard_table(), data)
  if isinstance(doc, dict):
    body = {k: doc.get(k) for k in ("format", "step", "leaves", "layouts", "arrays")}
    doc["crc32"] = zlib.crc32(canonical(body))
  _read_paths(json.dumps(doc).encode())
