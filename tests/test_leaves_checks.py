"""Every check still bites on a many-leaf checkpoint (issue 35 item 4): the
batched restore (one pass over the manifest, arrays over the mapped file,
the direct placement of replicated leaves) must never hand out a byte that
fails its shard's CRC32C, and the manifest's faster CRC32 path must still
refuse an altered file and still read the older layout."""

from __future__ import annotations

import json
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import emergency_ckpt as ec
from emergency_ckpt.core import direct_put, placement
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CorruptCheckpointError
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local import read as local_read

N = 300


def _tree(mesh, value: float) -> dict:
  rep = NamedSharding(mesh, P())
  host = [np.full((7 + i % 5,), value + i, np.float32) for i in range(N)]
  out = {f"l{i:04d}": a for i, a in enumerate(jax.device_put(host, [rep] * N))}
  out["big"] = jax.device_put(jnp.arange(4096.0) + value, NamedSharding(mesh, P("data")))
  return out


def _abstract(tree):
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


def _saved(options, mesh, steps=(2,)):
  tree = _tree(mesh, 1.0)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    for step in steps:
      mngr.save(step, tree)
    mngr.wait_until_finished()
  local = options.local.directory
  dirs = {}
  for root, _, files in os.walk(local):
    if local_format.MANIFEST in files and os.path.basename(root).startswith("step_"):
      dirs[int(os.path.basename(root)[len("step_") :])] = root
  return tree, dirs


def _flip(where: str, offset: int) -> None:
  path = os.path.join(where, local_format.SHARDS)
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("which", ["first", "middle", "last byte of a leaf", "last"])
def test_a_flipped_byte_in_any_leaf_fails_the_read(options, mesh, which):
  tree, dirs = _saved(options, mesh)
  where = dirs[2]
  body = local_format.read_manifest(where)
  leaves = body["leaves"]
  pick = {"first": 0, "middle": N // 2, "last byte of a leaf": 137, "last": len(leaves) - 1}[which]
  shard = leaves[pick]["shards"][-1]
  at = shard["offset"] + (shard["nbytes"] - 1 if which == "last byte of a leaf" else 0)
  paths, abstract, _ = shards_lib.leaf_paths(_abstract(tree))
  local_read.read_step(where, abstract=abstract, paths=paths)  # intact: reads
  _flip(where, at)
  with pytest.raises(CorruptCheckpointError, match=r"fails its checksum") as e:
    local_read.read_step(where, abstract=abstract, paths=paths)
  assert leaves[pick]["path"] in str(e.value)
  _, problems = local_format.verify_step_dir(where)
  assert len(problems) == 1 and leaves[pick]["path"] in problems[0]


def test_a_corrupted_local_step_is_never_returned(options, mesh):
  """The manager skips the damaged local copy (the persistent tier holds
  step 4): the restored leaves are the saved bytes, not the flipped one."""
  tree, dirs = _saved(options, mesh, steps=(2, 4))
  where = dirs[4]
  body = local_format.read_manifest(where)
  shard = body["leaves"][N // 3]["shards"][0]
  _flip(where, shard["offset"] + 1)
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    got = mngr.restore(_abstract(tree))
  assert got.step == 4 and got.source != "local", (got.step, got.source)
  for k, v in tree.items():
    np.testing.assert_array_equal(np.asarray(got.state[k]), np.asarray(v), err_msg=k)


def test_restored_leaves_equal_the_saved_ones_and_small_ones_are_copies(options, mesh):
  tree, dirs = _saved(options, mesh)
  paths, abstract, _ = shards_lib.leaf_paths(_abstract(tree))
  step = local_read.read_step(dirs[2], abstract=abstract, paths=paths)
  got = placement.assemble_many(abstract, step.arrays)
  for path, a, want, by_index in zip(paths, got, shards_lib.leaf_paths(tree)[1], step.arrays):
    assert (a.shape, a.dtype, a.sharding) == (want.shape, want.dtype, want.sharding), path
    np.testing.assert_array_equal(np.asarray(a), np.asarray(want), err_msg=path)
    if path != "['big']":  # a small replicated leaf: its own bytes, not the file's
      next(iter(by_index.values()))[...] = -1
      np.testing.assert_array_equal(np.asarray(a), np.asarray(want), err_msg=path)


def test_the_direct_placement_matches_jax_device_put(mesh, monkeypatch):
  rep = NamedSharding(mesh, P())
  host = [np.arange(i + 1, dtype=np.float32) for i in range(50)] * 3
  host += [np.ones((2, 3), np.int32), np.zeros((), np.float32)] * 4
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep) for x in host]
  by_index = [{tuple((0, d) for d in x.shape): x} for x in host]
  fast = placement.assemble_many(abstract, by_index)
  monkeypatch.setattr(direct_put, "_BATCHED_PUT", None)
  public = placement.assemble_many(abstract, by_index)
  for x, a, b in zip(host, fast, public):
    assert (a.shape, a.dtype, a.sharding, a.committed) == (b.shape, b.dtype, b.sharding, True)
    assert jax.typeof(a) == jax.typeof(b)
    np.testing.assert_array_equal(np.asarray(a), x)
    np.testing.assert_array_equal(np.asarray(a + 1), np.asarray(b + 1))  # usable by jit


