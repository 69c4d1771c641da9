"""fake-gcs-server for the tests: the implementation lives in the package
(emergency_ckpt/testing/gcs_server.py), where the scale benchmark uses it too."""

from emergency_ckpt.testing.gcs_server import (
  CLIENT_ENV,
  HOST,
  GcsServer,
  binary_path,
  client_defaults,
  create_bucket,
  list_objects,
)

__all__ = [
  "CLIENT_ENV",
  "HOST",
  "GcsServer",
  "binary_path",
  "client_defaults",
  "create_bucket",
  "list_objects",
]
