"""Does a saved step fit what the caller asks for? One place, one message style.

Every reader (local copy, persistent step, peer transfer) checks the caller's
abstract state against what was saved before it reads a byte: a mismatch is
a StateMismatchError naming the leaf and both sides, never a silent cast.
And a state sharded over the replica axis can be served neither by a peer
slice nor by the primary slice alone.

Called by: the local tier, the persistent tier, the peer transfers and the
manager, before they read; no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from emergency_ckpt.errors import StateMismatchError, TopologyError

_FIX = "Pass the abstract_state of the train state that was saved (restore, then convert)."


def _dtype_name(dtype: Any) -> str:
  try:
    return _dtype_name_cached(dtype)
  except TypeError:  # an unhashable dtype-like
    return _dtype_name_of(dtype)


def _dtype_name_of(dtype: Any) -> str:
  import jax.numpy as jnp  # noqa: PLC0415 - bfloat16 & co. need jax's dtypes

  return str(jnp.dtype(dtype))


@functools.lru_cache(maxsize=256)
def _dtype_name_cached(dtype: Any) -> str:  # once per dtype, not per leaf
  return _dtype_name_of(dtype)


def check_tree(saved_paths: Iterable[str], paths: Sequence[str], where: Any) -> None:
  """Checks that the caller's tree has the saved tree's leaves, in order.

  Args:
    saved_paths: the saved leaves' paths, in saved order.
    paths: the caller's leaves' paths.
    where: what was saved, for the message (e.g. "local step 30").

  Raises:
    StateMismatchError: naming leaves missing on either side (or a changed
      order).
  """
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
  """Checks one leaf's shape and dtype against what was saved.

  Args:
    path: the leaf's path, for the message.
    saved_shape, saved_dtype: what was saved.
    shape, dtype: what the caller asks for.
    where: what was saved, for the message.

  Raises:
    StateMismatchError: the shape or dtype differs.
  """
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
  """check_tree + check_leaf for every leaf.

  Args:
    saved: {path: (shape, dtype)} as saved; a dtype of None is not checked.
    paths: the caller's leaves' paths.
    abstract: the caller's leaves (with .shape and .dtype).
    where: what was saved, for the message.
    ordered: the saved order counts (a local copy's manifest), else only
      the set of paths (Orbax's metadata).

  Raises:
    StateMismatchError: naming the first mismatch.
  """
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
  """Why no single slice holds a full copy of `leaves`: every leaf must be a
  NamedSharding on `mesh`, not sharded over the replica axis.

  Args:
    paths: the leaves' paths, for the message.
    leaves: arrays or abstract leaves, with their shardings.
    mesh: the manager's mesh (None: any mesh).
    replica_axis: the replica axis's name.

  Returns:
    The reason for the first leaf that breaks the rule, or None.
  """
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
  """Checks that the primary slice alone holds a full copy (replica 0's
  shards).

  Args:
    paths: the leaves' paths, for the message.
    leaves: arrays or abstract leaves, with their shardings.
    replica_axis: the replica axis's name.

  Raises:
    TopologyError: a leaf is not a NamedSharding, or is sharded over the
      replica axis.
  """
  problem = replica_problem(paths, leaves, None, replica_axis)
  if problem:
    raise TopologyError(
      f"{problem}; neither the persistent tier nor a peer slice can serve it."
      " Use NamedSharding on the manager's mesh, replicated over the replica axis."
    )


def as_numpy_dtype(dtype: Any) -> np.dtype:
  """`dtype` as numpy's (jax's extended dtypes included).

  Args:
    dtype: anything jnp.dtype accepts.

  Returns:
    The numpy dtype.
  """
  import jax.numpy as jnp  # noqa: PLC0415

  return np.dtype(jnp.dtype(dtype))
