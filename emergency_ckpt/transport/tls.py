"""Optional encryption of peer streams (peer.encryption = "tls"): TLS 1.3
from the standard library's ssl, the listener's certificate pinned by the
fingerprint it publishes through the coordination service.

Each process makes one self-signed certificate (an EC P-256 key, by the
`openssl` command-line tool: the standard library cannot make keys) in a
private temporary folder, kept for the process's life. A client accepts a
listener only if the certificate it presents has the SHA-256 fingerprint
of the listener's offer; the handshake (handshake.py) then runs inside the
tunnel, so the client is authenticated by the secret as without TLS.

Called by: protocol.py (Listener when its encryption is "tls"; connect when
an offer names a fingerprint).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import shutil
import socket
import ssl
import subprocess
import tempfile

from emergency_ckpt.errors import PeerTransferError


@functools.cache
def server_context() -> tuple[ssl.SSLContext, str]:
  """This process's TLS server context and its certificate's fingerprint
  (hex SHA-256 of the DER). Made once per process (blocks on `openssl`,
  well under a second).

  Raises:
    OSError: no `openssl` tool, or it failed.
  """
  tool = shutil.which("openssl")
  if tool is None:
    raise OSError("peer.encryption='tls' needs the openssl command-line tool on the PATH")
  folder = tempfile.mkdtemp(prefix="ecpeer-tls-")  # mode 0700
  key, cert = os.path.join(folder, "key.pem"), os.path.join(folder, "cert.pem")
  args = [tool, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
  args += [
    "-nodes",
    "-days",
    "30",
    "-subj",
    "/CN=emergency-ckpt-peer",
    "-keyout",
    key,
    "-out",
    cert,
  ]
  try:
    subprocess.run(args, check=True, capture_output=True, timeout=60)
  except (subprocess.SubprocessError, OSError) as e:
    raise OSError(f"peer.encryption='tls': openssl could not make a certificate: {e}") from None
  ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_3
  ctx.load_cert_chain(cert, key)
  with open(cert) as f:
    der = ssl.PEM_cert_to_DER_cert(f.read())
  return ctx, hashlib.sha256(der).hexdigest()


def accept(sock: socket.socket) -> ssl.SSLSocket:
  """The listener's side of the TLS handshake, under the socket's deadline.

  Raises:
    OSError: the handshake failed (ssl.SSLError) or timed out.
  """
  ctx, _ = server_context()
  return ctx.wrap_socket(sock, server_side=True)


def connect(sock: socket.socket, fingerprint: str, what: str) -> ssl.SSLSocket:
  """The client's side: TLS 1.3, the certificate checked against the
  fingerprint the listener published.

  Raises:
    PeerTransferError: another certificate (not the listener offered).
    OSError: the handshake failed.
  """
  ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_3
  ctx.check_hostname = False
  ctx.verify_mode = ssl.CERT_NONE  # pinned by fingerprint below, not by a CA
  tls = ctx.wrap_socket(sock)
  der = tls.getpeercert(binary_form=True) or b""
  if not hmac.compare_digest(hashlib.sha256(der).hexdigest(), fingerprint):
    tls.close()
    raise PeerTransferError(f"{what} presented another certificate than it published")
  return tls
