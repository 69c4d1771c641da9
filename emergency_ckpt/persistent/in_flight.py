"""The persistent tier's upload in flight: whether one runs, what it is, waiting for it.

At most one upload runs per process. The save path asks `busy()` before
starting the next one: with persistent.when_busy="skip" the step is skipped
(persistent/admission.py) and `running()` names what it waits on; with
"wait" `wait_idle()` blocks until it ends, with a warning saying how long.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from emergency_ckpt.cluster.topology import Topology

logger = logging.getLogger("emergency_ckpt")


class UploadInFlight:
  """What PersistentTier knows of its upload in flight (a mixin: the tier sets
  the attributes below)."""

  directory: Any
  _topology: Topology
  _manager: Any  # Orbax's CheckpointManager once opened
  _upload: concurrent.futures.Future | None  # save_snapshot's, if any
  _upload_step: int | None  # the step of the last upload started or queued
  _upload_started: float | None  # time.monotonic() it began (None: queued)

  def busy(self) -> bool:
    """Whether this process's previous upload is still running: its future
    (it ends once Orbax's own wait returned). Never Orbax's "save in
    progress" mark: Orbax sets it before its save call can fail (a full
    disk, an earlier upload's error raised again) and clears it only in the
    finalize thread such a call never starts, so the mark would hold every
    later step back for good.

    Returns:
      True while it runs.
    """
    return self._upload is not None and not self._upload.done()

  def running(self) -> str | None:
    """What this process's upload in flight is, for a skip's message: e.g.
    "Orbax's upload of step 12 to gs://b/run/tensors, running for 8.1s";
    None when none runs."""
    if not self.busy():
      return None
    step, started = self._upload_step, self._upload_started
    if started is None:
      return f"the upload of step {step}, waiting for the primary slice to agree on it"
    return (
      f"Orbax's upload of step {step} to {self.directory}, running for"
      f" {time.monotonic() - started:.1f}s"
    )

  def wait_idle(self, step: int) -> None:
    """Waits for the upload in flight (persistent.when_busy="wait"), with a
    warning saying how long; its error is the upload's own, recorded when
    it ended (wait_until_finished() raises it).

    Args:
      step: the step about to be saved (named in the warning).
    """
    if not self.busy():
      return
    t0, previous = time.monotonic(), self._upload_step
    if self._upload is not None:
      concurrent.futures.wait([self._upload])
    if self._manager is not None:
      try:
        self._manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001 - recorded as the upload's failure
        logger.debug("%s upload of step %s failed: %s", self._topology.log_prefix(), previous, e)
    logger.warning(
      "%s persistent save of step %d waited %.1fs for the upload of step %s (at most one"
      " upload is in flight): the bucket is slower than persistent.save_interval_steps"
      " allows; raise the interval, check the bucket, or set persistent.when_busy='skip'"
      " so that training never waits for it.",
      self._topology.log_prefix(),
      step,
      time.monotonic() - t0,
      previous,
    )

  def in_flight(self) -> concurrent.futures.Future | None:
    """The background upload started last.

    Returns:
      Its future (done or not), or None.
    """
    return self._upload
