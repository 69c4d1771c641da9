"""Restoring ramdisk copies written on another mesh: every process assembles
its new shards from the saved shards that overlap them (reshard.py plans),
reading copies on its own host and pulling boxes from the processes that
hold the rest, over the authenticated streams of stream.py.

Each copy was verified shard by shard when read (local_read); a box sent
over the network carries a CRC32C computed as it is cut, checked on arrival.

Called by: every process. Coordination, per process: the saved layout (one
key published by the first holder, read by those that hold no copy), the
holders' offers (one key per saved process held, read only by the
processes that pull from it), then one agreement (gather_sparse). Blocks
until every process has its shards, or raises PeerTransferError on every
process alike (the restore then falls back to the persistent tier).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from emergency_ckpt import reshard
from emergency_ckpt import shards as shards_lib
from emergency_ckpt.errors import CollectiveTimeoutError, CorruptCheckpointError, PeerTransferError
from emergency_ckpt.local_format import LocalStep, checksum_ok
from emergency_ckpt.peer import stream
from emergency_ckpt.staging import aligned_empty

logger = logging.getLogger("emergency_ckpt")


def merged(step: int, copies: Mapping[int, LocalStep], paths: Sequence[str]) -> LocalStep:
  """One LocalStep serving every shard of `copies` (each in `paths` order),
  for stream.Server: the same index in two copies holds the same bytes."""
  arrays: list[dict] = [{} for _ in paths]
  records: list[dict] = [{} for _ in paths]
  for local in copies.values():
    saved = {leaf["path"]: leaf for leaf in local.manifest["leaves"]}
    for leaf_no, (path, by_index) in enumerate(zip(paths, local.arrays)):
      for index, arr in by_index.items():
        arrays[leaf_no].setdefault(index, arr)
      for rec in saved[path]["shards"]:
        records[leaf_no].setdefault(tuple(tuple(r) for r in rec["index"]), rec)
  leaves = [{"path": p, "shards": list(r.values())} for p, r in zip(paths, records)]
  return LocalStep(step, {"leaves": leaves}, arrays)


def transfer(
  step: int,
  abstract: Sequence[Any],
  paths: Sequence[str],
  copies: Mapping[int, LocalStep],
  saved: Mapping[str, Any] | None,
  *,
  partner_held: set[int] = frozenset(),
  partner_only: Sequence[Sequence[int]] = (),
  topology,
  collectives,
  host: str | None,
  timeout_s: float,
  ports: tuple[int, int] | None = None,
) -> tuple[list, str]:
  """(the step's arrays on this process, and where its bytes came from:
  "local" (this host's copies), "partner" (some from a partner's copy on
  another host) or "peer"). `copies`: {saved process: its verified
  copy on this host, arrays in `paths` order}; `saved`: what every holder
  publishes ({"layout": SavedLayout JSON, "sources": the saved process
  lists of the serving saved slices}), None on a process with no copy.
  `partner_held`: saved processes whose copy here its partner received
  (peer/partner.py); `partner_only`: per serving saved slice, the
  positions only such copies hold (the plan's: they are pulled from there).
  Raises PeerTransferError on every process if any failed."""
  me = topology.process_index
  server, offer, error = None, None, None
  if copies:
    try:
      if host is None:
        raise OSError("no address: set peer.host (see PeerOptions)")
      server = stream.Server(
        host,
        merged(step, copies, paths),
        paths,
        timeout_s=timeout_s,
        log_prefix=topology.log_prefix(),
        ports=ports,
      )
      offer = server.offer()
    except OSError as e:
      offer = {"error": f"cannot listen on {host!r}: {e}"}
  arrays, remote = None, None
  try:
    try:
      got = collectives.exchange_keyed(
        f"reshard_layout_{step}",
        {} if saved is None else {"layout": saved},
        wanted=[] if saved is not None else ["layout"],
        timeout_s=timeout_s,
      )
      saved = saved if saved is not None else got["layout"]
      layout = shards_lib.layout_for(paths, abstract)
      pieces = reshard.plan_pieces(
        layout,
        reshard.SavedLayout.from_json(saved["layout"]),
        saved["sources"],
        set(copies),
        me,
      )
      gap = reshard.covered(layout, pieces)
      if gap:
        raise PeerTransferError(f"the saved shards do not cover this process's: {gap}")
    except (CollectiveTimeoutError, KeyError, TypeError, ValueError) as e:
      pieces, error = [], f"process {me}: no saved layout ({type(e).__name__}: {e})"
    except PeerTransferError as e:
      pieces, error = [], f"process {me}: {e}"
    by_sender: dict[int, list[reshard.Piece]] = {}
    for p in pieces:
      if not p.local:
        by_sender.setdefault(p.saved_process, []).append(p)
    only = set()
    if saved is not None:
      for i, procs in enumerate(saved["sources"]):
        held = set(partner_only[i]) if i < len(partner_only) else set()
        only.update(sp for pos, sp in enumerate(procs) if pos in held)
    keys = {sp: f"r{sp}" if sp in only else f"p{sp}" for sp in by_sender}
    try:
      offers = collectives.exchange_keyed(
        f"reshard_offer_{step}",
        {f"r{sp}" if sp in partner_held else f"p{sp}": offer for sp in copies}
        if offer is not None
        else {},
        wanted=sorted(keys.values()),
        timeout_s=timeout_s,
      )
      offers = {sp: offers.get(key) for sp, key in keys.items()}
    except CollectiveTimeoutError as e:
      offers, error = {}, error or f"process {me}: no address from a holder ({e})"
    if error is None:
      try:
        buffer = aligned_empty(layout.nbytes)
        for p in pieces:
          if p.local:
            src = copies[p.saved_process].arrays[p.leaf][p.index]
            _dest(buffer, layout, p)[...] = src[reshard.relative(p.box, p.index)]
        _pull_all(offers, by_sender, layout, paths, buffer, step=step, timeout_s=timeout_s)
        arrays = shards_lib.assemble_buffer(abstract, layout, buffer)
        remote = "partner" if only & set(by_sender) else "peer" if by_sender else None
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
    if server is not None:
      server.close()
  failed = [e for _, e in sorted(outcome.items())]
  if failed:
    raise PeerTransferError(
      f"resharding step {step} from the ramdisk copies failed: " + "; ".join(failed)
    )
  return arrays, remote or "local"


def _dest(buffer: np.ndarray, layout: shards_lib.Layout, p: reshard.Piece) -> np.ndarray:
  """The part of the new shard's slot in `buffer` that piece `p` fills."""
  view = shards_lib.view(buffer, layout.leaves[p.leaf], p.slot)
  return view[(*reshard.relative(p.box, p.slot.index), Ellipsis)]  # a view, even of a scalar


def _pull_all(offers, by_sender, layout, paths, buffer, *, step: int, timeout_s: float) -> None:
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


def _pull(offer, sender, items, layout, paths, buffer, step, timeout_s) -> None:
  """`items` (pieces held by saved process `sender`) into `buffer`, each
  checked against the checksum its holder computed as it cut the box."""
  offer = offer or {"error": "nobody published its address"}
  request = [
    [p.leaf, paths[p.leaf], [list(r) for r in p.index], [list(r) for r in p.box]] for p in items
  ]
  with stream.request(offer, sender, step, request, timeout_s=timeout_s) as (sock, records):
    for p, record in zip(items, records):
      dtype = layout.leaves[p.leaf].dtype
      shape = shards_lib.shard_shape(p.box)
      nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
      where = f"leaf {paths[p.leaf]} box {p.box} of step {step} from saved process {sender}"
      if record.get("nbytes") != nbytes:
        raise CorruptCheckpointError(f"{where}: {record.get('nbytes')} bytes, expected {nbytes}")
      raw = aligned_empty(nbytes)
      stream.recv_into(sock, raw)
      if not checksum_ok(raw, record):
        raise CorruptCheckpointError(f"{where} fails its checksum on arrival")
      _dest(buffer, layout, p)[...] = raw.view(dtype).reshape(shape)
