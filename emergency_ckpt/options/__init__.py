"""Frozen, keyword-only option dataclasses, one per tier plus the manager.

These docstrings are the configuration reference (the docs site renders
them): every field says what it does, its default and why, and its valid
values. The YAML keys of `load_config` map 1:1 to the fields. Validation
raises `InvalidOptionsError` in `__post_init__`, naming the field
(options/checks.py); it never rewrites a field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile

from emergency_ckpt.options import checks as option_checks


def default_local_root() -> str:
  """This user's own ramdisk folder: /dev/shm/emergency_ckpt-<uid> (the
  temporary directory where there is no /dev/shm)."""
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  return os.path.join(base, f"emergency_ckpt-{os.getuid()}")


REDUNDANCY_OVERLAP_MIN_CPUS = 8  # local.redundancy_overlap=None: overlap from this many cores


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalTierOptions:
  """Frequent saves of every process's own shards to a node-local ramdisk."""

  directory: str | None = None
  """Node-local directory (e.g. /dev/shm/ckpt). May differ per process; a
  process only ever reads its own. Created with mode 0700 if missing; every
  folder above it must be root's or this user's (a shared sticky root such
  as /dev/shm is accepted). A non-empty path, not a URL. Default None: this
  user's own folder on the ramdisk, `/dev/shm/emergency_ckpt-<uid>` (the
  temporary directory where there is no /dev/shm), so users of one machine
  never share a run folder, and one squatted by another user is refused
  (UnsafeDirectoryError), never written through. `root` is the folder used."""

  save_interval_steps: int | str = 10
  """Save when step % save_interval_steps == 0. Default 10: local saves are
  cheap (one host copy plus a background write), so they can be frequent.
  An integer >= 1, or "auto": the manager measures what a local save costs
  the trainer (its save() stall plus how much it slows the steps that run
  beside its background write) and saves as often as keeps that cost under
  `overhead_budget` of the step time, with 20% to spare, every step if it
  can (see the user guide, "Save intervals chosen for you"). With save_interval_s, leave this
  at its default."""

  save_interval_s: float | None = None
  """Save about every this many seconds instead of every N steps, for
  trainers whose step time varies: the primary process turns it into a step
  interval from the measured step time (the smallest interval of at least
  this many seconds), re-planned as the step time changes; every process
  saves the same steps. In a job of one process: the first step at least
  this long after the tier's previous save. Default None: off (the step
  interval decides). None or a number > 0; save_interval_steps must then be
  left at its default (setting both is refused as ambiguous)."""

  overhead_budget: float = 0.01
  """With save_interval_steps "auto": the largest share of the step time
  that local saves may cost, averaged over the steps (a save's stall plus
  its slowdown of the steps beside its write, divided by the interval).
  Default 0.01 (1%): frequent local copies for a cost hard to see in the
  step time. A number > 0 and < 1; only with "auto"."""

  max_to_keep: int = 2
  """Local steps kept per process. Default 2 keeps one step to fall back on
  while the newest is written; the newest step with a committed state
  marker is always kept as well, whatever this says. An integer >= 1."""

  keep_period: int | None = None
  """Also keep every step divisible by this, forever (until deleted by hand or
  `emergency-ckpt gc`). Default None: off, since ramdisks are small: prefer
  this on the persistent tier. None or an integer >= 1."""

  keep_best: int | None = None
  """Also keep the `keep_best` best steps by the manager's `best_metric` (the
  value passed to save(metrics=...)). Default None: off. None or an integer
  >= 1; needs `best_metric`."""

  staging_buffers: int = 1
  """Local writes in flight at once. A save copies into a host staging
  buffer (kept between saves, one copy of the process's shards) that a
  background thread writes to the ramdisk, into a retired step's file where
  one is spare (the ramdisk keeps up to this many spares). Default 1: a save
  that arrives while the previous local write is still running waits for
  it, and host memory holds one extra copy; 2 lets them overlap, for one
  more buffer and spare. An integer >= 1."""

  keep_staging_buffer: bool = True
  """Keep the host staging buffer (one copy of this process's shards)
  allocated and faulted in between saves. Default True: save()'s stall is
  a plain copy into memory already there. False: its pages go back to the
  system once the step's last reader (local write, persistent upload) is
  done, so between saves the process holds no copy; each save then faults
  fresh pages in inside its stall (a slower save(); see the configuration
  reference, "Host memory"), and prepare() does nothing. The peak during a
  save is one copy either way. True or false."""

  device_snapshot: bool = False
  """On accelerators: save() copies this process's shards on the device
  (an asynchronous device-to-device copy, dispatched without waiting) and
  returns; the device-to-host copy into the staging buffer then runs in the
  background, beside the next training steps. Costs one more copy of the
  process's shards in device memory from save() until that copy ends (a
  save that cannot allocate it stages on the host instead, with a warning).
  Default False (no extra device memory): save() blocks on the
  device-to-host copy into page-locked host memory, and the copy from there
  into the staging buffer runs in the background. On CPU devices it only
  moves the host memcpy out of save() (the stall then is a copy in device
  memory instead). True or false."""

  redundancy: str = "none"
  """Copies of each process's local step in another host's ramdisk of the
  same slice, so a lost host's shards survive without a peer slice.
  "none" (the default: no extra memory or traffic; a peer slice or the
  persistent tier restores a lost host). "partner": after its local write,
  each process sends its step (in the background, over the authenticated
  peer transport) to its partner, the next process of its slice on another
  machine, which keeps it beside its own copy: 2x ramdisk memory; survives
  any loss that never takes a process and its partner together. Restore
  then rebuilds a lost host from its partner's copy (`r.source ==
  "partner"`) before the persistent tier. "xor": the slice's processes form
  groups of up to redundancy_group_size members on distinct machines; each
  member keeps an XOR parity block of the others' steps (1/(k-1) of a step
  extra for a group of k) and any one member lost per group is rebuilt
  from the other k-1 (`r.source == "parity"`)."""

  redundancy_group_size: int = 8
  """With "xor": the most members per group (fewer if the slice spans fewer
  machines). Larger groups cost less memory (1/(k-1)) but survive one loss
  among more hosts, and a rebuild reads k-1 hosts; the default 8 costs a
  seventh of a step. An integer >= 2."""

  redundancy_required: bool = True
  """With a redundancy scheme: a step commits only once its partner holds
  its copy, or its group's parity blocks hold its chunks. Default True, so
  a committed step is protected against a host loss; False: it may commit
  without them if a partner or member is unreachable, and is then not
  protected. True or false."""

  redundancy_overlap: bool | None = None
  """With a redundancy scheme: whether a process sends its partner copy or
  XOR chunks from the staged snapshot while its local write runs (True),
  rather than from the written file after it (False); the step's manifest
  follows the bytes once the write is done, so a step is protected about
  when it is written instead of a transfer later. It costs CPU beside the
  local write, on this process and on those receiving: None (the default)
  overlaps where this process may run on at least
  REDUNDANCY_OVERLAP_MIN_CPUS cores (a training host; on a few shared
  cores the writes only slow down). True, false or None."""

  def __post_init__(self):
    option_checks.check_local(self)

  @property
  def root(self) -> str:
    """The local directory in use: `directory`, or this user's default."""
    return self.directory if self.directory is not None else default_local_root()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PersistentTierOptions:
  """Less frequent saves by the primary slice to GCS (gs://) or any path."""

  directory: str
  """Shared, durable root: gs://bucket/path or a filesystem path every
  process can reach. Required: no default. Holds tensors/ (Orbax), state/
  (JSON per process) and run.json. A non-empty string."""

  save_interval_steps: int | str = 100
  """Save when step % save_interval_steps == 0. Default 100, 10x rarer than
  the local tier: uploads are slow and use bandwidth. An integer >= 1, or
  "auto": Young and Daly's interval sqrt(2 x C x MTBF) seconds, in steps of
  the measured step time, where C is the measured cost of one persistent
  save (its save() stall plus its slowdown of the steps beside its upload)
  and MTBF is `mean_time_between_failures_s`, else estimated from this
  run's restarts (see the user guide, "Save intervals chosen for you").
  With save_interval_s, leave this at its default."""

  save_interval_s: float | None = None
  """Save about every this many seconds instead of every N steps (as
  local.save_interval_s: the primary process turns it into a step interval
  from the measured step time). Default None: off. None or a number > 0;
  save_interval_steps must then be left at its default (setting both is
  refused as ambiguous)."""

  mean_time_between_failures_s: float | None = None
  """With save_interval_steps "auto": the job's mean time between failures
  (anything that restarts it), in seconds, for Young and Daly's interval.
  Default None: estimated from this run's history, the time since its
  first start divided by its restarts (each start of a manager on this
  persistent directory and run_id after the first counts as one), and 24
  hours (or the run's age, if longer) while it has never restarted. A
  number > 0; only with "auto"."""

  max_to_keep: int | None = 3
  """Persistent steps kept (newest first). Default 3: a few steps to fall
  back on if the newest proves bad, at a bounded bucket size. None keeps
  all. The newest restorable step is never deleted, whatever this says.
  None or an integer >= 1."""

  keep_period: int | None = None
  """Also keep every step divisible by this, forever (e.g. 1000 for an archive
  of every 1000th step). Default None: off. None or an integer >= 1."""

  keep_best: int | None = None
  """Also keep the `keep_best` best steps by the manager's `best_metric`.
  Default None: off. None or an integer >= 1; needs `best_metric`."""

  when_busy: str = "skip"
  """What a persistent step does when the previous upload still runs:
  "skip" (the step is skipped on the whole primary slice, agreed without
  blocking save(); training never waits for the bucket, health() and a
  save_skipped event name the skipped steps; the next persistent step after
  the upload ends is uploaded) or "wait" (save() waits for it, as Orbax's
  own managers do: every persistent step reaches the bucket, but a hung or
  slow bucket stalls training for as long as it is sick). Default "skip": a
  sick bucket never stops training. "wait" or "skip"."""

  compression: bool = False
  """zstd (level 1) in Orbax's zarr3 chunks, Orbax's default. Default False:
  the same standard format uncompressed takes less CPU per upload on the
  primary slice and restores faster from a cold cache, for somewhat more
  bytes stored (see README, Persistent tier). Turn it on when the bucket's
  bandwidth, not the hosts' CPU, bounds the upload. True or false."""

  shared_read: bool = True
  """When every slice restores the same step from this tier (no ramdisk
  holds it), the slices split its shards: each reads about 1/S from storage
  and gets the rest from the other slices over peer.transport "stream"
  (checksums checked on arrival), so the model leaves the bucket once per
  restore, not once per slice. Falls back to every process reading its own
  shards if the transfer fails. Needs peer.transport "stream" and a state
  replicated over the replica axis; otherwise each process reads its own.
  Default True: it cuts the bucket's egress S-fold, and any failure falls
  back to the per-process read. False: always read per process. True or
  false."""

  shared_read_slices: int | None = None
  """With shared_read: how many slices read from storage (slices 0..N-1,
  each about 1/N of the shards; the others receive everything from them).
  1: one slice reads the whole model and serves the rest. A number above
  the job's slice count means every slice. Default None: the rule
  min(slices, model bytes // 256 MiB), at least 1: one slice reads models
  under 512 MiB, and every reader reads at least 256 MiB. Each reader has a
  fixed cost that outweighs splitting a small read; the split's gain (R
  times the read bandwidth, each reader's egress cut R-fold) shows only
  with slices on hosts of their own, so the crossover is set high. None or
  an integer >= 1."""

  def __post_init__(self):
    option_checks.check_persistent(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerOptions:
  """How a slice that lost its ramdisk receives a step from a peer slice."""

  transport: str = "stream"
  """"stream" (the default: each receiving process pulls its shards over TCP
  from processes of intact slices, token-authenticated, CRC32C-checked;
  persistent.shared_read needs it too) or "collective" (an XLA collective
  permute over the replica axis: gloo's TCP on CPU, the accelerator network
  elsewhere; no port of ours to open)."""

  host: str | None = None
  """Address this process listens on, and peer slices connect to, while it
  serves a "stream" transfer. Default None: the address of this host's
  interface that routes to the JAX coordinator (right for one-NIC hosts;
  name the host's data-network address when it has several). None or a
  non-empty host name or address."""

  ports: str | int | None = None
  """Ports a "stream" sender may listen on: one port, or an inclusive range
  "LOW-HIGH" (e.g. "50000-50099") within 1-65535 that holds at least as
  many ports as processes share one host. Default None: any free port the
  kernel picks. Set it where hosts open only some ports to each other; a
  sender that finds no free port in it cannot serve, and the restore falls
  back to persistent."""

  integrity: str = "mac"
  """What protects the bytes of every peer stream (a restore's transfer,
  partner copies, XOR chunks) beyond the handshake, in which both ends
  always prove they hold the secret published through the coordination
  service: "mac" (the default: under a per-connection key, an HMAC-SHA256
  over every header and a GMAC (AES-GCM) over every shard, so a shard changed on
  the wire fails even when its CRC32C was fixed too; it costs one more pass
  over each byte in cache, measured in docs/security.md) or "crc" (headers MAC'd,
  payloads checked by their CRC32C only: against accidents, not a man in
  the middle; for networks no one else can reach)."""

  encryption: str = "none"
  """Whether peer streams are encrypted: "none" (the default: the job's
  bytes are readable on its network, but cannot be changed unseen under
  integrity "mac") or "tls" (TLS 1.3 from the standard library, each
  listener's self-signed certificate pinned by the fingerprint it publishes
  through the coordination service; needs the `openssl` tool on the PATH
  and costs more, measured in docs/security.md): for networks others can
  read."""

  allow_all_interfaces: bool = False
  """Whether `host` may be an all-interfaces address ("0.0.0.0", "::"), which
  exposes the listening ports on every network the host is on, not only the
  one its peers use. Default False: such a host is refused, since it is
  almost always an accident; name the data network's address instead, or
  set this True where a wildcard listener is wanted (a firewall in front)."""

  def __post_init__(self):
    option_checks.check_peer(self)

  @property
  def port_range(self) -> tuple[int, int] | None:
    """ports as (low, high), inclusive; None: any port."""
    return option_checks.parse_port_range(self.ports)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointManagerOptions:
  """Everything the manager needs; build one per process (directories may differ)."""

  local: LocalTierOptions
  """The ramdisk tier, saved by every slice. Required: a LocalTierOptions
  (YAML: the `local:` section)."""

  persistent: PersistentTierOptions
  """The durable tier, saved by the primary slice. Required: a
  PersistentTierOptions (YAML: the `persistent:` section). Also holds the
  state store, so non-tensor state survives the loss of any ramdisk."""

  replica_axis: str | int = "replica"
  """Name (or index) of the mesh axis whose entries are slices; each entry
  must be made of whole processes. Default "replica": name the mesh's slice
  axis so, or set this. A mesh axis name or index."""

  run_id: str | None = None
  """Names this run's folder in the ramdisk, so a new job never reads another
  job's leftovers. Default None derives it from persistent.directory (one
  run per persistent directory); restarts of the same run keep the same id.
  1-128 characters of letters, digits, '.', '_' or '-', starting with a
  letter or digit."""

  peer: PeerOptions = dataclasses.field(default_factory=PeerOptions)
  """How a slice that lost its ramdisk gets a step from a peer slice.
  Default PeerOptions() (YAML: the `peer:` section)."""

  host_id: str | None = None
  """The machine (failure domain) this process runs on, for the check that
  no machine holds processes of two slices (their local copies would then be
  lost together; see placement.py). Default None: the kernel's boot id,
  which every process and container on one machine shares (hostname where
  there is none). Set it where that is wrong, e.g. one id per simulated
  host when a test runs several "hosts" on one machine. None or a non-empty
  string."""

  collective_timeout_s: float = 300.0
  """Longest wait, in seconds, for other processes: in an exchange (restore
  agreement, latest_step), a transfer between processes, and Orbax's
  barriers at persistent saves. On timeout the error names the missing
  processes. Default 300 (5 minutes): a process that has not arrived by
  then is taken as dead or hung; raise it where the scheduler brings
  replacement hosts up slowly. A number > 0."""

  state_commit_timeout_s: float = 600.0
  """How long, in seconds, the primary waits for every process's JSON of a
  step before it gives up committing that step (the step then stays
  unrestorable). Default 600: each process writes its JSON only after its
  local write (and redundancy copies) of the step, in the background, so a
  slow host may take far longer than an exchange, and the wait blocks no
  training step. A number > 0."""

  finish_timeout_s: float | None = 1800.0
  """Longest wait, in seconds, of wait_until_finished() and close() when
  they are called without a timeout of their own. Past it they raise
  PendingWorkTimeoutError naming each tier's work still in flight (e.g. an
  upload to a bucket that stopped answering) and the steps that never
  reached the persistent tier; close() then abandons that work, uncommitted,
  so a job ending while its bucket is down exits. Default 1800 (30
  minutes): longer than a healthy upload of a large model takes, short
  enough that a dead bucket cannot hold a finished job for hours. A number
  > 0, or None to wait as long as it takes."""

  event_log: str | None = None
  """JSON-lines file of save/restore records (one line per event; read by
  `emergency-ckpt report`). "{process}" in it becomes the process index, so
  processes sharing a filesystem write separate files. Default None: Python
  logging only. None or a file path."""

  best_metric: str | None = None
  """Key of save(metrics={...}) that ranks steps for keep_best and
  best_step(), e.g. "eval_loss". Default None: no ranking. None or a
  non-empty name."""

  best_mode: str = "min"
  """"min" if smaller best_metric is better (a loss; the default), "max" if
  larger is (an accuracy)."""

  def __post_init__(self):
    option_checks.check_manager(self, LocalTierOptions, PersistentTierOptions, PeerOptions)

  @property
  def effective_run_id(self) -> str:
    """run_id, or a stable digest of the persistent directory."""
    if self.run_id is not None:
      return self.run_id
    digest = hashlib.sha256(self.persistent.directory.encode()).hexdigest()
    return f"run-{digest[:16]}"
