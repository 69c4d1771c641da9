"""Shared test set-up. GCS client settings must precede any gcsfs import."""

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("FSSPEC_GCS_TOKEN", "anon")
os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "dummy")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Job processes fork from a server that imported jax and Orbax once
# (emergency_ckpt.demo.launcher); EC_LAUNCHER_START=spawn runs each as a
# fresh interpreter instead.
os.environ.setdefault("EC_LAUNCHER_START", "fork")
# The research studies (benchmarks/) and the harness (tests/harness/) are
# imported from the checkout, not the wheel: subprocesses that run
# `python -m benchmarks.<study>` from a temporary folder find them here.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
  p for p in (_CHECKOUT, os.environ.get("PYTHONPATH")) if p
)

import tempfile  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def mesh():
  """A one-slice mesh over this process's devices: axes (replica=1, data)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  return Mesh(np.array(jax.devices()).reshape(1, -1), ("replica", "data"))


@pytest.fixture
def options(shm_dir):
  """Manager options for a one-process job on `shm_dir`: local every 2nd step,
  persistent every 4th."""
  import emergency_ckpt as ec  # noqa: PLC0415

  return ec.CheckpointManagerOptions(
    local=ec.LocalTierOptions(directory=os.path.join(shm_dir, "local"), save_interval_steps=2),
    persistent=ec.PersistentTierOptions(
      directory=os.path.join(shm_dir, "persistent"), save_interval_steps=4
    ),
    run_id="single",
  )


def _fresh_shm_dir(prefix: str):
  """Yields a fresh directory on a real tmpfs (/dev/shm if there is one), then removes it."""
  import shutil  # noqa: PLC0415

  base = "/dev/shm" if os.path.isdir("/dev/shm") else None
  path = tempfile.mkdtemp(prefix=prefix, dir=base)
  yield path
  shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_dir():
  """A fresh directory on a real tmpfs (/dev/shm), removed afterwards."""
  yield from _fresh_shm_dir("ectest-")


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
  """One fake-gcs-server for the session; points gcsfs and tensorstore (here
  and in every child process, which inherits os.environ) at it."""
  from tests.harness.gcs_server import GcsServer  # noqa: PLC0415

  server = GcsServer(log_dir=str(tmp_path_factory.mktemp("fakegcs"))).start()
  saved = {k: os.environ.get(k) for k in server.env}
  os.environ.update(server.env)
  yield server
  server.stop()
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


@pytest.fixture
def gcs_bucket(gcs_server):
  """A fresh, uniquely named bucket on the session's server, as gs://<name>."""
  return f"gs://{gcs_server.create_bucket()}"


@pytest.fixture
def gcs_proxy(gcs_server):
  """A fault-injecting proxy (tests/harness/gcs_proxy.py) in front of the session's
  fake-gcs-server, stopped afterwards. Not put in os.environ: point a client
  at it with monkeypatch.setenv(...) or run_job(env=...) from `gcs_proxy.env`."""
  from tests.harness.gcs_proxy import GcsProxy  # noqa: PLC0415

  proxy = GcsProxy(gcs_server.url).start()
  yield proxy
  proxy.stop()


@pytest.fixture(scope="session")
def fault_matrix():
  """Records fault-matrix rows (tests/fault_matrix.py): `check(id, observed,
  ok)` records, then asserts. Rows go to $EC_FAULT_MATRIX_OUT (JSON lines) if
  set, which `python -m tests.fault_matrix` turns into the table in docs/guarantees.md."""
  from tests.fault_matrix import Recorder  # noqa: PLC0415

  return Recorder(os.environ.get("EC_FAULT_MATRIX_OUT"))


@pytest.fixture(scope="module")
def module_shm_dir():
  """Like shm_dir, shared by one module's tests (one set of jobs per module)."""
  yield from _fresh_shm_dir("ecfault-")
