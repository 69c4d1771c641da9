"""Pure logic of the peer transfer: who sends to whom, and what can travel."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from emergency_ckpt.errors import TopologyError
from emergency_ckpt.transport.collective import _carrier
from emergency_ckpt.transport.routing import routes


def _check(intact, lost):
  rounds = routes(intact, lost)
  received = [dst for pairs in rounds for _, dst in pairs]
  assert sorted(received) == sorted(lost), "every lost slice receives exactly once"
  for pairs in rounds:
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts), pairs
    assert set(srcs) <= set(intact) and set(dsts) <= set(lost), pairs
  return rounds


def test_one_lost_slice_gets_the_first_intact_source():
  assert _check([2, 0, 1], [3]) == [[(2, 3)]]


def test_lost_slices_spread_over_intact_sources():
  assert _check([0, 1], [2, 3]) == [[(0, 2), (1, 3)]]


def test_more_lost_than_intact_takes_rounds():
  rounds = _check([0], [1, 2, 3])
  assert rounds == [[(0, 1)], [(0, 2)], [(0, 3)]]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_split_is_a_valid_permutation_schedule(n):
  for k in range(1, n):
    for intact in itertools.combinations(range(n), k):
      lost = [s for s in range(n) if s not in intact]
      rounds = _check(list(intact), lost)
      assert len(rounds) == -(-len(lost) // len(intact))


def test_no_intact_slice_is_an_error():
  with pytest.raises(TopologyError, match="intact"):
    routes([], [0, 1])


@pytest.mark.parametrize(
  "dtype, carrier, factor",
  [
    (np.float32, np.float32, 1),  # kept: moved as is
    (np.float64, np.float64, 1),
    (np.int8, np.int8, 1),
    (np.bool_, np.bool_, 1),
    (ml_dtypes.bfloat16, np.uint16, 1),  # widened by CPU collectives: carried
    (np.float16, np.uint16, 1),
    (np.complex64, np.uint32, 2),
  ],
)
def test_carriers_cover_the_bytes(dtype, carrier, factor):
  got, f = _carrier(np.dtype(dtype))
  assert (got, f) == (np.dtype(carrier), factor)
  assert got.itemsize * f == np.dtype(dtype).itemsize
