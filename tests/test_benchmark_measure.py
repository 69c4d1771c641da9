"""The benchmark's measuring helpers (pure, single process)."""

from __future__ import annotations

import numpy as np

from emergency_ckpt.bench import measure


def test_peak_rss_catches_a_transient_peak_without_a_sampling_thread():
  """64 MiB touched and freed inside the window shows in the peak, though
  RSS is back down when the window closes."""
  before = measure.rss_bytes()
  peak = measure.PeakRss().start()
  block = np.ones(64 << 20, np.uint8)  # touched: resident
  del block
  after = measure.rss_bytes()
  got = peak.stop()
  assert after < before + (32 << 20), "the block should be gone again"
  assert got >= before + (60 << 20), (got, before)
  if peak.method == "VmHWM":
    assert peak._thread is None  # nothing ran during the window
