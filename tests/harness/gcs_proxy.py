"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1, in front of fake-gcs-server;
it records every request (`requests`), which the scale benchmark counts
(bench/scale_commit.py). tests/harness/gcs_proxy.py re-exports this module.

Point a client at it instead of the server (STORAGE_EMULATOR_HOST for gcsfs,
TENSORSTORE_GCS_HTTP_URL for tensorstore; `GcsProxy.env`) and add rules:

  proxy.fail(times=2, status=503, method="POST", path="uploadType=multipart")
  proxy.reset(times=1, path="/o/run%2Fstate", when="response")
  proxy.delay(0.2)                                  # every request
  proxy.crawl(1e6)                                  # bodies both ways at 1 MB/s
  rule = proxy.hold(method="POST", path="tensors/4/")
  rule.wait_held(1); ...; rule.release()

A rule matches a request by method, substrings of its target (path and
query, matched both as sent and percent-decoded; a list: all of them) and a substring of its
User-Agent (gcsfs sends "python-gcsfs/...", tensorstore "tensorstore/...").
Every matching `delay` rule adds its latency; then the first matching
`fail`/`reset`/`hold` rule that has uses left acts (`times=None`: no limit):

- fail: answers with `status` (a GCS-style JSON error) without contacting the
  server; the connection stays usable.
- reset: TCP reset of the client's connection, either before the request
  reaches the server (`when="request"`) or after the server handled it,
  once `after_bytes` bytes of its response went through (`when="response"`):
  the write happened but the client never hears so.
- hold: the request (its body read in full) waits until the rule is released,
  then goes to the server. If the client hangs up meanwhile (killed) or the
  rule is aborted, the request is dropped: the server never sees it.

Connections are kept alive. Request bodies stream through (Content-Length or
chunked), so large uploads work; responses are relayed byte for byte.

Child processes control the same proxy over HTTP: requests under
/__proxy__/ are answered by the proxy itself (`ProxyClient`, found through
the EC_GCS_FAULTS_URL environment variable). Only 127.0.0.1 is bound.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import select
import socket
import struct
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"
CONTROL = "/__proxy__/"
ENV_VAR = "EC_GCS_FAULTS_URL"  # no "proxy" in it: JAX warns about such variables
ACTIONS = ("fail", "reset", "hold", "delay", "crawl")
_REASONS = {
  400: "Bad Request",
  401: "Unauthorized",
  403: "Forbidden",
  404: "Not Found",
  408: "Request Timeout",
  429: "Too Many Requests",
  500: "Internal Server Error",
  502: "Bad Gateway",
  503: "Service Unavailable",
  504: "Gateway Timeout",
}


class _Gone(Exception):
  """The client or the server went away mid-request."""


@dataclasses.dataclass(eq=False)
class Rule:
  """One fault. Matches on method, target substring and User-Agent substring."""

  action: str
  method: str | None = None
  path: str | list[str] | None = None  # substring(s) of the target, all must occur
  client: str | None = None
  times: int | None = None
  status: int = 503
  delay_s: float = 0.0
  rate_bps: float = 0.0  # crawl: bytes per second each way
  when: str = "request"
  after_bytes: int = 0
  predicate: Callable[[str, str, dict[str, str]], bool] | None = None
  id: int = 0
  hits: int = 0  # requests this rule acted on
  held_now: int = 0
  hung_up: int = 0  # held requests whose client went away while held
  released: bool = False
  aborted: bool = False
  _cond: threading.Condition = dataclasses.field(default_factory=threading.Condition, repr=False)

  def __post_init__(self):
    if self.action not in ACTIONS:
      raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
    if self.when not in ("request", "response"):
      raise ValueError(f"when must be 'request' or 'response', got {self.when!r}")

  @property
  def active(self) -> bool:
    if self.released or self.aborted:
      return False
    return self.times is None or self.hits < self.times

  def matches(self, method: str, target: str, headers: dict[str, str]) -> bool:
    if self.method is not None and method.upper() != self.method.upper():
      return False
    if self.path is not None:
      decoded = urllib.parse.unquote(target)
      parts = [self.path] if isinstance(self.path, str) else self.path
      if not all(p in target or p in decoded for p in parts):
        return False
    if self.client is not None and self.client not in headers.get("user-agent", ""):
      return False
    return self.predicate is None or bool(self.predicate(method, target, headers))

  def release(self) -> None:
    """Lets every held request go on to the server; the rule stops acting."""
    with self._cond:
      self.released = True
      self._cond.notify_all()

  def abort(self) -> None:
    """Drops every held request (connection reset); the rule stops acting."""
    with self._cond:
      self.aborted = True
      self._cond.notify_all()

  def wait_held(self, count: int = 1, timeout: float = 60.0) -> None:
    """Blocks until `count` requests were held by this rule (in total)."""
    deadline = time.monotonic() + timeout
    with self._cond:
      while self.hits < count:
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"rule {self.id} held {self.hits} of {count} requests in {timeout}s")
        self._cond.wait(left)

  def to_json(self) -> dict[str, Any]:
    out = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("predicate", "_cond")
    }
    out["active"] = self.active
    return out


