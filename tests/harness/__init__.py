"""Test harness: fake-gcs-server on 127.0.0.1 and a fault-injecting, request-recording GCS proxy in front of it."""
