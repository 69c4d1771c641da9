"""Does a saved step fit what the caller asks for? One place, one message style.

Every reader (local copy, persistent step, peer transfer) checks the caller's
abstract state against what was saved before it reads a byte: a mismatch is
a StateMismatchError naming the leaf and both sides, never a silent cast.
And a state sharded over the replica axis can be served neither by a peer
slice nor by the primary slice alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from emergency_ckpt.errors import StateMismatchError, TopologyError

_FIX = "Pass the abstract_state of the train state that was saved (restore, then convert)."


def _dtype_name(dtype: Any) -> str:
  import jax.numpy as jnp  # noqa: PLC0415 - bfloat16 & co. need jax's dtypes

  return str(jnp.dtype(dtype))


def check_tree(saved_paths: Iterable[str], paths: Sequence[str], where: Any) -> None:
  """Raises StateMismatchError naming leaves missing on either side (or a
  changed order) between the saved tree and the caller's."""
  saved_paths = list(saved_paths)
  if saved_paths == list(paths):
    return
  missing = sorted(set(saved_paths) - set(paths))
  extra = sorted(set(paths) - set(saved_paths))
  raise StateMismatchError(
    f"{where}: abstract_state does not match the saved tree."
    f" Saved but not asked for: {missing[:5]}; asked for but not saved:"
    f" {extra[:5]}. {_FIX}"
  )


def check_leaf(path: str, saved_shape, saved_dtype, shape, dtype, where: Any) -> None:
  """Raises StateMismatchError if the saved leaf's shape or dtype differs."""
  if tuple(saved_shape) == tuple(shape) and _dtype_name(saved_dtype) == _dtype_name(dtype):
    return
  raise StateMismatchError(
    f"leaf {path}: abstract_state asks for {_dtype_name(dtype)}{list(shape)},"
    f" {where} holds {_dtype_name(saved_dtype)}{list(saved_shape)}. {_FIX}"
  )


def check_state(
  saved: Mapping[str, tuple[Sequence[int], Any]],
  paths: Sequence[str],
  abstract: Sequence[Any],
  where: Any,
  *,
  ordered: bool = True,
) -> None:
  """check_tree + check_leaf for every leaf. `saved`: path -> (shape,
  dtype); a dtype of None is not checked. `ordered`: the saved order counts
  (a local copy's manifest), else only the set of paths (Orbax's metadata)."""
  if ordered:
    check_tree(saved, paths, where)
  elif set(saved) != set(paths):
    check_tree(sorted(saved), sorted(paths), where)
  for path, leaf in zip(paths, abstract):
    shape, dtype = saved[path]
    if dtype is not None:
      check_leaf(path, shape, dtype, leaf.shape, leaf.dtype, where)


def replica_problem(
  paths: Sequence[str], leaves: Sequence[Any], mesh, replica_axis: str
) -> str | None:
  """Why no single slice holds a full copy of `leaves`, or None: every leaf
  must be a NamedSharding on `mesh` (or on any mesh, if None), not sharded
  over the replica axis."""
  from jax.sharding import NamedSharding  # noqa: PLC0415

  for path, leaf in zip(paths, leaves):
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or (mesh is not None and sharding.mesh != mesh):
      return (
        f"leaf {path} has a {type(sharding).__name__}, not a NamedSharding on the manager's mesh"
      )
    for entry in sharding.spec:
      names = entry if isinstance(entry, tuple) else (entry,)
      if replica_axis in names:
        return (
          f"leaf {path} is sharded over the replica axis {replica_axis!r}, so no"
          " single slice holds its shards"
        )
  return None


def check_replicated(paths: Sequence[str], leaves: Sequence[Any], replica_axis: str) -> None:
  """Raises TopologyError unless every leaf is replicated over the replica
  axis (then the primary slice alone holds a full copy: replica 0's shards)."""
  problem = replica_problem(paths, leaves, None, replica_axis)
  if problem:
    raise TopologyError(
      f"{problem}; neither the persistent tier nor a peer slice can serve it."
      " Use NamedSharding on the manager's mesh, replicated over the replica axis."
    )


def as_numpy_dtype(dtype: Any) -> np.dtype:
  """`dtype` as numpy's (jax's extended dtypes included)."""
  import jax.numpy as jnp  # noqa: PLC0415

  return np.dtype(jnp.dtype(dtype))
