"""What save/ uses of the tiers and of the redundancy link: typed protocols,
on the consumer's side.

A save writes this process's step to the local tier, uploads it to the
persistent tier (the primary slice), and writes its JSON state and, on the
primary, COMMIT to the state store; with local.redundancy, the redundancy
link sends the step to a partner or an XOR group. Each protocol lists
exactly the methods save/ calls, so the tiers can change everything else
freely, and tests can stand in for a tier with a few methods.

Called by: nothing (types only). The manager passes local.tier.LocalTier,
state.store.StateStore and redundancy.links.start's link; commit.py builds
persistent.tier.PersistentTier itself. They satisfy these protocols.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
  import numpy as np

  from emergency_ckpt.local.tier import WriteResult
  from emergency_ckpt.runtime.staging import HostSnapshot


class LocalWriter(Protocol):
  """The local tier, as a save uses it. Each method is the
  implementation's own: see its docstring there."""

  def write_async(
    self, staged: HostSnapshot, on_done: Callable[[WriteResult], None] | None = None
  ) -> concurrent.futures.Future: ...

  def step_dir(self, step: int) -> str: ...

  def manifest(self, step: int) -> dict: ...


class PersistentUploader(Protocol):
  """The persistent tier, as a save uses it (the primary slice). Each method is the
  implementation's own: see its docstring there."""

  directory: Any
  """The tier's tensors folder (an epath.Path)."""

  def wait_previous(self, step: int) -> None: ...

  def save(self, step: int, tree: Any) -> None: ...

  def save_snapshot(
    self, step: int, tree: Any, make_tree: Callable[[], Any], release: Callable[[], None]
  ) -> None: ...


class StateWriter(Protocol):
  """The state store, as a save uses it. Each method is the
  implementation's own: see its docstring there."""

  def write(self, step: int, data_state: dict | None, shard_crc32c: dict | None = None) -> None: ...

  def write_shard_table(self, step: int, table: dict) -> None: ...

  def commit(
    self,
    step: int,
    *,
    timeout_s: float,
    poll_s: float = 0.05,
    metrics: dict | None = None,
    info: dict | None = None,
    written: Callable[[float], bool] | None = None,
  ) -> bool: ...


class RedundancyLink(Protocol):
  """A partner or XOR link (redundancy.links.start), as a save uses it. Each method is the
  implementation's own: see its docstring there."""

  overlap: bool
  """Whether the step goes from the staged snapshot during the local write."""

  @property
  def active(self) -> bool: ...

  def send(self, step_dir: str) -> tuple[int, float]: ...

  def send_snapshot(
    self,
    step: int,
    data: np.ndarray,
    spans: Sequence[tuple[int, int]],
    manifest: Callable[[], bytes],
    sent: Callable[[], None],
  ) -> tuple[int, float]: ...

  def send_failed(self, step: int, why: str) -> None: ...
