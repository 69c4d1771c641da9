"""Every shipped configs/*.yaml loads through ec.load_config with the values
it documents, and every option field has a docstring."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

import emergency_ckpt as ec
from emergency_ckpt.config import field_docs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))

# The variables the shipped files reference, as a launcher would set them.
ENV = {
  "EC_DEMO_ROOT": "/dev/shm/ec-demo",
  "EC_HOST": "3",
  "RUN_NAME": "llm-7b.run_42",
  "BUCKET": "my-bucket",
  "CKPT_ROOT": "gs://ckpt-bucket/team",
}

# file name -> {dotted option -> value after loading with ENV}
EXPECTED = {
  "cpu_demo.yaml": {
    "replica_axis": "replica",
    "run_id": "cpu-demo",
    "collective_timeout_s": 120,
    "local.directory": "/dev/shm/ec-demo/ramdisk/host_3",
    "local.save_interval_steps": 5,
    "local.max_to_keep": 2,
    "persistent.directory": "/dev/shm/ec-demo/persistent",
    "persistent.save_interval_steps": 20,
    "persistent.max_to_keep": 3,
  },
  "tpu_multislice.yaml": {
    "replica_axis": "replica",
    "run_id": "llm-7b.run_42",
    "collective_timeout_s": 600,
    "state_commit_timeout_s": 900,
    "local.directory": "/dev/shm/emergency_ckpt",
    "local.save_interval_steps": 50,
    "local.max_to_keep": 2,
    "persistent.directory": "gs://my-bucket/llm-7b.run_42/checkpoints",
    "persistent.save_interval_steps": 500,
    "persistent.max_to_keep": 5,
  },
  "single_slice.yaml": {
    "replica_axis": "replica",
    "run_id": "llm-7b.run_42",
    "collective_timeout_s": 300,
    "local.directory": "/dev/shm/emergency_ckpt",
    "local.save_interval_steps": 50,
    "local.max_to_keep": 2,
    "persistent.directory": "gs://ckpt-bucket/team/llm-7b.run_42",
    "persistent.save_interval_steps": 200,
    "persistent.max_to_keep": 3,
  },
  "gpu_multihost.yaml": {
    "replica_axis": "replica",
    "run_id": "llm-7b.run_42",
    "collective_timeout_s": 900,
    "peer.transport": "stream",
    "state_commit_timeout_s": 900,
    "local.directory": "/dev/shm/emergency_ckpt",
    "local.save_interval_steps": 100,
    "local.max_to_keep": 2,
    "persistent.directory": "gs://ckpt-bucket/team/llm-7b.run_42/checkpoints",
    "persistent.save_interval_steps": 1000,
    "persistent.max_to_keep": 3,
  },
}


def _get(options, dotted: str):
  for part in dotted.split("."):
    options = getattr(options, part)
  return options


def _strings(obj):
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      yield from _strings(value)
    elif isinstance(value, str):
      yield f.name, value


def test_every_config_has_expectations():
  names = sorted(os.path.basename(p) for p in CONFIGS)
  assert names == sorted(EXPECTED), "add the new config's values to EXPECTED"


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_with_documented_values(path, monkeypatch):
  for k, v in ENV.items():
    monkeypatch.setenv(k, v)
  options = ec.load_config(path)
  assert isinstance(options, ec.CheckpointManagerOptions)
  for dotted, value in EXPECTED[os.path.basename(path)].items():
    assert _get(options, dotted) == value, dotted
  for name, value in _strings(options):
    assert "$" not in value, f"{name}={value!r}: unexpanded variable"
  # The ramdisk is node-local; the persistent root outlives every host.
  assert options.local.directory.startswith("/")
  assert options.persistent.save_interval_steps >= options.local.save_interval_steps
  with open(path) as f:
    assert f.read().startswith("#"), "a shipped config starts with a comment saying what it is for"


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_overrides_apply(path, monkeypatch):
  for k, v in ENV.items():
    monkeypatch.setenv(k, v)
  options = ec.load_config(path, overrides=["local.max_to_keep=4", "persistent.max_to_keep=null"])
  assert options.local.max_to_keep == 4
  assert options.persistent.max_to_keep is None


@pytest.mark.parametrize(
  "cls", [ec.CheckpointManagerOptions, ec.LocalTierOptions, ec.PersistentTierOptions]
)
def test_every_option_field_has_a_docstring(cls):
  docs = field_docs(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  missing = [n for n in names if not docs.get(n, "").strip()]
  assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


@dataclasses.dataclass
class _HalfDocumented:  # module level: field_docs parses the class source as is
  documented: int = 1
  """Has one."""

  bare: int = 2


def test_field_docs_would_notice_a_missing_docstring():
  assert set(field_docs(_HalfDocumented)) == {"documented"}
