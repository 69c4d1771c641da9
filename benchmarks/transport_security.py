"""The cost of the peer transport's protection (issue 37): GB/s of one
stream over loopback, per mode, beside the plain stream.

  python -m benchmarks.transport_security [--mib N] [--reps K] [--out FILE.json]

Modes, each a real Listener and client on 127.0.0.1 moving `--mib` MiB as
shards of 64 MiB (one payload each, received into one buffer, as a
restore's pull does), interleaved over `--reps` rounds, the best round kept:

- plain: a raw socket, sendall / recv_into (MSG_WAITALL): the stream as it
  was before the handshake and MACs (no framing, no tag), the bound;
- crc: peer.integrity "crc": the handshake, MAC'd headers, raw payloads;
- mac: peer.integrity "mac" (GMAC over every payload on both ends,
  HMAC-SHA256 over the documents);
- tls: peer.encryption "tls" (TLS 1.3, AES-GCM), payloads without our MAC.

Also the MAC alone and the CRC32C alone over the same bytes in memory (one
core): the CPU each costs per byte. Each receive also sums the CRC32C, as
the real receivers do, in every mode.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import socket
import threading
import time

import crc32c
import numpy as np
from cryptography.hazmat.primitives.poly1305 import Poly1305

from emergency_ckpt.local.format import RunningChecksum
from emergency_ckpt.transport import protocol, session
from emergency_ckpt.transport.session import PayloadMac

SHARD = 64 << 20


class _Sink(protocol.Listener):
  """Answers each request {"n": shards} with that many shards of `data`."""

  _purpose = "bench"

  def __init__(self, data: np.ndarray, security: protocol.Security):
    self._timeout_s, self._prefix, self._data = 60, "[bench]", data
    self._start("127.0.0.1", None, security)

  def _handle(self, conn):
    n = conn.recv_json()["n"]
    conn.send_json({"ok": True})
    for _ in range(n):
      conn.send_payload(self._data)


def _secured(security: protocol.Security, shards: int, data: np.ndarray, out: np.ndarray) -> float:
  server = _Sink(data, security)
  try:
    t0 = time.perf_counter()
    with protocol.connect(server.offer(), timeout_s=60, step=0) as conn:
      conn.send_json({"n": shards})
      conn.recv_json()
      for _ in range(shards):
        running = RunningChecksum({"crc32c": 0})
        conn.recv_payload(out, running.update)  # as a restore's pull: summed piece by piece
    return time.perf_counter() - t0
  finally:
    server.close()


def _plain(shards: int, data: np.ndarray, out: np.ndarray) -> float:
  lsock = socket.create_server(("127.0.0.1", 0))

  def serve():
    conn, _ = lsock.accept()
    with conn:
      conn.recv(1)
      for _ in range(shards):
        conn.sendall(memoryview(data))

  t = threading.Thread(target=serve, daemon=True)
  t.start()
  t0 = time.perf_counter()
  with socket.create_connection(lsock.getsockname()) as sock:
    session.settle(sock, 60)
    sock.sendall(b"x")
    view = memoryview(out)
    for _ in range(shards):
      session.recv_exact(sock, view)
      crc32c.crc32c(out)
  dt = time.perf_counter() - t0
  t.join()
  lsock.close()
  return dt


def _cpu(data: np.ndarray, reps: int) -> dict:
  key = os.urandom(32)
  out = {}
  for name, fn in {
    "hmac-sha256 (CPU, 1 core)": lambda: hmac.new(key, data, hashlib.sha256).digest(),
    "poly1305 (CPU, 1 core)": lambda: Poly1305(key).update(data),
    "gmac, aes-256-gcm (CPU, 1 core)": lambda: _gmac(key, data),
    "blake2b keyed (CPU, 1 core)": lambda: hashlib.blake2b(data, key=key).digest(),
    "crc32c (CPU, 1 core)": lambda: crc32c.crc32c(data),
  }.items():
    best = min(_timed(fn) for _ in range(reps))
    out[name] = data.nbytes / best / 1e9
  return out


def _gmac(key: bytes, data: np.ndarray) -> bytes:
  mac = PayloadMac(key)
  mac.update(data)
  return mac.finalize()


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def main() -> None:
  """Runs every mode and prints a table (and writes --out)."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=512, help="MiB moved per mode and round")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  shards = max(1, (args.mib << 20) // SHARD)
  data = np.frombuffer(os.urandom(SHARD), np.uint8)
  out = np.empty(SHARD, np.uint8)
  modes = {
    "plain": lambda: _plain(shards, data, out),
    "crc": lambda: _secured(protocol.Security("crc"), shards, data, out),
    "mac": lambda: _secured(protocol.Security("mac"), shards, data, out),
    "tls": lambda: _secured(protocol.Security("crc", "tls"), shards, data, out),
  }
  times: dict[str, list[float]] = {m: [] for m in modes}
  for _ in range(args.reps):
    for mode, run in modes.items():
      times[mode].append(run())
  nbytes = shards * SHARD
  result = {m: nbytes / min(ts) / 1e9 for m, ts in times.items()}
  result.update(_cpu(data, args.reps))
  print(f"{nbytes >> 20} MiB per mode, best of {args.reps}:")
  for mode, gbs in result.items():
    print(f"  {mode:28s} {gbs:6.2f} GB/s")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"mib": nbytes >> 20, "reps": args.reps, "gb_per_s": result}, f, indent=1)


if __name__ == "__main__":
  main()
