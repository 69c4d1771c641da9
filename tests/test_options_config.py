"""Unit tests of option validation and YAML config loading."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import textwrap

import pytest

from emergency_ckpt.config import apply_overrides, field_docs, load_config, options_from_dict
from emergency_ckpt.errors import ConfigError, InvalidOptionsError
from emergency_ckpt.options import (
  CheckpointManagerOptions,
  LocalTierOptions,
  PeerOptions,
  PersistentTierOptions,
)
from emergency_ckpt.options.checks import RUN_ID_RE as _RUN_ID_RE

LOCAL = LocalTierOptions(directory="/dev/shm/ckpt")
PERSISTENT = PersistentTierOptions(directory="gs://bucket/run")


def manager(**kw):
  kw.setdefault("local", LOCAL)
  kw.setdefault("persistent", PERSISTENT)
  return CheckpointManagerOptions(**kw)


# ---- option validation -------------------------------------------------------

INVALID = [
  (
    "local_interval_0",
    lambda: LocalTierOptions(directory="/x", save_interval_steps=0),
    "local.save_interval_steps",
  ),
  (
    "local_interval_neg",
    lambda: LocalTierOptions(directory="/x", save_interval_steps=-5),
    "local.save_interval_steps",
  ),
  (
    "local_interval_bool",
    lambda: LocalTierOptions(directory="/x", save_interval_steps=True),
    "local.save_interval_steps",
  ),
  (
    "local_interval_float",
    lambda: LocalTierOptions(directory="/x", save_interval_steps=2.0),
    "local.save_interval_steps",
  ),
  (
    "local_interval_str",
    lambda: LocalTierOptions(directory="/x", save_interval_steps="10"),
    "local.save_interval_steps",
  ),
  (
    "local_max_to_keep_0",
    lambda: LocalTierOptions(directory="/x", max_to_keep=0),
    "local.max_to_keep",
  ),
  (
    "local_max_to_keep_none",
    lambda: LocalTierOptions(directory="/x", max_to_keep=None),
    "local.max_to_keep",
  ),
  (
    "local_staging_0",
    lambda: LocalTierOptions(directory="/x", staging_buffers=0),
    "local.staging_buffers",
  ),
  (
    "local_staging_bool",
    lambda: LocalTierOptions(directory="/x", staging_buffers=False),
    "local.staging_buffers",
  ),
  ("local_dir_empty", lambda: LocalTierOptions(directory=""), "local.directory"),
  ("local_dir_int", lambda: LocalTierOptions(directory=5), "local.directory"),
  ("local_dir_url", lambda: LocalTierOptions(directory="gs://bucket/ckpt"), "local.directory"),
  (
    "local_dir_file_url",
    lambda: LocalTierOptions(directory="file:///dev/shm/x"),
    "local.directory",
  ),
  ("persistent_dir_empty", lambda: PersistentTierOptions(directory=""), "persistent.directory"),
  ("persistent_dir_path_obj", lambda: PersistentTierOptions(directory=3), "persistent.directory"),
  (
    "persistent_interval_0",
    lambda: PersistentTierOptions(directory="/p", save_interval_steps=0),
    "persistent.save_interval_steps",
  ),
  (
    "persistent_interval_neg",
    lambda: PersistentTierOptions(directory="/p", save_interval_steps=-1),
    "persistent.save_interval_steps",
  ),
  (
    "persistent_interval_bool",
    lambda: PersistentTierOptions(directory="/p", save_interval_steps=True),
    "persistent.save_interval_steps",
  ),
  (
    "persistent_max_to_keep_0",
    lambda: PersistentTierOptions(directory="/p", max_to_keep=0),
    "persistent.max_to_keep",
  ),
  (
    "persistent_max_to_keep_neg",
    lambda: PersistentTierOptions(directory="/p", max_to_keep=-3),
    "persistent.max_to_keep",
  ),
  (
    "persistent_shared_read_slices_0",
    lambda: PersistentTierOptions(directory="/p", shared_read_slices=0),
    "persistent.shared_read_slices",
  ),
  (
    "persistent_shared_read_slices_bool",
    lambda: PersistentTierOptions(directory="/p", shared_read_slices=True),
    "persistent.shared_read_slices",
  ),
  (
    "persistent_shared_read_slices_str",
    lambda: PersistentTierOptions(directory="/p", shared_read_slices="2"),
    "persistent.shared_read_slices",
  ),
  (
    "persistent_shared_read_str",
    lambda: PersistentTierOptions(directory="/p", shared_read="yes"),
    "persistent.shared_read",
  ),
  ("manager_local_wrong_type", lambda: manager(local={"directory": "/x"}), "local"),
  ("manager_persistent_wrong_type", lambda: manager(persistent=LOCAL), "persistent"),
  ("replica_axis_bool", lambda: manager(replica_axis=True), "replica_axis"),
  ("replica_axis_false", lambda: manager(replica_axis=False), "replica_axis"),
  ("replica_axis_none", lambda: manager(replica_axis=None), "replica_axis"),
  ("replica_axis_float", lambda: manager(replica_axis=1.0), "replica_axis"),
  ("run_id_empty", lambda: manager(run_id=""), "run_id"),
  ("run_id_slash", lambda: manager(run_id="a/b"), "run_id"),
  ("run_id_dotdot", lambda: manager(run_id=".."), "run_id"),
  ("run_id_leading_dash", lambda: manager(run_id="-run"), "run_id"),
  ("run_id_space", lambda: manager(run_id="my run"), "run_id"),
  ("run_id_too_long", lambda: manager(run_id="a" * 129), "run_id"),
  ("run_id_not_str", lambda: manager(run_id=7), "run_id"),
  ("run_id_trailing_newline", lambda: manager(run_id="run1\n"), "run_id"),
  ("collective_timeout_0", lambda: manager(collective_timeout_s=0), "collective_timeout_s"),
  ("collective_timeout_neg", lambda: manager(collective_timeout_s=-1.5), "collective_timeout_s"),
  (
    "collective_timeout_nan",
    lambda: manager(collective_timeout_s=float("nan")),
    "collective_timeout_s",
  ),
  ("collective_timeout_str", lambda: manager(collective_timeout_s="300"), "collective_timeout_s"),
  ("collective_timeout_bool", lambda: manager(collective_timeout_s=True), "collective_timeout_s"),
  ("state_commit_timeout_0", lambda: manager(state_commit_timeout_s=0.0), "state_commit_timeout_s"),
  (
    "state_commit_timeout_neg",
    lambda: manager(state_commit_timeout_s=-600),
    "state_commit_timeout_s",
  ),
  (
    "state_commit_timeout_none",
    lambda: manager(state_commit_timeout_s=None),
    "state_commit_timeout_s",
  ),
  ("peer_transport_unknown", lambda: PeerOptions(transport="rdma"), "peer.transport"),
  ("peer_transport_none", lambda: PeerOptions(transport=None), "peer.transport"),
  ("peer_host_empty", lambda: PeerOptions(host=" "), "peer.host"),
  ("peer_host_not_str", lambda: PeerOptions(host=10), "peer.host"),
  ("host_id_empty", lambda: manager(host_id=""), "host_id"),
  ("peer_ports_word", lambda: PeerOptions(ports="fast"), "peer.ports"),
  ("peer_ports_zero", lambda: PeerOptions(ports=0), "peer.ports"),
  ("peer_ports_too_high", lambda: PeerOptions(ports="65000-70000"), "peer.ports"),
  ("peer_ports_reversed", lambda: PeerOptions(ports="50010-50000"), "peer.ports"),
  ("peer_ports_open_end", lambda: PeerOptions(ports="50000-"), "peer.ports"),
  ("peer_ports_bool", lambda: PeerOptions(ports=True), "peer.ports"),
  ("peer_ports_float", lambda: PeerOptions(ports=5.0e4), "peer.ports"),
  ("host_id_not_str", lambda: manager(host_id=3), "host_id"),
]


@pytest.mark.parametrize("build,field", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_option_raises_naming_field(build, field):
  with pytest.raises(InvalidOptionsError) as info:
    build()
  assert field in str(info.value)
  assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("run_id", ["a", "A" * 128, "run-1.2_3", "0abc", "job.2024-01-01_x"])
def test_valid_run_ids(run_id):
  assert manager(run_id=run_id).effective_run_id == run_id


def test_valid_options_build():
  opts = manager(
    local=LocalTierOptions(
      directory="/dev/shm/c", save_interval_steps=1, max_to_keep=1, staging_buffers=2
    ),
    persistent=PersistentTierOptions(directory="/mnt/p", save_interval_steps=1, max_to_keep=None),
    replica_axis=0,
    collective_timeout_s=0.5,
    state_commit_timeout_s=1,
  )
  assert opts.replica_axis == 0
  assert opts.persistent.max_to_keep is None


def test_options_are_frozen_and_keyword_only():
  with pytest.raises(dataclasses.FrozenInstanceError):
    LOCAL.max_to_keep = 5  # type: ignore[misc]
  with pytest.raises(TypeError):
    LocalTierOptions("/x")  # type: ignore[misc]


def test_effective_run_id_is_stable_and_derived_from_persistent_dir():
  a = manager(persistent=PersistentTierOptions(directory="gs://b/run1"))
  a_again = manager(
    local=LocalTierOptions(directory="/other/local"),
    persistent=PersistentTierOptions(directory="gs://b/run1", save_interval_steps=7),
  )
  b = manager(persistent=PersistentTierOptions(directory="gs://b/run2"))
  want = "run-" + hashlib.sha256(b"gs://b/run1").hexdigest()[:16]
  assert a.effective_run_id == want
  assert a_again.effective_run_id == want  # local dir and intervals do not matter
  assert b.effective_run_id != want
  assert _RUN_ID_RE.match(a.effective_run_id)
  assert manager(run_id="explicit", persistent=a.persistent).effective_run_id == "explicit"


# ---- YAML config -------------------------------------------------------------


def write(tmp_path, text: str, name="ckpt.yaml"):
  path = tmp_path / name
  path.write_text(textwrap.dedent(text))
  return path


FULL_YAML = textwrap.dedent(
  """
  local:
    directory: /dev/shm/ckpt
    save_interval_steps: 20
    max_to_keep: 3
    staging_buffers: 2
  persistent:
    directory: gs://bucket/run
    save_interval_steps: 200
    max_to_keep: null
  replica_axis: data
  run_id: exp-7
  collective_timeout_s: 120
  state_commit_timeout_s: 900.5
  """
)


def test_load_config_equals_dataclass_built_in_code(tmp_path):
  got = load_config(write(tmp_path, FULL_YAML))
  want = CheckpointManagerOptions(
    local=LocalTierOptions(
      directory="/dev/shm/ckpt", save_interval_steps=20, max_to_keep=3, staging_buffers=2
    ),
    persistent=PersistentTierOptions(
      directory="gs://bucket/run", save_interval_steps=200, max_to_keep=None
    ),
    replica_axis="data",
    run_id="exp-7",
    collective_timeout_s=120,
    state_commit_timeout_s=900.5,
  )
  assert got == want


def test_shared_read_slices_from_yaml_and_override(tmp_path):
  path = write(
    tmp_path,
    """
    local: {directory: /dev/shm/c}
    persistent: {directory: /mnt/p, shared_read: true, shared_read_slices: 1}
    """,
  )
  got = load_config(path)
  assert (got.persistent.shared_read, got.persistent.shared_read_slices) == (True, 1)
  got = load_config(path, ["persistent.shared_read_slices=null"])
  assert got.persistent.shared_read_slices is None
  assert PersistentTierOptions(directory="/p").shared_read_slices is None


def test_load_config_minimal_uses_defaults(tmp_path):
  path = write(
    tmp_path,
    """
    local: {directory: /dev/shm/c}
    persistent: {directory: /mnt/p}
    """,
  )
  assert load_config(path) == manager(
    local=LocalTierOptions(directory="/dev/shm/c"),
    persistent=PersistentTierOptions(directory="/mnt/p"),
  )


@pytest.mark.parametrize(
  "yaml_text,key",
  [
    (FULL_YAML + "bogus_top: 1\n", "bogus_top"),
    (FULL_YAML.replace("staging_buffers: 2", "staging_bufers: 2"), "local.staging_bufers"),
    (
      FULL_YAML.replace("max_to_keep: null", "max_to_keep: null\n  retries: 3"),
      "persistent.retries",
    ),
  ],
  ids=["top_level", "nested_local", "nested_persistent"],
)
def test_unknown_keys_rejected_by_name(tmp_path, yaml_text, key):
  with pytest.raises(ConfigError) as info:
    load_config(write(tmp_path, yaml_text))
  assert key in str(info.value)


def test_overrides(tmp_path):
  got = load_config(
    write(tmp_path, FULL_YAML),
    ["local.save_interval_steps=5", "persistent.directory=gs://b/x", "run_id=other"],
  )
  assert got.local.save_interval_steps == 5
  assert isinstance(got.local.save_interval_steps, int)
  assert got.persistent.directory == "gs://b/x"
  assert got.run_id == "other"
  assert got.local.max_to_keep == 3  # untouched keys keep the file's value


def test_override_adds_missing_section(tmp_path):
  got = load_config(
    write(tmp_path, "local: {directory: /dev/shm/c}\n"), ["persistent.directory=/mnt/p"]
  )
  assert got.persistent == PersistentTierOptions(directory="/mnt/p")


def test_override_into_empty_section(tmp_path):
  # An empty section (`local:` with nothing under it) loads as an empty mapping,
  # so an override must be able to fill it.
  path = write(tmp_path, "local:\npersistent: {directory: /mnt/p}\n")
  got = load_config(path, ["local.directory=/dev/shm/c"])
  assert got.local == LocalTierOptions(directory="/dev/shm/c")


def test_override_empty_value_is_none(tmp_path):
  got = load_config(write(tmp_path, FULL_YAML), ["persistent.max_to_keep="])
  assert got.persistent.max_to_keep is None


def test_apply_overrides_does_not_mutate_input():
  data = {"local": {"directory": "/a"}}
  out = apply_overrides(data, ["local.directory=/b"])
  assert data == {"local": {"directory": "/a"}}
  assert out == {"local": {"directory": "/b"}}


@pytest.mark.parametrize(
  "override",
  [
    "local.save_interval_steps",  # no '='
    "local.directory.sub=5",  # directory is not a section
    "local.directory=[unclosed",  # value is not valid YAML
  ],
)
def test_bad_override_syntax(tmp_path, override):
  with pytest.raises(ConfigError) as info:
    load_config(write(tmp_path, FULL_YAML), [override])
  assert override in str(info.value)


def test_override_with_invalid_value_raises_invalid_options(tmp_path):
  with pytest.raises(InvalidOptionsError, match="local.save_interval_steps"):
    load_config(write(tmp_path, FULL_YAML), ["local.save_interval_steps=0"])


def test_env_vars_expand_in_strings(tmp_path, monkeypatch):
  monkeypatch.setenv("EC_TEST_HOST", "host-3")
  monkeypatch.setenv("EC_TEST_BUCKET", "bkt")
  path = write(
    tmp_path,
    """
    local:
      directory: /dev/shm/ckpt-${EC_TEST_HOST}
    persistent:
      directory: gs://$EC_TEST_BUCKET/run
    run_id: r-${EC_TEST_HOST}
    """,
  )
  got = load_config(path)
  assert got.local.directory == "/dev/shm/ckpt-host-3"
  assert got.persistent.directory == "gs://bkt/run"
  assert got.run_id == "r-host-3"
  over = load_config(path, ["local.directory=/dev/shm/o-${EC_TEST_HOST}"])
  assert over.local.directory == "/dev/shm/o-host-3"


@pytest.mark.parametrize(
  "yaml_text,key",
  [
    ("local: {directory: /l}\n", "persistent"),
    ("local: {directory: /l}\npersistent: {max_to_keep: 2}\n", "persistent.directory"),
    ("", "local"),
  ],
)
def test_missing_required_key(tmp_path, yaml_text, key):
  with pytest.raises(ConfigError) as info:
    load_config(write(tmp_path, yaml_text))
  assert "missing" in str(info.value)
  assert key in str(info.value)


def test_without_a_local_directory_the_root_is_the_users_own(tmp_path):
  got = load_config(
    write(tmp_path, "persistent: {directory: /p}\nlocal: {save_interval_steps: 3}\n")
  )
  assert got.local.directory is None
  assert got.local.root == f"/dev/shm/emergency_ckpt-{os.getuid()}"


def test_section_not_a_mapping(tmp_path):
  with pytest.raises(ConfigError, match="local must be a mapping"):
    load_config(write(tmp_path, "local: 5\npersistent: {directory: /p}\n"))


def test_invalid_yaml_and_missing_file(tmp_path):
  with pytest.raises(ConfigError, match="not valid YAML"):
    load_config(write(tmp_path, "local: [unclosed\n"))
  with pytest.raises(ConfigError, match="cannot read config"):
    load_config(tmp_path / "absent.yaml")


def test_options_from_dict_matches_load_config(tmp_path):
  import yaml

  data = yaml.safe_load(textwrap.dedent(FULL_YAML))
  assert options_from_dict(data) == load_config(write(tmp_path, FULL_YAML))


@pytest.mark.parametrize("cls", [LocalTierOptions, PersistentTierOptions, CheckpointManagerOptions])
def test_field_docs_cover_every_field(cls):
  docs = field_docs(cls)
  assert set(docs) == {f.name for f in dataclasses.fields(cls)}
  for name, doc in docs.items():
    assert len(doc) > 10, name
    assert "\n" not in doc


def test_field_docs_local_content():
  docs = field_docs(LocalTierOptions)
  assert docs["directory"].startswith("Node-local directory")
  assert "0700" in docs["directory"]
  assert "step % save_interval_steps == 0" in docs["save_interval_steps"]


def test_unset_environment_variable_is_named(tmp_path, monkeypatch):
  import emergency_ckpt as ec  # noqa: PLC0415

  monkeypatch.delenv("EC_UNSET_ROOT", raising=False)
  cfg = tmp_path / "c.yaml"
  cfg.write_text(
    "local:\n  directory: /dev/shm/x\npersistent:\n  directory: ${EC_UNSET_ROOT}/run\n"
  )
  with pytest.raises(
    ec.ConfigError, match="persistent.directory: environment variable EC_UNSET_ROOT"
  ):
    ec.load_config(cfg)
  monkeypatch.setenv("EC_UNSET_ROOT", "/data")
  assert ec.load_config(cfg).persistent.directory == "/data/run"


def test_field_docs_of_a_nested_class():
  import dataclasses  # noqa: PLC0415

  from emergency_ckpt.config import field_docs  # noqa: PLC0415

  @dataclasses.dataclass
  class Inner:
    x: int = 1
    """The x."""

  assert field_docs(Inner) == {"x": "The x."}


@pytest.mark.parametrize(
  "value, want",
  [
    (None, None),
    (50000, (50000, 50000)),
    ("50000", (50000, 50000)),
    (" 50000-50099 ", (50000, 50099)),
  ],
)
def test_peer_ports_parse(value, want):
  assert PeerOptions(ports=value).port_range == want


def test_peer_ports_from_yaml_and_override(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text(
    "local: {directory: /dev/shm/x}\npersistent: {directory: /tmp/p}\npeer: {ports: 50000-50007}\n"
  )
  assert load_config(path).peer.port_range == (50000, 50007)
  assert load_config(path, ["peer.ports=6000"]).peer.port_range == (6000, 6000)
