"""The fault-injecting proxy (tests/harness/gcs_proxy.py), against fake-gcs-server."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
import urllib.request

import pytest

from tests.harness.gcs_proxy import ProxyClient


def _conn(url: str) -> http.client.HTTPConnection:
  parsed = urllib.parse.urlsplit(url)
  return http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)


def _upload(conn, bucket: str, name: str, body, **headers) -> tuple[int, bytes]:
  q = urllib.parse.urlencode({"uploadType": "media", "name": name})
  conn.request("POST", f"/upload/storage/v1/b/{bucket}/o?{q}", body=body, headers=headers)
  r = conn.getresponse()
  return r.status, r.read()


def _download(conn, bucket: str, name: str) -> tuple[int, bytes]:
  conn.request("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media")
  r = conn.getresponse()
  return r.status, r.read()


def _on_server(server, bucket: str, name: str) -> bytes | None:
  """The object as the server has it (straight, not through the proxy)."""
  c = _conn(server.url)
  try:
    status, data = _download(c, bucket, name)
  finally:
    c.close()
  return data if status == 200 else None


@pytest.fixture
def bucket(gcs_server):
  return gcs_server.create_bucket()


def test_passthrough_keepalive_large_and_chunked(gcs_server, gcs_proxy, bucket):
  big = os.urandom(6 << 20) + b"end"
  c = _conn(gcs_proxy.url)
  for i in range(3):  # one connection, several requests (keep-alive)
    status, _ = _upload(c, bucket, f"obj/{i}", f"v{i}".encode())
    assert status == 200
  assert _upload(c, bucket, "obj/big", big)[0] == 200

  def chunks():
    for i in range(0, len(big), 1 << 20):
      yield big[i : i + (1 << 20)]

  q = urllib.parse.urlencode({"uploadType": "media", "name": "obj/chunked"})
  c.request("POST", f"/upload/storage/v1/b/{bucket}/o?{q}", body=chunks(), encode_chunked=True)
  r = c.getresponse()
  assert r.status == 200, r.read()
  r.read()
  assert _download(c, bucket, "obj/1") == (200, b"v1")
  assert _download(c, bucket, "obj/big") == (200, big)
  assert _download(c, bucket, "obj/chunked") == (200, big)
  c.close()
  assert _on_server(gcs_server, bucket, "obj/chunked") == big
  stats = gcs_proxy.stats()
  assert stats["seen"] == stats["forwarded"] == 8, stats
  assert [r["method"] for r in gcs_proxy.requests][:3] == ["POST"] * 3


def test_fail_next_n_matching_then_pass(gcs_server, gcs_proxy, bucket):
  c = _conn(gcs_proxy.url)
  assert _upload(c, bucket, "a", b"x")[0] == 200
  rule = gcs_proxy.fail(times=2, status=503, method="GET", path="/o/a")
  other = _download(c, bucket, "a")
  assert other[0] == 503
  assert json.loads(other[1])["error"]["code"] == 503
  assert _download(c, bucket, "a")[0] == 503  # same connection: still usable
  assert _download(c, bucket, "a") == (200, b"x")  # rule used up
  assert _upload(c, bucket, "b", b"y")[0] == 200  # POST never matched
  assert rule.hits == 2 and not rule.active
  assert gcs_proxy.stats()["failed"] == 2
  for status in (429, 500, 403):
    gcs_proxy.fail(times=1, status=status, path="/o/a")
    assert _download(c, bucket, "a")[0] == status
  c.close()


def test_fail_with_expect_continue_never_sends_body(gcs_server, gcs_proxy, bucket):
  gcs_proxy.fail(times=1, status=503, method="POST")
  q = urllib.parse.urlencode({"uploadType": "media", "name": "e"})
  with socket.create_connection(("127.0.0.1", gcs_proxy.port), timeout=10) as s:
    s.sendall(
      f"POST /upload/storage/v1/b/{bucket}/o?{q} HTTP/1.1\r\nHost: x\r\n"
      "Content-Length: 5\r\nExpect: 100-continue\r\n\r\n".encode()
    )
    reply = s.recv(65536)
  assert reply.startswith(b"HTTP/1.1 503"), reply
  assert _on_server(gcs_server, bucket, "e") is None


def test_reset_before_request_never_reaches_server(gcs_server, gcs_proxy, bucket):
  gcs_proxy.reset(times=1, method="POST", path="name=r1")
  c = _conn(gcs_proxy.url)
  with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
    _upload(c, bucket, "r1", b"data")
  c.close()
  assert _on_server(gcs_server, bucket, "r1") is None
  c = _conn(gcs_proxy.url)
  assert _upload(c, bucket, "r1", b"data")[0] == 200  # used up
  c.close()
  assert gcs_proxy.stats()["reset"] == 1


def test_reset_after_response_write_lands_but_client_errs(gcs_server, gcs_proxy, bucket):
  gcs_proxy.reset(times=1, when="response", method="POST", path="name=r2")
  c = _conn(gcs_proxy.url)
  with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
    _upload(c, bucket, "r2", b"landed")
  c.close()
  assert _on_server(gcs_server, bucket, "r2") == b"landed"


def test_reset_mid_response_body_truncates_download(gcs_server, gcs_proxy, bucket):
  c = _conn(gcs_proxy.url)
  assert _upload(c, bucket, "long", os.urandom(1 << 20))[0] == 200
  gcs_proxy.reset(times=1, when="response", after_bytes=1000, method="GET", path="/o/long")
  with pytest.raises((ConnectionError, http.client.IncompleteRead)):
    _download(c, bucket, "long")
  c.close()
  assert gcs_proxy.stats()["reset"] == 1


def test_hold_until_release(gcs_server, gcs_proxy, bucket):
  rule = gcs_proxy.hold(method="POST", path="name=held")
  out = {}

  def upload():
    c = _conn(gcs_proxy.url)
    out["status"] = _upload(c, bucket, "held", b"later")[0]
    c.close()

  t = threading.Thread(target=upload)
  t.start()
  rule.wait_held(1, timeout=20)
  deadline = time.monotonic() + 5
  while rule.held_now < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert rule.held_now == 1
  c = _conn(gcs_proxy.url)  # other requests go on meanwhile
  assert _upload(c, bucket, "free", b"now")[0] == 200
  c.close()
  assert _on_server(gcs_server, bucket, "held") is None
  assert t.is_alive()
  rule.release()
  t.join(20)
  assert out == {"status": 200}
  assert _on_server(gcs_server, bucket, "held") == b"later"
  assert rule.held_now == 0


def test_hold_drops_request_of_a_client_that_died(gcs_server, gcs_proxy, bucket):
  rule = gcs_proxy.hold(method="POST", path="name=dead")
  q = urllib.parse.urlencode({"uploadType": "media", "name": "dead"})
  s = socket.create_connection(("127.0.0.1", gcs_proxy.port), timeout=10)
  s.sendall(
    f"POST /upload/storage/v1/b/{bucket}/o?{q} HTTP/1.1\r\nHost: x\r\n"
    "Content-Length: 4\r\n\r\ndata".encode()
  )
  rule.wait_held(1, timeout=20)
  (conn,) = gcs_proxy._conns  # the held request's connection (the only one)
  s.close()  # the client is gone with its whole request sent
  deadline = time.monotonic() + 10
  while rule.held_now and time.monotonic() < deadline:
    time.sleep(0.02)
  assert rule.held_now == 0
  rule.release()
  deadline = time.monotonic() + 10
  # The connection's thread is done with the request once the proxy forgets
  # it: by then it has either dropped the request or sent it to the server.
  while conn in gcs_proxy._conns and time.monotonic() < deadline:
    time.sleep(0.02)
  assert conn not in gcs_proxy._conns
  assert gcs_proxy.stats()["forwarded"] == 0
  assert _on_server(gcs_server, bucket, "dead") is None


def test_delay_and_client_filter(gcs_server, gcs_proxy, bucket):
  gcs_proxy.delay(0.3, client="only-this-agent")
  c = _conn(gcs_proxy.url)
  t0 = time.monotonic()
  _upload(c, bucket, "d", b"x", **{"User-Agent": "only-this-agent/1"})
  slow = time.monotonic() - t0
  _upload(c, bucket, "d", b"x", **{"User-Agent": "another/1"})
  c.close()
  assert slow >= 0.3
  assert gcs_proxy.stats()["delayed"] == 1


def test_control_endpoint_from_another_process_view(gcs_server, gcs_proxy, bucket):
  ctl = ProxyClient(gcs_proxy.url)
  held = ctl.hold(method="POST", path="name=ctl")
  ctl.fail(times=1, status=500, method="GET")
  c = _conn(gcs_proxy.url)
  assert _download(c, bucket, "nothing")[0] == 500
  c.close()
  done = threading.Event()

  def upload():
    c2 = _conn(gcs_proxy.url)
    _upload(c2, bucket, "ctl", b"via control")
    c2.close()
    done.set()

  threading.Thread(target=upload, daemon=True).start()
  assert ctl.wait_held(held["id"], 1, timeout=20)["hits"] == 1
  stats = ctl.stats()
  assert stats["failed"] == 1 and stats["held"] >= 1, stats
  assert not done.wait(0.3)
  ctl.release(held["id"])
  assert done.wait(20)
  assert _on_server(gcs_server, bucket, "ctl") == b"via control"
  assert ctl.requests()[-1]["target"].startswith("/upload/")
  ctl.clear()
  assert ctl.stats()["rules"] == []
  with pytest.raises(urllib.error.HTTPError):
    ctl._call("POST", "rules", {"action": "explode"})
