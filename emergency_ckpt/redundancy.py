"""In-slice redundancy of the local tier (local.redundancy): who protects
whose step, and sending it there after each local write.

"partner" (peer/partner.py): every process keeps a receiver open and sends
each local step to its partner, the next process of its slice on another
machine. Set up once per manager (a collective: which processes share this
machine, then the partner's address); each send runs on the "redundancy"
lane, after the local write and before this process's state file, so a
step commits only once its partner holds it (unless
local.redundancy_required is False).

Called by: the manager (start, close) and the save pipeline (protect).
"""

from __future__ import annotations

import logging
import time

from emergency_ckpt.peer import partner as partner_lib
from emergency_ckpt.topology import peer_host

logger = logging.getLogger("emergency_ckpt")


class Partner:
  """This process's partner link: a receiver for the step its own partner
  sender (another process) sends, and where to send its own steps."""

  def __init__(self, options, *, topology, collectives, process_dir: str, host_label: str):
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

  def send(self, step_dir: str) -> tuple[int, float]:
    """Sends one local step folder to the partner and waits until it is
    durable there: (bytes, seconds). Raises PeerTransferError or OSError.
    Called by: the redundancy lane."""
    t0 = time.perf_counter()
    nbytes = partner_lib.send(self._offer, self.partner, step_dir, timeout_s=self._timeout_s)
    return nbytes, time.perf_counter() - t0

  def close(self) -> None:
    self.receiver.close()


def start(options, *, topology, collectives, process_dir: str, host_label: str) -> Partner | None:
  """The redundancy link `options.local.redundancy` asks for (None: none).
  Called by: every process, the same options everywhere."""
  if options.local.redundancy == "none" or topology.process_count == 1:
    return None
  return Partner(
    options,
    topology=topology,
    collectives=collectives,
    process_dir=process_dir,
    host_label=host_label,
  )
