"""Executing a restore: try the newest candidate step, fall back, agree.

For each candidate step (newest first, from the inventory exchange):
1. every process reads what it can: its own local copy (mapped, verified)
   and its own JSON state;
2. one status exchange (only failures are sent); the pure plan
   (restore_plan.decide) says where each
   slice gets the step: its own copy, a peer slice, or the persistent tier;
3. execute: nothing more if every slice is intact, a peer transfer to the
   slices that lost it (on failure, every process alike falls back to the
   persistent tier or an older step), or a persistent read.
Then newer, unrestorable leftovers are discarded, so new saves never mix
with them (a barrier only when the primary deletes state folders).

Called by: every process; see CheckpointManager.restore for what it blocks on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from emergency_ckpt import transport as peer
from emergency_ckpt.cluster.topology import peer_host
from emergency_ckpt.core import reshard as reshard_lib
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import (
  CorruptCheckpointError,
  EmergencyCheckpointError,
  NoRestorableCheckpointError,
  PeerTransferError,
  StateMismatchError,
  StepNotRestorableError,
  TopologyMismatchError,
)
from emergency_ckpt.persistent import share as persistent_share
from emergency_ckpt.restore import plan as restore_plan
from emergency_ckpt.transport import reshard_stream

logger = logging.getLogger("emergency_ckpt")


@dataclasses.dataclass(frozen=True)
class RestoreResult:
  """What restore() gives this process."""

  step: int
  state: Any
  data_state: Any
  """This process's own data_state of `step` (what get_state() returned, if
  an object was saved); None if the step was saved by another process count."""
  source: str
  """Where this process got the tensors: "local" (its own host's ramdisk),
  "peer" (another slice, or other hosts' copies resharded onto this mesh),
  "partner" / "parity" (a lost host rebuilt inside its slice:
  local.redundancy), or "persistent"."""


@dataclasses.dataclass(frozen=True)
class Outcome:
  """A restored step, before the data state is decoded."""

  step: int
  state: Any
  data_state: Any
  source: str


class Restorer:
  """Restores a step on this process, in agreement with every other."""

  def __init__(
    self,
    options,
    *,
    topology,
    mesh,
    collectives,
    local,
    persistent,
    state,
    staging,
    events,
    orbax_start=lambda: None,
  ):
    """`orbax_start`: starts Orbax's load (OrbaxLoader.start), whose set-up
    is a barrier of every process: every process calls it before a plan
    that reads the persistent tier, whether or not it reads itself."""
    self._options = options
    self._orbax_start = orbax_start
    self._staging = staging
    self._events = events
    self._topology = topology
    self._mesh = mesh
    self._collectives = collectives
    self._local = local
    self._persistent = persistent
    self._state = state
    self._read_shared = False  # set per restore: may the slices split a persistent read?
    self._reshard_source = restore_plan.LOCAL  # where a reshard found this process's bytes

  def restore(
    self,
    abstract_state: Any,
    job: restore_plan.JobInventory,
    step: int | None,
    started: float,
  ) -> Outcome:
    """The newest restorable step (or `step`) of `job` onto abstract_state's
    shardings. Raises NoRestorableCheckpointError / StepNotRestorableError
    naming what was found, StateMismatchError if abstract_state does not fit.
    Either way (unless mismatched) it records a restore event (`started`:
    time.monotonic() when restore() began) and prepares the next save's
    staging buffer in the background, while the trainer goes on."""
    paths, abstract, treedef = shards_lib.leaf_paths(abstract_state)
    out, tried = self._restore(abstract_state, paths, abstract, treedef, job, step)
    self._staging.prepare(paths, abstract)
    if out is None:
      error = self._absence(job, step, tried)
      self._record(started, None, None, 0, tried, str(error))
      raise error
    nbytes = int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in abstract))
    self._record(started, out.step, out.source, nbytes, tried, None)
    return out

  def _record(self, started, step, source, nbytes, tried, error) -> None:
    self._events.record(
      "restore",
      step=step,
      source=source,
      duration_s=round(time.monotonic() - started, 6),
      bytes=nbytes,
      tried=tried,
      error=error,
    )

  def _restore(
    self, abstract_state, paths, abstract, treedef, job, step
  ) -> tuple[Outcome | None, list[str]]:
    """(the restored step or None, why candidates were rejected)."""
    topo = self._topology
    cands = restore_plan.candidates(job, step=step)
    peer_problem = peer.check_peer_compatible(paths, abstract, self._mesh, topo.replica_axis_name)
    options = self._options
    self._read_shared = (
      options.persistent.shared_read
      and options.peer.transport == "stream"
      and topo.num_slices > 1
      and not peer_problem
    )
    tried: list[str] = []
    damaged = False  # a persistent step was found damaged
    for cand in cands:
      status, local, data_state, saved_count = self._try_load(cand, paths, abstract)
      got = self._collectives.gather_sparse(
        f"restore_status_{cand.step}", None if status.is_ok else status.to_json()
      )
      statuses = {p: restore_plan.Status.from_json(v) for p, v in got.items()}  # failures
      mismatch = next((s.mismatch for s in statuses.values() if s.mismatch), None)
      if mismatch:
        raise StateMismatchError(mismatch)
      if peer_problem:  # no slice can serve another: a partial loss needs persistent
        cand = _without_peer(cand, topo.num_slices)
      plan = restore_plan.decide(cand, statuses, topo.slice_processes)
      if plan is None:
        why = {p: s.error for p, s in statuses.items() if s.error}
        logger.warning(
          "%s step %d is not restorable after verification: %s", topo.log_prefix(), cand.step, why
        )
        tried.append(f"step {cand.step}: {why}")
        continue
      run = (abstract_state, paths, abstract, treedef, local, saved_count)
      try:
        try:
          state = self._run(plan, *run)
        except PeerTransferError as e:  # raised on every process alike
          plan = restore_plan.decide(
            _without_peer(cand, topo.num_slices), statuses, topo.slice_processes
          )
          logger.warning(
            "%s %s; %s",
            topo.log_prefix(),
            e,
            "reading the step from the persistent tier" if plan else "trying an older step",
          )
          if plan is None:
            tried.append(f"step {cand.step}: {e}")
            continue
          state = self._run(plan, *run)
      except _Damaged as e:  # on every process alike
        tried.append(f"step {cand.step}: {e}")
        damaged = True
        continue
      source = self._reshard_source if plan.reshard_slices else plan.sources[topo.slice_index]
      logger.info("%s restored step %d from %s", topo.log_prefix(), plan.step, source)
      self._discard_newer(plan.step, {c.step for c in cands}, job.state_uncommitted)
      return Outcome(plan.step, state, data_state, source), tried
    if damaged:  # nothing left, and a persistent step was damaged: say which leaf
      raise CorruptCheckpointError(
        f"no restorable checkpoint: {'; '.join(tried)}. The persistent tier's copies"
        " are damaged and no ramdisk holds these steps: start from scratch, or restore"
        " a copy of the bucket."
      )
    return None, tried

  def _absence(self, job, step: int | None, tried: list[str]) -> EmergencyCheckpointError:
    """The error for 'nothing restorable', naming what was found."""
    dirs = (
      f"local {self._local.directory} (per process), persistent"
      f" {self._options.persistent.directory}"
    )
    detail = restore_plan.describe_absence(job)
    if tried:
      detail += "; rejected after verification: " + "; ".join(tried)
    if step is not None:
      return StepNotRestorableError(
        f"step {step} is not restorable. Looked in {dirs}. {detail}. Call"
        " all_steps() for the restorable steps."
      )
    return NoRestorableCheckpointError(
      f"no restorable checkpoint. Looked in {dirs}. {detail}. Start from"
      " scratch, or point the options at the run's directories."
    )

  def _discard_newer(self, restored: int, restorable: set[int], uncommitted: Sequence[int]) -> None:
    """Training resumes at restored + 1 and will save those steps again: what
    a crashed run left of unrestorable newer steps (a local copy, a JSON
    without COMMIT) must not mix with the new saves. Restorable steps are
    kept. Each process deletes its own local copies (nobody else writes
    there); the primary deletes the newer state folders without COMMIT that
    the inventory listed (`uncommitted`, the job summary's: no second
    listing), and then only, a barrier, so that no process saves a JSON
    into a folder being deleted. The same decision on every process."""
    for step in self._local.held_steps():
      if step > restored and step not in restorable:
        self._local.delete(step)
    doomed = [s for s in uncommitted if s > restored]
    if not doomed:
      return
    if self._topology.is_primary_process:
      for step in doomed:
        self._state.delete(step)
    self._collectives.barrier(f"restore_discard_{restored}")

  def _try_load(self, cand, paths, abstract):
    topo = self._topology
    local_ok, error, mismatch, local, saved_count = None, None, None, None, None
    reshard_bad: tuple[int, ...] = ()
    if cand.reshard and not cand.local_slices:  # copies written on another mesh
      local, reshard_bad = self._read_copies(cand, paths, abstract)
    if topo.slice_index in cand.local_slices:
      try:
        local = self._local.read(cand.step, paths, abstract)
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
    return status, local, data_state, saved_count

  def _data_source(self, step: int, record: dict | None) -> int:
    """Whose saved data state is this process's: the saved process whose
    first device sat where this process's first device sits (its data
    shard), when the step's COMMIT recorded where (process_origin) on a mesh
    of this shape; else this process's own index."""
    topo = self._topology
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

  def _read_copies(self, cand, paths, abstract) -> tuple[_Copies, tuple[int, ...]]:
    """This host's copies of `cand` from its complete saved slices, each
    verified shard by shard, and the saved slices whose copy failed (all of
    them if the saved layout cannot feed `abstract`)."""
    topo = self._topology
    shapes = [tuple(a.shape) for a in abstract]
    dtypes = [shards_lib.dtype_name(a.dtype) for a in abstract]
    out = _Copies()
    bad: set[int] = set()
    for process, (where, copy) in sorted(self._local.copies().get(cand.step, {}).items()):
      if copy.topology != cand.reshard_topology or copy.slice not in cand.reshard:
        continue
      try:  # a partner's copy: each shard is checked where it is used (reshard_stream)
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

  def _execute(self, plan, abstract_state, paths, abstract, treedef, local, saved_count):
    """The restored tree, on this process's devices. `saved_count`: how
    many processes saved the step (its COMMIT, read by _try_load)."""
    topo = self._topology
    if plan.reshard_slices:
      copies = local if local is not None else _Copies()
      saved = None
      if copies.layout is not None:
        sources = [copies.slice_processes[s] for s in plan.reshard_slices]
        saved = {"layout": copies.layout, "sources": sources}
      arrays, self._reshard_source = reshard_stream.transfer(
        plan.step,
        abstract,
        paths,
        copies.copies,
        saved,
        partner_held=copies.partner,
        unverified=copies.unverified,
        partner_only=plan.reshard_partner,
        parity_only=plan.reshard_parity,
        groups=plan.reshard_groups,
        xor_files=copies.xor_files,
        xor_groups=copies.xor_groups,
        topology=topo,
        collectives=self._collectives,
        host=peer_host(self._options.peer.host) if copies.copies else None,
        timeout_s=self._options.collective_timeout_s,
        ports=self._options.peer.port_range,
      )
      return jax.tree_util.tree_unflatten(treedef, arrays)
    if plan.peer_source is not None:
      intact = [s for s, src in enumerate(plan.sources) if src == restore_plan.LOCAL]
      intact.sort(key=lambda s: s != plan.peer_source)  # the planned source first
      lost = [s for s, src in enumerate(plan.sources) if src == restore_plan.PEER]
      mine = local if plan.sources[topo.slice_index] == restore_plan.LOCAL else None
      arrays = peer.transfer(
        plan.step,
        abstract,
        paths,
        mine,
        options=self._options.peer,
        mesh=self._mesh,
        topology=topo,
        collectives=self._collectives,
        intact=intact,
        lost=lost,
        timeout_s=self._options.collective_timeout_s,
      )
      return jax.tree_util.tree_unflatten(treedef, arrays)
    if plan.sources[topo.slice_index] == restore_plan.LOCAL:
      arrays = [shards_lib.assemble(a, by_index) for a, by_index in zip(abstract, local.arrays)]
      return jax.tree_util.tree_unflatten(treedef, arrays)
    expected = self._state.expected_crcs(plan.step, saved_count or topo.process_count)
    if self._read_shared:  # every slice reads the persistent tier: split it
      arrays = persistent_share.read_shared(
        plan.step,
        abstract_state,
        persistent=self._persistent,
        expected=expected,
        mesh=self._mesh,
        topology=topo,
        collectives=self._collectives,
        host=peer_host(self._options.peer.host),
        timeout_s=self._options.collective_timeout_s,
        ports=self._options.peer.port_range,
        readers=self._options.persistent.shared_read_slices,
      )
      if arrays is not None:
        return jax.tree_util.tree_unflatten(treedef, arrays)
    return self._persistent.restore(plan.step, abstract_state, expected)

  def _run(self, plan, *run):
    """_execute, then (if any slice read the persistent tier) one exchange
    of the persistent readers' failures: a shard that failed its checksum
    on any process raises _Damaged on every process (the step is skipped);
    any other failure raises on every process."""
    if restore_plan.PERSISTENT not in plan.sources:
      return self._execute(plan, *run)
    # Every process alike (the same plan): a slice that reads nothing itself
    # (the shared read's receivers) must still join Orbax's set-up barrier.
    self._orbax_start()
    state, failure, raised = None, None, None
    try:
      state = self._execute(plan, *run)
    except CorruptCheckpointError as e:
      failure = {"corrupt": True, "error": str(e)}
      logger.warning("%s persistent step %d: %s", self._topology.log_prefix(), plan.step, e)
    except Exception as e:
      failure, raised = {"corrupt": False, "error": f"{type(e).__name__}: {e}"}, e
    failures = self._collectives.gather_sparse(f"persistent_read_{plan.step}", failure)
    if raised is not None:
      raise raised
    fatal = {p: f["error"] for p, f in failures.items() if not f["corrupt"]}
    if fatal:
      raise EmergencyCheckpointError(
        f"reading persistent step {plan.step} failed on processes {sorted(fatal)}:"
        f" {next(iter(fatal.values()))}. See those processes' logs."
      )
    if failures:
      first = min(failures)
      error = failures[first]["error"]
      where = "" if error.startswith("process ") else f"process {first}: "
      raise _Damaged(f"persistent step {plan.step} is damaged ({where}{error})")
    return state


@dataclasses.dataclass
class _Copies:
  """A host's verified copies of a step written on another mesh."""

  copies: dict[int, Any] = dataclasses.field(default_factory=dict)
  """{saved process: LocalStep, arrays in the restored tree's order}."""
  layout: dict | None = None
  """reshard.SavedLayout JSON (None if this host holds no copy)."""
  slice_processes: list = dataclasses.field(default_factory=list)
  """The saved topology's slice_processes."""
  partner: set[int] = dataclasses.field(default_factory=set)
  """Saved processes whose copy here came from them as their partner."""
  xor_files: dict = dataclasses.field(default_factory=dict)
  """{(saved process, "data" | "parity"): bytes} for XOR rebuilds."""
  xor_groups: dict = dataclasses.field(default_factory=dict)
  """{saved process: its parity block's group.json body}."""
  unverified: set[int] = dataclasses.field(default_factory=set)
  """Saved processes whose copy here is not checked yet (a partner's: each
  shard is checked once, where it is used or received)."""


class _Damaged(Exception):
  """A persistent read failed its checksums somewhere: skip the step (every process)."""


def _without_peer(cand: restore_plan.Candidate, num_slices: int) -> restore_plan.Candidate:
  """Local copies count only if every slice has one (no peer can serve)."""
  if len(cand.local_slices) == num_slices:
    return cand
  return restore_plan.Candidate(cand.step, (), cand.in_persistent)
