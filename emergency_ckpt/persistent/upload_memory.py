"""Where a persistent upload's arrays come from: the staged snapshot, in which memory.

An upload that reads the local tier's staged host snapshot (an immutable
copy) leaves save() waiting for nothing but the staging; one that has Orbax
copy from the devices must block inside save() until that copy ends, since
the trainer may then donate or overwrite its arrays. On CPU devices the
snapshot is device memory already, so Orbax's arrays simply alias it. On
accelerators the arrays are built from it in the devices' pinned host
memory, so Orbax's "device-to-host copy" never touches a device; that needs
every device to have pinned host memory and a working transfer into it,
which a probe checks once, falling back to the inline copy otherwise.

Called by: the manager, once per process (the save pipeline then builds the
arrays in the memory kind chosen here).
"""

from __future__ import annotations

import logging

import jax
import numpy as np

logger = logging.getLogger("emergency_ckpt")

PINNED_HOST = "pinned_host"
CPU_UPLOAD_MEMORY_KIND: str | None = None
"""The memory kind of the arrays an upload from a snapshot builds on CPU
devices (None: their default memory, which aliases the snapshot). Tests set
PINNED_HOST to run the accelerators' path on CPU."""


def upload_memory_kind(devices) -> tuple[bool, str | None]:
  """Whether the persistent upload reads the staged snapshot, and in which memory.

  CPU: yes, in their default memory (CPU_UPLOAD_MEMORY_KIND). Accelerators:
  yes, in pinned host memory, where every device has it and a probe
  transfer into it and back works; else no (Orbax copies from the device
  inline, inside save()).

  Args:
    devices: this process's devices.

  Returns:
    (whether the upload reads the snapshot, the memory kind of the arrays it
    hands Orbax; None: the devices' default memory).
  """
  devices = list(devices)
  if all(d.platform == "cpu" for d in devices) and CPU_UPLOAD_MEMORY_KIND is None:
    return True, None
  if not devices or not all(
    any(m.kind == PINNED_HOST for m in d.addressable_memories()) for d in devices
  ):
    return False, None
  try:
    want = np.arange(256, dtype=np.float32)
    probe = jax.device_put(
      want.copy(), jax.sharding.SingleDeviceSharding(devices[0], memory_kind=PINNED_HOST)
    )
    ok = np.array_equal(np.asarray(probe), want)
  except Exception as e:  # noqa: BLE001 - any failure: the inline path, which always works
    logger.warning(
      "persistent uploads: a transfer into %s memory of %s failed (%s); Orbax will copy"
      " from the device inside save() instead (a longer stall at persistent steps).",
      PINNED_HOST,
      devices[0],
      e,
    )
    return False, None
  return (True, PINNED_HOST) if ok else (False, None)
