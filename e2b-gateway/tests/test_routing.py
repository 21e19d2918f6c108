"""Routing on one address (spec e2b-wire.md 1.6): TLS and plain HTTP sniffed on the same
port, the local CA and wildcard certificate, Host <port>-<id>.<domain> routing, and
forwarding of other sandbox ports to the guest (HTTP and WebSocket).

The test driver (spaced-test --runtime test) runs space-agent-host per sandbox on this
host (SPACE_FAKE_AGENT), so a "guest port" is a port on this host's 127.0.0.1: the guest
web server and WebSocket echo server below are plain Python servers started here.
"""
import base64
import hashlib
import http.client
import http.server
import json
import os
import shutil
import socket
import socketserver
import ssl
import struct
import subprocess
import sys
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import (MULT, Platform, connect_local, free_port,  # noqa: E402
                     skip_unless_agent, skip_unless_pg)

BIG = 5 * 1024 * 1024
FIREHOSE = 64 * 1024 * 1024
FIREHOSE_SENT = [0]
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


# ---- the "guest" servers ----

class GuestHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, status, body, ctype="application/json", extra=None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Guest", "yes")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _seen(self):
        return {"method": self.command, "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()}}

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        if self.path == "/big":
            body = bytes(range(256)) * (BIG // 256)
            self._send(200, body, "application/octet-stream")
        elif self.path == "/chunked":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"alpha-", b"beta-" * 1000, b"gamma"):
                self.wfile.write(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\nX-Trailer: t\r\n\r\n")
        elif self.path == "/eof":
            # no length, no chunking: the body ends when the guest closes
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"until-close" * 100)
            self.close_connection = True
        elif self.path == "/firehose":
            # 64 MiB, counting what the socket took: a client that stops reading must stop us
            self.send_response(200)
            self.send_header("Content-Length", str(FIREHOSE))
            self.end_headers()
            chunk = b"f" * 65536
            FIREHOSE_SENT[0] = 0
            try:
                for _ in range(FIREHOSE // len(chunk)):
                    self.wfile.write(chunk)
                    FIREHOSE_SENT[0] += len(chunk)
            except OSError:
                pass
        elif self.path in RAW:
            self.wfile.write(RAW[self.path])
            self.close_connection = True
        elif self.path.startswith("/status/"):
            self._send(int(self.path[8:]), b'{"guest":"status"}')
        elif self.path == "/nocontent":
            self.send_response(204)
            self.end_headers()
        else:
            self._send(200, json.dumps(self._seen()).encode(), extra={"Set-Cookie": "a=b"})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(n)
        seen = self._seen()
        seen["len"] = len(data)
        seen["sha256"] = hashlib.sha256(data).hexdigest()
        self._send(201, json.dumps(seen).encode())


# Responses written as is (what a broken or unusual guest server sends).
RAW = {
    "/raw-100": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "/raw-bare-cr": b"HTTP/1.1 200 OK\r\nX-Bad: a\rSet-Cookie: evil=1\r\nContent-Length: 0\r\n\r\n",
    "/raw-garbage": b"SSH-2.0-OpenSSH\r\n\r\n",
    "/raw-short": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly-some",
    "/raw-bad-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
}


class GuestHTTP(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        pass  # clients that leave mid-response are part of the tests


def ws_read_frame(sock_file):
    """(opcode, payload) of one frame; unmasks when masked."""
    h = sock_file.read(2)
    if len(h) < 2:
        return None, b""
    op = h[0] & 0x0F
    masked = h[1] & 0x80
    n = h[1] & 0x7F
    if n == 126:
        n = struct.unpack(">H", sock_file.read(2))[0]
    elif n == 127:
        n = struct.unpack(">Q", sock_file.read(8))[0]
    mask = sock_file.read(4) if masked else None
    data = sock_file.read(n)
    if mask:
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    return op, data


def ws_frame(op, payload, mask):
    head = bytes([0x80 | op])
    n = len(payload)
    mbit = 0x80 if mask else 0
    if n < 126:
        head += bytes([mbit | n])
    elif n < 65536:
        head += bytes([mbit | 126]) + struct.pack(">H", n)
    else:
        head += bytes([mbit | 127]) + struct.pack(">Q", n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


class WSEchoHandler(socketserver.StreamRequestHandler):
    """A WebSocket echo server: handshake, then every data frame comes back."""

    def handle(self):
        headers = {}
        line = self.rfile.readline()
        if not line.startswith(b"GET "):
            return
        self.path = line.split()[1].decode()
        while True:
            line = self.rfile.readline().strip()
            if not line:
                break
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if headers.get("upgrade", "").lower() != "websocket":
            self.wfile.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            return
        accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode()
                                               + WS_GUID).digest()).decode()
        # a greeting frame right behind the 101 (same write) checks bytes after the head
        self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                          "Connection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n"
                          % accept).encode() + ws_frame(1, b"hello " + self.path.encode(),
                                                        False))
        self.wfile.flush()
        while True:
            op, data = ws_read_frame(self.rfile)
            if op is None or op == 8:
                if op == 8:
                    self.wfile.write(ws_frame(8, data, False))
                return
            self.wfile.write(ws_frame(op, data, False))
            self.wfile.flush()


class WSServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(server):
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return server


class NamedHTTPS(http.client.HTTPSConnection):
    """HTTPS to 127.0.0.1 with SNI, Host and certificate check for a sandbox name (independent of
    how the name resolves; test_name_resolution checks that separately)."""

    def __init__(self, name, port, context, timeout, rcvbuf=None):
        super().__init__(name, port, context=context, timeout=timeout)
        self.rcvbuf = rcvbuf

    def connect(self):
        raw = connect_local(self.port, self.timeout, self.rcvbuf)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)


@skip_unless_pg
@skip_unless_agent
class RoutingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.guest = serve(GuestHTTP(("127.0.0.1", 0), GuestHandler))
        cls.gport = cls.guest.server_address[1]
        cls.ws = serve(WSServer(("127.0.0.1", 0), WSEchoHandler))
        cls.wsport = cls.ws.server_address[1]
        cls.p = Platform(teams=("alpha", "beta"), start=False, runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20"})
        cls.s = cls.p.s
        cls.key = cls.p.keys["alpha"]
        cls.other_key = cls.p.keys["beta"]
        cls.s.env.pop("SPACE_E2B_DOMAIN", None)  # the default domain is under test
        cls.s.start()
        cls.domain = "space.localhost:%d" % cls.s.port
        cls.ca = os.path.join(cls.s.data_dir, "tls", "ca.pem")
        cls.sb = cls.create(cls.key)
        cls.sid = cls.sb["sandboxID"]
        cls.token = cls.sb["envdAccessToken"]

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()
        cls.guest.shutdown()
        cls.ws.shutdown()

    # ---- helpers ----

    @classmethod
    def api(cls, method, path, body=None, key=None):
        h = {"X-API-KEY": key or cls.key}
        return cls.s.request(method, path, body=body, key="", headers=h, timeout=120)

    @classmethod
    def create(cls, key, **fields):
        body = {"templateID": "base", "timeout": 300, "metadata": {}, "envVars": {},
                "secure": True}
        body.update(fields)
        st, sb = cls.api("POST", "/sandboxes", body, key=key)
        assert st == 201, (st, sb)
        return sb

    def host(self, port=None, sid=None):
        return "%d-%s.%s" % (port or self.gport, sid or self.sid, self.domain)

    def name(self, port=None, sid=None):
        return self.host(port, sid).rsplit(":", 1)[0]

    def ctx(self, alpn=None, cafile=None):
        c = ssl.create_default_context(cafile=cafile or self.ca)
        if alpn:
            c.set_alpn_protocols(alpn)
        return c

    def https(self, port=None, sid=None, timeout=60, rcvbuf=None):
        return NamedHTTPS(self.name(port, sid), self.s.port, self.ctx(), timeout * MULT, rcvbuf)

    def plain(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=timeout * MULT)

    def fetch(self, conn, method, path, host=None, headers=None, body=None):
        h = {"Host": host or self.host()}
        h.update(headers or {})
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        return r, r.read()

    def token_hdr(self, token=None):
        return {"X-Access-Token": token or self.token}

    # ---- TLS and the shared port ----

    def test_domain_returned(self):
        self.assertEqual(self.sb.get("domain"), self.domain)

    def test_tls_alpn_h2_and_http11(self):
        for port, offered, want in ((49983, ["h2", "http/1.1"], "h2"),
                                    (8080, ["h2", "http/1.1"], "h2"),
                                    (49983, ["http/1.1"], "http/1.1"),
                                    # The code interpreter's host speaks HTTP/1.1 only: an SDK
                                    # that gives up on a cell closes the connection, which
                                    # interrupts it (an HTTP/2 stream is dropped silently).
                                    (49999, ["h2", "http/1.1"], "http/1.1")):
            raw = socket.create_connection(("127.0.0.1", self.s.port), timeout=30 * MULT)
            with self.ctx(offered).wrap_socket(raw, server_hostname=self.name(port)) as t:
                self.assertEqual(t.selected_alpn_protocol(), want, (port, offered))
                self.assertGreaterEqual(t.version(), "TLSv1.2")
        # Without SNI (an IP literal) the default applies.
        raw = socket.create_connection(("127.0.0.1", self.s.port), timeout=30 * MULT)
        c = self.ctx(["h2", "http/1.1"])
        c.check_hostname = False
        with c.wrap_socket(raw) as t:
            self.assertEqual(t.selected_alpn_protocol(), "h2")

    def test_tls_bundle_and_wrong_name(self):
        bundle = os.path.join(self.s.data_dir, "tls", "bundle.pem")
        raw = socket.create_connection(("127.0.0.1", self.s.port), timeout=30 * MULT)
        with self.ctx(cafile=bundle).wrap_socket(raw, server_hostname=self.name(49983)):
            pass
        raw = socket.create_connection(("127.0.0.1", self.s.port), timeout=30 * MULT)
        with self.assertRaises(ssl.SSLCertVerificationError):
            self.ctx().wrap_socket(raw, server_hostname="example.com")
        raw.close()

    def test_tls_files(self):
        tls = os.path.join(self.s.data_dir, "tls")
        self.assertEqual(os.stat(os.path.join(tls, "ca.key")).st_mode & 0o777, 0o600)
        self.assertEqual(os.stat(os.path.join(tls, "server.key")).st_mode & 0o777, 0o600)
        with open(self.s.log_path) as f:
            log = f.read()
        self.assertIn("SSL_CERT_FILE=", log)
        self.assertIn("NODE_EXTRA_CA_CERTS=" + self.ca, log)

    def test_plain_http_same_port(self):
        c = self.plain()
        r, body = self.fetch(c, "GET", "/healthz", host="127.0.0.1:%d" % self.s.port)
        self.assertEqual(r.status, 200, body)
        c.close()

    def test_api_over_https(self):
        c = NamedHTTPS("api." + self.domain.rsplit(":", 1)[0], self.s.port, self.ctx(), 60)
        c.request("GET", "/sandboxes/" + self.sid, headers={"X-API-KEY": self.key})
        r = c.getresponse()
        body = json.loads(r.read())
        self.assertEqual(r.status, 200, body)
        self.assertEqual(body["sandboxID"], self.sid)
        c.close()

    def test_silent_connection_is_closed_others_served(self):
        # a connection that never speaks does not block the listener
        idle = socket.create_connection(("127.0.0.1", self.s.port))
        c = self.plain()
        r, _ = self.fetch(c, "GET", "/healthz", host="127.0.0.1")
        self.assertEqual(r.status, 200)
        idle.close()
        c.close()

    def test_name_resolution(self):
        infos = socket.getaddrinfo("x.space.localhost", self.s.port, proto=socket.IPPROTO_TCP)
        addrs = {i[4][0] for i in infos}
        self.assertIn("127.0.0.1", addrs, "nss-myhostname must resolve *.localhost")
        infos = socket.getaddrinfo(self.name(), self.s.port, family=socket.AF_INET)
        self.assertEqual({i[4][0] for i in infos}, {"127.0.0.1"})
        # and a client that resolves the name itself gets through
        c = http.client.HTTPSConnection(self.name(), self.s.port, context=self.ctx(),
                                        timeout=60 * MULT)
        r, body = self.fetch(c, "GET", "/resolved")
        self.assertEqual(r.status, 200, body)
        c.close()

    def test_ipv6_loopback_twin(self):
        # *.localhost resolves to ::1 first for many clients: the same port answers there
        try:
            raw = socket.create_connection(("::1", self.s.port), timeout=30 * MULT)
        except OSError as e:
            self.skipTest("no ::1 listener here: %s" % e)
        with self.ctx(["http/1.1"]).wrap_socket(raw, server_hostname=self.name()) as t:
            t.sendall(b"GET /v6 HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
                      % self.host().encode())
            data = b""
            while True:
                chunk = t.recv(65536)
                if not chunk:
                    break
                data += chunk
        self.assertTrue(data.startswith(b"HTTP/1.1 200 "), data[:200])
        self.assertIn(b'"/v6"', data)

    # ---- forwarding ----

    def test_forward_https(self):
        c = self.https()
        r, body = self.fetch(c, "GET", "/some/path?q=1&r=%20x",
                             headers=dict(self.token_hdr(), **{"X-Custom": "v1"}))
        self.assertEqual(r.status, 200, body)
        self.assertEqual(r.getheader("X-Guest"), "yes")
        self.assertEqual(r.getheader("Set-Cookie"), "a=b")
        seen = json.loads(body)
        self.assertEqual(seen["path"], "/some/path?q=1&r=%20x")
        self.assertEqual(seen["headers"]["x-custom"], "v1")
        self.assertEqual(seen["headers"]["host"], self.host())
        self.assertEqual(seen["headers"]["x-forwarded-proto"], "https")
        self.assertNotIn("x-access-token", seen["headers"])  # our credential stays here
        # keep-alive: the same connection carries more requests, API ones included
        r, body = self.fetch(c, "GET", "/second")
        self.assertEqual(r.status, 200, body)
        r, body = self.fetch(c, "GET", "/sandboxes/" + self.sid, host="api.space.localhost",
                             headers={"X-API-KEY": self.key})
        self.assertEqual(r.status, 200, body)
        r, body = self.fetch(c, "GET", "/third")
        self.assertEqual(r.status, 200, body)
        c.close()

    def test_forward_plain_http(self):
        c = self.plain()
        r, body = self.fetch(c, "GET", "/plain")
        self.assertEqual(r.status, 200, body)
        self.assertEqual(json.loads(body)["headers"]["x-forwarded-proto"], "http")
        c.close()

    def test_forward_statuses_and_framings(self):
        c = self.https()
        r, body = self.fetch(c, "GET", "/status/404")
        self.assertEqual((r.status, body), (404, b'{"guest":"status"}'))
        r, body = self.fetch(c, "GET", "/chunked")
        self.assertEqual(r.status, 200)
        self.assertEqual(body, b"alpha-" + b"beta-" * 1000 + b"gamma")
        r, body = self.fetch(c, "GET", "/nocontent")
        self.assertEqual((r.status, body), (204, b""))
        r, body = self.fetch(c, "HEAD", "/big")
        self.assertEqual((r.status, body), (200, b""))
        r, body = self.fetch(c, "GET", "/eof")
        self.assertEqual((r.status, body), (200, b"until-close" * 100))
        c.close()

    def test_forward_big_bodies(self):
        c = self.https(timeout=120)
        r, body = self.fetch(c, "GET", "/big")
        self.assertEqual(r.status, 200)
        self.assertEqual(r.getheader("Content-Length"), str(BIG))
        self.assertEqual(body, bytes(range(256)) * (BIG // 256))
        up = os.urandom(BIG)
        r, body = self.fetch(c, "POST", "/echo", body=up,
                             headers={"Content-Type": "application/octet-stream"})
        self.assertEqual(r.status, 201, body[:200])
        seen = json.loads(body)
        self.assertEqual((seen["len"], seen["sha256"]), (BIG, hashlib.sha256(up).hexdigest()))
        c.close()

    def test_forward_http2(self):
        curl = shutil.which("curl")
        if curl is None:
            self.skipTest("curl is not installed")
        out = subprocess.run(
            [curl, "-sS", "--http2", "--cacert", self.ca, "-o", "/dev/null",
             "-w", "%{http_version} %{http_code} %{size_download}",
             "--resolve", "%s:%d:127.0.0.1" % (self.name(), self.s.port),
             "https://%s/big" % self.host()],
            capture_output=True, text=True, timeout=120 * MULT)
        self.assertEqual(out.stdout.strip(), "2 200 %d" % BIG, out.stderr)

    def test_unusual_and_broken_guest_responses(self):
        c = self.plain()
        r, body = self.fetch(c, "GET", "/raw-100")
        self.assertEqual((r.status, body), (200, b"ok"))
        for path in ("/raw-bare-cr", "/raw-garbage"):
            r, body = self.fetch(c, "GET", path)
            self.assertEqual(r.status, 502, (path, body))
            self.assertEqual(json.loads(body)["code"], 502)
        c.close()
        # a body cut short or mis-chunked after the head went out: the client sees an error
        for path in ("/raw-short", "/raw-bad-chunk"):
            c = self.plain()
            with self.assertRaises((http.client.IncompleteRead, ConnectionError,
                                    http.client.HTTPException), msg=path):
                r, body = self.fetch(c, "GET", path)
                if r.status == 502:  # the head had not gone out yet
                    raise http.client.HTTPException("502")
            c.close()

    def test_client_leaves_mid_body(self):
        for tls in (False, True):
            c = self.https(timeout=30) if tls else self.plain(timeout=30)
            c.request("GET", "/big", headers={"Host": self.host()})
            r = c.getresponse()
            self.assertEqual(len(r.read(1000)), 1000)
            c.close()
        c = self.plain()
        r, body = self.fetch(c, "GET", "/after-leaving")
        self.assertEqual(r.status, 200, body)
        c.close()

    def test_slow_client_slows_the_guest(self):
        import time
        c = self.https(timeout=60, rcvbuf=128 * 1024)
        c.request("GET", "/firehose", headers={"Host": self.host()})
        r = c.getresponse()
        self.assertEqual(len(r.read(1 << 20)), 1 << 20)
        time.sleep(1.0 * MULT)
        stalled = FIREHOSE_SENT[0]
        # what sits in between is bounded (agent window, our two buffers, socket buffers),
        # far below the 64 MiB the guest wants to send
        self.assertLess(stalled, 48 * 1024 * 1024)
        got = 1 << 20
        while True:
            b = r.read(1 << 20)
            if not b:
                break
            got += len(b)
        self.assertEqual(got, FIREHOSE)
        c.close()

    def test_guest_port_closed_is_502(self):
        closed = free_port()
        c = self.https(port=closed)
        r, body = self.fetch(c, "GET", "/", host=self.host(closed))
        self.assertEqual(r.status, 502, body)
        err = json.loads(body)
        # E2B's closed-port error: the sandbox, the port and a fixed message.
        self.assertEqual(err, {"code": 502, "port": closed, "sandboxId": self.sid,
                               "message": "The sandbox is running but port is not open"})
        # A browser gets a page saying the same.
        r, body = self.fetch(c, "GET", "/", host=self.host(closed),
                             headers={"Accept": "text/html,application/xhtml+xml"})
        self.assertEqual(r.status, 502, body)
        self.assertTrue(r.getheader("content-type").startswith("text/html"))
        self.assertIn(b"Port %d is not open" % closed, body)
        c.close()

    # ---- authentication and lookup ----

    def test_public_by_default_without_token(self):
        c = self.plain()
        r, body = self.fetch(c, "GET", "/public")
        self.assertEqual(r.status, 200, body)
        c.close()

    def test_wrong_token_is_401(self):
        c = self.plain()
        r, body = self.fetch(c, "GET", "/", headers=self.token_hdr("x" * 43))
        self.assertEqual(r.status, 401, body)
        self.assertEqual(json.loads(body)["code"], 401)
        c.close()

    def test_other_team_sandbox(self):
        other = self.create(self.other_key)
        c = self.plain()
        # our token does not open their sandbox
        r, body = self.fetch(c, "GET", "/", host=self.host(sid=other["sandboxID"]),
                             headers=self.token_hdr())
        self.assertIn(r.status, (401, 404), body)
        # their own token does
        r, body = self.fetch(c, "GET", "/", host=self.host(sid=other["sandboxID"]),
                             headers=self.token_hdr(other["envdAccessToken"]))
        self.assertEqual(r.status, 200, body)
        c.close()

    def test_unknown_sandbox_is_502_not_found(self):
        # E2B's edge answers a port host of an unknown sandbox with 502 and the sandbox id.
        c = self.plain()
        r, body = self.fetch(c, "GET", "/", host=self.host(sid="nosuchsandbox0"))
        self.assertEqual(r.status, 502, body)
        self.assertEqual(json.loads(body), {"code": 502, "sandboxId": "nosuchsandbox0",
                                            "message": "The sandbox was not found"})
        c.close()

    def test_private_sandbox_needs_token(self):
        sb = self.create(self.key, network={"allowPublicTraffic": False})
        c = self.plain()
        host = self.host(sid=sb["sandboxID"])
        # without a token, exactly an unknown sandbox (no existence oracle)
        r, body = self.fetch(c, "GET", "/", host=host)
        self.assertEqual(r.status, 502, body)
        self.assertEqual(json.loads(body), {"code": 502, "sandboxId": sb["sandboxID"],
                                            "message": "The sandbox was not found"})
        r, body = self.fetch(c, "GET", "/", host=host,
                             headers=self.token_hdr(sb["envdAccessToken"]))
        self.assertEqual(r.status, 200, body)
        r, body = self.fetch(c, "GET", "/", host=host,
                             headers={"E2B-Traffic-Access-Token": sb["trafficAccessToken"]})
        self.assertEqual(r.status, 200, body)
        c.close()

    # ---- WebSocket ----

    def ws_connect(self, tls):
        raw = socket.create_connection(("127.0.0.1", self.s.port), timeout=30 * MULT)
        host = self.host(self.wsport)
        sock = self.ctx(["http/1.1"]).wrap_socket(raw, server_hostname=host.rsplit(":", 1)[0]) \
            if tls else raw
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(("GET /chat?x=1 HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\n"
                      "Connection: Upgrade\r\nSec-WebSocket-Key: %s\r\n"
                      "Sec-WebSocket-Version: 13\r\n\r\n" % (host, key)).encode())
        f = sock.makefile("rb")
        status = f.readline()
        self.assertIn(b" 101 ", status)
        headers = {}
        while True:
            line = f.readline().strip()
            if not line:
                break
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        self.assertEqual(headers.get("upgrade", "").lower(), "websocket")
        self.assertEqual(headers.get("connection", "").lower(), "upgrade")
        want = base64.b64encode(hashlib.sha1(key.encode() + WS_GUID).digest()).decode()
        self.assertEqual(headers.get("sec-websocket-accept"), want)
        return sock, f

    def ws_roundtrips(self, tls):
        sock, f = self.ws_connect(tls)
        op, data = ws_read_frame(f)
        self.assertEqual((op, data), (1, b"hello /chat?x=1"))
        for msg in (b"one", b"two" * 1000, os.urandom(2 * 1024 * 1024)):
            sock.sendall(ws_frame(2, msg, True))
            op, data = ws_read_frame(f)
            self.assertEqual(op, 2)
            self.assertEqual(data, msg)
        sock.sendall(ws_frame(8, b"\x03\xe8", True))
        op, _ = ws_read_frame(f)
        self.assertEqual(op, 8)
        f.close()
        sock.close()

    def test_websocket_plain(self):
        self.ws_roundtrips(False)

    def test_websocket_tls(self):
        self.ws_roundtrips(True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
