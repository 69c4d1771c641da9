"""The benchmark's train state: float32 leaves sharded over 'data' and
replicated over 'replica', with values that do not depend on the layout.

Every leaf is (rows, COLS) float32 split into BLOCKS row blocks; block b of
leaf i is drawn from its own seeded generator, so any process can rebuild any
shard (to verify a restore) without the saved state in memory. Each block
starts with -0.0 and the smallest denormal, which a float sum-with-zeros
broadcast does not carry over (restores record whether they were bit-exact).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

LEAVES = 4
COLS = 1024
BLOCKS = 4  # the finest 'data' split of any layout used here
SEED = 20260
SPEC = P("data", None)

# layout name -> (slices, devices per slice); always 4 processes x 2 devices
LAYOUTS = {"2x2": (2, 4), "4x1": (4, 2)}


@dataclasses.dataclass(frozen=True)
class Layout:
  name: str
  mesh: Mesh
  slice_index: int
  num_slices: int
  rows: int  # per leaf

  @property
  def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
    sharding = NamedSharding(self.mesh, SPEC)
    return {
      name: jax.ShapeDtypeStruct((self.rows, COLS), np.float32, sharding=sharding)
      for name in leaf_names()
    }


def leaf_names() -> list[str]:
  return [f"layer_{i}" for i in range(LEAVES)]


def rows_per_leaf(mib_per_replica: int) -> int:
  total = mib_per_replica * 2**20 // 4  # float32 elements per replica
  rows = total // (LEAVES * COLS)
  if rows < BLOCKS or rows % BLOCKS:
    raise ValueError(f"--mib-per-replica {mib_per_replica} gives {rows} rows per leaf")
  return rows


def make_layout(name: str, mib_per_replica: int) -> Layout:
  slices, per_slice = LAYOUTS[name]
  devices = np.array(jax.devices()).reshape(slices, per_slice)
  mesh = Mesh(devices, ("replica", "data"))
  me = jax.process_index()
  owner = [s for s in range(slices) if any(d.process_index == me for d in devices[s])]
  if len(owner) != 1:
    raise RuntimeError(f"process {me} spans slices {owner} in layout {name}")
  return Layout(name, mesh, owner[0], slices, rows_per_leaf(mib_per_replica))


def slice_processes(layout: Layout) -> list[list[int]]:
  devices = np.asarray(layout.mesh.devices)
  return [sorted({d.process_index for d in devices[s]}) for s in range(layout.num_slices)]


def _block(leaf: int, block: int, rows: int) -> np.ndarray:
  rng = np.random.default_rng([SEED, leaf, block])
  a = rng.random((rows, COLS), dtype=np.float32)
  a *= 2
  a -= 1
  bits = a.view(np.uint32)
  bits[0, 0] = 0x80000000  # -0.0
  bits[0, 1] = 0x00000001  # smallest denormal
  return a


def values(leaf: int, rows: int, start: int, stop: int) -> np.ndarray:
  """Rows [start, stop) of leaf `leaf` (whole blocks only)."""
  per = rows // BLOCKS
  if start % per or stop % per:
    raise ValueError(f"rows [{start}, {stop}) do not fall on block boundaries of {per}")
  parts = [_block(leaf, b, per) for b in range(start // per, stop // per)]
  return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _rows(index, rows: int) -> tuple[int, int]:
  start, stop, _ = index[0].indices(rows)
  return start, stop


def make_state(layout: Layout) -> dict[str, jax.Array]:
  out = {}
  for i, (name, leaf) in enumerate(layout.abstract.items()):
    out[name] = jax.make_array_from_callback(
      leaf.shape,
      leaf.sharding,
      lambda idx, i=i: values(i, layout.rows, *_rows(idx, layout.rows)),
    )
  return jax.block_until_ready(out)


def unique_shards(state: dict[str, jax.Array]) -> list[np.ndarray]:
  """This process's distinct shards, as host arrays (no copy on CPU)."""
  out = []
  for arr in state.values():
    seen = set()
    for shard in arr.addressable_shards:
      key = tuple((s.start, s.stop) for s in shard.index)
      if key not in seen:
        seen.add(key)
        out.append(np.asarray(shard.data))
  return out


def bytes_per_process(state: dict[str, jax.Array]) -> int:
  return sum(a.nbytes for a in unique_shards(state))


def mismatched_shards(restored: dict, layout: Layout, original: dict | None = None) -> int:
  """Addressable shards of `restored` that differ bit-for-bit from the
  expected values (from `original` when given, else regenerated)."""
  bad = 0
  for i, name in enumerate(leaf_names()):
    arr = restored.get(name) if isinstance(restored, dict) else None
    if arr is None or tuple(arr.shape) != (layout.rows, COLS) or arr.dtype != np.float32:
      bad += 1
      continue
    want_by_device = {}
    if original is not None:
      want_by_device = {s.device: s.data for s in original[name].addressable_shards}
    for shard in arr.addressable_shards:
      if shard.device in want_by_device:
        want = np.asarray(want_by_device[shard.device])
      else:
        want = values(i, layout.rows, *_rows(shard.index, layout.rows))
      got = np.asarray(shard.data)
      if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        bad += 1
  return bad
