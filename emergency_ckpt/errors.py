"""Typed errors. Each subclasses the nearest builtin and says how to fix it.

Every class's docstring gives the cause (when it is raised) and the fix;
docs/troubleshooting.md renders them, beside its cause/fix table.
"""

from __future__ import annotations


class EmergencyCheckpointError(Exception):
  """Base class of every error this library raises on purpose.

  Cause: raised as such for a call on a closed manager ("this
  CheckpointManager is closed"), and when reading a persistent step failed
  on some processes for a reason other than damage (the message names them).

  Fix: create a new manager after close(). For a failed read, see the named
  processes' logs.
  """


class InvalidOptionsError(EmergencyCheckpointError, ValueError):
  """An options object or a config file has an impossible value.

  Cause: an interval or max_to_keep below 1, a timeout <= 0, a URL as
  local.directory, a bad run_id, keep_best without best_metric, an unknown
  peer.transport, a bad peer.ports range; best_step() without best_metric;
  an Orbax option the MaxText / Orbax facade cannot honour. The message
  names the field.

  Fix: correct the named field (the configuration reference lists each
  field's valid values).
  """


class ConfigError(InvalidOptionsError):
  """A YAML config cannot be turned into options.

  Cause: an unknown or missing key, a bad `key.sub=value` override, invalid
  YAML, a file that cannot be read, or an unset environment variable in a
  value.

  Fix: correct the key it names (the message lists the valid keys), or
  export the variable or override the key.
  """


class TopologyError(EmergencyCheckpointError, ValueError):
  """The mesh cannot be split into slices along the replica axis.

  Cause: the axis is not on the mesh, an index is out of range, or an entry
  of the axis splits a process (or, with the MaxText facade, the named axis
  shards the state).

  Fix: set replica_axis to the axis whose entries are slices, each made of
  whole processes.
  """


class StepError(EmergencyCheckpointError, ValueError):
  """save() got a step it cannot save.

  Cause: a negative, non-integer (2.0, True) or non-increasing step.

  Fix: save each step once, with increasing integers; after restore(),
  continue from r.step + 1.
  """


class StepAlreadyExistsError(StepError):
  """save() was asked to save a step that was already saved.

  Cause: the same step saved twice.

  Fix: as for StepError.
  """


class NoRestorableCheckpointError(EmergencyCheckpointError, FileNotFoundError):
  """restore() found no step that every process can load.

  Cause: nothing was saved yet, or every step was rejected; the message
  names the directories it looked in and every step it rejected and why
  (uncommitted, damaged, another topology).

  Fix: on a first start, call latest_step() and skip restore() when it is
  None. Otherwise check local.directory, persistent.directory and run_id
  (the same as the run that saved?), and the rejected steps' reasons.
  """


class StepNotRestorableError(NoRestorableCheckpointError):
  """restore(step=N) names a step that is not restorable.

  Cause: the step was never saved, is uncommitted, or was found damaged
  when read.

  Fix: pick a step from all_steps(), or call restore() without step for the
  newest.
  """


class StateMismatchError(EmergencyCheckpointError, ValueError):
  """abstract_state does not match the saved tree, shapes or dtypes.

  Cause: a leaf differs from what was saved (the message names the leaf and
  both values), or a leaf is not a jax.Array / ShapeDtypeStruct with a
  sharding. A value is never cast silently.

  Fix: pass the abstract state of the train state that was saved; restore,
  then convert.
  """


class TopologyMismatchError(EmergencyCheckpointError, ValueError):
  """A local-tier step was saved with another slice/process layout.

  Cause: the copy lacks a shard this process needs. Restore skips such a
  copy and takes the step from a peer, a reshard or the persistent tier.

  Fix: nothing, usually. If it surfaces, restore from the persistent tier,
  or restart with the topology that saved the step.
  """


class DataStateError(EmergencyCheckpointError, TypeError):
  """data_state cannot be stored as JSON, or restored into the object given.

  Cause: data_state is not a dict of JSON values or an object with
  get_state() (the message names the key path: a numpy scalar, a set, a
  NaN, bytes inside a dict, a non-string key); or restore(data_state=...)
  got an object without set_state().

  Fix: convert the named value to str, int, float, list or dict (an
  iterator's get_state() may return bytes); pass the iterator itself to
  restore(data_state=...), or read r.data_state.
  """


