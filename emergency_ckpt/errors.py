"""Typed errors. Each subclasses the nearest builtin and says how to fix it."""

from __future__ import annotations


class EmergencyCheckpointError(Exception):
  """Base class of every error this library raises on purpose."""


class InvalidOptionsError(EmergencyCheckpointError, ValueError):
  """Raised when an options object or a config file has an impossible value."""


class ConfigError(InvalidOptionsError):
  """Raised when a YAML config has an unknown key, a bad override or a bad type."""


class TopologyError(EmergencyCheckpointError, ValueError):
  """Raised when the mesh cannot be split into slices along the replica axis."""


class StepError(EmergencyCheckpointError, ValueError):
  """Raised when save() gets a negative, non-integer or non-monotonic step."""


class StepAlreadyExistsError(StepError):
  """Raised when save() is asked to save a step that was already saved."""


class NoRestorableCheckpointError(EmergencyCheckpointError, FileNotFoundError):
  """Raised when restore() finds no step that every process can load."""


class StepNotRestorableError(NoRestorableCheckpointError):
  """Raised when restore(step=N) names a step that is not restorable."""


class StateMismatchError(EmergencyCheckpointError, ValueError):
  """Raised when abstract_state does not match the saved tree, shapes or dtypes."""


class TopologyMismatchError(EmergencyCheckpointError, ValueError):
  """Raised when a local-tier step was saved with another slice/process layout."""


class DataStateError(EmergencyCheckpointError, TypeError):
  """Raised when data_state is not a JSON-serialisable dict (names the key)."""


class CorruptCheckpointError(EmergencyCheckpointError, OSError):
  """Raised when a stored file fails its checksum or cannot be parsed."""


class CollectiveTimeoutError(EmergencyCheckpointError, TimeoutError):
  """Raised when processes do not reach an exchange in time (names them)."""


class UnsafeDirectoryError(EmergencyCheckpointError, PermissionError):
  """Raised when a ramdisk directory is a symlink, foreign-owned or too open."""


class StorageError(EmergencyCheckpointError, OSError):
  """Raised when the persistent storage fails permanently (names bucket and op)."""


class StorageNotFoundError(StorageError, FileNotFoundError):
  """Raised when an object that must exist is absent (names bucket and operation).

  A FileNotFoundError too, so callers that treat absence as data (a missing
  JSON is a corrupt step) keep working."""


class ProtectedStepError(StepError):
  """delete() refused: the step is the only restorable one (pass force=True)."""


class MetricsError(EmergencyCheckpointError, TypeError):
  """save(metrics=...) is not a dict of names to finite numbers."""


class PeerTransferError(EmergencyCheckpointError, ConnectionError):
  """Raised on every process when a cross-slice transfer failed on some
  process (a refused or broken connection, a shard failing its checksum);
  restore() then reads the persistent tier or an older step."""
