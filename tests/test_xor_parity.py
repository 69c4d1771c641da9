"""XOR parity (xor_parity.py, pure): groups over machines, rebuild of any one member."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_xor_parity_rebuilds_any_one_member_bit_exactly(k):
  from emergency_ckpt.core import parity as xp  # noqa: PLC0415

  rng = np.random.default_rng(k)
  data = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 300, k)]
  data[0] = data[0][:1]  # sizes differ, one tiny
  parities = [xp.parity(j, data) for j in range(k)]
  assert all(len(p) == xp.block_length([len(d) for d in data], j) for j, p in enumerate(parities))
  for m in range(k):
    rebuilt = bytearray(len(data[m]))
    for t, (j, others) in enumerate(xp.rebuild_sources(m, k)):
      acc = parities[j].copy()
      for i, ti in others:
        off, length = xp.chunk(len(data[i]), k, ti)
        xp.xor_into(acc, data[i][off : off + length])
      off, length = xp.chunk(len(data[m]), k, t)
      rebuilt[off : off + length] = acc[:length].tobytes()
    assert bytes(rebuilt) == data[m], m


def test_xor_groups_spread_over_machines():
  from emergency_ckpt.core import parity as xp  # noqa: PLC0415

  machine = {p: f"m{p // 2}" for p in range(8)}  # 4 machines x 2 processes
  got = xp.groups(range(8), machine, 4)
  assert got == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert all(xp.shared_machines(g, machine) == [] for g in got)
  assert xp.groups(range(5), {p: str(p) for p in range(5)}, 4) == [[0, 1, 2], [3, 4]]
  one = xp.groups(range(4), dict.fromkeys(range(4), "m"), 8)  # one machine: cannot spread
  assert one == [[0, 1], [2, 3]] and xp.shared_machines(one[0], dict.fromkeys(range(4), "m"))


def test_xor_parts_give_each_process_its_group_and_its_machines():
  """What the XOR set-up's assign hands each process: its group (as groups()
  cuts the slice) and the group's machines, so it can check the spread
  without the slice's other machines."""
  from emergency_ckpt.core import parity as xp  # noqa: PLC0415

  machine = {p: f"m{p // 2}" for p in range(10, 18)}  # 4 machines x 2 processes
  parts = xp.parts(range(10, 18), machine, 4)
  assert sorted(parts) == list(range(10, 18))
  for group in xp.groups(range(10, 18), machine, 4):
    for p in group:
      assert parts[p] == {"group": group, "machines": [machine[q] for q in group]}
