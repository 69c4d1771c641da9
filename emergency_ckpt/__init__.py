"""emergency_ckpt: multi-tier emergency checkpointing for multi-slice JAX jobs.

The public surface; everything else is an implementation detail.
"""

from emergency_ckpt.config import load_config, options_from_dict
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
from emergency_ckpt.manager import CheckpointManager, RestoreResult, StepMetadata
from emergency_ckpt.options import (
  CheckpointManagerOptions,
  LocalTierOptions,
  PersistentTierOptions,
)

__all__ = [
  "CheckpointManager",
  "CheckpointManagerOptions",
  "CollectiveTimeoutError",
  "ConfigError",
  "CorruptCheckpointError",
  "DataStateError",
  "EmergencyCheckpointError",
  "InvalidOptionsError",
  "MetricsError",
  "LocalTierOptions",
  "NoRestorableCheckpointError",
  "PeerTransferError",
  "ProtectedStepError",
  "PersistentTierOptions",
  "RestoreResult",
  "StateMismatchError",
  "StepAlreadyExistsError",
  "StepError",
  "StepMetadata",
  "StepNotRestorableError",
  "StorageError",
  "TopologyError",
  "TopologyMismatchError",
  "UnsafeDirectoryError",
  "load_config",
  "options_from_dict",
]
