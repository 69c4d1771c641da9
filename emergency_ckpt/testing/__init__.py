"""Support for running emergency_ckpt in real multi-process jobs on one machine.

`emergency_ckpt.testing.launcher.run_job` starts a jax.distributed job of N CPU
processes on 127.0.0.1; the test suite, the demo (`emergency-ckpt demo`) and
the benchmark (`emergency-ckpt bench`) use it. `gcs_server` (fake-gcs-server on
127.0.0.1) and `gcs_proxy` (a fault-injecting, request-recording proxy in
front of it) serve the GCS tests and the scale benchmark's commit stage. Not
part of the checkpointing API.
"""
