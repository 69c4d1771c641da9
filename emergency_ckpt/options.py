"""Frozen, keyword-only option dataclasses, one per tier plus the manager.

Every field documents its default and why. Validation raises
`InvalidOptionsError` in `__post_init__`; it never rewrites a field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from emergency_ckpt.errors import InvalidOptionsError

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _require(cond: bool, message: str) -> None:
  if not cond:
    raise InvalidOptionsError(message)


def _positive_int(value, name: str) -> None:
  _require(
    isinstance(value, int) and not isinstance(value, bool) and value >= 1,
    f"{name} must be an integer >= 1, got {value!r}.",
  )


def _optional_positive_int(value, name: str) -> None:
  if value is not None:
    _positive_int(value, name)


def parse_port_range(value, name: str = "peer.ports") -> tuple[int, int] | None:
  """None, a port (50000 or "50000") or an inclusive range ("50000-50099")
  -> (low, high) or None. Raises InvalidOptionsError naming `name`."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, str)):
    text = ""  # refused below
  else:
    text = str(value).strip()
  low, sep, high = text.partition("-")
  ok = low.strip().isdigit() and (not sep or high.strip().isdigit())
  lo, hi = (int(low), int(high if sep else low)) if ok else (0, 0)
  _require(
    ok and 1 <= lo <= hi <= 65535,
    f"{name} must be a port or an inclusive range 'LOW-HIGH' within 1-65535"
    f" (e.g. '50000-50099'), got {value!r}.",
  )
  return lo, hi


BEST_MODES = ("min", "max")
PEER_TRANSPORTS = ("stream", "collective")


