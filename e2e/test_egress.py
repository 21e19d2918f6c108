"""End to end: sandboxes' outbound traffic through the host's egress proxy, on real microVMs.

The guests have no network device: curl and Python in the guest reach the host's test servers
(HTTP and HTTPS on 127.0.0.1, standing in for the internet) only through the agent's proxy
port and spaced's egress proxy (core/egress/egress.h), which applies each sandbox's policy. Uses
spaced-test for its test-only resolver override (SPACE_TEST_EGRESS_HOSTS), which makes names
like ok.test and rebind.test resolve to 127.0.0.1; the default policy denies loopback, so the
tests open 127.0.0.1 by an explicit IP rule where they need it.

Needs SP_TEST_DATA_DIR with a built `base` template (the e2e.template fixture), root and
PostgreSQL. SP_TEST_EGRESS_LOAD=0 skips the 1,000-connection and 1 GiB case.

ProxyProtocolTest needs no VM: with the test driver's host-side agent (SPACE_FAKE_AGENT) it
checks the proxy's HTTP handling byte for byte (origin-form rewrite, hop-by-hop headers,
chunked bodies, pipelined requests, malformed requests, tunnels).
"""
import http.server
import json
import os
import resource
import selectors
import shutil
import socket
import socketserver
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import (KEEP, MULT, free_port, pg_bindir, Platform,  # noqa: E402
                     vm_skip_reason, wait_s)

DATA = os.environ.get("SP_TEST_DATA_DIR")
SPACED_TEST = os.environ.get("SPACED_TEST")
PROXY = "http://127.0.0.1:3128"  # SP_EGRESS_GUEST_PORT
LOAD = os.environ.get("SP_TEST_EGRESS_LOAD", "1") != "0"


def skip_reason():
    reason = vm_skip_reason(DATA)
    if reason is not None:
        return reason
    if not SPACED_TEST or not os.path.exists(SPACED_TEST):
        return "SPACED_TEST (spaced-test, for the resolver override) is not built"
    if subprocess.run(["which", "openssl"], capture_output=True).returncode != 0:
        return "openssl is not installed (for the HTTPS test server's certificate)"
    return None


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path.startswith("/bytes/"):
            n = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"\0" * (1 << 20)
            while n > 0:
                k = min(n, len(chunk))
                self.wfile.write(chunk[:k])
                n -= k
            return
        body = ("hello %s host=%s\n" % (self.path, self.headers.get("Host"))).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(n)
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # a thousand connections arrive at once


def serve(tls_dir=None):
    srv = Server(("127.0.0.1", 0), Handler)
    if tls_dir is not None:
        cert, key = os.path.join(tls_dir, "cert.pem"), os.path.join(tls_dir, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-subj", "/CN=ok.test", "-keyout", key, "-out", cert],
                       check=True, capture_output=True)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


# Opens N connections through the proxy at once, each a plain-HTTP GET in absolute form.
MANY = r"""
import asyncio, sys
N, port = int(sys.argv[1]), int(sys.argv[2])
async def one(i):
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", 3128), 120)
        w.write(b"GET http://127.0.0.1:%d/c%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (port, i, port))
        await w.drain()
        data = await asyncio.wait_for(r.read(), 120)
        w.close()
        return data.startswith(b"HTTP/1.1 200") and (b"/c%d " % i) in data
    except Exception as e:
        return False
async def main():
    res = await asyncio.gather(*(one(i) for i in range(N)))
    print(sum(res))
asyncio.run(main())
"""

# N workers, each opening a connection through the proxy, sending a CONNECT to a host port
# and pushing SIZE bytes after it (16 KiB at a time, so the guest's own buffers stay small)
# without waiting for the answer, then waiting for the answer and starting again, until HOLD
# seconds have passed; prints how the connections were answered as JSON ("200", "503",
# "504", "eof", "wait": none yet at the end, or an error's name).
FLOOD = r"""
import asyncio, json, sys, time
N, port, size, hold = (int(a) for a in sys.argv[1:5])
res = {}
end = time.time() + hold
chunk = b"x" * 16384
def count(k):
    res[k] = res.get(k, 0) + 1
async def push(w):
    for _ in range(size // len(chunk)):
        w.write(chunk)
        await w.drain()
async def one(i):
    while time.time() < end:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", 3128), 60)
        except Exception as e:
            count("open " + type(e).__name__)
            await asyncio.sleep(1)
            continue
        w.transport.set_write_buffer_limits(high=16384)
        w.write(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (port, port))
        pusher = asyncio.ensure_future(push(w))
        try:
            line = await asyncio.wait_for(r.readline(), max(1, end - time.time()))
            count(line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else "eof")
        except asyncio.TimeoutError:
            count("wait")
        except Exception as e:
            count(type(e).__name__)
        pusher.cancel()
        w.transport.abort()
async def main():
    # One connection's unexpected error is counted, not the end of the report.
    for x in await asyncio.gather(*(one(i) for i in range(N)), return_exceptions=True):
        if isinstance(x, BaseException):
            count("error " + type(x).__name__)
    print(json.dumps(res))
asyncio.run(main())
"""


class Blackhole:
    """A port whose connections never complete: its listener's queue is full and it never
    accepts, so the kernel drops every further SYN. A proxied connection there waits for its
    connect timeout with the guest's bytes in the proxy, not in any kernel buffer."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.port = self.sock.getsockname()[1]
        self.fill = []
        for _ in range(2):
            c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", self.port))
            self.fill.append(c)
        time.sleep(0.2)

    def close(self):
        for c in self.fill:
            c.close()
        self.sock.close()


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class SlowUpstream:
    """Accepts connections and never reads them (a small receive buffer, so the kernel holds
    little): whatever a guest sends there waits in the proxy."""

    def __init__(self):
        raise_nofile()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4096)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()
        self.conns = []


# CONNECT then TLS with a chosen server name; prints the HTTP status line or the error.
# A long-lived connection through the guest's proxy: a CONNECT tunnel (plain HTTP inside, so
# it is relayed), one answered request, then a wait for what comes next (EOF when spaced
# closes it).
KEEPALIVE = r"""
import socket, sys
P = int(sys.argv[1])
s = socket.create_connection(("127.0.0.1", 3128), timeout=60)
s.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (P, P))
buf = b""
while b"\r\n\r\n" not in buf:
    d = s.recv(4096)
    if not d:
        break
    buf += d
print("connect", buf.split(b"\r\n")[0].decode(), flush=True)
s.sendall(b"GET /first HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % P)
buf = b""
while b"hello /first" not in buf:
    d = s.recv(4096)
    if not d:
        break
    buf += d
print("first", b"hello /first" in buf, flush=True)
open("/tmp/keepalive-up", "w").close()
try:
    d = s.recv(4096)
    print("after", "closed" if d == b"" else "data", flush=True)
except socket.timeout:
    print("after timeout", flush=True)
except OSError as e:
    print("after closed", type(e).__name__, flush=True)
"""

SNI = r"""
import socket, ssl, sys
host, port, sni = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
s.sendall(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host, port, host, port)).encode())
resp = b""
while b"\r\n\r\n" not in resp:
    d = s.recv(4096)
    if not d:
        break
    resp += d
