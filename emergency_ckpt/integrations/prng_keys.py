"""Typed PRNG key leaves (dtype key<...>) in and out of a checkpoint (pure).

emergency_ckpt stores raw bytes of numeric arrays; a typed key array has no
numpy dtype. Orbax saves such a leaf as its key data, and so does the
orbax_emergency facade: save() stores `jax.random.key_data(k)` (uint32, the
key's shape plus the implementation's key shape, sharded like the key), and
restore() reads that and re-wraps it with the abstract leaf's
implementation. MaxText's train state holds one (its rng, impl unsafe_rbg).
Called by: the facade's save() and restore(), on every process. Blocks on
nothing (key_data is one small device computation per key leaf).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec


def is_key(leaf: Any) -> bool:
  """Whether `leaf` is a typed PRNG key.

  Args:
    leaf: an array, an abstract leaf, or anything else.

  Returns:
    True for a typed PRNG key array or its abstract (ShapeDtypeStruct).
  """
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _impl(leaf: Any):
  # The key implementation of a key dtype. Private (dtype._impl), but the only
  # way to get it from an abstract leaf: jax.random.key_impl wants an array.
  return leaf.dtype._impl  # noqa: SLF001


def to_data(tree: Any) -> Any:
  """The tree to save: each key leaf as its key data.

  Args:
    tree: the train state.

  Returns:
    `tree`, each key leaf replaced by jax.random.key_data of it.
  """
  return jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def abstract_data(abstract: Any) -> Any:
  """The abstract tree to restore onto: each key leaf as its key data's.

  Args:
    abstract: the abstract train state (ShapeDtypeStruct leaves).

  Returns:
    `abstract`, each key leaf replaced by the abstract of its key data
    (same sharding on the leading dimensions, the key's own dimensions
    unsharded).
  """

  def one(leaf):
    if not is_key(leaf):
      return leaf
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
      extra = (None,) * (len(data.shape) - len(leaf.shape))
      spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec)) + extra
      sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)

  return jax.tree_util.tree_map(one, abstract)


def from_data(tree: Any, abstract: Any) -> Any:
  """The restored tree with its keys back.

  Args:
    tree: the restored tree (key data where `abstract` has keys).
    abstract: the abstract train state, with the key leaves.

  Returns:
    `tree`, the key data of each leaf that is a key in `abstract` wrapped
    with that leaf's key implementation.
  """
  return jax.tree_util.tree_map(
    lambda a, x: jax.random.wrap_key_data(x, impl=_impl(a)) if is_key(a) else x, abstract, tree
  )
