"""The fault-injecting, request-recording GCS proxy for the tests: the
implementation lives in the package (emergency_ckpt/testing/gcs_proxy.py),
where the scale benchmark counts requests with it too."""

from emergency_ckpt.testing.gcs_proxy import (
  ACTIONS,
  CONTROL,
  ENV_VAR,
  HOST,
  GcsProxy,
  ProxyClient,
  Rule,
)

__all__ = ["ACTIONS", "CONTROL", "ENV_VAR", "HOST", "GcsProxy", "ProxyClient", "Rule"]
