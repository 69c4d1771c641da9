"""Job functions for test_data_state_remap (run by run_job)."""

from __future__ import annotations

from typing import Any

import emergency_ckpt as ec
from tests import scenarios as sc


def restore_remapped(args: dict) -> dict[str, Any]:
  """Restores (every ramdisk of the saving job is elsewhere: a new process
  count) with and without a data_state_remap that reads the saved states."""
  mesh = sc.mesh_for(args["slices"])
  seen: list[int] = []

  def remap(saved, index, count):
    # A global position: the sum of every saved process's, split evenly.
    total = sum(saved[p]["pos"] for p in saved)
    seen.extend(p for p in saved)
    return {"pos": total // count + index, "of": count, "saved_processes": len(saved)}

  out: dict[str, Any] = {}
  with ec.CheckpointManager(sc.options(args), mesh=mesh) as mngr:
    r = mngr.restore(sc.abstract_state(mesh), data_state_remap=remap)
    out["remapped"] = {
      "step": r.step,
      "source": r.source,
      "bad": sc.mismatches(r.state, r.step),
      "data_state": r.data_state,
      "seen": seen,
    }
    r = mngr.restore(sc.abstract_state(mesh))
    out["plain"] = {"step": r.step, "data_state": r.data_state}
  return out
