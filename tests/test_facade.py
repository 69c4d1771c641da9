"""The public facade: every exported name resolves, and nothing heavy loads early."""

from __future__ import annotations

import subprocess
import sys

import emergency_ckpt as ec


def test_every_public_name_resolves_and_matches_all():
  assert sorted(ec.__all__) == sorted(ec._EXPORTS)
  for name in ec.__all__:
    assert getattr(ec, name) is not None
  assert issubclass(ec.StepNotRestorableError, ec.EmergencyCheckpointError)
  assert dir(ec) == ec.__all__


def test_unknown_names_raise_attribute_error():
  try:
    ec.LocalTier  # noqa: B018 - an implementation detail, not exported
  except AttributeError as e:
    assert "LocalTier" in str(e)
  else:
    raise AssertionError("ec.LocalTier should not be public")


def test_importing_the_package_and_options_does_not_import_jax():
  code = (
    "import sys, emergency_ckpt as ec; ec.LocalTierOptions; ec.load_config;"
    " import emergency_ckpt.cli; print(sorted(m for m in ('jax', 'orbax') if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