print(resp.split(b"\r\n")[0].decode())
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
try:
    t = ctx.wrap_socket(s, server_hostname=sni)
    t.sendall(("GET /sni HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % sni).encode())
    print(t.recv(4096).split(b"\r\n")[0].decode())
except (OSError, ssl.SSLError) as e:
    print("TLS failed:", type(e).__name__)
"""


@unittest.skipIf(skip_reason(), skip_reason())
class EgressTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="sp-egress-")
        cls.http = serve()
        cls.https = serve(cls.tmp)
        cls.other = serve()  # a second port, for the port rules
        cls.P = cls.http.server_address[1]
        cls.TP = cls.https.server_address[1]
        cls.OP = cls.other.server_address[1]
        cls.hosts = os.path.join(cls.tmp, "hosts")
        with open(cls.hosts, "w") as f:
            f.write("# test names for the egress resolver\n"
                    "127.0.0.1 ok.test blocked.test a.wild.test wild.test rebind.test\n")
        cls.p = Platform(teams=(None,), binary=SPACED_TEST, data_dir=DATA,
                         env={"SPACE_ACCEL": os.environ.get("SPACE_ACCEL", "auto"),
                              "SPACE_TEST_EGRESS_HOSTS": cls.hosts,
                              # ASan's quarantine (256 MiB) would hide what the flood case
                              # measures
                              "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "") +
                              ":quarantine_size_mb=8"})
        cls.s, cls.pg = cls.p.s, cls.p.pg
        cls.sandboxes = []

    @classmethod
    def tearDownClass(cls):
        for sid in cls.sandboxes:
            try:
                cls.s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
            except OSError:
                pass
        cls.p.destroy()
        for srv in (cls.http, cls.https, cls.other):
            srv.shutdown()
        if not KEEP:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    # ---- helpers ----

    def req(self, *a, **kw):
        return self.s.request(*a, **kw)

    def create(self, egress=None, **fields):
        body = dict(template="base", **fields)
        if egress is not None:
            body["egress"] = egress
        st, r = self.req("POST", "/v1/sandboxes?wait=%d" % wait_s(120), body, timeout=130 * MULT)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["operation"]["status"], "succeeded", (r, self.s.read_log()))
        sid = r["sandbox"]["id"]
        self.sandboxes.append(sid)
        return sid

    def run_cmd(self, sid, cmd, timeout=120):
        # NO_PROXY lists 127.0.0.1 (the guest's own loopback); these tests mean the host's.
        st, r = self.req("POST", "/v1/sandboxes/%s/commands" % sid,
                         {"cmd": cmd, "env": {"NO_PROXY": "", "no_proxy": ""},
                          "timeout_s": int(timeout * MULT)}, timeout=(timeout + 30) * MULT)
        self.assertEqual(st, 200, r)
        return r

    def diagnose(self, sid):
        """What a sandbox and the host were doing, for a failure message."""
        out = []
        try:
            st, r = self.req("POST", "/v1/sandboxes/%s/commands" % sid,
                             {"cmd": "cat /proc/loadavg; head -3 /proc/meminfo;"
                                     " cat /proc/net/sockstat; dmesg | tail -20;"
                                     # pid, name, state, user+system ticks, RSS pages
                                     " cat /proc/[0-9]*/stat 2>/dev/null | awk '{print $1, $2,"
                                     " $3, $14 + $15, $24}' | sort -k4 -n -r | head -8",
                              "timeout_s": 30}, timeout=60)
            out.append("guest (%s): %s" % (st, r.get("stdout", r) if st == 200 else r))
        except OSError as e:
            out.append("guest: no answer (%s)" % e)
        try:
            with open(os.path.join(DATA, "vms", sid, "console.log"), errors="replace") as f:
                out.append("console: " + f.read()[-2000:])
        except OSError as e:
            out.append("console: %s" % e)
        st, r = self.req("GET", "/v1/sandboxes/%s/egress?limit=5" % sid)
        out.append("egress audit (%s): %s" % (st, r))
        out.append("spaced: " + self.s.read_log())
        return "\n".join(out)

    def curl(self, sid, url, *extra):
        """(HTTP status, CONNECT status, body, curl exit code) for one request via the proxy."""
        args = " ".join("'%s'" % a for a in extra)
        r = self.run_cmd(sid, "curl -sS -k -m 30 -o /tmp/body -w '%%{http_code} %%{http_connect}'"
                              " %s '%s'; echo \" $?\"; cat /tmp/body 2>/dev/null" % (args, url))
        first, _, body = r["stdout"].partition("\n")
        parts = first.split()
        return int(parts[0]), int(parts[1]), body, int(parts[2])

    def audit(self, sid, **q):
        qs = "&".join("%s=%s" % kv for kv in q.items())
        st, r = self.req("GET", "/v1/sandboxes/%s/egress?%s" % (sid, qs))
        self.assertEqual(st, 200, r)
        return r

    def audit_until(self, sid, pred, timeout=5):
        deadline = time.time() + timeout * MULT
        while True:
            rows = self.audit(sid, limit=1000)["entries"]
            if pred(rows) or time.time() > deadline:
                return rows
            time.sleep(0.2)

    def put_policy(self, sid, policy):
        st, r = self.req("PUT", "/v1/sandboxes/%s/egress/policy" % sid,
                         raw=json.dumps(policy).encode())
        return st, r

    # ---- cases ----

    def test_egress_guest_loopback_is_up(self):
        # The proxy and DNS listen on the guest's 127.0.0.1: the agent must bring lo up.
        sid = self.create()
        r = self.run_cmd(sid, "cat /sys/class/net/lo/flags")
        self.assertTrue(int(r["stdout"].strip(), 16) & 1, "guest loopback is down: %s" % r)
        # Bypass attempts: there is no other way out than the proxy. No network device
        # but lo, and a direct connection (proxy variables ignored) has no route.
        r = self.run_cmd(sid, "ls /sys/class/net")
        self.assertEqual(r["stdout"].split(), ["lo"], r)
        r = self.run_cmd(sid, "python3 -c \"import socket\n"
                              "try:\n socket.create_connection(('192.0.2.1', 80), timeout=5)\n"
                              " print('connected')\nexcept OSError as e:\n print(e.errno)\"")
        self.assertEqual(r["stdout"].strip(), "101", r)  # ENETUNREACH
        r = self.run_cmd(sid, "curl -sS --noproxy '*' -m 10 http://192.0.2.1/; echo \" $?\"")
        self.assertNotEqual(r["stdout"].split()[-1], "0", r)

    def test_egress_allowed_and_audited(self):
        sid = self.create({"allow": ["127.0.0.1"]})
        env = self.run_cmd(sid, "echo $HTTPS_PROXY $http_proxy; cat /etc/resolv.conf")["stdout"]
        self.assertIn(PROXY + " " + PROXY, env)
        self.assertIn("nameserver 127.0.0.1", env)
        code, _, body, rc = self.curl(sid, "http://127.0.0.1:%d/hello" % self.P)
        self.assertEqual((code, rc), (200, 0), body)
        self.assertIn("hello /hello host=127.0.0.1:%d" % self.P, body)
        # A name the policy does not mention, resolving to the allowed address: plain and TLS.
        code, _, body, rc = self.curl(sid, "http://ok.test:%d/name" % self.P)
        self.assertEqual(code, 200, body)
        code, cc, body, rc = self.curl(sid, "https://ok.test:%d/tls" % self.TP)
        self.assertEqual((cc, code, rc), (200, 200, 0), body)
        self.assertIn("hello /tls host=ok.test:%d" % self.TP, body)
        # A request body goes up, the echo comes back.
        r = self.run_cmd(sid, "head -c 300000 /dev/zero | tr '\\0' x > /tmp/up;"
                              " curl -sS -m 30 --data-binary @/tmp/up http://127.0.0.1:%d/echo"
                              " | wc -c" % self.P)
        self.assertEqual(r["stdout"].strip(), "300000", r)
        # DNS through the proxy for names the policy allows.
        r = self.run_cmd(sid, "python3 -c \"import socket; print(socket.gethostbyname('ok.test'))\"")
        self.assertEqual(r["stdout"].strip(), "127.0.0.1", r)
        rows = self.audit_until(sid, lambda rows: len(rows) >= 5)
        kinds = {(e["kind"], e["host"], e["allowed"]) for e in rows}
        self.assertIn(("http", "127.0.0.1", True), kinds)
        self.assertIn(("connect", "ok.test", True), kinds)
        self.assertIn(("dns", "ok.test", True), kinds)
        tls = [e for e in rows if e["kind"] == "connect"][0]
        self.assertEqual((tls["port"], tls["address"]), (self.TP, "127.0.0.1"))
        self.assertGreater(tls["bytes_down"], 0)
        self.assertGreater(tls["bytes_up"], 0)
        echo = [e for e in rows if e["kind"] == "http" and e["bytes_up"] >= 300000]
        self.assertTrue(echo, rows)
        ids = [e["id"] for e in rows]
        self.assertEqual(ids, sorted(ids, reverse=True))  # newest first
        # Pagination with a cursor.
        p1 = self.audit(sid, limit=2)
        self.assertEqual(len(p1["entries"]), 2)
        self.assertIsNotNone(p1["next_cursor"])
        p2 = self.audit(sid, limit=2, cursor=p1["next_cursor"])
        self.assertLess(p2["entries"][0]["id"], p1["entries"][1]["id"])
        st, r = self.req("GET", "/v1/sandboxes/%s/egress?limit=0" % sid)
        self.assertEqual(st, 400, r)
        st, r = self.req("GET", "/v1/sandboxes/%s/egress?cursor=x" % sid)
        self.assertEqual(st, 400, r)

    def test_egress_denials(self):
        sid = self.create({"allow": ["127.0.0.1"],
                           "deny": ["blocked.test", "*.wild.test", "127.0.0.1:%d" % self.OP]})
        code, _, body, _ = self.curl(sid, "http://blocked.test:%d/" % self.P)
        self.assertEqual(code, 403)
        self.assertIn("denied by rule 'blocked.test'", body)
        code, _, body, _ = self.curl(sid, "http://a.wild.test:%d/" % self.P)
        self.assertEqual(code, 403)
        self.assertIn("'*.wild.test'", body)
        code, _, body, _ = self.curl(sid, "http://wild.test:%d/apex" % self.P)
        self.assertEqual(code, 200, body)  # the wildcard covers subdomains, not the apex
        # CONNECT: denied before any tunnel.
        code, cc, body, rc = self.curl(sid, "https://blocked.test:%d/" % self.TP)
        self.assertEqual(cc, 403)
        self.assertNotEqual(rc, 0)
        # A denied port, by CONNECT and plain HTTP.
        code, cc, body, rc = self.curl(sid, "https://127.0.0.1:%d/" % self.OP)
        self.assertEqual(cc, 403)
        code, _, body, _ = self.curl(sid, "http://127.0.0.1:%d/" % self.OP)
        self.assertEqual(code, 403)
        self.assertIn("127.0.0.1:%d" % self.OP, body)
        # The Host header must name the URI's host.
        code, _, body, _ = self.curl(sid, "http://ok.test:%d/" % self.P, "-H", "Host: blocked.test")
        self.assertEqual(code, 403)
        self.assertIn("Host header", body)
        # Deny wins over allow, by CIDR; the change applies to the next connection.
        st, pol = self.put_policy(sid, {"allow": ["127.0.0.1"], "deny": ["127.0.0.0/8"]})
        self.assertEqual(st, 200, pol)
        self.assertEqual(pol, {"internet": True, "allow": ["127.0.0.1"], "deny": ["127.0.0.0/8"]})
        code, _, body, _ = self.curl(sid, "http://127.0.0.1:%d/" % self.P)
        self.assertEqual(code, 403)
        self.assertIn("denied by rule '127.0.0.0/8'", body)
        st, pol = self.put_policy(sid, {"allow": ["127.0.0.1"]})
        self.assertEqual(st, 200, pol)
        code, _, body, _ = self.curl(sid, "http://127.0.0.1:%d/again" % self.P)
        self.assertEqual(code, 200, body)
        st, got = self.req("GET", "/v1/sandboxes/%s/egress/policy" % sid)
        self.assertEqual((st, got), (200, {"internet": True, "allow": ["127.0.0.1"], "deny": []}))
        # Bad policies are refused, naming the rule; the stored one is unchanged.
        st, r = self.put_policy(sid, {"allow": ["127.0.0.1", "10.0.0.1/8"]})
        self.assertEqual(st, 400, r)
        self.assertIn("allow[1] '10.0.0.1/8'", r["error"]["message"])
        st, r = self.put_policy(sid, {"allow": [], "bogus": 1})
        self.assertEqual(st, 400, r)
        st, got = self.req("GET", "/v1/sandboxes/%s/egress/policy" % sid)
        self.assertEqual(got["allow"], ["127.0.0.1"])
        rows = self.audit_until(sid, lambda rows: sum(not e["allowed"] for e in rows) >= 7)
        denied = [e for e in rows if not e["allowed"]]
        self.assertTrue(any(e["reason"] == "denied by rule 'blocked.test'" for e in denied), rows)
        self.assertTrue(any(e["kind"] == "connect" and e["host"] == "blocked.test"
                            for e in denied), rows)

    def test_egress_create_validation(self):
        st, r = self.req("POST", "/v1/sandboxes", {"template": "base",
                                                   "egress": {"deny": ["ok.test", "exa mple"]}})
        self.assertEqual(st, 400, r)
        self.assertIn("egress.deny[1] 'exa mple'", r["error"]["message"])
        st, r = self.req("POST", "/v1/sandboxes", {"template": "base", "egress": {"internet": 1}})
        self.assertEqual(st, 400, r)
        st, r = self.req("GET", "/v1/sandboxes/nosuchsandbox00000000/egress/policy")
        self.assertEqual(st, 404, r)

    def test_egress_internet_off(self):
        sid = self.create({"internet": False, "allow": ["127.0.0.1"]})
        code, _, body, _ = self.curl(sid, "http://127.0.0.1:%d/" % self.P)
        self.assertEqual(code, 200, body)  # an explicit allow still opens its destination
        code, _, body, _ = self.curl(sid, "http://ok.test:%d/" % self.P)
        self.assertEqual(code, 403)
        self.assertIn("internet access is off", body)
        code, cc, body, _ = self.curl(sid, "https://example.com/")
        self.assertEqual(cc, 403)
        r = self.run_cmd(sid, "python3 -c \"import socket; socket.gethostbyname('ok.test')\"")
        self.assertNotEqual(r["exit_code"], 0, r)  # NXDOMAIN for a name the policy denies
        st, got = self.req("GET", "/v1/sandboxes/%s/egress/policy" % sid)
        self.assertEqual(got, {"internet": False, "allow": ["127.0.0.1"], "deny": []})

    def test_egress_e2b_network_mapping(self):
        # E2B: denyOut ALL_TRAFFIC plus allowOut is "internet off, except these".
        body = {"templateID": "base", "timeout": 300, "allow_internet_access": True,
                "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["127.0.0.1", "*.ok.test"]}}
        st, r = self.req("POST", "/sandboxes", body, headers={"X-API-Key": self.s.key}, key="",
                         timeout=130 * MULT)
        self.assertEqual(st, 201, r)
        sid = r["sandboxID"]
        self.sandboxes.append(sid)
        st, got = self.req("GET", "/v1/sandboxes/%s/egress/policy" % sid)
        self.assertEqual(got, {"internet": False, "allow": ["127.0.0.1", "*.ok.test"], "deny": []})
        code, _, body, _ = self.curl(sid, "http://127.0.0.1:%d/" % self.P)
        self.assertEqual(code, 200, body)
        code, _, body, _ = self.curl(sid, "http://blocked.test:%d/" % self.P)
        self.assertEqual(code, 403, body)
        # A bad entry is a 400 naming it; allow_internet_access false alone turns it off.
        st, r = self.req("POST", "/sandboxes", {"templateID": "base", "network": {
            "allowOut": ["ok.test", "1.2.3.4/40"]}}, headers={"X-API-Key": self.s.key}, key="")
        self.assertEqual(st, 400, r)
        self.assertIn("network.allowOut[1] '1.2.3.4/40'", r["message"])
        st, r = self.req("POST", "/sandboxes", {"templateID": "base", "timeout": 300,
                                                "allow_internet_access": False},
                         headers={"X-API-Key": self.s.key}, key="", timeout=130 * MULT)
        self.assertEqual(st, 201, r)
        self.sandboxes.append(r["sandboxID"])
        st, got = self.req("GET", "/v1/sandboxes/%s/egress/policy" % r["sandboxID"])
        self.assertEqual(got, {"internet": False, "allow": [], "deny": []})

    def test_egress_dns_rebinding(self):
        # Allowed by name, resolving to loopback: the address check still denies it.
        sid = self.create({"allow": ["rebind.test"]})
        code, _, body, _ = self.curl(sid, "http://rebind.test:%d/" % self.P)
        self.assertEqual(code, 403)
        self.assertIn("rebind.test resolves only to denied addresses (loopback address)", body)
        code, cc, body, _ = self.curl(sid, "https://rebind.test:%d/" % self.TP)
        self.assertEqual(cc, 403)
        # DNS answers drop the address too.
        r = self.run_cmd(sid, "python3 -c \"import socket; print(socket.gethostbyname('rebind.test'))\"")
        self.assertNotEqual(r["exit_code"], 0, r)
        self.assertNotIn("127.0.0.1", r["stdout"])
        rows = self.audit_until(sid, lambda rows: any(e["kind"] == "dns" for e in rows))
        http = [e for e in rows if e["kind"] == "http" and e["host"] == "rebind.test"]
        self.assertTrue(http and not http[0]["allowed"], rows)
        self.assertEqual(http[0]["address"], "127.0.0.1")

    def test_egress_policy_change_closes_open_connections(self):
        sid = self.create({"allow": ["127.0.0.1"]})
        self.run_cmd(sid, "cat > /tmp/ka.py <<'EOF'\n%sEOF" % KEEPALIVE)
        out = {}
        t = threading.Thread(target=lambda: out.update(
            r=self.run_cmd(sid, "python3 /tmp/ka.py %d" % self.P)))
        t.start()
        deadline = time.time() + 60 * MULT
        while time.time() < deadline:
            if "up" in self.run_cmd(sid, "test -e /tmp/keepalive-up && echo up")["stdout"]:
                break
            time.sleep(0.5)
        st, pol = self.put_policy(sid, {"allow": ["127.0.0.1"], "deny": ["127.0.0.0/8"]})
        self.assertEqual(st, 200, pol)
        t.join(120 * MULT)
        self.assertFalse(t.is_alive())
        lines = out["r"]["stdout"].splitlines()
        self.assertEqual(lines[:2], ["connect HTTP/1.1 200 Connection established",
                                     "first True"], out)
        self.assertTrue(lines[2].startswith("after closed"), out)  # not a 60 s timeout
        rows = self.audit_until(sid, lambda rows: any(
            "policy changed" in (e["reason"] or "") for e in rows))
        self.assertTrue(any("policy changed: denied by rule '127.0.0.0/8'" == e["reason"]
                            for e in rows), rows)

    def test_egress_sni_must_match(self):
        sid = self.create({"allow": ["127.0.0.1"]})
        self.run_cmd(sid, "cat > /tmp/sni.py <<'EOF'\n%sEOF" % SNI)
        r = self.run_cmd(sid, "python3 /tmp/sni.py ok.test %d ok.test" % self.TP)
        self.assertEqual(r["stdout"].splitlines(), ["HTTP/1.1 200 Connection established",
                                                   "HTTP/1.1 200 OK"], r)
        r = self.run_cmd(sid, "python3 /tmp/sni.py ok.test %d evil.test" % self.TP)
        lines = r["stdout"].splitlines()
        self.assertEqual(lines[0], "HTTP/1.1 200 Connection established", r)
        self.assertTrue(lines[1].startswith("TLS failed"), r)
        rows = self.audit_until(sid, lambda rows: any(not e["allowed"] for e in rows))
        self.assertTrue(any("TLS server name 'evil.test'" in (e["reason"] or "") for e in rows),
                        rows)

    @unittest.skipUnless(LOAD, "SP_TEST_EGRESS_LOAD=0")
    def test_egress_load_does_not_stall_others(self):
        busy = self.create({"allow": ["127.0.0.1"]})
        quiet = self.create()
        self.run_cmd(busy, "cat > /tmp/many.py <<'EOF'\n%sEOF" % MANY)

        lat_cmd, lat_api = [], []
        stop = threading.Event()

        def probe():
            while not stop.is_set():
                t0 = time.time()
                st, r = self.req("POST", "/v1/sandboxes/%s/commands" % quiet, {"cmd": "echo ok"},
                                 timeout=120)
                lat_cmd.append(time.time() - t0)
                t0 = time.time()
                st2, _ = self.req("GET", "/v1/sandboxes/%s" % quiet)
                lat_api.append(time.time() - t0)
                assert st == 200 and r["stdout"] == "ok\n" and st2 == 200, (st, r, st2)
                time.sleep(0.2)

        base_cmd, base_api = [], []
        for _ in range(5):
            t0 = time.time()
            self.req("POST", "/v1/sandboxes/%s/commands" % quiet, {"cmd": "echo ok"})
            base_cmd.append(time.time() - t0)
            t0 = time.time()
            self.req("GET", "/v1/sandboxes/%s" % quiet)
            base_api.append(time.time() - t0)

        th = threading.Thread(target=probe, daemon=True)
        th.start()
        try:
            t0 = time.time()
            r = self.run_cmd(busy, "ulimit -n 8192; python3 /tmp/many.py 1000 %d" % self.P,
                             timeout=600)
            t_many = time.time() - t0
            ok = int(r["stdout"].strip() or 0)
            t0 = time.time()
            # A stall (under 64 KB/s for 60 s) fails here, with what the guest was doing,
            # rather than running into the test's timeout.
            r2 = self.run_cmd(busy, "curl -sS -m 1500 --speed-limit 65536 --speed-time 60"
                                    " -o /dev/null -w '%%{size_download}'"
                                    " http://127.0.0.1:%d/bytes/%d" % (self.P, 1 << 30),
                              timeout=1600)
            t_big = time.time() - t0
        finally:
            stop.set()
            th.join(timeout=180)
        if ok != 1000 or r2["stdout"].strip() != str(1 << 30):
            self.fail("1000 connections: %d ok (%s); 1 GiB: %s\n%s"
                      % (ok, r, r2, self.diagnose(busy)))

        def pct(xs, p):
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(len(xs) * p))]

        print("\n1000 connections at once: %.1f s; 1 GiB through the proxy: %.1f s (%.1f MB/s)"
              % (t_many, t_big, (1 << 30) / t_big / 1e6), file=sys.stderr)
        print("other sandbox's command: idle median %.0f ms; under load median %.0f ms, p99 %.0f ms,"
              " max %.0f ms (%d samples)" % (statistics.median(base_cmd) * 1e3,
                                              statistics.median(lat_cmd) * 1e3,
                                              pct(lat_cmd, 0.99) * 1e3, max(lat_cmd) * 1e3,
                                              len(lat_cmd)), file=sys.stderr)
        print("API GET: idle median %.1f ms; under load median %.1f ms, p99 %.1f ms, max %.1f ms"
              % (statistics.median(base_api) * 1e3, statistics.median(lat_api) * 1e3,
                 pct(lat_api, 0.99) * 1e3, max(lat_api) * 1e3), file=sys.stderr)
        self.assertGreater(len(lat_cmd), 5)
        # Not stalled: the other sandbox and the API keep answering throughout.
        self.assertLess(max(lat_api), 2.0 * MULT)
        self.assertLess(max(lat_cmd), 10.0 * MULT)
        st, _ = self.req("GET", "/v1/sandboxes/%s/egress?limit=5" % busy)
        self.assertEqual(st, 200)


    def test_egress_flood_memory_bounded(self):
        # 2,000 connections at once from one guest, again and again for a minute and a half,
        # each a CONNECT to a port that never completes a connection with 256 KiB pushed after
        # it: before the budget, spaced held each connection's whole first window (256 KiB)
        # until its connect timeout, up to 500 MiB for this guest alone; now 16 KiB, charged,
        # and another sandbox's egress keeps working throughout.
        # The flooding sandbox has 512 MiB: its 2,000 sockets' buffers count against the
        # command's own memory limit in the guest (agent/cgroup.c), which in 256 MiB is about
        # 135 MiB and which the flood met at times (exit 137): this is about the host's budget.
        hole = Blackhole()
        try:
            busy = self.create({"allow": ["127.0.0.1"]}, memory_mb=512)
            quiet = self.create({"allow": ["127.0.0.1"]})
            self.run_cmd(busy, "cat > /tmp/flood.py <<'EOF'\n%sEOF" % FLOOD)
            self.run_cmd(quiet, "true")
            rss0 = self.s.rss_kb()
            peak = rss0
            out = {}

            def flood():
                try:
                    out["r"] = self.run_cmd(busy, "ulimit -n 8192; python3 /tmp/flood.py 2000"
                                                  " %d %d %d" % (hole.port, 256 << 10,
                                                                 int(90 * MULT)), timeout=400)
                except BaseException as e:  # reported below with the guest's state
                    out["r"] = {"error": repr(e)}

            th = threading.Thread(target=flood, daemon=True)
            th.start()
            quiet_ok, quiet_ms = 0, []
            while th.is_alive():
                peak = max(peak, self.s.rss_kb())
                t0 = time.time()
                code, _, body, rc = self.curl(quiet, "http://127.0.0.1:%d/quiet" % self.P)
                quiet_ms.append((time.time() - t0) * 1e3)
                quiet_ok += code == 200 and "/quiet" in body
                peak = max(peak, self.s.rss_kb())
                th.join(timeout=1)
            r = out.get("r") or {}
            lines = (r.get("stdout") or "").strip().splitlines()
            if not lines:
                # The flood printed nothing: say how it ended and what the guest was doing.
                self.fail("flood gave no result: %s, exit %s, stderr %r; %s"
                          % (r.get("error", "ran"), r.get("exit_code"),
                             (r.get("stderr") or "")[-1500:], self.diagnose(busy)))
            res = json.loads(lines[-1])
        finally:
            hole.close()
        grown = (peak - rss0) // 1024
        print("\nflood: %s; spaced RSS %d MiB before, +%d MiB at peak; the other sandbox: %d of"
              " %d requests answered, median %.0f ms" % (res, rss0 // 1024, grown, quiet_ok,
                                                        len(quiet_ms),
                                                        statistics.median(quiet_ms)),
              file=sys.stderr)
        # The connections reached the proxy and waited there for their connect timeout (under
        # TCG the guest does not always manage to open all 2,000 at once; those it cannot are
        # counted as "open ...").
        self.assertGreater(res.get("504", 0), 0, res)
        self.assertNotIn("200", res)
        self.assertGreater(quiet_ok, 0)
        self.assertEqual(quiet_ok, len(quiet_ms))
        # 2,000 first windows of 16 KiB and their records (40 MiB), and what the allocator and
        # ASan (quarantine cut to 8 MiB for this class) add around them.
        self.assertLess(grown, 100, res)
        code, _, body, _ = self.curl(busy, "http://127.0.0.1:%d/after" % self.P)
        self.assertEqual(code, 200, body)


class RawUpstream:
    """A TCP server that records what each connection sent and answers with a script:
    "fixed" reads one request (head and Content-Length or chunked body) and answers 200 and
    closes; "echo101" answers 101 and then echoes."""

    def __init__(self, family=socket.AF_INET, host="127.0.0.1"):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.got = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        c.settimeout(10)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                d = c.recv(65536)
                if not d:
                    break
                data += d
            head = data.split(b"\r\n\r\n")[0].lower()
            if b"upgrade: websocket" in head:
                c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                          b"Connection: Upgrade\r\n\r\n")
                while True:
                    d = c.recv(65536)
                    if not d:
                        break
                    c.sendall(d)
            else:
                # Read until the body is complete (good enough for the test's bodies).
                end = time.time() + 2
                c.settimeout(0.5)
                while time.time() < end and not self._complete(data):
                    try:
                        d = c.recv(65536)
                    except socket.timeout:
                        continue
                    if not d:
                        break
                    data += d
                time.sleep(0.3)  # anything pipelined after it would arrive now
                c.setblocking(False)
                try:
                    d = c.recv(65536)
                    data += d or b""
                except (BlockingIOError, OSError):
                    pass
                c.setblocking(True)
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        except OSError:
            pass
        finally:
            with self.lock:
                self.got.append(data)
            c.close()

    @staticmethod
    def _complete(data):
        head, _, body = data.partition(b"\r\n\r\n")
        h = head.lower()
        if b"transfer-encoding: chunked" in h:  # a last chunk, then trailers and a blank line
            return body.endswith(b"\r\n\r\n") and b"\n0\r\n" in b"\n" + body
        for line in h.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                return len(body) >= int(line.split(b":")[1])
        return True

    def close(self):
        self.sock.close()


def proxy_skip_reason():
    if pg_bindir() is None:
        return "PostgreSQL is not installed"
    if not SPACED_TEST or not os.path.exists(SPACED_TEST):
        return "SPACED_TEST is not built"
    if not os.environ.get("SPACE_FAKE_AGENT"):
        return "SPACE_FAKE_AGENT (space-agent-host) is not set"
    return None


@unittest.skipIf(proxy_skip_reason(), proxy_skip_reason())
class ProxyProtocolTest(unittest.TestCase):
    """The proxy's request handling byte for byte, without VMs: the test driver's agent runs
    on the host (space-agent-host), so its proxy port is a host port this test talks to as a
    guest program would."""

    @classmethod
    def setUpClass(cls):
        cls.up = RawUpstream()
        cls.pport = free_port()
        cls.p = Platform(teams=(None,), binary=SPACED_TEST, runtime="test",
                         env={"SPACE_FAKE_AGENT": os.environ["SPACE_FAKE_AGENT"],
                              "SPACE_FAKE_DELAY_MS": "10",
                              "SPACE_TEST_EGRESS_PORT": str(cls.pport),
                              "SPACE_TEST_EGRESS_NO_DNS": "1"})
        cls.s, cls.pg = cls.p.s, cls.p.pg
        st, r = cls.s.request("POST", "/v1/sandboxes?wait=30",
                              {"template": "base", "egress": {"allow": ["127.0.0.1", "::1"]}})
        assert st == 200 and r["operation"]["status"] == "succeeded", r
        cls.sid = r["sandbox"]["id"]
        deadline = time.time() + 10 * MULT
        while time.time() < deadline:  # the agent listens once EGRESS_CONFIG arrived
            try:
                socket.create_connection(("127.0.0.1", cls.pport), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()
        cls.up.close()

    def exchange(self, data, read_timeout=10):
        """Sends data to the proxy port; returns everything read until the proxy closes."""
        c = socket.create_connection(("127.0.0.1", self.pport), timeout=read_timeout * MULT)
        c.sendall(data)
        out = b""
        while True:
            try:
                d = c.recv(65536)
            except socket.timeout:
                break
            if not d:
                break
            out += d
        c.close()
        return out

    def last_upstream(self, before):
        deadline = time.time() + 5 * MULT
        while time.time() < deadline:
            with self.up.lock:
                if len(self.up.got) > before:
                    return self.up.got[-1]
            time.sleep(0.02)
        self.fail("nothing reached the upstream")

    def status(self, data):
        return self.exchange(data).split(b"\r\n")[0].decode()

    def test_proxy_rewrites_to_origin_form(self):
        n = len(self.up.got)
        P = self.up.port
        req = (b"GET http://127.0.0.1:%d/a/b?q=1#frag HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
               b"Proxy-Connection: keep-alive\r\nProxy-Authorization: Basic eA==\r\n"
               b"Keep-Alive: 5\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nX-Keep: 2\r\n\r\n"
               % (P, P))
        out = self.exchange(req)
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK"), out)
        got = self.last_upstream(n).decode()
        lines = got.split("\r\n")
        self.assertEqual(lines[0], "GET /a/b?q=1 HTTP/1.1")
        self.assertIn("Host: 127.0.0.1:%d" % P, lines)
        self.assertIn("X-Keep: 2", lines)
        self.assertIn("Connection: close", lines)
        for gone in ("Proxy-Connection", "Proxy-Authorization", "Keep-Alive", "X-Hop",
                     "Connection: keep-alive"):
            self.assertFalse(any(l.startswith(gone) for l in lines), (gone, got))
        # No Host header: the URI's host is sent; HTTP/1.0 stays 1.0; no path becomes "/".
        n = len(self.up.got)
        out = self.exchange(b"GET http://127.0.0.1:%d HTTP/1.0\r\n\r\n" % P)
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK"), out)
        lines = self.last_upstream(n).decode().split("\r\n")
        self.assertEqual(lines[0], "GET / HTTP/1.0")
        self.assertIn("Host: 127.0.0.1:%d" % P, lines)

    def test_proxy_forwards_bodies_and_drops_pipelined_requests(self):
        P = self.up.port
        n = len(self.up.got)
        body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nTrailer: x\r\n\r\n"
        second = b"GET http://127.0.0.1:%d/second HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (P, P)
        out = self.exchange(b"POST http://127.0.0.1:%d/chunked HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n" % (P, P) + body + second)
        self.assertEqual(out.count(b"HTTP/1.1 "), 1, out)
        got = self.last_upstream(n)
        self.assertTrue(got.endswith(b"\r\n\r\n" + body), got)
        self.assertNotIn(b"/second", got)  # never reaches the upstream
        n = len(self.up.got)
        out = self.exchange(b"PUT http://127.0.0.1:%d/len HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                            b"Content-Length: 5\r\n\r\nabcde" % (P, P) + second)
        got = self.last_upstream(n)
        self.assertTrue(got.endswith(b"\r\n\r\nabcde"), got)
        self.assertNotIn(b"/second", got)

    def test_proxy_refuses_bad_requests(self):
        P = self.up.port
        cases = [
            (b"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 400"),
            (b"GET https://127.0.0.1:%d/ HTTP/1.1\r\n\r\n" % P, "HTTP/1.1 400"),
            (b"GET ftp://127.0.0.1/ HTTP/1.1\r\n\r\n", "HTTP/1.1 400"),
            (b"GET http://127.0.0.1:%d/ HTTP/2.0\r\n\r\n" % P, "HTTP/1.1 505"),
            (b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nContent-Length: 1\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n" % P, "HTTP/1.1 400"),
            (b"POST http://127.0.0.1:%d/ HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n" % P,
             "HTTP/1.1 501"),
            (b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
             % P, "HTTP/1.1 400"),
            (b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n" % P,
             "HTTP/1.1 400"),
            (b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nX: a\r\n folded\r\n\r\n" % P, "HTTP/1.1 400"),
            (b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n" % P,
             "HTTP/1.1 403"),
            (b"GET http://user@127.0.0.1:%d/ HTTP/1.1\r\n\r\n" % P, "HTTP/1.1 400"),
            (b"GET http://127.1:%d/ HTTP/1.1\r\n\r\n" % P, "HTTP/1.1 400"),
            (b"GET http://127.0.0.1:0/ HTTP/1.1\r\n\r\n", "HTTP/1.1 400"),
            (b"CONNECT 127.0.0.1 HTTP/1.1\r\n\r\n", "HTTP/1.1 400"),
            (b"CONNECT 127.0.0.1:99999 HTTP/1.1\r\n\r\n", "HTTP/1.1 400"),
            (b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nX: " % P + b"a" * 20000 + b"\r\n\r\n",
             "HTTP/1.1 431"),
            (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", "HTTP/1.1 400"),
        ]
        n = len(self.up.got)
        for req, want in cases:
            got = self.status(req)
            self.assertTrue(got.startswith(want), (req[:80], got, want))
        time.sleep(0.3)
        self.assertEqual(len(self.up.got), n)  # none of them reached the upstream
        # A denied destination: 403 with the reason, and nothing upstream.
        out = self.exchange(b"GET http://10.1.2.3:%d/ HTTP/1.1\r\n\r\n" % P)
        self.assertTrue(out.startswith(b"HTTP/1.1 403 Forbidden"), out)
        self.assertIn(b"X-Space-Egress: denied", out)
        self.assertIn(b"private address", out)

    def test_proxy_tunnels(self):
        P = self.up.port
        # Upgrade passes through as a tunnel after the head.
        c = socket.create_connection(("127.0.0.1", self.pport), timeout=10 * MULT)
        c.sendall(b"GET http://127.0.0.1:%d/ws HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                  b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n" % (P, P))
        head = b""
        while b"\r\n\r\n" not in head:
            head += c.recv(4096)
        self.assertTrue(head.startswith(b"HTTP/1.1 101"), head)
        c.sendall(b"ping")
        self.assertEqual(c.recv(4096), b"ping")
        c.close()
        # CONNECT: a raw tunnel; non-TLS bytes are passed as they are.
        c = socket.create_connection(("127.0.0.1", self.pport), timeout=10 * MULT)
        c.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\n\r\n" % P)
        head = b""
        while b"\r\n\r\n" not in head:
            head += c.recv(4096)
        self.assertEqual(head, b"HTTP/1.1 200 Connection established\r\n\r\n")
        n = len(self.up.got)
        c.sendall(b"GET /inner HTTP/1.1\r\nHost: x\r\n\r\n")
        out = b""
        while True:
            d = c.recv(4096)
            if not d:
                break
            out += d
        c.close()
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK"), out)
        self.assertTrue(self.last_upstream(n).startswith(b"GET /inner HTTP/1.1"))
        # IPv6 literals, where the host has ::1.
        try:
            up6 = RawUpstream(socket.AF_INET6, "::1")
        except OSError:
            return
        try:
            out = self.exchange(b"GET http://[::1]:%d/v6 HTTP/1.1\r\nHost: [::1]:%d\r\n\r\n"
                                % (up6.port, up6.port))
            self.assertTrue(out.startswith(b"HTTP/1.1 200 OK"), out)
        finally:
            up6.close()

    def test_proxy_audit_and_closed_guest(self):
        # A guest that connects and leaves without a word, and one that stops mid-head: closed
        # quietly; the proxy carries on.
        socket.create_connection(("127.0.0.1", self.pport)).close()
        c = socket.create_connection(("127.0.0.1", self.pport))
        c.sendall(b"GET http://127.0.0.1:1/ HTT")
        c.close()
        out = self.exchange(b"GET http://192.168.7.7:81/audit HTTP/1.1\r\n\r\n")
        self.assertTrue(out.startswith(b"HTTP/1.1 403"), out)
        deadline = time.time() + 5 * MULT
        while True:
            st, r = self.s.request("GET", "/v1/sandboxes/%s/egress?limit=1000" % self.sid)
            self.assertEqual(st, 200, r)
            rows = [e for e in r["entries"] if e["host"] == "192.168.7.7"]
            if rows or time.time() > deadline:
                break
            time.sleep(0.1)
        self.assertTrue(rows, r)
        self.assertEqual((rows[0]["kind"], rows[0]["port"], rows[0]["allowed"], rows[0]["reason"]),
                         ("http", 81, False, "private address"))


def scrape(port):
    """{(name, labels text): value} from spaced's /metrics."""
    import urllib.request
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=30 * MULT) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


@unittest.skipIf(proxy_skip_reason(), proxy_skip_reason())
class EgressFloodHostTest(unittest.TestCase):
    """An egress connection flood without VMs (the test driver's agent on this host, as in
    ProxyProtocolTest): 2,000 connections each pushing 256 KiB toward an upstream that never
    reads. spaced holds no more than its egress budget (--egress-memory-mb 64 here) for them:
    the connections past it are answered 503 or wait for credit, spaced's RSS stays near the
    budget, the books balance back to zero when the flood ends, and the proxy works after."""

    N = 2000
    SIZE = 256 << 10
    LIMIT_MB = 64

    @classmethod
    def setUpClass(cls):
        raise_nofile()
        cls.up = RawUpstream()
        cls.pport = free_port()
        cls.mport = free_port()
        asan = os.environ.get("ASAN_OPTIONS", "") + ":quarantine_size_mb=8"
        cls.p = Platform(teams=(None,), binary=SPACED_TEST, runtime="test",
                         env={"SPACE_FAKE_AGENT": os.environ["SPACE_FAKE_AGENT"],
                              "SPACE_FAKE_DELAY_MS": "10", "ASAN_OPTIONS": asan,
                              "SPACE_TEST_EGRESS_PORT": str(cls.pport),
                              "SPACE_TEST_EGRESS_NO_DNS": "1"},
                         args=["--egress-memory-mb", str(cls.LIMIT_MB),
                               "--metrics-listen", "127.0.0.1:%d" % cls.mport])
        cls.s = cls.p.s
        st, r = cls.s.request("POST", "/v1/sandboxes?wait=30",
                              {"template": "base", "egress": {"allow": ["127.0.0.1"]}})
        assert st == 200 and r["operation"]["status"] == "succeeded", r
        deadline = time.time() + 10 * MULT
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", cls.pport), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()
        cls.up.close()

    def mem(self):
        m = scrape(self.mport)
        return (m.get('space_egress_memory_bytes{kind="used"}', -1),
                m.get('space_egress_memory_bytes{kind="limit"}', -1))

    def get_ok(self):
        c = socket.create_connection(("127.0.0.1", self.pport), timeout=30 * MULT)
        c.sendall(b"GET http://127.0.0.1:%d/x HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n"
                  % (self.up.port, self.up.port))
        out = b""
        while True:
            d = c.recv(65536)
            if not d:
                break
            out += d
        c.close()
        return out.startswith(b"HTTP/1.1 200")

    def flood(self, port):
        """N connections to the proxy, each a CONNECT to port followed by SIZE bytes, pushed
        until nothing moves for 3 s, then held 4 s more; returns ({answer: count}, MiB pushed,
        the most of the budget used, spaced's RSS growth at the peak in MiB). Closes them
        all."""
        sel = selectors.DefaultSelector()
        socks = []
        head = b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (port, port)
        chunk = b"x" * 65536
        rss0 = self.s.rss_kb()
        peak_rss = rss0
        answers = {}
        try:
            for i in range(self.N):
                c = socket.create_connection(("127.0.0.1", self.pport), timeout=10)
                c.setblocking(False)
                c.send(head)
                st = {"sock": c, "left": self.SIZE, "resp": b""}
                socks.append(st)
                sel.register(c, selectors.EVENT_READ | selectors.EVENT_WRITE, st)
            idle_since = time.time()
            while time.time() - idle_since < 3:
                moved = False
                for key, ev in sel.select(timeout=0.2):
                    st = key.data
                    c = st["sock"]
                    if ev & selectors.EVENT_READ:
                        try:
                            d = c.recv(4096)
                        except OSError as e:
                            d, st["err"] = b"", type(e).__name__
                        st["resp"] += d
                        if not d:
                            sel.unregister(c)
                            continue
                    if ev & selectors.EVENT_WRITE and st["left"] > 0:
                        try:
                            n = c.send(chunk[:min(len(chunk), st["left"])])
                        except BlockingIOError:
                            n = 0
                        except OSError as e:
                            n, st["err"], st["left"] = 0, type(e).__name__, 0
                        st["left"] -= n
                        moved |= n > 0
                    if st["left"] == 0 and not (ev & selectors.EVENT_READ):
                        sel.modify(c, selectors.EVENT_READ, st)
                if moved:
                    idle_since = time.time()
                peak_rss = max(peak_rss, self.s.rss_kb())
            # What the kernel took from us the agent may still be passing on: watch a while.
            used = 0
            for _ in range(20):
                used = max(used, self.mem()[0])
                peak_rss = max(peak_rss, self.s.rss_kb())
                time.sleep(0.2)
            peak_rss = max(peak_rss, self.s.rss_kb())
            for st in socks:
                r = st["resp"]
                k = r.split(b" ")[1].decode() if r.startswith(b"HTTP/") else st.get("err", "wait")
                answers[k] = answers.get(k, 0) + 1
            pushed = sum(self.SIZE - st["left"] for st in socks) >> 20
        finally:
            for st in socks:
                st["sock"].close()
            sel.close()
        grown = (peak_rss - rss0) // 1024
        print("\nflood: %s; pushed %d MiB; budget used %d MiB of %d; spaced RSS %d MiB before,"
              " +%d MiB at peak" % (answers, pushed, used // (1 << 20), self.LIMIT_MB,
                                    rss0 // 1024, grown), file=sys.stderr)
        return answers, pushed, used, grown

    def settled(self, used0):
        """Every charge comes back once the connections are gone; then the proxy works."""
        deadline = time.time() + 10 * MULT
        while self.mem()[0] != used0 and time.time() < deadline:
            time.sleep(0.1)
        self.assertEqual(self.mem()[0], used0)
        self.assertTrue(self.get_ok())

    def flood_against(self, upstream):
        """A flood at a new upstream of class upstream (proxy working, budget as configured
        first): the budget's use before it, and what flood() measured."""
        self.assertTrue(self.get_ok())
        used0, limit = self.mem()
        self.assertEqual(limit, self.LIMIT_MB << 20)
        server = upstream()
        try:
            return used0, self.flood(server.port)
        finally:
            server.close()

    def test_flood_of_connections_that_never_complete(self):
        # The destination never completes the connection: each waits for its connect
        # timeout with what the guest sent after the CONNECT in the proxy. Only the first
        # window (16 KiB) may be sent before the connection is up: about 40 MiB for 2,000
        # (before the budget: their 256 KiB first windows, 500 MiB).
        used0, (answers, pushed, used, grown) = self.flood_against(Blackhole)
        self.assertNotIn("200", answers)
        self.assertLessEqual(used, self.N * (4096 + 16384) + used0)
        self.assertLess(grown, self.LIMIT_MB, answers)
        self.settled(used0)

    def test_flood_stays_within_the_budget(self):
        # The destination takes the connections and never reads: the connections that are up
        # get their full windows until the sandbox's share is used (all but the quarter kept
        # for first windows), later ones a first window until the share is full, the rest 503.
        used0, (answers, pushed, used, grown) = self.flood_against(SlowUpstream)
        self.assertEqual(sum(answers.values()), self.N)
        self.assertGreater(answers.get("200", 0), 100, answers)
        self.assertGreater(answers.get("503", 0), 0, answers)  # the budget refused some
        self.assertLessEqual(used, self.LIMIT_MB << 20)
        self.assertGreater(used, (self.LIMIT_MB << 20) // 2)
        self.assertLess(grown, self.LIMIT_MB + 32, answers)
        log = self.s.read_log()
        self.assertTrue("egress memory share used" in log or
                        "egress memory limit reached" in log, log[-2000:])
        self.settled(used0)

if __name__ == "__main__":
    if skip_reason() and proxy_skip_reason():
        print("skipped:", skip_reason(), "/", proxy_skip_reason())
        sys.exit(77)
    unittest.main(verbosity=2)
