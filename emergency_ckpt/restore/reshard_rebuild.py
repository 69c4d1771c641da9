"""The XOR rebuild phase of a reshard: saved processes no copy holds, rebuilt
from their group's data and parity blocks before the shards are assembled.

A reshard (reshard_transfer.py) serves every saved process's copy; when
local.redundancy is "xor" and a position of a serving saved slice is held
by no copy, the plan names it in `parity_only` and this phase rebuilds it
(redundancy/xor.py pulls the byte ranges and sums them). Holders of a
survivor's data and parity serve byte ranges to the rebuilders.

Who rebuilds a lost member: when the job has as many processes as the
saved one, the process of the lost member's index (the restarted one,
which needs its shards): it pulls every piece from the survivors at once
and holds the result, with no second transfer; the holder of the first
survivor's parity block publishes the group's sizes and the lost member's
manifest beside its offers. Otherwise the first survivor of the group
rebuilds it and serves it like any other copy.

Called by: reshard_transfer.transfer, on every process (one exchange when
the plan rebuilds anything, none otherwise: the plan is the same
everywhere).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from emergency_ckpt.errors import CollectiveTimeoutError, PeerTransferError
from emergency_ckpt.local import format as local_format
from emergency_ckpt.local.format import LocalStep
from emergency_ckpt.redundancy import xor as xor_lib
from emergency_ckpt.transport.listener import Security

if TYPE_CHECKING:
  from emergency_ckpt.cluster.context import JobContext

logger = logging.getLogger("emergency_ckpt")


class ParityInputs(Protocol):
  """What the rebuild phase reads of a reshard's redundancy inputs
  (reshard_transfer.ReshardRedundancy)."""

  parity_only: Sequence[Sequence[int]]
  """Per serving saved slice: the positions rebuilt from XOR parity."""
  groups: Sequence[Sequence[Sequence[int]]]
  """Per serving saved slice: its XOR groups (positions)."""
  xor_files: Mapping[tuple[int, str], np.ndarray]
  """{(saved process, "data" | "parity"): bytes} held on this host."""
  xor_groups: Mapping[int, dict]
  """{saved process: its parity block's group.json body}."""


def rebuild(
  ctx: JobContext,
  step: int,
  paths: Sequence[str],
  sources: Sequence[Sequence[int]],
  parity: ParityInputs,
  servers: list[Any],
  *,
  host: str | None,
) -> tuple[dict[int, LocalStep], str | None]:
  """Rebuilds the saved processes this process is the rebuilder of.

  Args:
    ctx: the job (topology, collectives, the peer options' ports and the
      collective timeout).
    step: the step being restored.
    paths: the restored tree's leaf paths (the order of the arrays).
    sources: per serving saved slice, its saved processes.
    parity: the plan's parity positions and groups, and the data and
      parity blocks on this host.
    servers: the range server this process starts, if it serves any
      survivor's bytes, is appended here (the caller closes it).
    host: the address this process serves at (None: it has no copy; a
      process that must serve then fails with an error, not an exception).

  Returns:
    ({saved process: its rebuilt LocalStep, arrays in `paths` order}, an
    error message or None). Errors are returned, not raised: every process
    must reach the reshard's agreement.
  """
  parity_only = parity.parity_only
  if not any(parity_only):  # the same plan everywhere: no process rebuilds, none waits
    return {}, None
  topology, collectives = ctx.topology, ctx.collectives
  timeout_s = ctx.options.collective_timeout_s
  files, bodies = parity.xor_files, parity.xor_groups
  me = topology.process_index
  at_destination = sum(len(procs) for procs in sources) == topology.process_count
  needed, tasks = set(), []  # survivors to serve; (lost, group processes, rebuilder) here
  described = {}  # lost member: its group's sizes and manifest, published from here
  for i, procs in enumerate(sources):
    for m in parity_only[i] if i < len(parity_only) else ():
      group = next((g for g in parity.groups[i] if m in g), None)
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
      if host is None:
        raise OSError("no address: set peer.host (see PeerOptions)")
      server = xor_lib.RangeServer(
        host,
        step,
        serving,
        timeout_s=timeout_s,
        log_prefix=topology.log_prefix(),
        ports=ctx.options.peer.port_range,
        security=Security.of(ctx.options.peer),
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


def _describe(
  lost: int,
  members: Sequence[int],
  holder: int,
  files: Mapping[tuple[int, str], np.ndarray],
  bodies: Mapping[int, dict],
) -> dict:
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
