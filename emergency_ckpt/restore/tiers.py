"""What restore/ uses of the tiers: typed protocols, on the consumer's side.

The inventory and the restorer read the local tier (this host's steps,
copies and parity blocks), the persistent tier (finalized steps, reads) and
the state store (records, data states, checksums); they delete only what a
restore discards. Each protocol lists exactly the methods restore/ calls,
so the tiers can change everything else freely, and tests can stand in
for a tier with a few methods.

Called by: nothing (types only). The manager passes local.tier.LocalTier,
persistent.tier.PersistentTier and state.store.StateStore, which satisfy
them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
  import os

  from etils import epath

  from emergency_ckpt.core import shards as shards_lib
  from emergency_ckpt.local.discovery import Copy, Parity
  from emergency_ckpt.local.format import LocalStep
  from emergency_ckpt.state.shard_records import Expected


class LocalSource(Protocol):
  """The local tier, as the inventory and the restorer use it. Each method is the
  implementation's own: see its docstring there."""

  directory: str
  """This process's own ramdisk folder."""

  def usable_steps(self) -> tuple[list[int], dict[int, str]]: ...

  def held_steps(self) -> list[int]: ...

  def step_bytes(self, step: int) -> int | None: ...

  def copies(self) -> dict[int, dict[int, tuple[str, Copy]]]: ...

  def parity(self) -> dict[int, dict[int, Parity]]: ...

  def set_colocated(self, processes: Iterable[int]) -> None: ...

  def read(self, step: int, paths: Sequence[str], abstract: Sequence[Any]) -> LocalStep: ...

  def read_copy(self, where: str, *, verify: bool = True) -> LocalStep: ...

  def xor_files(self, where: str, parity: Parity) -> dict[tuple[int, str], Any]: ...

  def delete(self, step: int) -> None: ...

  def drop_newer_leftovers(self, restored: int, keep: Collection[int]) -> None: ...


class PersistentSource(Protocol):
  """The persistent tier, as the inventory and the restorer use it. Each method is the
  implementation's own: see its docstring there."""

  directory: os.PathLike[str] | epath.Path
  """The tier's tensors folder."""

  def steps(self) -> list[int]: ...

  def restore(self, step: int, abstract_tree: Any, expected: Expected) -> Any: ...

  def read_into(
    self,
    step: int,
    abstract_tree: Any,
    expected: Expected,
    select: Callable[[int, Any], bool] | None = None,
    *,
    buffer: Any = None,
    on_ready: Callable[[int, Any], None] | None = None,
  ) -> tuple[shards_lib.Layout, Any]: ...

  def delete(self, step: int) -> None: ...


class StateSource(Protocol):
  """The state store, as the inventory and the restorer use it. Each method is the
  implementation's own: see its docstring there."""

  def listed_steps(self) -> list[int]: ...

  def committed_steps(self, steps: Iterable[int] | None = None) -> list[int]: ...

  def is_committed(self, step: int) -> bool: ...

  def record(self, step: int) -> dict | None: ...

  def saved_process_count(self, step: int) -> int | None: ...

  def read(
    self, step: int, process: int | None = None, count: int | None = None
  ) -> dict | None: ...

  def expected_crcs(self, step: int, count: int) -> Expected: ...

  def delete(self, step: int) -> None: ...
