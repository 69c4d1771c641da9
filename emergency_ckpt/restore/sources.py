"""Reading one restore candidate from each source: this process's part.

Before the status exchange, `Sources.load` reads what this process can of
a candidate step: its own local copy (mapped, verified), the copies on its
host written on another mesh (for a reshard), and its own JSON state (the
data state of the process whose shard it now holds). After the plan,
`Sources.execute` gets the step's tensors from the source the plan names
for this process's slice: its own copy, a peer slice (transport/), other
hosts' copies resharded onto this mesh (reshard_transfer.py), or the
persistent tier (split between the slices when they all read it:
persistent/share.py).

Called by: the restorer (restorer.py), on every process, for each
candidate it tries. `load` blocks on this process's reads only; `execute`
on the collectives of the source it runs (see each module).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax

from emergency_ckpt import transport as peer
from emergency_ckpt.cluster.topology import peer_host
from emergency_ckpt.core import placement
from emergency_ckpt.core import reshard as reshard_lib
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import (
  CorruptCheckpointError,
  StateMismatchError,
  TopologyMismatchError,
)
from emergency_ckpt.local.format import LocalStep
from emergency_ckpt.persistent import share as persistent_share
from emergency_ckpt.restore import plan as restore_plan
from emergency_ckpt.restore import reshard_transfer
from emergency_ckpt.transport.listener import Security

if TYPE_CHECKING:
  import numpy as np

  from emergency_ckpt.cluster.context import JobContext
  from emergency_ckpt.restore.tiers import LocalSource, PersistentSource, StateSource

logger = logging.getLogger("emergency_ckpt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """What a restore restores onto: the abstract tree, flattened."""

  abstract_state: Any
  """The tree of jax.ShapeDtypeStruct (with shardings) restore() got."""
  paths: list[str]
  """Its leaf paths (shards.leaf_paths)."""
  abstract: list[Any]
  """Its leaves, in `paths` order."""
  treedef: Any
  """Its structure, to unflatten the restored arrays."""

  @classmethod
  def of(cls, abstract_state: Any) -> Target:
    """Flattens `abstract_state`.

    Args:
      abstract_state: the tree to restore onto.

    Returns:
      Its Target.
    """
    paths, abstract, treedef = shards_lib.leaf_paths(abstract_state)
    return cls(abstract_state=abstract_state, paths=paths, abstract=abstract, treedef=treedef)

  def tree(self, arrays: Sequence[Any]) -> Any:
    """The restored tree.

    Args:
      arrays: one array per leaf, in `paths` order.

    Returns:
      `arrays` in the abstract tree's structure.
    """
    return jax.tree_util.tree_unflatten(self.treedef, arrays)


@dataclasses.dataclass
class _Copies:
  """A host's verified copies of a step written on another mesh."""

  copies: dict[int, LocalStep] = dataclasses.field(default_factory=dict)
  """{saved process: LocalStep, arrays in the restored tree's order}."""
  layout: dict | None = None
  """reshard.SavedLayout JSON (None if this host holds no copy)."""
  slice_processes: list = dataclasses.field(default_factory=list)
  """The saved topology's slice_processes."""
  partner: set[int] = dataclasses.field(default_factory=set)
  """Saved processes whose copy here came from them as their partner."""
  xor_files: dict[tuple[int, str], np.ndarray] = dataclasses.field(default_factory=dict)
  """{(saved process, "data" | "parity"): bytes} for XOR rebuilds."""
  xor_groups: dict[int, dict] = dataclasses.field(default_factory=dict)
  """{saved process: its parity block's group.json body}."""
  unverified: set[int] = dataclasses.field(default_factory=set)
  """Saved processes whose copy here is not checked yet (a partner's: each
  shard is checked once, where it is used or received)."""


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What this process read of a candidate before the status exchange."""

  status: restore_plan.Status
  """What it could read (sent to the others only if something failed)."""
  local: LocalStep | _Copies | None
  """Its own verified local copy, or its host's copies written on another
  mesh, or None."""
  data_state: Any
  """Its saved data state (encoded), or None."""
  saved_count: int | None
  """How many processes saved the step (its COMMIT), if known."""


class Sources:
  """This process's reads of a restore candidate, from each source."""

  def __init__(
    self,
    ctx: JobContext,
    *,
    local: LocalSource,
    persistent: PersistentSource,
    state: StateSource,
  ):
    """Args:
    ctx: the job.
    local: this process's local tier.
    persistent: the persistent tier.
    state: the state store.
    """
    self._ctx = ctx
    self._local = local
    self._persistent = persistent
    self._state = state

  def load(self, cand: restore_plan.Candidate, target: Target) -> Loaded:
    """Reads what this process can of `cand`: its local copy (if its slice
    holds the step), its host's copies written on another mesh (a reshard
    candidate), and its JSON state. Called by: every process. Blocks on
    this process's reads only.

    Args:
      cand: the candidate step.
      target: what the restore restores onto.

    Returns:
      What was read, and the status to report (a local copy or JSON state
      that fails verification is reported there, not raised).
    """
    topo = self._ctx.topology
    local_ok, error, mismatch, local, saved_count = None, None, None, None, None
    reshard_bad: tuple[int, ...] = ()
    if cand.reshard and not cand.local_slices:  # copies written on another mesh
      local, reshard_bad = self._read_copies(cand, target)
    if topo.slice_index in cand.local_slices:
      try:
        local = self._local.read(cand.step, target.paths, target.abstract)
        local_ok = True
      except StateMismatchError as e:
        local_ok, mismatch = False, str(e)
      except (CorruptCheckpointError, TopologyMismatchError, OSError) as e:
        local_ok, error = False, f"local copy: {e}"
        logger.warning("%s local copy of step %d unusable: %s", topo.log_prefix(), cand.step, e)
    try:
      record = self._state.record(cand.step)
      saved_count = None if record is None else record["process_count"]
      if saved_count is not None and saved_count != topo.process_count:
        # Per-process iterator positions cannot be mapped onto another
        # process count: the tensors restore (resharded), data_state is None.
        logger.warning(
          "%s step %d was saved by %d processes, this job has %d: data_state is None"
          " unless restore(data_state_remap=...) maps the saved states onto this job;"
          " else re-initialise the data pipeline for the new topology.",
          topo.log_prefix(),
          cand.step,
          saved_count,
          topo.process_count,
        )
        data_state, state_ok = None, True
      else:
        data_state = self._state.read(cand.step, self._data_source(cand.step, record))
        state_ok = True
    except CorruptCheckpointError as e:
      data_state, state_ok = None, False
      error = f"{error}; state: {e}" if error else f"state: {e}"
    status = restore_plan.Status(local_ok, state_ok, error, mismatch, reshard_bad)
    return Loaded(status, local, data_state, saved_count)

  def _data_source(self, step: int, record: dict | None) -> int:
    """Whose saved data state is this process's: the saved process whose
    first device sat where this process's first device sits (its data
    shard), when the step's COMMIT recorded where (process_origin) on a mesh
    of this shape; else this process's own index."""
    topo = self._ctx.topology
    me = topo.process_index
    fp = ((record or {}).get("info") or {}).get("topology") or {}
    saved, mine = fp.get("process_origin"), topo.process_origin
    if not saved or mine is None or list(fp.get("mesh_shape", ())) != list(topo.mesh_shape):
      return me
    try:
      source = list(saved).index(mine[me])
    except ValueError:
      return me
    if source != me:
      logger.info(
        "%s step %d: data_state saved by process %d, which held this process's mesh coordinates",
        topo.log_prefix(),
        step,
        source,
      )
    return source

  def _read_copies(
    self, cand: restore_plan.Candidate, target: Target
  ) -> tuple[_Copies, tuple[int, ...]]:
    """This host's copies of `cand` from its complete saved slices, each
    verified shard by shard, and the saved slices whose copy failed (all of
    them if the saved layout cannot feed the target)."""
    topo = self._ctx.topology
    paths = target.paths
    shapes = [tuple(a.shape) for a in target.abstract]
    dtypes = [shards_lib.dtype_name(a.dtype) for a in target.abstract]
    out = _Copies()
    bad: set[int] = set()
    for process, (where, copy) in sorted(self._local.copies().get(cand.step, {}).items()):
      if copy.topology != cand.reshard_topology or copy.slice not in cand.reshard:
        continue
      try:  # a partner's copy: each shard is checked where it is used (reshard_transfer)
        step = self._local.read_copy(where, verify=not copy.partner)
      except (OSError, CorruptCheckpointError) as e:  # CorruptCheckpointError is an OSError
        logger.warning("%s copy %s of step %d unusable: %s", topo.log_prefix(), where, cand.step, e)
        bad.add(copy.slice)
        continue
      layout = reshard_lib.SavedLayout.from_manifest(step.manifest)
      problem = "it records no layout" if layout is None else layout.problem(paths, shapes, dtypes)
      if problem:
        logger.warning(
          "%s step %d cannot be resharded from ramdisk copies: %s",
          topo.log_prefix(),
          cand.step,
          problem,
        )
        return out, tuple(cand.reshard)
      by_path = dict(zip([leaf["path"] for leaf in step.manifest["leaves"]], step.arrays))
      out.copies[process] = dataclasses.replace(step, arrays=[by_path[p] for p in paths])
      if copy.partner:
        out.partner.add(process)
        out.unverified.add(process)
      elif cand.reshard_parity.get(copy.slice):  # a group of its slice needs a rebuild
        parity = self._local.parity().get(cand.step, {}).get(process)
        if parity is not None and parity.copy.topology == copy.topology:
          try:
            out.xor_files.update(self._local.xor_files(where, parity))
            out.xor_groups[process] = parity.body
          except (OSError, CorruptCheckpointError) as e:
            logger.warning("%s parity block %s unusable: %s", topo.log_prefix(), parity.where, e)
            bad.add(copy.slice)
      out.layout = layout.to_json()
      out.slice_processes = step.manifest["topology"]["slice_processes"]
    return out, tuple(sorted(bad))

  def execute(
    self,
    plan: restore_plan.RestorePlan,
    target: Target,
    loaded: Loaded,
    *,
    read_shared: bool,
  ) -> tuple[Any, str]:
    """Gets the step's tensors from the source `plan` names for this
    process's slice. Called by: every process, with the same plan. Blocks
    on that source's transfer or read.

    Args:
      plan: the agreed plan.
      target: what the restore restores onto.
      loaded: what load() read of the plan's step.
      read_shared: whether the slices may split a persistent read.

    Returns:
      (the restored tree on this process's devices, where this process's
      tensors came from: "local", "peer", "partner", "parity" or
      "persistent").

    Raises:
      PeerTransferError: a peer or reshard transfer failed (on every
        process alike).
      CorruptCheckpointError: a persistent shard fails its checksum.
    """
    ctx, topo = self._ctx, self._ctx.topology
    options, local = ctx.options, loaded.local
    mine = plan.sources[topo.slice_index]
    if plan.reshard_slices:
      copies = local if isinstance(local, _Copies) else _Copies()
      saved = None
      if copies.layout is not None:
        sources = [copies.slice_processes[s] for s in plan.reshard_slices]
        saved = {"layout": copies.layout, "sources": sources}
      redundancy = reshard_transfer.ReshardRedundancy(
        partner_held=copies.partner,
        unverified=copies.unverified,
        partner_only=plan.reshard_partner,
        parity_only=plan.reshard_parity,
        groups=plan.reshard_groups,
        xor_files=copies.xor_files,
        xor_groups=copies.xor_groups,
      )
      arrays, source = reshard_transfer.transfer(
        ctx, plan.step, target.abstract, target.paths, copies.copies, saved, redundancy
      )
      return target.tree(arrays), source
    if plan.peer_source is not None:
      intact = [s for s, src in enumerate(plan.sources) if src == restore_plan.LOCAL]
      intact.sort(key=lambda s: s != plan.peer_source)  # the planned source first
      lost = [s for s, src in enumerate(plan.sources) if src == restore_plan.PEER]
      arrays = peer.transfer(
        plan.step,
        target.abstract,
        target.paths,
        local if mine == restore_plan.LOCAL else None,
        options=options.peer,
        mesh=ctx.mesh,
        topology=topo,
        collectives=ctx.collectives,
        intact=intact,
        lost=lost,
        timeout_s=options.collective_timeout_s,
      )
      return target.tree(arrays), mine
    if mine == restore_plan.LOCAL:
      # Its own private mapping, kept from recycling while mapped: every leaf aliases it.
      arrays = placement.assemble_many(target.abstract, local.arrays, copy_small=False)
      return target.tree(arrays), mine
    expected = self._state.expected_crcs(plan.step, loaded.saved_count or topo.process_count)
    if read_shared:  # every slice reads the persistent tier: split it
      arrays = persistent_share.read_shared(
        plan.step,
        target.abstract_state,
        persistent=self._persistent,
        expected=expected,
        mesh=ctx.mesh,
        topology=topo,
        collectives=ctx.collectives,
        host=peer_host(options.peer.host),
        timeout_s=options.collective_timeout_s,
        ports=options.peer.port_range,
        readers=options.persistent.shared_read_slices,
        security=Security.of(options.peer),
      )
      if arrays is not None:
        return target.tree(arrays), mine
    return self._persistent.restore(plan.step, target.abstract_state, expected), mine
