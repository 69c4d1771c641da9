"""The peer handshake: both ends prove they hold the listener's secret,
without sending it, and agree on a key for this connection only.

The secret (256 random bits per listener) travels only through the JAX
coordination service, in the listener's offer, beside the context the
listener names itself by (its purpose and owner). On connect:

  listener -> client   MAGIC, server nonce Ns (32 random bytes)
  client -> listener   client nonce Nc, its claim (JSON: who connects, for
                       which step), proof_c = HMAC(secret, "client" | T)
  listener -> client   proof_s = HMAC(secret, "server" | T)

where T = MAGIC | Ns | Nc | context, and the context names the protocol
version, the listener's purpose and owner, the client and the step. Each
side checks the other's proof (a constant-time compare) before it sends
anything else; the session key is HMAC(secret, "session" | T). Both nonces
are fresh per connection, so a recorded exchange played again fails (the
listener's nonce differs), and a party without the secret learns nothing
but two random nonces and a MAC over them.

Called by: protocol.py (Listener._serve on the listener's side, connect on
the client's).
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import struct

from emergency_ckpt.errors import PeerTransferError
from emergency_ckpt.transport import session as session_lib

MAGIC = b"ECPEER4\n"  # 4: payload tags are GMAC (session.py)
NONCE_BYTES = 32
TOKEN_BYTES = 32
PROOF_BYTES = 32
_CLAIM_MAX = 1024
_CLAIM_LEN = struct.Struct("!H")


class NotServed(ConnectionError):
  """The listener closed before its challenge: at its cap of connections
  being authenticated (a flood), or closing. The client may try again."""


def context(offer: dict, claim: dict) -> bytes:
  """The bytes both proofs and the session key are bound to.

  Args:
    offer: the listener's offer (purpose, owner).
    claim: the client's claim (who connects, the step), as sent.

  Returns:
    The canonical context.
  """
  doc = {
    "v": 2,
    "purpose": offer.get("purpose", ""),
    "receiver": offer.get("receiver", ""),
    "sender": claim.get("sender"),
    "step": claim.get("step"),
  }
  return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _prove(secret: bytes, role: bytes, transcript: bytes) -> bytes:
  return hmac.digest(secret, b"ecpeer " + role + b"\0" + transcript, "sha256")


def serve(sock: socket.socket, secret: bytes, offer: dict, *, what: str) -> tuple[bytes, dict]:
  """The listener's side, on a socket whose deadline is the handshake's.
  Blocks until the client proved itself, or the deadline.

  Args:
    sock: the accepted socket (settled to the handshake deadline).
    secret: the listener's secret.
    offer: its offer (the context's purpose and owner).
    what: names the listener in errors.

  Returns:
    (the session key, the client's claim).

  Raises:
    PermissionError: the client did not prove it holds the secret.
    OSError: the connection failed or the deadline passed.
  """
  ns = secrets.token_bytes(NONCE_BYTES)
  session_lib.send_all(sock, MAGIC + ns)
  head = bytearray(NONCE_BYTES + _CLAIM_LEN.size)
  session_lib.recv_exact(sock, memoryview(head))
  nc = bytes(head[:NONCE_BYTES])
  (n,) = _CLAIM_LEN.unpack(head[NONCE_BYTES:])
  if n > _CLAIM_MAX:
    raise PermissionError(f"{what}: a claim of {n} bytes: not a peer of this job")
  rest = bytearray(n + PROOF_BYTES)
  session_lib.recv_exact(sock, memoryview(rest))
  raw_claim, proof = bytes(rest[:n]), bytes(rest[n:])
  try:
    claim = json.loads(raw_claim)
  except ValueError:
    claim = None
  if not isinstance(claim, dict):
    raise PermissionError(f"{what}: an unreadable claim: not a peer of this job")
  transcript = MAGIC + ns + nc + context(offer, claim)
  if not hmac.compare_digest(proof, _prove(secret, b"client", transcript)):
    raise PermissionError(f"{what}: a client without the secret (or a replayed exchange)")
  session_lib.send_all(sock, _prove(secret, b"server", transcript))
  return _prove(secret, b"session", transcript), claim


def join(sock: socket.socket, offer: dict, claim: dict, *, what: str) -> bytes:
  """The client's side. Blocks until the listener proved itself, or the
  socket's timeout.

  Args:
    sock: the connected socket (settled).
    offer: the listener's offer, as published (its secret: "token").
    claim: who connects and for which step ({"sender": ..., "step": ...}).
    what: names the listener in errors.

  Returns:
    The session key.

  Raises:
    NotServed: the listener closed before its challenge (try again).
    PeerTransferError: it answered, but not as the listener of this offer
      (it does not hold the secret, or refused ours).
    OSError: the connection failed or timed out.
  """
  secret = bytes.fromhex(offer["token"])
  head = bytearray(len(MAGIC) + NONCE_BYTES)
  try:
    session_lib.recv_exact(sock, memoryview(head))
  except (ConnectionError, TimeoutError) as e:
    raise NotServed(f"{what} sent no challenge ({e})") from None
  if head[: len(MAGIC)] != MAGIC:
    raise PeerTransferError(f"{what} does not speak this protocol: refused")
  ns = bytes(head[len(MAGIC) :])
  nc = secrets.token_bytes(NONCE_BYTES)
  raw_claim = json.dumps(claim, sort_keys=True).encode()
  transcript = MAGIC + ns + nc + context(offer, claim)
  session_lib.send_all(
    sock, nc + _CLAIM_LEN.pack(len(raw_claim)) + raw_claim + _prove(secret, b"client", transcript)
  )
  proof = bytearray(PROOF_BYTES)
  try:
    session_lib.recv_exact(sock, memoryview(proof))
  except ConnectionError as e:
    raise PeerTransferError(f"{what} refused this client's proof ({e}): a wrong secret?") from None
  if not hmac.compare_digest(bytes(proof), _prove(secret, b"server", transcript)):
    raise PeerTransferError(f"{what} did not prove it holds the secret: not the listener offered")
  return _prove(secret, b"session", transcript)
