"""Restoring ramdisk copies written on another mesh: every process assembles
its new shards from the saved shards that overlap them (core/reshard.py
plans the pieces), reading copies on its own host and pulling boxes from
the processes that hold the rest (transport/stream.py). Saved processes no
copy holds are first rebuilt from XOR parity (reshard_rebuild.py).

Each copy was verified shard by shard when read, except a partner's, whose
shards are checked here where they are used or cut for a receiver; a box
sent over the network carries a CRC32C computed as it is cut, checked on
arrival.

Called by: the restorer (sources.py), on every process. Coordination: the
saved layout (one key, published by the first holder), the holders' offers
(one key per saved process held, read only by those that pull from it),
then one agreement (gather_sparse). Blocks until every process has its
shards, or raises PeerTransferError on every process alike.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

import numpy as np

from emergency_ckpt.cluster.topology import peer_host
from emergency_ckpt.core import placement, reshard
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CollectiveTimeoutError, CorruptCheckpointError, PeerTransferError
from emergency_ckpt.local.format import LocalStep, checksum_ok
from emergency_ckpt.restore import reshard_rebuild
from emergency_ckpt.runtime.buffers import aligned_empty
from emergency_ckpt.transport import protocol, pull, stream
from emergency_ckpt.transport.listener import Security

if TYPE_CHECKING:
  from emergency_ckpt.cluster.context import JobContext

logger = logging.getLogger("emergency_ckpt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReshardRedundancy:
  """What local.redundancy adds to a reshard: partner copies held on this
  host, and the XOR rebuilds the plan asks for. Empty without redundancy."""

  partner_held: Set[int] = frozenset()
  """Saved processes whose copy here came from them as their partner."""
  unverified: Set[int] = frozenset()
  """Saved processes whose copy here is not checked yet (a partner's): each
  shard is checked before it is used here or cut for a receiver (a whole
  shard goes with its recorded checksum, checked by the receiver)."""
  partner_only: Sequence[Sequence[int]] = ()
  """Per serving saved slice (the plan's): positions only partner copies hold."""
  parity_only: Sequence[Sequence[int]] = ()
  """Per serving saved slice: the positions rebuilt from XOR parity."""
  groups: Sequence[Sequence[Sequence[int]]] = ()
  """Per serving saved slice: its XOR groups (positions)."""
  xor_files: Mapping[tuple[int, str], np.ndarray] = dataclasses.field(default_factory=dict)
  """{(saved process, "data" | "parity"): bytes} of copies with their parity block here."""
  xor_groups: Mapping[int, dict] = dataclasses.field(default_factory=dict)
  """{saved process: its parity block's group.json body}."""


def merged(
  step: int,
  copies: Mapping[int, LocalStep],
  paths: Sequence[str],
  unverified: Set[int] = frozenset(),
) -> tuple[LocalStep, set[tuple[int, tuple]]]:
  """One LocalStep serving every shard of `copies`, for stream.Server.

  The same index in two copies holds the same bytes: it is taken from a
  verified copy where one has it.

  Args:
    step: the step the copies hold.
    copies: {saved process: its copy on this host, arrays in `paths` order}.
    paths: the restored tree's leaf paths.
    unverified: saved processes whose copy is not checked yet.

  Returns:
    (the merged step, the (leaf number, index) of the shards taken from an
    `unverified` copy).
  """
  arrays: list[dict] = [{} for _ in paths]
  records: list[dict] = [{} for _ in paths]
  loose = set()
  for sp, local in sorted(copies.items(), key=lambda kv: kv[0] in unverified):
    saved = {leaf["path"]: leaf for leaf in local.manifest["leaves"]}
    for leaf_no, (path, by_index) in enumerate(zip(paths, local.arrays)):
      for index, arr in by_index.items():
        if index not in arrays[leaf_no]:
          arrays[leaf_no][index] = arr
          if sp in unverified:
            loose.add((leaf_no, index))
      for rec in saved[path]["shards"]:
        records[leaf_no].setdefault(tuple(tuple(r) for r in rec["index"]), rec)
  leaves = [{"path": p, "shards": list(r.values())} for p, r in zip(paths, records)]
  return LocalStep(step, {"leaves": leaves}, arrays), loose


def transfer(
  ctx: JobContext,
  step: int,
  abstract: Sequence[Any],
  paths: Sequence[str],
  copies: Mapping[int, LocalStep],
  saved: Mapping[str, Any] | None,
  redundancy: ReshardRedundancy = ReshardRedundancy(),
) -> tuple[list[Any], str]:
  """Assembles this process's shards of `step` from the saved copies.

  Args:
    ctx: the job (topology, collectives, peer options, collective timeout).
    step: the step being restored.
    abstract: the restored tree's leaves (shape, dtype, sharding).
    paths: their paths.
    copies: {saved process: its verified copy on this host, arrays in
      `paths` order}.
    saved: what every holder publishes ({"layout": SavedLayout JSON,
      "sources": the saved process lists of the serving saved slices});
      None on a process with no copy.
    redundancy: partner copies and XOR rebuilds (ReshardRedundancy).

  Returns:
    (the step's arrays on this process, where its bytes came from: "local"
    (this host's copies), "parity" (some rebuilt from XOR parity),
    "partner" (some from a partner's copy on another host) or "peer").

  Raises:
    PeerTransferError: on every process, if any process failed.
  """
  topology, collectives = ctx.topology, ctx.collectives
  timeout_s = ctx.options.collective_timeout_s
  host = peer_host(ctx.options.peer.host) if copies else None
  unverified = redundancy.unverified
  me = topology.process_index
  servers: list = []
  arrays, remote, error, offer = None, None, None, None
  copies = dict(copies)
  try:
    try:
      got = collectives.exchange_keyed(
        f"reshard_layout_{step}",
        {} if saved is None else {"layout": saved},
        wanted=[] if saved is not None else ["layout"],
        timeout_s=timeout_s,
      )
      saved = saved if saved is not None else got["layout"]
      sources = saved["sources"]
    except (CollectiveTimeoutError, KeyError, TypeError) as e:
      sources, error = [], f"process {me}: no saved layout ({type(e).__name__}: {e})"
    keyed = _Keys(sources, redundancy.partner_only, redundancy.parity_only)
    rebuilt, failed = reshard_rebuild.rebuild(
      ctx, step, paths, sources, redundancy, servers, host=host
    )
    error = error or failed
    copies.update(rebuilt)
    if copies:
      try:
        if host is None:
          raise OSError("no address: set peer.host (see PeerOptions)")
        serving, loose = merged(step, copies, paths, unverified)
        servers.append(
          stream.Server(
            host,
            serving,
            paths,
            timeout_s=timeout_s,
            log_prefix=topology.log_prefix(),
            ports=ctx.options.peer.port_range,
            unverified=loose,
            security=Security.of(ctx.options.peer),
          )
        )
        offer = servers[-1].offer()
      except OSError as e:
        offer = {"error": f"cannot listen on {host!r}: {e}"}
    pieces = []
    if error is None:
      try:
        layout = shards_lib.layout_for(paths, abstract)
        pieces = reshard.plan_pieces(
          layout, reshard.SavedLayout.from_json(saved["layout"]), sources, set(copies), me
        )
        gap = reshard.covered(layout, pieces)
        if gap:
          raise PeerTransferError(f"the saved shards do not cover this process's: {gap}")
      except (KeyError, TypeError, ValueError, PeerTransferError) as e:
        pieces, error = [], f"process {me}: {type(e).__name__}: {e}"
    by_sender: dict[int, list[reshard.Piece]] = {}
    for p in pieces:
      if not p.local:
        by_sender.setdefault(p.saved_process, []).append(p)
    keys = {sp: keyed.wanted(sp) for sp in by_sender}
    try:
      published = {
        keyed.mine(sp, sp in redundancy.partner_held, sp in rebuilt): offer for sp in copies
      }
      offers = collectives.exchange_keyed(
        f"reshard_offer_{step}",
        published if offer is not None else {},
        wanted=sorted(keys.values()),
        timeout_s=timeout_s,
      )
      offers = {sp: offers.get(key) for sp, key in keys.items()}
    except CollectiveTimeoutError as e:
      offers, error = {}, error or f"process {me}: no address from a holder ({e})"
    if error is None:
      try:
        buffer = aligned_empty(layout.nbytes)  # pages are touched only where written
        whole: dict[tuple[int, tuple], np.ndarray] = {}  # new shards that are a saved one here
        unchecked = _records(copies, paths, unverified)
        for p in pieces:
          if p.local:
            src = copies[p.saved_process].arrays[p.leaf][p.index]
            if p.saved_process in unverified:
              _check(unchecked, (p.saved_process, p.leaf, p.index), paths, src)
            if p.box == p.index == p.slot.index:  # the copy's own array: nothing copied
              whole[(p.leaf, p.slot.index)] = src
            else:
              _dest(buffer, layout, p)[...] = src[reshard.relative(p.box, p.index)]
        _pull_all(offers, by_sender, layout, paths, buffer, step=step, timeout_s=timeout_s)
        arrays = [
          placement.assemble(
            a,
            {
              slot.index: whole.get((n, slot.index))
              if (n, slot.index) in whole
              else shards_lib.view(buffer, leaf, slot)
              for slot in leaf.slots
            },
          )
          for n, (a, leaf) in enumerate(zip(abstract, layout.leaves))
        ]
        kinds = {keys[sp][0] for sp in by_sender}
        remote = (
          "parity"
          if "x" in kinds or set(rebuilt) & {p.saved_process for p in pieces}
          else "partner"
          if "r" in kinds
          else "peer"
          if by_sender
          else None
        )
      except Exception as e:  # noqa: BLE001 - every process must reach the agreement
        error = f"process {me} ({type(e).__name__}): {e}"
        logger.warning(
          "%s reshard of step %d failed: %s",
          topology.log_prefix(),
          step,
          e,
          exc_info=not isinstance(e, (OSError, PeerTransferError)),
        )
    outcome = collectives.gather_sparse(f"reshard_done_{step}", error)
  finally:
    for server in servers:
      server.close()
  failed = [e for _, e in sorted(outcome.items())]
  if failed:
    raise PeerTransferError(
      f"resharding step {step} from the ramdisk copies failed: " + "; ".join(failed)
    )
  return arrays, remote or "local"


class _Keys:
  """Under which key a holder of saved process sp publishes its offer, and
  which key a receiver reads: "p" (its writer's folder), "r" (a partner's
  copy), "x" (rebuilt from parity), by what the plan says holds it."""

  def __init__(
    self,
    sources: Sequence[Sequence[int]],
    partner_only: Sequence[Sequence[int]],
    parity_only: Sequence[Sequence[int]],
  ):
    self._only: dict[int, str] = {}
    for i, procs in enumerate(sources):
      for kind, per_slice in (("r", partner_only), ("x", parity_only)):
        held = set(per_slice[i]) if i < len(per_slice) else set()
        self._only.update({sp: kind for pos, sp in enumerate(procs) if pos in held})

  def wanted(self, sp: int) -> str:
    return f"{self._only.get(sp, 'p')}{sp}"

  @staticmethod
  def mine(sp: int, partner: bool, rebuilt: bool) -> str:
    return f"{'x' if rebuilt else 'r' if partner else 'p'}{sp}"


def _records(
  copies: Mapping[int, LocalStep], paths: Sequence[str], unverified: Set[int]
) -> dict[tuple[int, int, tuple], dict]:
  """{(saved process, leaf number, index): manifest record} of every shard
  of the copies not verified yet."""
  leaf_no = {path: n for n, path in enumerate(paths)}
  return {
    (sp, leaf_no[leaf["path"]], tuple(tuple(r) for r in s["index"])): s
    for sp in unverified
    if sp in copies
    for leaf in copies[sp].manifest["leaves"]
    if leaf["path"] in leaf_no
    for s in leaf["shards"]
  }


def _check(unchecked: dict, key: tuple, paths: Sequence[str], arr: np.ndarray) -> None:
  """Checks a shard of a copy not verified yet (`key` in `unchecked`, which
  it leaves once checked) against its manifest record; raises
  CorruptCheckpointError."""
  record = unchecked.pop(key, None)
  if record is None:  # checked already
    return
  if not checksum_ok(arr.reshape(-1).view(np.uint8), record):
    sp, leaf, index = key
    raise CorruptCheckpointError(
      f"leaf {paths[leaf]} shard {index} of saved process {sp}'s copy fails its checksum"
    )


def _dest(buffer: np.ndarray, layout: shards_lib.Layout, p: reshard.Piece) -> np.ndarray:
  """The part of the new shard's slot in `buffer` that piece `p` fills."""
  view = shards_lib.view(buffer, layout.leaves[p.leaf], p.slot)
  return view[(*reshard.relative(p.box, p.slot.index), Ellipsis)]  # a view, even of a scalar


def _pull_all(
  offers: Mapping[int, dict | None],
  by_sender: Mapping[int, list[reshard.Piece]],
  layout: shards_lib.Layout,
  paths: Sequence[str],
  buffer: np.ndarray,
  *,
  step: int,
  timeout_s: float,
) -> None:
  """Every remote piece, from every holder at once."""
  if not by_sender:
    return
  pool = concurrent.futures.ThreadPoolExecutor(len(by_sender), "ec-reshard-recv")
  try:
    futures = [
      pool.submit(_pull, offers.get(sp), sp, items, layout, paths, buffer, step, timeout_s)
      for sp, items in by_sender.items()
    ]
    for f in concurrent.futures.as_completed(futures):
      f.result()  # the first failure ends the transfer
  finally:
    pool.shutdown(wait=False, cancel_futures=True)


def _pull(
  offer: dict | None,
  sender: int,
  items: Sequence[reshard.Piece],
  layout: shards_lib.Layout,
  paths: Sequence[str],
  buffer: np.ndarray,
  step: int,
  timeout_s: float,
) -> None:
  """`items` (pieces held by saved process `sender`) into `buffer`, each
  checked against the checksum its holder computed as it cut the box."""
  offer = offer or {"error": "nobody published its address"}
  request = [
    [p.leaf, paths[p.leaf], [list(r) for r in p.index], [list(r) for r in p.box]] for p in items
  ]
  with pull.request(offer, sender, step, request, timeout_s=timeout_s) as (sock, records):
    for p, record in zip(items, records):
      dtype = layout.leaves[p.leaf].dtype
      shape = shards_lib.shard_shape(p.box)
      nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
      where = f"leaf {paths[p.leaf]} box {p.box} of step {step} from saved process {sender}"
      if record.get("nbytes") != nbytes:
        raise CorruptCheckpointError(f"{where}: {record.get('nbytes')} bytes, expected {nbytes}")
      if p.box == p.slot.index:  # the whole new shard: straight into its place
        raw = buffer[p.slot.offset : p.slot.offset + p.slot.nbytes]
      else:
        raw = aligned_empty(nbytes)
      protocol.recv_into(sock, raw)
      if not checksum_ok(raw, record):
        raise CorruptCheckpointError(f"{where} fails its checksum on arrival")
      if p.box != p.slot.index:
        _dest(buffer, layout, p)[...] = raw.view(dtype).reshape(shape)
