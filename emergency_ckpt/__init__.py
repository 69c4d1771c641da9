"""emergency_ckpt: multi-tier emergency checkpointing for multi-slice JAX jobs.

The public surface, and only it: every name below is documented in the docs (docs/api.md);
the modules behind it are implementation details. Names load on first use,
so offline tools (`emergency-ckpt gc`, `inspect`, `verify`) never import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_EXPORTS = {
  "CheckpointManager": "emergency_ckpt.manager",
  "Goodput": "emergency_ckpt.core.goodput",
  "Health": "emergency_ckpt.core.health",
  "TierHealth": "emergency_ckpt.core.health",
  "RestoreResult": "emergency_ckpt.restore.restorer",
  "StepMetadata": "emergency_ckpt.restore.inventory",
  "CheckpointManagerOptions": "emergency_ckpt.options",
  "LocalTierOptions": "emergency_ckpt.options",
  "PeerOptions": "emergency_ckpt.options",
  "PersistentTierOptions": "emergency_ckpt.options",
  "load_config": "emergency_ckpt.config",
  "options_from_dict": "emergency_ckpt.config",
  **{
    name: "emergency_ckpt.errors"
    for name in (
      "CollectiveTimeoutError",
      "ConfigError",
      "CorruptCheckpointError",
      "DataStateError",
      "EmergencyCheckpointError",
      "InvalidOptionsError",
      "MetricsError",
      "NoRestorableCheckpointError",
      "PeerTransferError",
      "PendingWorkTimeoutError",
      "ProtectedStepError",
      "StateMismatchError",
      "StepAlreadyExistsError",
      "StepError",
      "StepNotRestorableError",
      "StorageError",
      "TopologyError",
      "TopologyMismatchError",
      "UnsafeDirectoryError",
    )
  },
}

__all__ = [
  "CheckpointManager",
  "CheckpointManagerOptions",
  "CollectiveTimeoutError",
  "ConfigError",
  "CorruptCheckpointError",
  "DataStateError",
  "EmergencyCheckpointError",
  "Goodput",
  "Health",
  "InvalidOptionsError",
  "LocalTierOptions",
  "MetricsError",
  "NoRestorableCheckpointError",
  "PeerOptions",
  "PeerTransferError",
  "PendingWorkTimeoutError",
  "PersistentTierOptions",
  "ProtectedStepError",
  "RestoreResult",
  "StateMismatchError",
  "StepAlreadyExistsError",
  "StepError",
  "StepMetadata",
  "StepNotRestorableError",
  "StorageError",
  "TierHealth",
  "TopologyError",
  "TopologyMismatchError",
  "UnsafeDirectoryError",
  "load_config",
  "options_from_dict",
]


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'emergency_ckpt' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__() -> list[str]:
  return __all__


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
  from emergency_ckpt.config import load_config, options_from_dict
  from emergency_ckpt.core.goodput import Goodput
  from emergency_ckpt.core.health import Health, TierHealth
  from emergency_ckpt.errors import (
    CollectiveTimeoutError,
    ConfigError,
    CorruptCheckpointError,
    DataStateError,
    EmergencyCheckpointError,
    InvalidOptionsError,
    MetricsError,
    NoRestorableCheckpointError,
    PeerTransferError,
    PendingWorkTimeoutError,
    ProtectedStepError,
    StateMismatchError,
    StepAlreadyExistsError,
    StepError,
    StepNotRestorableError,
    StorageError,
    TopologyError,
    TopologyMismatchError,
    UnsafeDirectoryError,
  )
  from emergency_ckpt.manager import CheckpointManager
  from emergency_ckpt.options import (
    CheckpointManagerOptions,
    LocalTierOptions,
    PeerOptions,
    PersistentTierOptions,
  )
  from emergency_ckpt.restore.inventory import StepMetadata
  from emergency_ckpt.restore.restorer import RestoreResult
