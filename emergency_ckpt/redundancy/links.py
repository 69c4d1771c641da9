"""In-slice redundancy of the local tier (local.redundancy): who protects
whose step, and sending it there after each local write.

"partner" (partner.py): every process keeps a receiver open and sends
each local step to its partner, the next process of its slice on another
machine. Set up once per manager (a collective: which processes share this
machine, then the partner's address).

"xor" (xor.py, xor_wire.py, core/parity.py): the slice's processes form
groups on distinct machines (a collective within the slice: its last
process to arrive groups the slice's machines and tells each process its
group), every member keeps a parity receiver open and sends each local
step's chunks to the other members (their addresses: one more collective).

Either way each send runs on the "redundancy" lane, after the local write
(with `overlap`: beside it, from the staged snapshot, the manifest
following once the write is done) and before this process's state file,
so a step commits only once it is protected (unless
local.redundancy_required is False).

Called by: the manager (start, close) and the save pipeline (protect).
"""

from __future__ import annotations

import abc
import logging
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from emergency_ckpt.cluster.topology import peer_host
from emergency_ckpt.core import parity as xor_parity
from emergency_ckpt.options import REDUNDANCY_OVERLAP_MIN_CPUS
from emergency_ckpt.redundancy import partner as partner_lib
from emergency_ckpt.redundancy import xor as xor_lib
from emergency_ckpt.redundancy import xor_wire
from emergency_ckpt.transport import protocol

logger = logging.getLogger("emergency_ckpt")


class _Link(abc.ABC):
  """What the save pipeline calls on a redundancy link (Partner, Xor)."""

  overlap: bool
  """Whether the step goes from the staged snapshot during the local write
  (send_snapshot) rather than from the written file (send)."""

  def send_snapshot(
    self,
    step: int,
    data: np.ndarray,
    spans: Sequence[tuple[int, int]],
    manifest: Callable[[], bytes],
    sent: Callable[[], None],
  ) -> tuple[int, float]:
    """As send(), from the staged bytes of a step that its local write is
    writing meanwhile. Called by: the redundancy lane.

    Args:
      step: the step.
      data: its staged bytes (uint8).
      spans: its shards' (offset, nbytes) in `data`.
      manifest: blocks until the write is done and returns the step's raw
        manifest (raising if it failed: the receivers then drop the step).
      sent: called once the bytes are out (the snapshot may be let go).

    Returns:
      (bytes sent, seconds).

    Raises:
      PeerTransferError: a receiver cannot receive, or did not store it.
      OSError: a connection failed.
    """
    t0 = time.perf_counter()
    nbytes = self._send_snapshot(step, data, spans, manifest, sent)
    return nbytes, time.perf_counter() - t0

  @abc.abstractmethod
  def _send_snapshot(self, step, data, spans, manifest, sent) -> int:
    """The scheme's send of the snapshot; the bytes sent."""


class Partner(_Link):
  """This process's partner link: a receiver for the step its own partner
  sender (another process) sends, and where to send its own steps."""

  def __init__(
    self, options, *, topology, collectives, process_dir: str, host_label: str, mapped=None
  ):
    """Called by: every process (two collectives: group_by, exchange_some)."""
    self._options = options
    self._prefix = topology.log_prefix()
    self._timeout_s = options.collective_timeout_s
    self.receiver = partner_lib.Receiver(
      process_dir,
      peer_host(options.peer.host),
      keep=options.local.max_to_keep + 1,
      timeout_s=options.collective_timeout_s,
      log_prefix=self._prefix,
      ports=options.peer.port_range,
      mapped=mapped,
      security=protocol.Security.of(options.peer),
    )
    same = collectives.group_by("partner_hosts", host_label, topology.slice_index)
    me = topology.process_index
    self.partner = partner_lib.choose_partner(
      me, topology.slice_processes[topology.slice_index], same
    )
    self.problem: str | None = None
    if self.partner is None:
      self.problem = (
        f"local.redundancy='partner': every process of slice {topology.slice_index} runs"
        f" on this machine ({host_label}), so no partner copy survives losing it; run"
        " the slice's processes on several machines, or set local.redundancy='none'."
      )
      logger.warning("%s %s", self._prefix, self.problem)
    wanted = [] if self.partner is None else [self.partner]
    got = collectives.exchange_some("partner_offer", self.receiver.offer(), wanted=wanted)
    self._offer = got.get(self.partner)
    self._me = me
    self.overlap = overlap_of(options)

  def send_failed(self, step: int, why: str) -> None:
    """Nothing: the partner waits for no one else.

    Args:
      step: the step whose local write failed.
      why: the error.
    """

  @property
  def active(self) -> bool:
    """Returns whether this process's steps are protected (it has a partner)."""
    return self.partner is not None

  def send(self, step_dir: str) -> tuple[int, float]:
    """Sends one local step folder to the partner and waits until it is
    durable there. Called by: the redundancy lane.

    Args:
      step_dir: the written step's folder.

    Returns:
      (bytes sent, seconds).

    Raises:
      PeerTransferError: the partner cannot receive, or did not store it.
      OSError: the step's files or the connection failed.
    """
    t0 = time.perf_counter()
    nbytes = partner_lib.send(self._offer, self.partner, step_dir, timeout_s=self._timeout_s)
    return nbytes, time.perf_counter() - t0

  def _send_snapshot(self, step, data, spans, manifest, sent) -> int:
    return partner_lib.send_snapshot(
      self._offer, self.partner, step, self._me, data, spans, manifest,
      timeout_s=self._timeout_s, sent=sent,
    )  # fmt: skip

  def close(self) -> None:
    """Closes the receiver."""
    self.receiver.close()