def _body(n=3):
  return {
    "format": local_format.FORMAT,
    "step": 5,
    "nbytes": 64 * n,
    "leaves": [
      {
        "path": f"['l{i}']",
        "shape": [4],
        "dtype": "float32",
        "shards": [{"index": [[0, 4]], "offset": 64 * i, "nbytes": 16, "crc32c": 7}],
      }
      for i in range(n)
    ],
  }


def test_manifest_layouts_old_and_new_read_and_any_flip_is_refused():
  body = _body()
  head = {k: v for k, v in body.items() if k != "leaves"}
  new = local_format.encode_manifest(body)
  canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
  old = json.dumps({"body": body, "crc32": zlib.crc32(canonical)}).encode()  # before 2026-11-28
  older = json.loads(old)
  assert {k: v for k, v in json.loads(new).items() if k in older} == older  # what old readers read
  assert local_format.decode_manifest(new, "m") == body
  assert local_format.decode_manifest(old, "m") == body
  for raw in (new, old):
    assert local_format.decode_manifest(raw, "m", leaves=False) == head
    for i in range(len(raw)):  # every byte of both layouts, one flip at a time
      torn = raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1 :]
      for leaves, want in ((True, body), (False, head)):
        try:
          got = local_format.decode_manifest(torn, "m", leaves=leaves)
        except CorruptCheckpointError:
          continue
        assert got == want, (i, leaves, torn[max(0, i - 20) : i + 20])  # only no-op flips pass


def test_the_light_decode_reads_the_head_without_parsing_the_leaves(monkeypatch):
  """Discovery's decode of a manifest with a head parses the head's bytes
  only (a few hundred, whatever the number of leaves)."""
  raw = local_format.encode_manifest(_body(5000))
  parsed = []
  real = json.loads
  monkeypatch.setattr(local_format.json, "loads", lambda b: parsed.append(len(b)) or real(b))
  head = local_format.decode_manifest(raw, "m", leaves=False)
  assert head["step"] == 5 and "leaves" not in head
  assert parsed and max(parsed) < 1000 < len(raw), (parsed, len(raw))


def _compact(doc) -> bytes:
  return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _headless(body) -> bytes:
  """A manifest as written before heads were added."""
  canonical = _compact(body)
  return b'{"body": %s, "crc32": %d}' % (canonical, zlib.crc32(canonical))


def test_a_head_that_differs_from_its_body_is_refused_by_the_whole_decode():
  """Forged files whose head says one step and whose body another, every
  CRC32 right: the light decode may list such a step, the read never takes
  it. Also with a second "head" key at the end, the one a JSON parser keeps."""
  body = _body()
  lying = _compact({k: v for k, v in dict(body, step=9).items() if k != "leaves"})
  canonical = _compact(body)
  forged = b'{"head": %s, "head_crc32": %d, "body": %s, "crc32": %d}' % (
    lying,
    zlib.crc32(lying),
    canonical,
    zlib.crc32(canonical),
  )
  assert local_format.decode_manifest(forged, "m", leaves=False)["step"] == 9
  with pytest.raises(CorruptCheckpointError, match="head differs"):
    local_format.decode_manifest(forged, "m")
  good = local_format.encode_manifest(body)
  assert local_format.decode_manifest(good, "m") == body
  duplicated = good[:-1] + b', "head": %s}' % lying
  for leaves in (False, True):  # not the layout the light decode reads: decoded whole
    with pytest.raises(CorruptCheckpointError, match="head differs"):
      local_format.decode_manifest(duplicated, "m", leaves=leaves)


