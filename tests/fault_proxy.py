"""An HTTP proxy for the tests that injects object-store faults on a deterministic schedule.

It sits between the clients (gcsfs, tensorstore) and the local GCS emulator, forwards every
request, and answers some of them itself, as `Rule`s say: every Nth matching request, or a
burst of K consecutive ones, gets an HTTP 503/429, a stall (no answer for `stall_s`, longer
than the client's timeout, then the connection drops), a connection reset halfway through the
request body (an upload cut off), or a hold (no answer until `release()`, for a SIGKILL
mid-save), or the start of an outage ("outage": this request and every later one get a 503).
`outage(status)` answers everything with `status` until `outage(None)`.

Requests are matched on "<METHOD> <unquoted URL>", so an object name in the query string of an
upload (`...?uploadType=media&name=run/metrics.jsonl`) matches as a path.
"""
import dataclasses
import http.client
import json
import re
import socket
import socketserver
import struct
import threading
import time
import urllib.parse

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te",
               "trailer", "upgrade", "expect", "content-length"}


@dataclasses.dataclass
class Rule:
  """`fault` ("503", "429", "stall", "reset", "hold", "outage") for requests matching `match`: every
  `every`-th match (every > 0), else `count` consecutive matches after skipping `skip`."""
  fault: str
  match: str = "."
  every: int = 0
  count: int = 1
  skip: int = 0
  seen: int = 0      # matches so far
  fired: int = 0     # faults injected so far

  def fires(self, request: str) -> bool:
    if not re.search(self.match, request):
      return False
    self.seen += 1
    hit = (self.seen % self.every == 0) if self.every else (
        self.skip < self.seen <= self.skip + self.count)
    self.fired += hit
    return hit


class FaultProxy:
  """`FaultProxy(upstream_port, port)`; `.url`; `.rules` (checked in order, first that fires
  wins); `.log` the (request, fault or None) of every request; `close()`."""

  def __init__(self, upstream_port: int, port: int = 0, stall_s: float = 3.0):
    self.upstream_port, self.stall_s = upstream_port, stall_s
    self.rules: list[Rule] = []
    self.log: list[tuple[str, str | None]] = []
    self.held = threading.Event()      # set when a request is being held
    self._release = threading.Event()
    self._outage: str | None = None
    self.outage_since: float | None = None   # time.monotonic() when the outage began
    self._lock = threading.Lock()
    proxy = self

    class Handler(socketserver.StreamRequestHandler):
      def handle(self):
        try:
          proxy._serve(self.connection, self.rfile)   # pylint: disable=protected-access
        except OSError:
          pass   # the client hung up (its timeout, a killed process)

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    self._server = socketserver.ThreadingTCPServer(("127.0.0.1", port), Handler)
    self._server.daemon_threads = True
    self.port = self._server.server_address[1]
    self.url = f"http://127.0.0.1:{self.port}"
    threading.Thread(target=self._server.serve_forever, daemon=True).start()

  def outage(self, status: str | None) -> None:
    """Every request answered with HTTP `status` from now on (None: the store is back)."""
    self._outage = status
    self.outage_since = None if status is None else time.monotonic()

  def release(self) -> None:
    self._release.set()

  def faults(self) -> list[tuple[str, str]]:
    return [(r, f) for r, f in self.log if f]

  def close(self) -> None:
    self._release.set()
    self._server.shutdown()
    self._server.server_close()

  def _decide(self, request: str) -> str | None:
    with self._lock:
      fault = self._outage
      if fault is None:
        fault = next((r.fault for r in self.rules if r.fires(request)), None)
        if fault == "outage":
          self.outage("503")
          fault = "503"
      self.log.append((request, fault))
      return fault

  def _serve(self, conn: socket.socket, rfile) -> None:
    while True:   # one keep-alive connection, request after request
      line = rfile.readline(65537)
      if not line.strip():
        return
      method, target, _ = line.decode("latin-1").split(" ", 2)
      headers = []
      while (header := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
        name, _, value = header.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
      lower = {k.lower(): v for k, v in headers}
      fault = self._decide(f"{method} {urllib.parse.unquote(target)}")
      if lower.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")   # curl waits 1 s for it otherwise
      if fault == "reset":
        self._read_half_then_reset(conn, rfile, lower)
        return
      body = self._read_body(rfile, lower)
      if fault == "stall":
        time.sleep(self.stall_s)
        return   # the client gave up meanwhile; the request is never applied
      if fault == "hold":
        self.held.set()
        self._release.wait()
        return
      if fault is not None:
        self._answer(conn, int(fault), json.dumps(
            {"error": {"code": int(fault), "message": "injected by the test proxy"}}).encode())
        continue
      status, reason, reply_headers, reply = self._forward(method, target, headers, body)
      head = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in reply_headers
                                                  if k.lower() not in _HOP_BY_HOP]
      length = dict((k.lower(), v) for k, v in reply_headers).get("content-length", "0") \
          if method == "HEAD" else str(len(reply))
      head += [f"Content-Length: {length}", "Connection: keep-alive"]
      conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + reply)

  @staticmethod
  def _answer(conn, status: int, body: bytes) -> None:
    reason = {503: "Service Unavailable", 429: "Too Many Requests"}.get(status, "Error")
    conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n".encode() + body)

  @staticmethod
  def _read_body(rfile, lower: dict) -> bytes:
    if "content-length" in lower:
      return rfile.read(int(lower["content-length"]))
    if lower.get("transfer-encoding", "").lower() == "chunked":
      chunks = []
      while (size := int(rfile.readline().split(b";")[0], 16)) > 0:
        chunks.append(rfile.read(size))
        rfile.readline()
      while rfile.readline() not in (b"\r\n", b""):   # trailers
        pass
      return b"".join(chunks)
    return b""

  @staticmethod
  def _read_half_then_reset(conn, rfile, lower: dict) -> None:
    rfile.read(int(lower.get("content-length", "0")) // 2)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    conn.close()

  def _forward(self, method, target, headers, body):
    upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
    try:
      upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
      for name, value in headers:
        if name.lower() not in _HOP_BY_HOP:
          upstream.putheader(name, value)
      upstream.putheader("Content-Length", str(len(body)))
      upstream.endheaders(body)
      reply = upstream.getresponse()
      return reply.status, reply.reason, reply.getheaders(), reply.read()
    finally:
      upstream.close()