class Xor(_Link):
  """This process's XOR group: its parity receiver, and where its chunks go."""

  def __init__(
    self, options, *, topology, collectives, process_dir: str, host_label: str, mapped=None
  ):
    """Called by: every process (two collectives: an assign within the
    slice, which gives each process only its group; exchange_some)."""
    me = topology.process_index
    self._prefix = topology.log_prefix()
    self._timeout_s = options.collective_timeout_s
    procs = topology.slice_processes[topology.slice_index]
    size = options.local.redundancy_group_size
    part = collectives.assign(
      f"xor_hosts_{topology.slice_index}",
      host_label,
      processes=procs,
      assign=lambda machines: xor_parity.parts(procs, machines, size),
    )
    self.group = part["group"]
    self.member = self.group.index(me)
    self.problem: str | None = None
    shared = xor_parity.shared_machines(self.group, dict(zip(self.group, part["machines"])))
    if len(self.group) < 2 or shared:
      self.problem = (
        f"local.redundancy='xor': XOR group {self.group} of slice {topology.slice_index}"
        f" has processes {shared or self.group} on a machine another member runs on, so"
        " losing that machine loses two members (not rebuildable); spread the slice over"
        " more machines, lower local.redundancy_group_size, or use 'partner'."
      )
      logger.warning("%s %s", self._prefix, self.problem)
    self.receiver = xor_wire.ParityReceiver(
      process_dir,
      peer_host(options.peer.host),
      member=self.member,
      group=self.group,
      keep=options.local.max_to_keep + 1,
      timeout_s=options.collective_timeout_s,
      log_prefix=self._prefix,
      ports=options.peer.port_range,
      mapped=mapped,
      security=protocol.Security.of(options.peer),
    )
    others = [p for p in self.group if p != me]
    self._offers = collectives.exchange_some("xor_offer", self.receiver.offer(), wanted=others)
    self.overlap = overlap_of(options)

  @property
  def active(self) -> bool:
    """Returns whether this process's steps are protected (a group of 2 or more)."""
    return len(self.group) >= 2

  def send(self, step_dir: str) -> tuple[int, float]:
    """Sends this member's chunks of one local step folder to the group and
    waits until every parity block holding them is durable. Called by: the
    redundancy lane.

    Args:
      step_dir: the written step's folder.

    Returns:
      (bytes sent, seconds).

    Raises:
      PeerTransferError: a member cannot receive, or did not store its block.
      OSError: the step's files or a connection failed.
    """
    t0 = time.perf_counter()
    nbytes = xor_lib.send(
      self._offers, self.group, self.member, step_dir, timeout_s=self._timeout_s
    )
    return nbytes, time.perf_counter() - t0

  def send_failed(self, step: int, why: str) -> None:
    """Tells the group this process's local write of `step` failed, so its
    members drop the step at once (xor.send_failure; errors only logged).
    Called by: the redundancy lane.

    Args:
      step: the step.
      why: the write's error.
    """
    xor_lib.send_failure(
      self._offers, self.group, self.member, step, why, timeout_s=self._timeout_s
    )

  def _send_snapshot(self, step, data, spans, manifest, sent) -> int:
    return xor_lib.send_snapshot(
      self._offers, self.group, self.member, step, data, manifest,
      timeout_s=self._timeout_s, sent=sent,
    )  # fmt: skip

  def close(self) -> None:
    """Closes the receiver (waits for its stored steps' retires)."""
    self.receiver.close()


def overlap_of(options) -> bool:
  """local.redundancy_overlap, resolved.

  Args:
    options: the manager's CheckpointManagerOptions.

  Returns:
    The option if set; if None, whether this process may run on at least
    REDUNDANCY_OVERLAP_MIN_CPUS cores.
  """
  overlap = options.local.redundancy_overlap
  return overlap if overlap is not None else _cpus() >= REDUNDANCY_OVERLAP_MIN_CPUS


def _cpus() -> int:
  """The cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


def start(
  options, *, topology, collectives, process_dir: str, host_label: str, mapped=None
) -> Partner | Xor | None:
  """The redundancy link `options.local.redundancy` asks for. Called by:
  every process, the same options everywhere (collectives inside).

  Args:
    options: the manager's CheckpointManagerOptions.
    topology: this process's Topology.
    collectives: the job's Collectives.
    process_dir: this process's local folder (receivers write there).
    host_label: this machine's name (who shares a machine).
    mapped: whether a restore mapped a file (LocalTier.mapped): a partner
      copy's file or a parity block is then never written over.

  Returns:
    The Partner or Xor link, or None (no redundancy, or one process).

  Raises:
    OSError: a receiver cannot listen.
  """
  if options.local.redundancy == "none" or topology.process_count == 1:
    return None
  if options.local.redundancy == "xor":
    return Xor(
      options,
      topology=topology,
      collectives=collectives,
      process_dir=process_dir,
      host_label=host_label,
      mapped=mapped,
    )
  return Partner(
    options,
    topology=topology,
    collectives=collectives,
    process_dir=process_dir,
    host_label=host_label,
    mapped=mapped,
  )