def test_discovery_decode_skips_only_the_leaf_checks_and_never_vouches_for_them():
  """Discovery decodes each kept step's manifest without the per-leaf
  checks (leaves=False); those bytes must still get them when a reader
  decodes them whole: the light decode never lets them into the cache of
  checked manifests."""
  body = _body()
  body["leaves"][1]["shards"][0]["nbytes"] = 24  # a forged size, its CRC32 recomputed
  raw = local_format.encode_manifest(body)
  head = {k: v for k, v in body.items() if k != "leaves"}
  assert local_format.decode_manifest(raw, "m", leaves=False) == head
  with pytest.raises(CorruptCheckpointError, match=r"\['l1'\]|24"):
    local_format.decode_manifest(raw, "m")
  assert local_format.decode_manifest(raw, "m", leaves=False) == head  # again: still light
  with pytest.raises(CorruptCheckpointError):
    local_format.decode_manifest(raw, "m")
  forged = dict(body, topology=[1, 2])  # outside the leaves: refused by the light decode too
  with pytest.raises(CorruptCheckpointError, match="topology"):
    local_format.decode_manifest(local_format.encode_manifest(forged), "m", leaves=False)
  for bad in ([], {"step": 1}):  # a body that is no object, or lacks its leaves
    with pytest.raises(CorruptCheckpointError):
      local_format.decode_manifest(
        json.dumps({"body": bad, "crc32": zlib.crc32(json.dumps(bad).encode())}).encode(),
        "m",
        leaves=False,
      )


def test_a_forged_leaf_in_the_newest_manifest_falls_back_to_the_step_before(options, mesh):
  """A manifest whose leaf record was edited and its CRC32 recomputed passes
  discovery's light decode; the read refuses it, and the restore takes the
  step before (bit-exact), never the forged one."""
  tree, dirs = _saved(options, mesh, steps=(2, 4))
  where = dirs[4]
  body = local_format.read_manifest(where)
  body["leaves"][N // 2]["shards"][0]["nbytes"] += 8
  with open(os.path.join(where, local_format.MANIFEST), "wb") as f:
    f.write(local_format.encode_manifest(body))
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    got = mngr.restore(_abstract(tree))
  assert (got.step, got.source) != (4, "local"), (got.step, got.source)
  for k, v in tree.items():
    np.testing.assert_array_equal(np.asarray(got.state[k]), np.asarray(v), err_msg=k)


def test_a_light_decode_hands_its_body_to_the_next_whole_decode_of_the_same_bytes(monkeypatch):
  """A manifest without a head (written by earlier versions): discovery's
  light decode parks its body; the step's read (a whole decode of the same
  bytes) takes it instead of parsing again, still makes the per-leaf
  checks, and drops the other parked bodies."""
  parses = []
  real = json.loads
  monkeypatch.setattr(local_format.json, "loads", lambda raw: parses.append(1) or real(raw))
  local_format._PARKED.clear()  # noqa: SLF001
  bodies = [_body(n) for n in (2, 3, 4)]
  raws = [_headless(b) for b in bodies]
  for raw in raws:
    local_format.decode_manifest(raw, "m", leaves=False)
  assert len(parses) == 3 and len(local_format._PARKED) == 2  # noqa: SLF001 - bounded
  assert local_format.decode_manifest(raws[2], "m") == bodies[2]
  assert len(parses) == 3  # taken, not parsed again
  assert local_format._PARKED == {}  # noqa: SLF001 - the rest dropped
  assert local_format.decode_manifest(raws[1], "m") == bodies[1]
  assert len(parses) == 4  # nothing parked for it any more: parsed
  forged = _body(2)
  forged["leaves"][0]["shards"][0]["offset"] = 10**9  # past the end, its CRC32 recomputed
  raw = _headless(forged)
  local_format.decode_manifest(raw, "m", leaves=False)
  with pytest.raises(CorruptCheckpointError):  # a parked body still gets the leaf checks
    local_format.decode_manifest(raw, "m")


def test_a_newer_step_the_restore_rejected_is_removed(options, mesh):
  """Step 6 (local only) is damaged: the restore rejects it and takes step 4.
  Training goes on from step 5 and will save step 6 again, so the rejected
  copy must not stay beside the new saves (the soak's 'orphans' finding: a
  rejected newer step kept in a folder adopted after a host shuffle)."""
  tree, dirs = _saved(options, mesh, steps=(4, 6))
  body = local_format.read_manifest(dirs[6])
  body["leaves"][N // 2]["shards"][0]["nbytes"] += 8  # forged, its CRC32 recomputed
  with open(os.path.join(dirs[6], local_format.MANIFEST), "wb") as f:
    f.write(local_format.encode_manifest(body))
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    got = mngr.restore(_abstract(tree))
    assert got.step == 4, (got.step, got.source)
    assert not os.path.exists(dirs[6]), os.listdir(os.path.dirname(dirs[6]))
    assert os.path.exists(dirs[4])