class CorruptCheckpointError(EmergencyCheckpointError, OSError):
  """A stored file fails its checksum or cannot be parsed.

  Cause: a damaged local shard or manifest, state JSON or persistent shard.
  Restore skips damaged steps and raises it only when no older step is
  left, or when data_state_remap reads a damaged saved state.

  Fix: run `emergency-ckpt verify DIR` to see what is damaged; restore an
  older step (all_steps()), and remove the damaged one (`emergency-ckpt gc`
  or delete()).
  """


class CollectiveTimeoutError(EmergencyCheckpointError, TimeoutError):
  """Processes did not reach an exchange in time (names them).

  Cause: processes did not arrive within collective_timeout_s (the message
  names those that never arrived), or Orbax's set-up or barrier timed out.

  Fix: look at the named processes (crashed, hung, still starting). Raise
  collective_timeout_s when the scheduler brings replacement hosts up
  slowly.
  """


class PendingWorkTimeoutError(EmergencyCheckpointError, TimeoutError):
  """wait_until_finished() or close() gave up waiting for background work.

  Cause: a tier's work was still in flight after the timeout (the call's
  `timeout_s`, else `CheckpointManagerOptions.finish_timeout_s`): typically
  an upload to a bucket that hangs, refuses or crawls. The message names
  each tier's pending work (tier, step, operation, how long it ran) and the
  steps that never reached the persistent tier. Nothing committed is lost;
  after close() the pending work is abandoned, uncommitted.

  Fix: check the bucket (its status, credentials, network path); raise the
  timeout if uploads are only slow; the newest committed step restores as
  usual after a restart.
  """


class UnsafeDirectoryError(EmergencyCheckpointError, PermissionError):
  """A ramdisk directory is a symlink, foreign-owned or too open.

  Cause: a folder of local.directory is a symlink, owned by another user,
  or more open than 0700 (a world-writable root without the sticky bit).

  Fix: `chmod 700` the named folder or remove it, or choose another
  local.directory. A shared sticky root such as /dev/shm is accepted.
  """


class StorageError(EmergencyCheckpointError, OSError):
  """The persistent storage failed permanently (names bucket and operation).

  Cause: a missing bucket, a permission error, or transient GCS errors that
  outlasted the retries.

  Fix: check the bucket name, the credentials and the network; transient
  errors are retried before this is raised.
  """


class StorageNotFoundError(StorageError, FileNotFoundError):
  """An object that must exist is absent (names bucket and operation).

  A FileNotFoundError too, so callers that treat absence as data (a missing
  JSON is a corrupt step) keep working.

  Cause: an object that must exist on GCS is absent.

  Fix: as for StorageError: check that nothing else deletes files under
  persistent.directory while a job runs.
  """


class ProtectedStepError(StepError):
  """delete() refused to delete a step.

  Cause: the step is the only restorable one.

  Fix: save a newer step first, or pass force=True.
  """


class MetricsError(EmergencyCheckpointError, TypeError):
  """save(metrics=...) is not a dict of names to finite numbers.

  Cause: metrics is not a dict, a metric name is not a string, or a value
  is not a finite number (a bool, a NaN, an infinity).

  Fix: pass {"loss": float(loss)}-style values; drop NaN and infinities.
  """


class PeerTransferError(EmergencyCheckpointError, ConnectionError):
  """A cross-slice transfer failed on some process; raised on every process.

  Cause: a refused or broken connection, no free port in peer.ports, or a
  shard failing its checksum. Restore then reads the persistent tier or an
  older step on its own.

  Fix: if it recurs, open the hosts' ports to each other (peer.ports, at
  least one per process of a host), name the data network's address
  (peer.host) on hosts with several NICs, or set peer.transport:
  collective.
  """


CALLER_ERRORS = (
  InvalidOptionsError,
  TopologyError,
  StepError,
  StateMismatchError,
  TopologyMismatchError,
  DataStateError,
  MetricsError,
)
"""The errors that are the caller's to fix (its options, mesh, state or
data_state), as opposed to a sick tier's (storage, peers, timeouts):
check_for_errors() raises these and only reports the others."""
