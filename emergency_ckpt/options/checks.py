"""The rules an option value must satisfy, and the messages that name the field.

The option dataclasses (options.py) call these from `__post_init__`, so an
impossible value fails where the options are built, in code or from YAML,
with an `InvalidOptionsError` naming the field and the values it accepts;
nothing is ever rewritten into a valid value. Kept apart from options.py,
whose docstrings are the configuration reference.

Called by: options.py only.
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any

from emergency_ckpt.errors import InvalidOptionsError

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
BEST_MODES = ("min", "max")
PEER_TRANSPORTS = ("stream", "collective")
PEER_INTEGRITY = ("mac", "crc")
PEER_ENCRYPTION = ("none", "tls")
REDUNDANCY = ("none", "partner", "xor")


def require(cond: bool, message: str) -> None:
  """Raises unless a condition holds.

  Args:
    cond: the condition.
    message: the error's message (names the field and what it accepts).

  Raises:
    InvalidOptionsError: `cond` is false.
  """
  if not cond:
    raise InvalidOptionsError(message)


def positive_int(value: Any, name: str) -> None:
  """Checks an integer >= 1 (a bool is not one).

  Args:
    value: the field's value.
    name: the field, as the message names it.

  Raises:
    InvalidOptionsError: it is not.
  """
  require(
    isinstance(value, int) and not isinstance(value, bool) and value >= 1,
    f"{name} must be an integer >= 1, got {value!r}.",
  )


def optional_positive_int(value: Any, name: str) -> None:
  """Checks None or an integer >= 1.

  Args:
    value: the field's value.
    name: the field, as the message names it.

  Raises:
    InvalidOptionsError: it is neither.
  """
  if value is not None:
    positive_int(value, name)


AUTO = "auto"
"""The save_interval_steps value that lets the manager choose the interval."""

DEFAULT_INTERVALS = {"local": 10, "persistent": 100}
"""Each tier's default save_interval_steps (options.py): the value that
save_interval_s takes over from."""

DEFAULT_OVERHEAD_BUDGET = 0.01
"""local.overhead_budget's default (options.py)."""


