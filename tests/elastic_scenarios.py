"""Job functions for test_elastic_restart (run by run_job): restarts onto
shuffled hosts, fewer slices and more slices."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from typing import Any

import jax

import emergency_ckpt as ec
from tests import scenarios as sc


@contextlib.contextmanager
def _logged():
  """The library's log records (INFO and up) inside the block, as
  (level, text)."""
  got: list[tuple[int, str]] = []

  class Keep(logging.Handler):
    def emit(self, record):
      got.append((record.levelno, record.getMessage()))

  handler = Keep(logging.INFO)
  logger = logging.getLogger("emergency_ckpt")
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  try:
    yield got
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)


def restore_then_save(args: dict) -> dict[str, Any]:
  """Restores the newest step, then saves args['then_save'] (the run goes on
  under the new topology) and lists this host's run folder."""
  mesh = sc.mesh_for(args["slices"], args.get("mesh_order"))
  # Each process a host of its own (these jobs share one machine, whose
  # boot id would make every folder a live co-located one, never taken).
  options = dataclasses.replace(sc.options(args), host_id=f"sim-host-{jax.process_index()}")
  with ec.CheckpointManager(options, mesh=mesh) as mngr:
    held = list(mngr.metadata(5).local_slices) if args.get("metadata_of_5") else None
    with _logged() as logged:  # why a newer step was passed over, if one was
      r = mngr.restore(sc.abstract_state(mesh))
    warned = [text for level, text in logged if level >= logging.WARNING]
    out = {
      "step": r.step,
      "source": r.source,
      "slice": mngr.topology.slice_index,
      "bad": sc.mismatches(r.state, r.step),
      "data_state": r.data_state,
      "local_slices_of_5": held,
      "warnings": warned,
      # the saved processes this process rebuilt from XOR parity
      "rebuilt": sorted(
        int(m.group(1))
        for _, text in logged
        if (m := re.search(r"rebuilt saved process (\d+)'s step", text))
      ),
    }
    for step in args.get("then_save", ()):
      mngr.save(step, sc.make_state(mesh, step), data_state=sc.data_state(step))
    mngr.wait_until_finished()
    out["all_steps"] = mngr.all_steps()
  run = os.path.join(sc.host_dir(args), args.get("run_id", "test-run"))
  out["host_folders"] = {
    name: sorted(n for n in os.listdir(os.path.join(run, name)) if n.startswith("step_"))
    for name in sorted(os.listdir(run))
  }
  out["process"] = jax.process_index()
  return out
