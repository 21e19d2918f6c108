"""Request bodies (http/bodygate.h, server.c's body policy), against a real PostgreSQL and
spaced-test: a large body without a key is refused on its head, quickly, and spaced's memory
does not grow by it; oversized JSON bodies get 413 with a clear error on both APIs; an upload
with a key goes on; keep-alive does not get a request past the gate; the bound on large bodies
at once answers 503; a chunked body to a JSON route is stopped past the cap; the gate reads
every head as h2o does (its parser, the last Host), and fails closed on folded lines."""
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, skip_unless_pg  # noqa: E402

MIB = 1 << 20


_left = {}  # bytes read past a response, by socket (pipelined responses)


def read_response(sock, timeout=10):
    """One HTTP/1 response from sock: (status, headers dict, body bytes)."""
    sock.settimeout(timeout * MULT)
    data = _left.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("connection closed before a response: %r" % data)
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    def more():
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("connection closed inside a response")
        return chunk

    if hdrs.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += more()
            line, rest = rest.split(b"\r\n", 1)
            n = int(line.split(b";")[0], 16)
            while len(rest) < n + 2:
                rest += more()
            body += rest[:n]
            rest = rest[n + 2:]
            if n == 0:
                _left[sock] = rest
                return status, hdrs, body
    if "content-length" not in hdrs:  # the body runs to the close
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            rest += chunk
        return status, hdrs, rest
    n = int(hdrs["content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    _left[sock] = rest[n:]
    return status, hdrs, rest[:n]


@skip_unless_pg
class BodiesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=("alpha",), runtime="test",
                         args=["--max-large-bodies", "1", "--max-body-kb", "1024"])
        cls.s = cls.p.s

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    def conn(self):
        return socket.create_connection(("127.0.0.1", self.s.port), timeout=10 * MULT)

    def head(self, method, path, length=None, headers=(), chunked=False):
        h = ["%s %s HTTP/1.1" % (method, path), "Host: 127.0.0.1:%d" % self.s.port]
        if chunked:
            h.append("Transfer-Encoding: chunked")
        elif length is not None:
            h.append("Content-Length: %d" % length)
        h += list(headers)
        return ("\r\n".join(h) + "\r\n\r\n").encode()

    def refused_on_head(self, method, path, length, headers=()):
        """Sends only the head of a length-byte request (and a first 1 MiB of its body): the
        response, which must come without the rest of the body."""
        c = self.conn()
        try:
            t0 = time.time()
            # The head alone: the answer comes without the body. (A client that sends on may
            # see a reset instead: h2o 2.2.5 closes without draining, as for its own 413.)
            c.sendall(self.head(method, path, length, headers))
            st, hdrs, body = read_response(c)
            self.assertLess(time.time() - t0, 5 * MULT)
            # The rest of the body is read and dropped (so that a client that sends it all
            # first still gets the answer), never kept.
            try:
                for _ in range(length // MIB):
                    c.sendall(b"x" * MIB)
            except OSError:
                pass
            return st, hdrs, body
        finally:
            c.close()

    def test_large_body_without_key_refused_on_head_rss_flat(self):
        rss0 = self.s.rss_kb()
        for _ in range(3):
            st, _, body = self.refused_on_head("PUT", "/v1/template-files/" + "a" * 64, 50 * MIB)
            self.assertEqual(st, 401, body)
            err = json.loads(body)["error"]
            self.assertIn("missing API key", err["message"])
            # E2B: its template files upload without its token or key
            st, _, body = self.refused_on_head("PUT", "/upload/template-files/" + "a" * 64,
                                               50 * MIB)
            self.assertEqual(st, 401, body)
            self.assertEqual(json.loads(body)["code"], 401)
        # Six 50 MiB bodies were sent: 300 MiB had they been kept; a few MiB of noise is allowed.
        self.assertLess(self.s.rss_kb() - rss0, 30 * 1024)

    def test_oversized_json_is_413_on_both_apis(self):
        st, _, body = self.refused_on_head("POST", "/v1/sandboxes", 2 * MIB,
                                           ["Authorization: Bearer " + self.s.key,
                                            "Content-Type: application/json"])
        self.assertEqual(st, 413, body)
        self.assertEqual(json.loads(body)["error"]["code"], "payload_too_large")
        self.assertIn("larger than 1024 KiB", json.loads(body)["error"]["message"])
        st, _, body = self.refused_on_head("POST", "/sandboxes", 2 * MIB,
                                           ["X-API-Key: " + self.s.key,
                                            "Content-Type: application/json"])
        self.assertEqual(st, 413, body)
        self.assertEqual(json.loads(body)["code"], 413)
        self.assertIn("larger than 1024 KiB", json.loads(body)["message"])
        # at the cap: the route's own answer (a bad template), not the gate's
        st, r = self.s.request("POST", "/v1/sandboxes", raw=b" " * (1024 * 1024 - 2) + b"{}",
                               headers={"Content-Type": "application/json"})
        self.assertNotEqual(st, 413, r)

    def test_upload_with_key_goes_on(self):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            payload = os.urandom(3 * MIB)
            ti = tarfile.TarInfo("big.bin")
            ti.size = len(payload)
            tf.addfile(ti, io.BytesIO(payload))
        data = buf.getvalue()
        sha = hashlib.sha256(data).hexdigest()
        st, r = self.s.request("PUT", "/v1/template-files/" + sha, raw=data,
                               headers={"Content-Type": "application/octet-stream"})
        self.assertIn(st, (200, 201), r)
        st, r = self.s.request("GET", "/v1/template-files/" + sha)
        self.assertEqual(st, 200, r)

    def test_keep_alive_does_not_pass_the_gate(self):
        c = self.conn()
        try:
            c.sendall(self.head("GET", "/healthz"))
            st, hdrs, _ = read_response(c)
            self.assertEqual(st, 200)
            self.assertNotEqual(hdrs.get("connection"), "close")
            # the second request on the connection is vetted like the first
            c.sendall(self.head("PUT", "/v1/template-files/" + "b" * 64, 50 * MIB))
            st, _, body = read_response(c)
            self.assertEqual(st, 401, body)
            # and one pipelined behind a small one
        finally:
            c.close()
        c = self.conn()
        try:
            c.sendall(self.head("GET", "/healthz") +
                      self.head("PUT", "/v1/template-files/" + "c" * 64, 50 * MIB))
            st, _, _ = read_response(c)
            self.assertEqual(st, 200)
            st, _, body = read_response(c)
            self.assertEqual(st, 401, body)
        finally:
            c.close()

    def test_large_bodies_at_once_are_bounded(self):
        hold = self.conn()
        try:
            # one upload in progress (a valid key; its body comes slowly)
            hold.sendall(self.head("PUT", "/v1/template-files/" + "d" * 64, 8 * MIB,
                                   ["Authorization: Bearer " + self.s.key]))
            hold.sendall(b"x" * 1024)
            time.sleep(0.3 * MULT)
            st, _, body = self.refused_on_head("PUT", "/v1/template-files/" + "e" * 64, 8 * MIB,
                                               ["Authorization: Bearer " + self.s.key])
            self.assertEqual(st, 503, body)
            self.assertIn("too many large request bodies", json.loads(body)["error"]["message"])
        finally:
            hold.close()
        # the place is free again once that connection is gone
        deadline = time.time() + 5 * MULT
        while True:
            st, r = self.s.request("PUT", "/v1/template-files/" + "f" * 64, raw=b"y" * (2 * MIB))
            if st != 503 or time.time() > deadline:
                break
            time.sleep(0.1)
        self.assertNotEqual(st, 503, r)

    def test_duplicate_host_read_as_h2o_reads_it(self):
        # h2o routes by the last Host field: the gate vets by it too. The first names a
        # sandbox's guest port (large bodies go on there, counted); the last, the API, whose
        # JSON route caps the body: refused on the head, never read.
        domain = self.s.env.get("SPACE_E2B_DOMAIN") or "space.localhost:%d" % self.s.port
        c = self.conn()
        try:
            c.sendall(("POST /v1/sandboxes HTTP/1.1\r\n"
                       "Host: 8080-%s.%s\r\n"
                       "Host: 127.0.0.1:%d\r\n"
                       "Authorization: Bearer %s\r\n"
                       "Content-Length: %d\r\n\r\n"
                       % ("a" * 20, domain, self.s.port, self.s.key, 50 * MIB)).encode())
            st, _, body = read_response(c)
            self.assertEqual(st, 413, body)
            self.assertEqual(json.loads(body)["error"]["code"], "payload_too_large")
        finally:
            c.close()

    def test_heads_h2o_reads_the_gate_reads(self):
        # The gate parses heads with h2o's own parser: a head past 8 KiB (up to h2o's
        # H2O_MAX_REQLEN) and an HTTP/1.x minor version h2o reads as 1.1 are answered, not cut.
        for head in (self.head("GET", "/healthz", headers=["X-Pad: " + "p" * (64 * 1024)]),
                     b"GET /healthz HTTP/1.5\r\nHost: 127.0.0.1\r\n\r\n"):
            c = self.conn()
            try:
                c.sendall(head)
                st, _, body = read_response(c)
                self.assertEqual(st, 200, body)
            finally:
                c.close()
        # A folded field line, which h2o 2.2.5 keeps as a field without a name: the gate
        # fails closed (the connection ends with no answer from a route).
        c = self.conn()
        try:
            c.sendall(b"PUT /v1/template-files/" + b"g" * 64 + b" HTTP/1.1\r\n"
                      b"Host: 127.0.0.1\r\nX-A: b\r\n c\r\n"
                      b"Content-Length: 52428800\r\n\r\n")
            c.settimeout(10 * MULT)
            data = b""
            try:
                while True:
                    chunk = c.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except OSError:
                pass
            self.assertFalse(data.startswith(b"HTTP/1.1 2"), data)
            self.assertNotIn(b"missing API key", data)
        finally:
            c.close()

    def test_chunked_json_body_stopped_past_cap(self):
        c = self.conn()
        try:
            c.sendall(self.head("POST", "/v1/sandboxes", chunked=True,
                                headers=["Authorization: Bearer " + self.s.key]))
            chunk = b"%x\r\n%s\r\n" % (256 * 1024, b" " * (256 * 1024))
            try:
                for _ in range(40):  # 10 MiB, far past the 1 MiB cap
                    c.sendall(chunk)
            except OSError:
                pass
            st, _, _ = read_response(c)
            self.assertEqual(st, 413)
        finally:
            c.close()


@skip_unless_pg
@unittest.skipUnless(shutil.which("curl") and "HTTP2" in subprocess.run(
    ["curl", "--version"], capture_output=True, text=True).stdout, "no curl with HTTP/2")
class Http2BodiesTest(unittest.TestCase):
    """HTTP/2 bodies (README: Request bodies): h2o decodes HTTP/2 frames itself and reads a
    stream's whole body before any handler, so the gate cannot see an HTTP/2 head first. What
    holds there: --max-upload-mb (h2o's own limit) per stream, then the route's own refusal.
    Checked with a real HTTP/2 client (curl, prior knowledge on the plain port)."""
    CAP = 16  # --max-upload-mb

    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=("alpha",), runtime="test", args=["--max-upload-mb", str(cls.CAP)])
        cls.s = cls.p.s

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    def post(self, path, mib, key=None):
        """POST mib MiB over h2c: (status, HTTP version, bytes sent)."""
        with tempfile.NamedTemporaryFile() as f:
            f.truncate(mib * MIB)
            argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{http_version} "
                    "%{size_upload}", "--http2-prior-knowledge", "-X", "POST", "--data-binary",
                    "@" + f.name, "-H", "Content-Type: application/json"]
            if key:
                argv += ["-H", "Authorization: Bearer " + key]
            r = subprocess.run(argv + ["http://127.0.0.1:%d%s" % (self.s.port, path)],
                               capture_output=True, text=True, timeout=120 * MULT)
        st, ver, sent = r.stdout.split()
        return int(st), ver, int(sent)

    def test_http2_bodies_bounded_by_the_upload_cap(self):
        # under the cap: read whole, then refused by the route (no key; too large for JSON)
        st, ver, sent = self.post("/v1/sandboxes", 4)
        self.assertEqual((st, ver), (413, "2"))
        st, ver, _ = self.post("/v1/sandboxes", 4, key=self.p.keys["alpha"])
        self.assertEqual((st, ver), (413, "2"))
        # past the cap: h2o resets the stream (no answer) before the whole body is in, having
        # read about the cap; what it held is given back, so a second such body does not add
        # to spaced's memory (five such bodies kept would be over 100 MiB more; ASan's RSS
        # moves by a few tens of MiB on its own)
        rss = []
        for _ in range(5):
            st, _, sent = self.post("/v1/sandboxes", 4 * self.CAP)
            self.assertNotEqual(st, 200)
            self.assertLess(sent, 2 * self.CAP * MIB)
            rss.append(self.s.rss_kb())
        self.assertLess(rss[4] - rss[0], 4 * self.CAP * 1024, rss)
        st, r = self.s.request("GET", "/v1/sandboxes", key=self.p.keys["alpha"])
        self.assertEqual(st, 200, r)  # still serving


if __name__ == "__main__":
    unittest.main()