def _number(value: Any) -> bool:
  """A finite int or float that is not a bool."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_cadence(o: Any, tier: str) -> None:
  """Checks a tier's save_interval_steps, save_interval_s and, per tier,
  overhead_budget (local) or mean_time_between_failures_s (persistent).

  Rules: save_interval_steps is an integer >= 1 or "auto"; save_interval_s
  is None or a number > 0 and may only be set while save_interval_steps is
  left at its default (an explicit interval and seconds together are
  ambiguous, and so are "auto" and seconds); overhead_budget is in (0, 1)
  and mean_time_between_failures_s is None or > 0, and each may only differ
  from its default with save_interval_steps "auto" (they tune it, nothing
  else), so a setting that would do nothing is refused, not ignored.

  Args:
    o: a LocalTierOptions or PersistentTierOptions.
    tier: "local" or "persistent" (names the fields in messages).

  Raises:
    InvalidOptionsError: naming the field, what is wrong and how to fix it.
  """
  steps = o.save_interval_steps
  if steps != AUTO:
    require(
      isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1,
      f"{tier}.save_interval_steps must be an integer >= 1 or 'auto', got {steps!r}.",
    )
  seconds = o.save_interval_s
  if seconds is not None:
    require(
      _number(seconds) and seconds > 0,
      f"{tier}.save_interval_s must be a number of seconds > 0, or None (off), got {seconds!r}.",
    )
    require(
      steps == DEFAULT_INTERVALS[tier],
      f"{tier}.save_interval_s={seconds!r} and {tier}.save_interval_steps={steps!r} are both"
      f" set, which is ambiguous: keep one. Remove save_interval_steps to save about every"
      f" {seconds!r} seconds, or set save_interval_s to None to save by steps.",
    )
  if tier == "local":
    budget = o.overhead_budget
    require(
      _number(budget) and 0 < budget < 1,
      f"local.overhead_budget must be a fraction of the step time > 0 and < 1 (e.g. 0.01"
      f" for 1%), got {budget!r}.",
    )
    require(
      steps == AUTO or budget == DEFAULT_OVERHEAD_BUDGET,
      f"local.overhead_budget={budget!r} only tunes local.save_interval_steps: auto, but"
      f" local.save_interval_steps is {steps!r}. Set local.save_interval_steps: auto, or"
      " remove overhead_budget.",
    )
  else:
    mtbf = o.mean_time_between_failures_s
    require(
      mtbf is None or (_number(mtbf) and mtbf > 0),
      "persistent.mean_time_between_failures_s must be a number of seconds > 0, or None"
      f" (estimated from this run's restarts), got {mtbf!r}.",
    )
    require(
      mtbf is None or steps == AUTO,
      f"persistent.mean_time_between_failures_s={mtbf!r} only tunes"
      f" persistent.save_interval_steps: auto, but persistent.save_interval_steps is"
      f" {steps!r}. Set persistent.save_interval_steps: auto, or remove"
      " mean_time_between_failures_s.",
    )


def parse_port_range(value: Any, name: str = "peer.ports") -> tuple[int, int] | None:
  """A port option as an inclusive range.

  Args:
    value: None, a port (50000 or "50000") or an inclusive range
      ("50000-50099"), within 1-65535.
    name: the field, as the message names it.

  Returns:
    (low, high), or None for None.

  Raises:
    InvalidOptionsError: naming `name`, if `value` is none of those.
  """
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, str)):
    text = ""  # refused below
  else:
    text = str(value).strip()
  low, sep, high = text.partition("-")
  ok = low.strip().isdigit() and (not sep or high.strip().isdigit())
  lo, hi = (int(low), int(high if sep else low)) if ok else (0, 0)
  require(
    ok and 1 <= lo <= hi <= 65535,
    f"{name} must be a port or an inclusive range 'LOW-HIGH' within 1-65535"
    f" (e.g. '50000-50099'), got {value!r}.",
  )
  return lo, hi


def check_local(o: Any) -> None:
  """Checks a LocalTierOptions.

  Args:
    o: the options.

  Raises:
    InvalidOptionsError: naming the first impossible field.
  """
  require(
    o.directory is None or (isinstance(o.directory, str) and bool(o.directory)),
    "local.directory must be a non-empty path string (e.g. /dev/shm/ckpt), or None"
    " (this user's own folder on the ramdisk).",
  )
  require(
    o.directory is None or "://" not in o.directory,
    f"local.directory={o.directory!r} must be a node-local path, not a URL.",
  )
  check_cadence(o, "local")
  positive_int(o.max_to_keep, "local.max_to_keep")
  optional_positive_int(o.keep_period, "local.keep_period")
  optional_positive_int(o.keep_best, "local.keep_best")
  positive_int(o.staging_buffers, "local.staging_buffers")
  require(
    isinstance(o.keep_staging_buffer, bool),
    f"local.keep_staging_buffer must be true or false, got {o.keep_staging_buffer!r}.",
  )
  require(
    isinstance(o.device_snapshot, bool),
    f"local.device_snapshot must be true or false, got {o.device_snapshot!r}.",
  )
  require(
    o.redundancy in REDUNDANCY,
    f"local.redundancy={o.redundancy!r} is not one of {', '.join(REDUNDANCY)}.",
  )
  require(
    isinstance(o.redundancy_group_size, int)
    and not isinstance(o.redundancy_group_size, bool)
    and o.redundancy_group_size >= 2,
    f"local.redundancy_group_size must be an integer >= 2, got {o.redundancy_group_size!r}.",
  )
  require(
    isinstance(o.redundancy_required, bool),
    f"local.redundancy_required must be true or false, got {o.redundancy_required!r}.",
  )
  require(
    o.redundancy_overlap is None or isinstance(o.redundancy_overlap, bool),
    "local.redundancy_overlap must be true, false or null (automatic), got"
    f" {o.redundancy_overlap!r}.",
  )


def check_persistent(o: Any) -> None:
  """Checks a PersistentTierOptions.

  Args:
    o: the options.

  Raises:
    InvalidOptionsError: naming the first impossible field.
  """
  require(isinstance(o.compression, bool), "persistent.compression must be true or false.")
  require(
    o.when_busy in ("wait", "skip"),
    f"persistent.when_busy must be 'wait' or 'skip', got {o.when_busy!r}.",
  )
  require(isinstance(o.shared_read, bool), "persistent.shared_read must be true or false.")
  optional_positive_int(o.shared_read_slices, "persistent.shared_read_slices")
  require(
    isinstance(o.directory, str) and bool(o.directory),
    "persistent.directory must be a non-empty path or gs:// URL.",
  )
  check_cadence(o, "persistent")
  if o.max_to_keep is not None:
    positive_int(o.max_to_keep, "persistent.max_to_keep")
  optional_positive_int(o.keep_period, "persistent.keep_period")
  optional_positive_int(o.keep_best, "persistent.keep_best")


def check_peer(o: Any) -> None:
  """Checks a PeerOptions.

  Args:
    o: the options.

  Raises:
    InvalidOptionsError: naming the first impossible field.
  """
  require(
    o.transport in PEER_TRANSPORTS,
    f"peer.transport must be one of {list(PEER_TRANSPORTS)}, got {o.transport!r}.",
  )
  require(
    o.host is None or (isinstance(o.host, str) and bool(o.host.strip())),
    f"peer.host must be a host name or address, or None, got {o.host!r}.",
  )
  parse_port_range(o.ports)
  require(
    o.integrity in PEER_INTEGRITY,
    f"peer.integrity must be one of {list(PEER_INTEGRITY)}, got {o.integrity!r}.",
  )
  require(
    o.encryption in PEER_ENCRYPTION,
    f"peer.encryption must be one of {list(PEER_ENCRYPTION)}, got {o.encryption!r}.",
  )
  require(
    isinstance(o.allow_all_interfaces, bool),
    f"peer.allow_all_interfaces must be True or False, got {o.allow_all_interfaces!r}.",
  )
  require(
    o.allow_all_interfaces or not _all_interfaces(o.host),
    f"peer.host {o.host!r} listens on every interface of the host, exposing the peer"
    " ports beyond the data network. Name the data network's address (or None for the"
    " interface that reaches the coordinator), or set peer.allow_all_interfaces: true.",
  )


def _all_interfaces(host: Any) -> bool:
  """Whether a peer.host is a wildcard address (0.0.0.0, ::, or a spelling of them)."""
  if not isinstance(host, str):
    return False
  try:
    return ipaddress.ip_address(host.strip().strip("[]")).is_unspecified
  except ValueError:
    return host.strip() in ("", "*")


def check_manager(o: Any, local: type, persistent: type, peer: type) -> None:
  """Checks a CheckpointManagerOptions.

  Args:
    o: the options.
    local: the class its `local` must be (LocalTierOptions).
    persistent: the class its `persistent` must be (PersistentTierOptions).
    peer: the class its `peer` must be (PeerOptions).

  Raises:
    InvalidOptionsError: naming the first impossible field.
  """
  require(isinstance(o.local, local), "local must be a LocalTierOptions.")
  require(
    isinstance(o.persistent, persistent),
    "persistent must be a PersistentTierOptions (it also holds the state"
    " store, which must survive losing any ramdisk).",
  )
  require(
    isinstance(o.replica_axis, (str, int)) and not isinstance(o.replica_axis, bool),
    f"replica_axis must be a mesh axis name or index, got {o.replica_axis!r}.",
  )
  if o.run_id is not None:
    require(
      isinstance(o.run_id, str) and bool(RUN_ID_RE.fullmatch(o.run_id)),
      f"run_id={o.run_id!r} must be 1-128 characters of letters, digits,"
      " '.', '_' or '-', starting with a letter or digit.",
    )
  require(
    o.best_metric is None or (isinstance(o.best_metric, str) and bool(o.best_metric)),
    f"best_metric must be a non-empty metric name or None, got {o.best_metric!r}.",
  )
  require(
    o.best_mode in BEST_MODES,
    f"best_mode must be 'min' or 'max', got {o.best_mode!r}.",
  )
  for tier in ("local", "persistent"):
    require(
      getattr(o, tier).keep_best is None or o.best_metric is not None,
      f"{tier}.keep_best={getattr(o, tier).keep_best} needs best_metric: name the"
      " save(metrics=...) key that ranks steps (e.g. best_metric: eval_loss).",
    )
  require(
    o.event_log is None or (isinstance(o.event_log, str) and bool(o.event_log)),
    f"event_log must be a file path or None, got {o.event_log!r}.",
  )
  require(isinstance(o.peer, peer), "peer must be a PeerOptions.")
  require(
    o.host_id is None or (isinstance(o.host_id, str) and bool(o.host_id.strip())),
    f"host_id must be a non-empty string or None (the machine's boot id), got {o.host_id!r}.",
  )
  for name in ("collective_timeout_s", "state_commit_timeout_s", "finish_timeout_s"):
    value = getattr(o, name)
    if value is None and name == "finish_timeout_s":
      continue
    require(
      isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
      f"{name} must be a number > 0"
      + (" or None (no limit)" if name == "finish_timeout_s" else "")
      + f", got {value!r}.",
    )
