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

from emergency_ckpt.core import reshard
from emergency_ckpt.core import shards as shards_lib
from emergency_ckpt.errors import CollectiveTimeoutError, CorruptCheckpointError, PeerTransferError
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local.format import LocalStep, checksum_ok
from emergency_ckpt.redundancy import xor as xor_lib
from emergency_ckpt.runtime.staging import aligned_empty
from emergency_ckpt.transport import stream

logger = logging.getLogger("emergency_ckpt")


def merged(
  step: int,
  copies: Mapping[int, LocalStep],
  paths: Sequence[str],
  unverified: set[int] = frozenset(),
) -> tuple[LocalStep, set]:
  """One LocalStep serving every shard of `copies` (each in `paths` order),
  for stream.Server: the same index in two copies holds the same bytes
  (taken from a verified copy where one has it); and the (leaf number,
  index) of those taken from an `unverified` copy."""
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
  step: int,
  abstract: Sequence[Any],
  paths: Sequence[str],
  copies: Mapping[int, LocalStep],
  saved: Mapping[str, Any] | None,
  *,
  partner_held: set[int] = frozenset(),
  unverified: set[int] = frozenset(),
  partner_only: Sequence[Sequence[int]] = (),
  parity_only: Sequence[Sequence[int]] = (),
  groups: Sequence[Sequence[Sequence[int]]] = (),
  xor_files: Mapping[tuple[int, str], np.ndarray] | None = None,
  xor_groups: Mapping[int, dict] | None = None,
  topology,
  collectives,
  host: str | None,
  timeout_s: float,
  ports: tuple[int, int] | None = None,
) -> tuple[list, str]:
  """(the step's arrays on this process, and where its bytes came from:
  "local" (this host's copies), "parity" (some rebuilt from XOR parity),
  "partner" (some from a partner's copy on another host) or "peer").
  `copies`: {saved process: its verified copy on this host, arrays in
  `paths` order}; `saved`: what every holder publishes ({"layout":
  SavedLayout JSON, "sources": the saved process lists of the serving
  saved slices}), None on a process with no copy. Per serving saved slice
  (the plan's): `partner_only`, the positions only partner copies hold
  (`partner_held`: the saved processes whose copy here is such);
  `unverified`: saved processes whose copy here is not checked yet: each
  of its shards is checked before it is used here or cut for a receiver
  (a whole shard is sent with its recorded checksum, which the receiver
  checks). `parity_only`, the positions rebuilt from their XOR `groups`
  (positions). `xor_files`: {(saved process, "data" | "parity"): bytes}
  of the copies here that have their parity block here, `xor_groups`
  their group.json bodies. Raises PeerTransferError on every process if
  any failed."""
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
    keyed = _Keys(sources, partner_only, parity_only)
    rebuilt, failed = _rebuild(
      step,
      paths,
      sources,
      parity_only,
      groups,
      xor_files or {},
      xor_groups or {},
      servers,
      topology=topology,
      collectives=collectives,
      host=host,
      timeout_s=timeout_s,
      ports=ports,
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
            ports=ports,
            unverified=loose,
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
      published = {keyed.mine(sp, sp in partner_held, sp in rebuilt): offer for sp in copies}
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
          shards_lib.assemble(
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

  def __init__(self, sources, partner_only, parity_only):
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


def _rebuild(
  step, paths, sources, parity_only, groups, files, bodies, servers, **kw
) -> tuple[dict[int, LocalStep], str | None]:
  """The XOR rebuild phase (every process calls it; one exchange when the
  plan rebuilds anything): the saved processes this process rebuilds
  ({saved process: LocalStep, arrays in `paths` order}) and an error, if
  any. Holders of a survivor's data and parity serve byte ranges
  (RangeServer, added to `servers`).

  Who rebuilds a lost member: when the job has as many processes as the
  saved one, the process of the lost member's index (the restarted one,
  which needs its shards): it pulls every piece from the survivors at once
  and holds the result, with no second transfer; the holder of the first
  survivor's parity block publishes the group's sizes and the lost
  member's manifest beside its offers. Otherwise the first survivor of
  the group rebuilds it and serves it like any other copy."""
  if not any(parity_only):  # the same plan everywhere: no process rebuilds, none waits
    return {}, None
  topology, collectives, timeout_s = kw["topology"], kw["collectives"], kw["timeout_s"]
  me = topology.process_index
  at_destination = sum(len(procs) for procs in sources) == topology.process_count
  needed, tasks = set(), []  # survivors to serve; (lost, group processes, rebuilder) here
  described = {}  # lost member: its group's sizes and manifest, published from here
  for i, procs in enumerate(sources):
    for m in parity_only[i] if i < len(parity_only) else ():
      group = next((g for g in groups[i] if m in g), None)
      if group is None:
        continue
      members = [procs[pos] for pos in group]
      survivors = [p for pos, p in zip(group, members) if pos != m]
      needed.update(survivors)
      holder = (survivors[0], "parity") in files
      if at_destination:
        if holder:
          described[procs[m]] = _describe(procs[m], members, survivors[0], files, bodies)
        if me == procs[m]:
          tasks.append((procs[m], members, None))
      elif holder:
        tasks.append((procs[m], members, survivors[0]))
  serving = {key: buf for key, buf in files.items() if key[0] in needed}
  payload, error = {f"g{lost}": d for lost, d in described.items()}, None
  if serving:
    try:
      if kw["host"] is None:
        raise OSError("no address: set peer.host (see PeerOptions)")
      server = xor_lib.RangeServer(
        kw["host"],
        step,
        serving,
        timeout_s=timeout_s,
        log_prefix=topology.log_prefix(),
        ports=kw["ports"],
      )
      servers.append(server)
      payload.update({f"d{sp}": server.offer() for sp, _ in serving})
    except OSError as e:
      payload.update({f"d{sp}": {"error": f"cannot listen: {e}"} for sp, _ in serving})
  wanted = {f"d{p}" for lost, members, _ in tasks for p in members if p != lost}
  wanted.update(f"g{lost}" for lost, _, rebuilder in tasks if rebuilder is None)
  try:
    offers = collectives.exchange_keyed(
      f"reshard_rebuild_{step}", payload, wanted=sorted(wanted), timeout_s=timeout_s
    )
  except CollectiveTimeoutError as e:
    return {}, f"process {me}: no address for a rebuild ({e})"
  out = {}
  for lost, members, rebuilder in tasks:
    try:
      d = (
        offers[f"g{lost}"]
        if rebuilder is None
        else _describe(lost, members, rebuilder, files, bodies)
      )
      if "error" in d:
        raise PeerTransferError(f"no description of the group: {d['error']}")
      sizes = {int(i): int(n) for i, n in d["sizes"].items()}
      manifest = local_format.decode_manifest(bytes.fromhex(d["manifest"]), "group.json")
      got = xor_lib.rebuild(
        step,
        lost,
        members,
        sizes,
        manifest,
        {p: offers.get(f"d{p}") for p in members if p != lost},
        timeout_s=timeout_s,
        here=files,
      )
      by_path = dict(zip([leaf["path"] for leaf in manifest["leaves"]], got.arrays))
      out[lost] = LocalStep(step, manifest, [by_path[p] for p in paths])
      logger.info(
        "%s rebuilt saved process %d's step %d from its XOR group %s",
        topology.log_prefix(),
        lost,
        step,
        members,
      )
    except Exception as e:  # noqa: BLE001 - every process must reach the agreement
      error = f"process {me}: rebuilding saved process {lost} ({type(e).__name__}: {e})"
      logger.warning("%s %s", topology.log_prefix(), error)
  return out, error


def _describe(lost: int, members, holder: int, files, bodies) -> dict:
  """What a rebuild of `lost` needs besides the bytes, from the group.json
  of `holder`'s parity block (held here): every member's shards.bin size
  ({member index: bytes}) and the lost member's manifest (hex); {"error"}
  if that body lacks them."""
  try:
    body = bodies[holder]
    r = members.index(holder)
    sizes = {str(i): int(body["sizes"][str(i)]) for i in range(len(members)) if i != r}
    sizes[str(r)] = len(files[(holder, "data")])
    return {"sizes": sizes, "manifest": body["manifests"][str(members.index(lost))]}
  except (KeyError, TypeError, ValueError) as e:
    return {"error": f"group.json of {holder}'s parity block ({type(e).__name__}: {e})"}


def _records(copies: Mapping[int, LocalStep], paths: Sequence[str], unverified) -> dict:
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
      if p.box == p.slot.index:  # the whole new shard: straight into its place
        raw = buffer[p.slot.offset : p.slot.offset + p.slot.nbytes]
      else:
        raw = aligned_empty(nbytes)
      stream.recv_into(sock, raw)
      if not checksum_ok(raw, record):
        raise CorruptCheckpointError(f"{where} fails its checksum on arrival")
      if p.box != p.slot.index:
        _dest(buffer, layout, p)[...] = raw.view(dtype).reshape(shape)