class _Conn:
  """One client connection and its (lazily opened) server connection."""

  def __init__(self, proxy: GcsProxy, sock: socket.socket):
    self.proxy = proxy
    self.client = sock
    self.buf = bytearray()
    self.upstream: socket.socket | None = None
    self.write_lock = threading.Lock()
    self.reset_after: int | None = None  # reset the client after this many response bytes
    self.rate_bps: float = (
      0.0  # crawl: the current request's bytes per second each way (0: full speed)
    )
    self.closed = False

  # ---- reading from the client ------------------------------------------
  def _fill(self) -> bool:
    try:
      data = self.client.recv(65536)
    except OSError:
      data = b""
    if not data:
      return False
    self.buf += data
    return True

  def read_head(self) -> bytes | None:
    while True:
      end = self.buf.find(b"\r\n\r\n")
      if end >= 0:
        head = bytes(self.buf[: end + 4])
        del self.buf[: end + 4]
        return head
      if len(self.buf) > 1 << 20 or not self._fill():
        return None

  def read_line(self) -> bytes:
    while True:
      end = self.buf.find(b"\r\n")
      if end >= 0:
        line = bytes(self.buf[: end + 2])
        del self.buf[: end + 2]
        return line
      if not self._fill():
        raise _Gone("client closed mid-body")

  def read_some(self, limit: int) -> bytes:
    if not self.buf and not self._fill():
      raise _Gone("client closed mid-body")
    out = bytes(self.buf[:limit])
    del self.buf[:limit]
    return out

  def body_chunks(self, headers: dict[str, str]):
    """Yields the request body's raw bytes as they arrive (framing kept)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
      while True:
        line = self.read_line()
        yield line
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
          while True:  # trailers, then an empty line
            trailer = self.read_line()
            yield trailer
            if trailer == b"\r\n":
              return
        left = size + 2  # data and its CRLF
        while left:
          part = self.read_some(min(left, 65536))
          left -= len(part)
          yield part
    else:
      left = int(headers.get("content-length", "0") or 0)
      while left:
        part = self.read_some(min(left, 65536))
        left -= len(part)
        yield part

  # ---- writing -------------------------------------------------------------
  def _crawl(self, nbytes: int) -> None:
    if self.rate_bps:
      time.sleep(nbytes / self.rate_bps)

  def send_client(self, data: bytes) -> None:
    with self.write_lock:
      self.client.sendall(data)

  def respond(self, status: int, body: bytes, *, method: str, close: bool = False) -> None:
    head = [
      f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}",
      "Content-Type: application/json; charset=UTF-8",
      f"Content-Length: {len(body)}",
    ]
    if close:
      head.append("Connection: close")
    payload = ("\r\n".join(head) + "\r\n\r\n").encode()
    self.send_client(payload if method == "HEAD" else payload + body)

  def reset_client(self) -> None:
    """Closes the client connection with a TCP RST (SO_LINGER 0)."""
    self.closed = True
    try:
      self.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
      # Wakes a thread blocked reading it (a close alone would not, and the
      # socket would live on until that read returns); sends nothing.
      self.client.shutdown(socket.SHUT_RD)
    except OSError:
      pass
    try:
      self.client.close()
    except OSError:
      pass
    self.close_upstream()

  def close_gracefully(self) -> None:
    """Closes after what was sent is read: FIN first, drain, then close."""
    self.closed = True
    try:
      self.client.shutdown(socket.SHUT_WR)
      self.client.settimeout(1.0)
      while self.client.recv(65536):
        pass
    except OSError:
      pass
    _close(self.client)
    self.close_upstream()

  def close_upstream(self) -> None:
    up, self.upstream = self.upstream, None
    if up is not None:
      _close(up)

  def client_gone(self) -> bool:
    """True if the client hung up (EOF or error) while we hold its request."""
    try:
      readable, _, _ = select.select([self.client], [], [], 0)
      if not readable:
        return False
      data = self.client.recv(65536, socket.MSG_PEEK)
      return not data
    except OSError:
      return True

  # ---- the server side -----------------------------------------------------
  def ensure_upstream(self) -> socket.socket:
    if self.upstream is None:
      up = socket.create_connection((self.proxy.upstream_host, self.proxy.upstream_port), 30)
      up.settimeout(None)
      up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      self.upstream = up
      threading.Thread(target=self._pump, args=(up,), daemon=True, name="gcs-proxy-pump").start()
    return self.upstream

  def _pump(self, up: socket.socket) -> None:
    """Server to client, byte for byte; a server close closes the client."""
    try:
      while True:
        data = up.recv(65536)
        if not data:
          break
        limit = self.reset_after
        if limit is not None:
          if len(data) > limit:
            if limit:
              self.send_client(data[:limit])
            self.proxy._count("reset")
            self.reset_client()
            return
          self.reset_after = limit - len(data)
        self.proxy._count("bytes_down", len(data))  # what clients read, headers included
        self._crawl(len(data))
        self.send_client(data)
    except OSError:
      pass
    if self.upstream is up:
      self.closed = True
      try:
        self.client.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      self.close_upstream()

  # ---- the request loop ----------------------------------------------------
  def run(self) -> None:
    try:
      while not self.closed:
        head = self.read_head()
        if head is None:
          break
        if not self.handle(head):
          break
    except (_Gone, OSError, ValueError):
      pass
    finally:
      self.closed = True
      _close(self.client)
      self.close_upstream()
      self.proxy._forget(self)

  def handle(self, head: bytes) -> bool:
    """Serves one request; False ends the connection."""
    lines = head.decode("latin-1").split("\r\n")
    method, target, _version = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
      if ":" in line:
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if target.startswith(CONTROL):
      body = b"".join(self.body_chunks(headers))
      status, doc = self.proxy._control(method, target, body)
      self.respond(status, json.dumps(doc).encode(), method=method)
      return True
    rule = self.proxy._decide(method, target, headers)
    self.rate_bps = self.proxy._rate(method, target, headers)
    expects = "100-continue" in headers.get("expect", "").lower()
    if rule is None:
      return self.forward(head, headers, method)
    if rule.action == "fail":
      if expects:  # the client waits for our go before sending the body
        self.respond(rule.status, _error_body(rule.status), method=method, close=True)
        self.close_gracefully()
        return False
      for _ in self.body_chunks(headers):
        pass
      self.respond(rule.status, _error_body(rule.status), method=method)
      return True
    if rule.action == "reset" and rule.when == "request":
      self.reset_client()
      return False
    # reset after the response starts, or hold: take the whole request first
    # (answering "100 Continue" ourselves, so no interim response comes back)
    if expects:
      self.send_client(b"HTTP/1.1 100 Continue\r\n\r\n")
      head = _drop_header(head, "expect")
    body = b"".join(self.body_chunks(headers))
    if rule.action == "hold" and not self.proxy._hold(rule, self):
      self.reset_client()
      return False
    if rule.action == "reset":
      self.reset_after = rule.after_bytes
    up = self.ensure_upstream()
    up.sendall(head + body)
    self.proxy._count("forwarded")
    return True

  def forward(self, head: bytes, headers: dict[str, str], method: str) -> bool:
    up = self.ensure_upstream()
    up.sendall(head)
    for part in self.body_chunks(headers):
      self._crawl(len(part))
      up.sendall(part)
    self.proxy._count("forwarded")
    return True


class GcsProxy:
  """The proxy: a listening socket and a thread per client connection."""

  def __init__(self, upstream: str, *, port: int = 0):
    parsed = urllib.parse.urlsplit(upstream)
    if parsed.hostname not in ("127.0.0.1", "localhost"):
      raise ValueError(f"upstream must be on 127.0.0.1, got {upstream!r}")
    self.upstream = upstream
    self.upstream_host = "127.0.0.1"
    self.upstream_port = parsed.port or 80
    self._port = port
    self._sock: socket.socket | None = None
    self._lock = threading.Lock()
    self._rules: list[Rule] = []
    self._ids = itertools.count(1)
    self._conns: set[_Conn] = set()
    self._counts = dict.fromkeys(
      ("seen", "forwarded", "failed", "reset", "held", "delayed", "bytes_down"), 0
    )
    self.requests: list[dict[str, Any]] = []  # the newest 10000 requests seen
    self.port = 0
    self.url = ""

  # ---- lifecycle -----------------------------------------------------------
  def start(self) -> GcsProxy:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, self._port))
    sock.listen(128)
    self._sock = sock
    self.port = sock.getsockname()[1]
    self.url = f"http://{HOST}:{self.port}"
    threading.Thread(target=self._accept, daemon=True, name="gcs-proxy-accept").start()
    return self

  def stop(self) -> None:
    """Stops listening, drops held requests and closes every connection."""
    sock, self._sock = self._sock, None
    if sock is not None:
      _close(sock)
    with self._lock:
      rules, conns = list(self._rules), list(self._conns)
    for rule in rules:
      rule.abort()
    for conn in conns:
      conn.closed = True
      _close(conn.client)
      conn.close_upstream()

  def __enter__(self) -> GcsProxy:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  @property
  def env(self) -> dict[str, str]:
    """Points both clients (and ProxyClient.from_env) at the proxy."""
    return {
      "STORAGE_EMULATOR_HOST": self.url,
      "TENSORSTORE_GCS_HTTP_URL": self.url,
      ENV_VAR: self.url,
    }

  def _accept(self) -> None:
    while True:
      sock = self._sock
      if sock is None:
        return
      try:
        client, _ = sock.accept()
      except OSError:
        return
      client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      conn = _Conn(self, client)
      with self._lock:
        self._conns.add(conn)
      threading.Thread(target=conn.run, daemon=True, name="gcs-proxy-conn").start()

  def _forget(self, conn: _Conn) -> None:
    with self._lock:
      self._conns.discard(conn)

  # ---- rules -----------------------------------------------------------------
  def add(self, action: str, **kw) -> Rule:
    rule = Rule(action, **kw)
    with self._lock:
      rule.id = next(self._ids)
      self._rules.append(rule)
    return rule

  def fail(self, times: int | None = 1, status: int = 503, **match) -> Rule:
    """Answers the next `times` matching requests with HTTP `status`."""
    return self.add("fail", times=times, status=status, **match)

  def reset(
    self, times: int | None = 1, when: str = "request", after_bytes: int = 0, **match
  ) -> Rule:
    """Resets the connection of the next `times` matching requests."""
    return self.add("reset", times=times, when=when, after_bytes=after_bytes, **match)

  def hold(self, times: int | None = None, **match) -> Rule:
    """Holds matching requests until `rule.release()` (or drops them on abort)."""
    return self.add("hold", times=times, **match)

  def delay(self, seconds: float, times: int | None = None, **match) -> Rule:
    """Adds `seconds` of latency to each matching request."""
    return self.add("delay", times=times, delay_s=seconds, **match)

  def crawl(self, bytes_per_s: float, times: int | None = None, **match) -> Rule:
    """Moves each matching request's body and its response at `bytes_per_s`."""
    return self.add("crawl", times=times, rate_bps=bytes_per_s, **match)

  def rule(self, rule_id: int) -> Rule:
    with self._lock:
      for r in self._rules:
        if r.id == rule_id:
          return r
    raise KeyError(f"no rule {rule_id}")

  def release(self, rule_id: int | None = None) -> None:
    """Releases one hold rule, or all of them."""
    with self._lock:
      rules = [r for r in self._rules if rule_id is None or r.id == rule_id]
    for r in rules:
      r.release()

  def clear(self) -> None:
    """Removes every rule; requests held by them are dropped."""
    with self._lock:
      rules, self._rules = self._rules, []
    for r in rules:
      r.abort()

  def stats(self) -> dict[str, Any]:
    with self._lock:
      out: dict[str, Any] = dict(self._counts)
      out["held_now"] = sum(r.held_now for r in self._rules)
      out["rules"] = [r.to_json() for r in self._rules]
    return out

  # ---- used by connections ---------------------------------------------------
  def _count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self._counts[key] += n

  def _decide(self, method: str, target: str, headers: dict[str, str]) -> Rule | None:
    delay, chosen = 0.0, None
    with self._lock:
      self._counts["seen"] += 1
      for r in self._rules:
        if not r.active or not r.matches(method, target, headers):
          continue
        if r.action == "crawl":
          continue  # _rate's
        if r.action == "delay":
          r.hits += 1
          delay += r.delay_s
        elif chosen is None:
          chosen = r
          with r._cond:
            r.hits += 1
            r._cond.notify_all()
      action = chosen.action if chosen else "forward"
      if chosen is not None and chosen.action == "fail":
        self._counts["failed"] += 1
      if chosen is not None and chosen.action == "reset" and chosen.when == "request":
        self._counts["reset"] += 1
      if delay:
        self._counts["delayed"] += 1
      self.requests.append(
        {
          "t": time.time(),
          "method": method,
          "target": target,
          "client": headers.get("user-agent", ""),
          "action": action,
          "rule": chosen.id if chosen else None,
        }
      )
      del self.requests[:-10000]
    if delay:
      time.sleep(delay)
    return chosen

  def _rate(self, method: str, target: str, headers: dict[str, str]) -> float:
    """The slowest matching crawl rule's bytes per second (0: none matches)."""
    with self._lock:
      rates = []
      for r in self._rules:
        if r.action == "crawl" and r.active and r.matches(method, target, headers):
          r.hits += 1
          rates.append(r.rate_bps)
    return min(rates, default=0.0)

  def _hold(self, rule: Rule, conn: _Conn) -> bool:
    """Waits for release (True), abort or client hang-up (False)."""
    self._count("held")
    with rule._cond:
      rule.held_now += 1
      rule._cond.notify_all()
    try:
      while True:
        with rule._cond:
          if rule.aborted or self._sock is None:
            return False
          if rule.released:
            return True
          rule._cond.wait(0.05)
        if conn.client_gone():
          with rule._cond:
            rule.hung_up += 1
          return False
    finally:
      with rule._cond:
        rule.held_now -= 1
        rule._cond.notify_all()

  def _control(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
    path = urllib.parse.urlsplit(target).path[len(CONTROL) :].strip("/")
    try:
      doc = json.loads(body) if body else {}
      if method == "GET" and path == "stats":
        return 200, self.stats()
      if method == "GET" and path == "requests":
        with self._lock:
          return 200, list(self.requests)
      if method == "POST" and path == "rules":
        return 200, self.add(doc.pop("action"), **doc).to_json()
      if method == "POST" and path == "release":
        self.release(doc.get("id"))
        return 200, {"ok": True}
      if method == "POST" and path == "abort":
        self.rule(doc["id"]).abort()
        return 200, {"ok": True}
      if method == "POST" and path == "clear":
        self.clear()
        return 200, {"ok": True}
    except (KeyError, TypeError, ValueError) as e:
      return 400, {"error": f"{type(e).__name__}: {e}"}
    return 404, {"error": f"no control endpoint {method} {path}"}


class ProxyClient:
  """Controls a GcsProxy over HTTP (from a child process)."""

  def __init__(self, url: str):
    self.url = url.rstrip("/")

  @classmethod
  def from_env(cls) -> ProxyClient:
    return cls(os.environ[ENV_VAR])

  def _call(self, method: str, path: str, doc: dict | None = None) -> Any:
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(f"{self.url}{CONTROL}{path}", data=data, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
      return json.load(r)

  def add(self, action: str, **kw) -> dict:
    return self._call("POST", "rules", {"action": action, **kw})

  def fail(self, times: int | None = 1, status: int = 503, **match) -> dict:
    return self.add("fail", times=times, status=status, **match)

  def reset(
    self, times: int | None = 1, when: str = "request", after_bytes: int = 0, **match
  ) -> dict:
    return self.add("reset", times=times, when=when, after_bytes=after_bytes, **match)

  def hold(self, times: int | None = None, **match) -> dict:
    return self.add("hold", times=times, **match)

  def delay(self, seconds: float, times: int | None = None, **match) -> dict:
    return self.add("delay", times=times, delay_s=seconds, **match)

  def crawl(self, bytes_per_s: float, times: int | None = None, **match) -> dict:
    return self.add("crawl", times=times, rate_bps=bytes_per_s, **match)

  def release(self, rule_id: int | None = None) -> None:
    self._call("POST", "release", {"id": rule_id})

  def abort(self, rule_id: int) -> None:
    self._call("POST", "abort", {"id": rule_id})

  def clear(self) -> None:
    self._call("POST", "clear", {})

  def stats(self) -> dict:
    return self._call("GET", "stats")

  def requests(self) -> list[dict]:
    return self._call("GET", "requests")

  def rule(self, rule_id: int) -> dict:
    for r in self.stats()["rules"]:
      if r["id"] == rule_id:
        return r
    raise KeyError(f"no rule {rule_id}")

  def wait_held(self, rule_id: int, count: int = 1, timeout: float = 60.0) -> dict:
    """Polls until rule `rule_id` has held `count` requests; returns the rule."""
    deadline = time.monotonic() + timeout
    while True:
      r = self.rule(rule_id)
      if r["hits"] >= count:
        return r
      if time.monotonic() > deadline:
        raise TimeoutError(f"rule {rule_id} held {r['hits']} of {count} requests in {timeout}s")
      time.sleep(0.05)


def _error_body(status: int) -> bytes:
  """A GCS JSON API error document (no word 'invalid': gcsfs maps that to 400)."""
  reason = {403: "forbidden", 401: "required", 404: "notFound", 429: "rateLimitExceeded"}
  message = f"{_REASONS.get(status, 'Error')} (injected by tests.harness.gcs_proxy)"
  return json.dumps(
    {
      "error": {
        "code": status,
        "message": message,
        "errors": [
          {"message": message, "domain": "global", "reason": reason.get(status, "backendError")}
        ],
      }
    }
  ).encode()


def _drop_header(head: bytes, name: str) -> bytes:
  lines = head.split(b"\r\n")
  keep = [ln for ln in lines if not ln.lower().startswith(name.encode() + b":")]
  return b"\r\n".join(keep)


def _close(sock: socket.socket) -> None:
  """Shuts down (waking any thread blocked on it), then closes."""
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  try:
    sock.close()
  except OSError:
    pass