REDUNDANCY = ("none", "partner", "xor")
REDUNDANCY_OVERLAP_MIN_CPUS = 8  # local.redundancy_overlap=None: overlap from this many cores


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalTierOptions:
  """Frequent saves of every process's own shards to a node-local ramdisk."""

  directory: str
  """Node-local directory (e.g. /dev/shm/ckpt). May differ per process; a
  process only ever reads its own. Created with mode 0700 if missing."""

  save_interval_steps: int = 10
  """Save when step % save_interval_steps == 0. Local saves are cheap (one host
  copy plus a background write), so the default is frequent."""

  max_to_keep: int = 2
  """Local steps kept per process. 2 keeps one step to fall back on while the
  newest is written; the newest step with a committed state marker is always
  kept as well, whatever this says."""

  keep_period: int | None = None
  """Also keep every step divisible by this, forever (until deleted by hand or
  `emergency-ckpt gc`). None: off. Ramdisks are small: prefer this on the
  persistent tier."""

  keep_best: int | None = None
  """Also keep the `keep_best` best steps by the manager's `best_metric` (the
  value passed to save(metrics=...)). None: off."""

  staging_buffers: int = 1
  """Local writes in flight at once. A save copies into a host staging
  buffer (kept between saves, one copy of the process's shards) that a
  background thread writes to the ramdisk, into a retired step's file where
  one is spare (the ramdisk keeps up to this many spares). With 1, a save
  that arrives while the previous local write is still running waits for
  it; 2 lets them overlap, for one more buffer and spare."""

  device_snapshot: bool = False
  """On accelerators: save() copies this process's shards on the device
  (an asynchronous device-to-device copy, dispatched in microseconds per
  device) and returns; the device-to-host copy into the staging buffer then
  runs in the background, beside the next training steps. Costs one more
  copy of the process's shards in device memory from save() until that
  copy ends (a save that cannot allocate it stages on the host instead, with
  a warning). False (the default: no extra device memory): save() blocks on
  the device-to-host copy into page-locked host memory, and the copy from
  there into the staging buffer runs in the background. On an H200, 4 GiB:
  a 0.6 ms stall with True (benchmarks/results/2026-11-26-device-stall-h200).
  On CPU devices it only moves the host memcpy out of save() (the stall then
  is a copy in device memory instead)."""

  redundancy: str = "none"
  """Copies of each process's local step in another host's ramdisk of the
  same slice, so a lost host's shards survive without a peer slice:
  "none", or "partner": after its local write, each process sends its step
  (in the background, over the authenticated peer transport) to its partner,
  the next process of its slice on another machine, which keeps it beside
  its own copy: 2x ramdisk memory; survives any loss that never takes a
  process and its partner together. Restore then rebuilds a lost host from
  its partner's copy (`r.source == "partner"`) before the persistent tier.
  "xor": the slice's processes form groups of up to redundancy_group_size
  members on distinct machines; each member keeps an XOR parity block of
  the others' steps (1/(k-1) of a step extra for a group of k) and any one
  member lost per group is rebuilt from the other k-1 (`r.source ==
  "parity"`)."""

  redundancy_group_size: int = 8
  """With "xor": the most members per group (at least 2; fewer if the slice
  spans fewer machines). Larger groups cost less memory (1/(k-1)) but
  survive one loss among more hosts, and a rebuild reads k-1 hosts."""

  redundancy_required: bool = True
  """With a redundancy scheme: a step commits only once its partner holds
  its copy, or its group's parity blocks hold its chunks (False: it may
  commit without them if a partner or member is unreachable; the step is
  then not protected against a host loss)."""

  redundancy_overlap: bool | None = None
  """With a redundancy scheme: whether a process sends its partner copy or
  XOR chunks from the staged snapshot while its local write runs (True),
  rather than from the written file after it (False); the step's manifest
  follows the bytes once the write is done, so a step is protected about
  when it is written instead of a transfer later. It costs CPU beside the
  local write, on this process and on those receiving: None (the default)
  overlaps where this process may run on at least
  REDUNDANCY_OVERLAP_MIN_CPUS cores (a training host; on a few shared
  cores the writes only slow down)."""

  def __post_init__(self):
    _require(
      isinstance(self.directory, str) and bool(self.directory),
      "local.directory must be a non-empty path string (e.g. /dev/shm/ckpt).",
    )
    _require(
      "://" not in self.directory,
      f"local.directory={self.directory!r} must be a node-local path, not a URL.",
    )
    _positive_int(self.save_interval_steps, "local.save_interval_steps")
    _positive_int(self.max_to_keep, "local.max_to_keep")
    _optional_positive_int(self.keep_period, "local.keep_period")
    _optional_positive_int(self.keep_best, "local.keep_best")
    _positive_int(self.staging_buffers, "local.staging_buffers")
    _require(
      isinstance(self.device_snapshot, bool),
      f"local.device_snapshot must be true or false, got {self.device_snapshot!r}.",
    )
    _require(
      self.redundancy in REDUNDANCY,
      f"local.redundancy={self.redundancy!r} is not one of {', '.join(REDUNDANCY)}.",
    )
    _require(
      isinstance(self.redundancy_group_size, int)
      and not isinstance(self.redundancy_group_size, bool)
      and self.redundancy_group_size >= 2,
      f"local.redundancy_group_size must be an integer >= 2, got {self.redundancy_group_size!r}.",
    )
    _require(
      isinstance(self.redundancy_required, bool),
      f"local.redundancy_required must be true or false, got {self.redundancy_required!r}.",
    )
    _require(
      self.redundancy_overlap is None or isinstance(self.redundancy_overlap, bool),
      "local.redundancy_overlap must be true, false or null (automatic), got"
      f" {self.redundancy_overlap!r}.",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PersistentTierOptions:
  """Less frequent saves by the primary slice to GCS (gs://) or any path."""

  directory: str
  """Shared, durable root: gs://bucket/path or a filesystem path. Holds
  tensors/ (Orbax), state/ (JSON per process) and run.json."""

  save_interval_steps: int = 100
  """Save when step % save_interval_steps == 0. Uploads are slow and use
  bandwidth, so the default is 10x rarer than the local tier."""

  max_to_keep: int | None = 3
  """Persistent steps kept (newest first); None keeps all. The newest
  restorable step is never deleted, whatever this says."""

  keep_period: int | None = None
  """Also keep every step divisible by this, forever (e.g. 1000 for an archive
  of every 1000th step). None: off."""

  keep_best: int | None = None
  """Also keep the `keep_best` best steps by the manager's `best_metric`.
  None: off."""

  compression: bool = False
  """zstd (level 1) in Orbax's zarr3 chunks, Orbax's default. Off by default:
  the same standard format uncompressed took half the CPU per upload on the
  primary slice (0.75 vs 1.5 cpu-s per 256 MiB process) and restored 1.6x
  faster from a cold cache, for 18% more bytes on float32 test weights
  (see README, Persistent tier). Turn it on when the bucket's bandwidth, not
  the hosts' CPU, bounds the upload."""

  shared_read: bool = True
  """When every slice restores the same step from this tier (no ramdisk
  holds it), the slices split its shards: each reads about 1/S from storage
  and gets the rest from the other slices over peer.transport "stream"
  (checksums checked on arrival), so the model leaves the bucket once per
  restore, not once per slice. Falls back to every process reading its own
  shards if the transfer fails. Needs peer.transport "stream" and a state
  replicated over the replica axis; otherwise each process reads its own.
  False: always read per process."""

  shared_read_slices: int | None = None
  """With shared_read: how many slices read from storage (slices 0..N-1,
  each about 1/N of the shards; the others receive everything from them).
  1: one slice reads the whole model and serves the rest. A number above
  the job's slice count means every slice. None: the measured rule,
  min(slices, model bytes // 256 MiB), at least 1: one slice reads models
  under 512 MiB, and every reader reads at least 256 MiB. Measured on one
  2-core machine (fake-gcs-server; README, Persistent tier): at 4-16 MiB
  one reader took 0.66-1.06x the per-process read's time, the split
  0.96-1.43x (each reader's fixed cost); at 64-256 MiB they were within
  noise of each other. The split's gain (R times the read bandwidth, each
  reader's egress cut R-fold) needs slices on hosts of their own, which one
  machine cannot show, so the crossover is set above the sizes measured."""

  def __post_init__(self):
    _require(isinstance(self.compression, bool), "persistent.compression must be true or false.")
    _require(isinstance(self.shared_read, bool), "persistent.shared_read must be true or false.")
    _optional_positive_int(self.shared_read_slices, "persistent.shared_read_slices")
    _require(
      isinstance(self.directory, str) and bool(self.directory),
      "persistent.directory must be a non-empty path or gs:// URL.",
    )
    _positive_int(self.save_interval_steps, "persistent.save_interval_steps")
    if self.max_to_keep is not None:
      _positive_int(self.max_to_keep, "persistent.max_to_keep")
    _optional_positive_int(self.keep_period, "persistent.keep_period")
    _optional_positive_int(self.keep_best, "persistent.keep_best")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerOptions:
  """How a slice that lost its ramdisk receives a step from a peer slice."""

  transport: str = "stream"
  """"stream" (each receiving process pulls its shards over TCP from
  processes of intact slices, token-authenticated, CRC32C-checked; 0.21 s
  for 256 MiB per process on this CPU test machine) or "collective" (an XLA
  collective permute over the replica axis: gloo's TCP on CPU, 0.415 s
  there; the accelerator network elsewhere; no port of ours to open)."""

  host: str | None = None
  """Address this process listens on, and peer slices connect to, while it
  serves a "stream" transfer. None: the address of this host's interface
  that routes to the JAX coordinator (right for one-NIC hosts; name the
  host's data-network address when it has several)."""

  ports: str | int | None = None
  """Ports a "stream" sender may listen on: one port, or an inclusive range
  "LOW-HIGH" (e.g. "50000-50099") that holds at least as many ports as
  processes share one host. None: any free port the kernel picks. Set it
  where hosts open only some ports to each other; a sender that finds no
  free port in it cannot serve, and the restore falls back to persistent."""

  def __post_init__(self):
    _require(
      self.transport in PEER_TRANSPORTS,
      f"peer.transport must be one of {list(PEER_TRANSPORTS)}, got {self.transport!r}.",
    )
    _require(
      self.host is None or (isinstance(self.host, str) and bool(self.host.strip())),
      f"peer.host must be a host name or address, or None, got {self.host!r}.",
    )
    parse_port_range(self.ports)

  @property
  def port_range(self) -> tuple[int, int] | None:
    """ports as (low, high), inclusive; None: any port."""
    return parse_port_range(self.ports)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointManagerOptions:
  """Everything the manager needs; build one per process (directories may differ)."""

  local: LocalTierOptions
  """The ramdisk tier, saved by every slice."""

  persistent: PersistentTierOptions
  """The durable tier, saved by the primary slice. Also holds the state store,
  so non-tensor state survives the loss of any ramdisk."""

  replica_axis: str | int = "replica"
  """Name (or index) of the mesh axis whose entries are slices."""

  run_id: str | None = None
  """Names this run's folder in the ramdisk, so a new job never reads another
  job's leftovers. None derives it from persistent.directory (one run per
  persistent directory); restarts of the same run keep the same id."""

  peer: PeerOptions = dataclasses.field(default_factory=PeerOptions)
  """How a slice that lost its ramdisk gets a step from a peer slice."""

  host_id: str | None = None
  """The machine (failure domain) this process runs on, for the check that
  no machine holds processes of two slices (their local copies would then be
  lost together; see placement.py). None: the kernel's boot id, which every
  process and container on one machine shares (hostname where there is
  none). Set it where that is wrong, e.g. one id per simulated host when a
  test runs several "hosts" on one machine."""

  collective_timeout_s: float = 300.0
  """Longest wait for other processes in an exchange (restore agreement,
  latest_step). On timeout the error names the missing processes."""

  state_commit_timeout_s: float = 600.0
  """How long the primary waits for every process's JSON of a step before it
  gives up committing that step (the step then stays unrestorable)."""

  event_log: str | None = None
  """JSON-lines file of save/restore records (one line per event; read by
  `emergency-ckpt report`). "{process}" in it becomes the process index, so
  processes sharing a filesystem write separate files. None: Python logging
  only."""

  best_metric: str | None = None
  """Key of save(metrics={...}) that ranks steps for keep_best and
  best_step(), e.g. "eval_loss". None: no ranking."""

  best_mode: str = "min"
  """"min" if smaller best_metric is better (a loss), "max" if larger is (an
  accuracy)."""

  def __post_init__(self):
    _require(
      isinstance(self.local, LocalTierOptions),
      "local must be a LocalTierOptions.",
    )
    _require(
      isinstance(self.persistent, PersistentTierOptions),
      "persistent must be a PersistentTierOptions (it also holds the state"
      " store, which must survive losing any ramdisk).",
    )
    _require(
      isinstance(self.replica_axis, (str, int)) and not isinstance(self.replica_axis, bool),
      f"replica_axis must be a mesh axis name or index, got {self.replica_axis!r}.",
    )
    if self.run_id is not None:
      _require(
        isinstance(self.run_id, str) and bool(_RUN_ID_RE.fullmatch(self.run_id)),
        f"run_id={self.run_id!r} must be 1-128 characters of letters, digits,"
        " '.', '_' or '-', starting with a letter or digit.",
      )
    _require(
      self.best_metric is None or (isinstance(self.best_metric, str) and bool(self.best_metric)),
      f"best_metric must be a non-empty metric name or None, got {self.best_metric!r}.",
    )
    _require(
      self.best_mode in BEST_MODES,
      f"best_mode must be 'min' or 'max', got {self.best_mode!r}.",
    )
    for tier in ("local", "persistent"):
      _require(
        getattr(self, tier).keep_best is None or self.best_metric is not None,
        f"{tier}.keep_best={getattr(self, tier).keep_best} needs best_metric: name the"
        " save(metrics=...) key that ranks steps (e.g. best_metric: eval_loss).",
      )
    _require(
      self.event_log is None or (isinstance(self.event_log, str) and bool(self.event_log)),
      f"event_log must be a file path or None, got {self.event_log!r}.",
    )
    _require(
      isinstance(self.peer, PeerOptions),
      "peer must be a PeerOptions.",
    )
    _require(
      self.host_id is None or (isinstance(self.host_id, str) and bool(self.host_id.strip())),
      f"host_id must be a non-empty string or None (the machine's boot id), got {self.host_id!r}.",
    )
    for name in ("collective_timeout_s", "state_commit_timeout_s"):
      value = getattr(self, name)
      _require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
        f"{name} must be a number > 0, got {value!r}.",
      )

  def retention(self, tier: str):
    """The retention rules of `tier` ("local" or "persistent")."""
    from emergency_ckpt.retention.rules import Rules  # noqa: PLC0415 - retention imports errors only

    t = getattr(self, tier)
    return Rules(
      max_to_keep=t.max_to_keep,
      keep_period=t.keep_period,
      keep_best=t.keep_best,
      best_metric=self.best_metric,
      best_mode=self.best_mode,
    )

  @property
  def effective_run_id(self) -> str:
    """run_id, or a stable digest of the persistent directory."""
    if self.run_id is not None:
      return self.run_id
    digest = hashlib.sha256(self.persistent.directory.encode()).hexdigest()
    return f"run-{digest[:16]}"
