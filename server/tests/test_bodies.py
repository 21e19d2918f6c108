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
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, read_response, skip_unless_pg  # noqa: E402
from h2client import H2Client, h2  # noqa: E402

MIB = 1 << 20


def random_tar(size):
    """A tar of one file of size random bytes, and its SHA-256 (a template file's key)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        payload = os.urandom(size)
        ti = tarfile.TarInfo("big.bin")
        ti.size = len(payload)
        tf.addfile(ti, io.BytesIO(payload))
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


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

    def test_template_file_past_its_cap_refused_on_head(self):
        # A template file is at most 256 MiB: an upload whose head says more is refused on its
        # head, with its key, on both APIs (E2B's upload route with its API key)
        for path, hdr in (("/v1/template-files/" + "b" * 64,
                           "Authorization: Bearer %s" % self.s.key),
                          ("/upload/template-files/" + "b" * 64, "X-API-Key: %s" % self.s.key)):
            c = self.conn()
            try:
                t0 = time.time()
                c.sendall(self.head("PUT", path, 300 * MIB, [hdr]))
                st, _, body = read_response(c)
                self.assertLess(time.time() - t0, 5 * MULT)
            finally:
                c.close()
            self.assertEqual(st, 413, (path, body))
            self.assertIn("at most 256 MiB", body.decode(), path)
        # below the cap it is read, and the route answers (these bytes are no tar)
        c = self.conn()
        try:
            c.sendall(self.head("PUT", "/v1/template-files/" + "b" * 64, 1 * MIB,
                                ["Authorization: Bearer %s" % self.s.key]) + b"x" * MIB)
            st, _, body = read_response(c)
        finally:
            c.close()
        self.assertEqual(st, 400, body)

    def test_upload_link_with_a_wrong_token_refused_on_head(self):
        # E2B's template-file upload link: its token is checked before its body is read
        for tok in ("x" * 43, "not-a-token"):
            st, _, body = self.refused_on_head(
                "PUT", "/upload/template-files/%s?token=%s" % ("a" * 64, tok), 50 * MIB)
            self.assertEqual(st, 403, body)
            self.assertEqual(json.loads(body)["code"], 403)
        # the link's own token: the body (over the cap, so left on the connection) is read
        data, sha = random_tar(3 * MIB)
        r, got = self.s.exchange("GET", "/templates/base/files/" + sha, None,
                                 headers={"X-API-Key": self.s.key})
        self.assertEqual(r.status, 201, got)
        url = json.loads(got)["url"]
        link = url[url.index("/upload/"):]
        r, got = self.s.exchange("PUT", link, raw=data, headers={})
        self.assertEqual(r.status, 200, got)
        self.assertEqual(json.loads(got), {"stored": True})

    def test_first_request_over_tls_is_vetted(self):
        # A TLS client's first request may arrive in the read that ends the handshake: the gate
        # reads it before h2o does (h2o would otherwise take its 50 MiB body unvetted).
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["http/1.1"])
        for _ in range(10):
            c = ctx.wrap_socket(self.conn())
            try:
                t0 = time.time()
                c.sendall(self.head("PUT", "/v1/template-files/" + "a" * 64, 50 * MIB)
                          + b"x" * MIB)
                st, _, body = read_response(c)
                self.assertEqual(st, 401, body)
                self.assertLess(time.time() - t0, 5 * MULT)
            finally:
                c.close()

    def test_large_body_with_a_wrong_key_refused_on_head(self):
        # Plain HTTP/1: the key's value is checked before the body is read, on both APIs (so it
        # is over TLS and HTTP/2; over TLS with Expect: 100-continue, after the 100, which
        # goes out on the head, but before the body: below).
        rss0 = self.s.rss_kb()
        for _ in range(3):
            st, _, body = self.refused_on_head("PUT", "/v1/template-files/" + "a" * 64, 50 * MIB,
                                               ["Authorization: Bearer sp_not_a_key"])
            self.assertEqual(st, 401, body)
            self.assertEqual(json.loads(body)["error"]["code"], "unauthenticated")
            st, _, body = self.refused_on_head("PUT", "/upload/template-files/" + "a" * 64,
                                               50 * MIB, ["X-API-Key: sp_not_a_key"])
            self.assertEqual(st, 401, body)
            self.assertEqual(json.loads(body)["code"], 401)
        self.assertLess(self.s.rss_kb() - rss0, 30 * 1024)
        # TLS with Expect: 100-continue: the 100, then the refusal, with no byte of the body
        # sent. (Before, such a request was h2o's to read: its 100, then nothing until the
        # whole body had come.)
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["http/1.1"])
        for path, key in (("/v1/template-files/", "Authorization: Bearer sp_not_a_key"),
                          ("/upload/template-files/", "X-API-Key: sp_not_a_key")):
            c = ctx.wrap_socket(self.conn())
            try:
                c.settimeout(10 * MULT)
                c.sendall(self.head("PUT", path + "a" * 64, 50 * MIB,
                                    [key, "Expect: 100-continue"]))
                data = b""
                while b"HTTP/1.1 401" not in data or not data.endswith(b"}\n"):
                    chunk = c.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            finally:
                c.close()
            self.assertTrue(data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 401 "),
                            data)

        data, sha = random_tar(3 * MIB)
        c = self.conn()
        try:
            c.sendall(self.head("PUT", "/v1/template-files/" + sha, chunked=True,
                                headers=["Authorization: Bearer " + self.s.key]))
            for i in range(0, len(data), 500000):
                part = data[i:i + 500000]
                c.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            c.sendall(b"0\r\n\r\n")
            st, hdrs, body = read_response(c)
        finally:
            c.close()
        self.assertIn(st, (200, 201), body)
        st, r = self.s.request("GET", "/v1/template-files/" + sha)
        self.assertEqual(st, 200, r)

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
        data, sha = random_tar(3 * MIB)
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
@unittest.skipUnless(h2 is not None, "no h2 package (Debian's python3-h2)")
class Http2BodiesTest(unittest.TestCase):
    """HTTP/2 bodies (README: Request bodies): the gate reads each stream's head as h2o decoded
    it, before its first DATA reaches h2o, and holds HTTP/2 to what HTTP/1 is held to: a JSON
    route's body past --max-body-kb, an upload without its credential and one more large body
    than --max-large-bodies are answered (413, 401, 503) on the head or after at most one frame
    of body, the rest of which is dropped, flow control given back, the connection kept.
    Driven with the h2 package (frames exactly as sent) and with curl (prior knowledge, TLS,
    h2c upgrade)."""
    CAP = 16  # --max-upload-mb

    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=("alpha",), runtime="test",
                         args=["--max-upload-mb", str(cls.CAP), "--max-large-bodies", "1"])
        cls.s = cls.p.s
        cls.key = cls.p.keys["alpha"]

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    def client(self):
        c = H2Client(self.s.port)
        self.addCleanup(c.close)
        return c

    def test_json_body_past_cap_answered_before_it_is_read(self):
        c = self.client()
        sid = c.open("POST", "/v1/sandboxes", key=self.key,
                     headers=[("content-type", "application/json"),
                              ("content-length", str(64 * MIB))])
        c.send(sid, 64 * MIB, end=True, until=lambda: sid in c.status)
        st, body = c.answer(sid)
        self.assertEqual(st, 413, body)
        self.assertIn("larger than 1024 KiB", json.loads(body)["error"]["message"])
        # what was sent before the answer came is bounded by flow control, not the body
        self.assertLess(c.sent[sid], 20 * MIB)
        # DATA sent on after the answer is dropped; the stream is then reset with NO_ERROR
        # (RFC 9113 8.1: stop sending), and the connection goes on
        c.send(sid, 256 * 1024, until=lambda: sid in c.reset)
        deadline = time.time() + 5 * MULT
        while sid not in c.reset and time.time() < deadline:
            c.send(sid, 16 * 1024)
            c.pump()
        self.assertEqual(c.reset.get(sid), 0)
        sid2 = c.open("GET", "/healthz", end=True)
        self.assertEqual(c.answer(sid2)[0], 200)
        self.assertIsNone(c.terminated)

    def test_refusal_answered_on_the_head(self):
        # heads alone, their bodies held back (as Expect: 100-continue does): each refusal
        # comes before a byte of its body is sent, and the body sent after it is dropped
        c = self.client()
        heads = [("PUT", "/v1/template-files/" + "a" * 64, None, 50 * MIB, 401),
                 ("POST", "/v1/sandboxes", self.key, 64 * MIB, 413),
                 ("PUT", "/upload/template-files/" + "b" * 64, None, 50 * MIB, 401)]
        sids = [c.open(m, path, key=key, headers=[("content-length", str(n))])
                for m, path, key, n, _ in heads]
        for sid, (_, path, _, _, want) in zip(sids, heads):
            self.assertEqual(c.answer(sid, path)[0], want)
            self.assertEqual(c.sent[sid], 0)
        for sid in sids:
            c.send(sid, 64 * 1024, until=lambda: sid in c.reset)
        deadline = time.time() + 5 * MULT
        while any(sid not in c.reset for sid in sids) and time.time() < deadline:
            for sid in sids:
                if sid not in c.reset:
                    c.send(sid, 16 * 1024)
            c.pump()
        self.assertEqual([c.reset.get(sid) for sid in sids], [0] * len(sids))
        # a head the policy lets through waits for its body as before
        sid = c.open("POST", "/v1/sandboxes", key=self.key,
                     headers=[("content-type", "application/json"), ("content-length", "2")])
        for _ in range(3):
            c.pump()
        self.assertNotIn(sid, c.status)
        c.c.send_data(sid, b"{}", end_stream=True)
        c.flush()
        self.assertNotIn(c.answer(sid)[0], (401, 413, 503))
        self.assertIsNone(c.terminated)

    def test_trailers_after_answer_dropped_hpack_kept(self):
        c = self.client()
        n = 0
        for late in (False, True):
            sid = c.open("POST", "/v1/sandboxes", key=self.key, flush=False,
                         headers=[("content-type", "application/json"), ("x-one", "1"),
                                  ("content-length", str(64 * MIB))])
            # late: one DATA frame (refused at it), the answer, then the trailers; else three
            # frames and the trailers in one write. The client ends its body with trailers, as
            # it may (RFC 9113 8.1); the h2 package indexes their fields, so its later heads
            # refer to HPACK table entries h2o must have too.
            c.send(sid, 16 * 1024 if late else 48 * 1024, flush=False)
            if late:
                c.flush()
                deadline = time.time() + 10 * MULT
                while sid not in c.status and time.time() < deadline and c.pump():
                    pass
            c.c.send_headers(sid, [("x-trailer-%d" % (n + i), "v" * 40) for i in range(4)],
                             end_stream=True)
            n += 4
            c.flush()
            st, body = c.answer(sid)
            self.assertEqual(st, 413, body)
            for _ in range(2):  # heads that refer to entries from before and after the trailers
                sid2 = c.open("GET", "/v1/sandboxes/sb-none", key=self.key, end=True,
                              headers=[("x-one", "1"), ("x-trailer-%d" % (n - 1), "v" * 40)])
                st, body = c.answer(sid2)
                self.assertEqual(st, 404, body)
                self.assertIn("not found", json.loads(body)["error"]["message"])
        self.assertIsNone(c.terminated)

    def test_trailers_in_continuation_frames_dropped_hpack_kept(self):
        c = self.client()
        for n, how in enumerate(("one write", "after the answer", "frame by frame")):
            sid = c.open("POST", "/v1/sandboxes", key=self.key, flush=False,
                         headers=[("content-type", "application/json"),
                                  ("content-length", str(64 * MIB))])
            c.send(sid, 48 * 1024, flush=False)
            if how != "one write":
                c.flush()
                deadline = time.time() + 10 * MULT
                while sid not in c.status and time.time() < deadline and c.pump():
                    pass
            # trailers whose block is past one frame (16 KiB): the h2 package sends a HEADERS
            # frame and CONTINUATION frames, indexing the fields as it goes
            c.c.send_headers(sid, [("x-c%d-%d" % (n, i), "v" * 50) for i in range(400)],
                             end_stream=True)
            data = c.c.data_to_send()
            frames, off = [], 0
            while off < len(data):
                end = off + 9 + int.from_bytes(data[off:off + 3], "big")
                frames.append(data[off:end])
                off = end
            self.assertGreater(sum(1 for f in frames if f[3] == 0x9), 0, how)
            if how == "frame by frame":  # the gate keeps them from h2o until the last one
                for f in frames:
                    c.sock.sendall(f)
                    self.assertTrue(c.pump(0.3))
            else:
                c.sock.sendall(data)
            st, body = c.answer(sid, how)
            self.assertEqual(st, 413, body)
            for _ in range(2):  # heads that refer to the entries the trailers added
                sid2 = c.open("GET", "/v1/sandboxes/sb-none", key=self.key, end=True,
                              headers=[("x-c%d-399" % n, "v" * 50), ("x-c%d-390" % n, "v" * 50)])
                st, body = c.answer(sid2, how)
                self.assertEqual(st, 404, body)
                self.assertIn("not found", json.loads(body)["error"]["message"])
        self.assertIsNone(c.terminated)

    def test_body_without_length_stopped_past_cap(self):
        c = self.client()
        sid = c.open("POST", "/v1/sandboxes", key=self.key,
                     headers=[("content-type", "application/json")])
        # well past the 16 MiB stream window h2o gives: what gets sent before the answer is
        # bounded by flow control (the gate gives back connection window, never stream window)
        c.send(sid, 64 * MIB, end=True, until=lambda: sid in c.status)
        st, body = c.answer(sid)
        self.assertEqual(st, 413, body)
        self.assertLess(c.sent[sid], 20 * MIB)
        # a body longer than its content-length is stopped where it passes it
        sid = c.open("POST", "/v1/sandboxes", key=self.key,
                     headers=[("content-type", "application/json"), ("content-length", "10")])
        c.c.send_data(sid, b"{" * 100, end_stream=True)
        c.flush()
        st, body = c.answer(sid)
        self.assertEqual(st, 400, body)
        self.assertIn("content-length", json.loads(body)["error"]["message"])

    def test_upload_without_credential_answered_on_both_apis(self):
        c = self.client()
        sid = c.open("PUT", "/v1/template-files/" + "a" * 64,
                     headers=[("content-length", str(50 * MIB))])
        c.send(sid, 50 * MIB, end=True, until=lambda: sid in c.status)
        st, body = c.answer(sid)
        self.assertEqual(st, 401, body)
        self.assertIn("missing API key", json.loads(body)["error"]["message"])
        sid = c.open("PUT", "/upload/template-files/" + "a" * 64,
                     headers=[("content-length", str(50 * MIB))])
        c.send(sid, 50 * MIB, end=True, until=lambda: sid in c.status)
        st, body = c.answer(sid)
        self.assertEqual(st, 401, body)
        self.assertEqual(json.loads(body)["code"], 401)
        self.assertLess(c.sent[sid], 20 * MIB)
        self.assertIsNone(c.terminated)

    def test_upload_with_key_goes_on(self):
        data, sha = random_tar(3 * MIB)
        c = self.client()
        # no content-length: its size shows as it comes, and an upload has no cap but h2o's
        sid = c.open("PUT", "/v1/template-files/" + sha, key=self.key,
                     headers=[("content-type", "application/octet-stream")])
        off = 0
        while off < len(data):
            n = min(len(data) - off, c.c.local_flow_control_window(sid),
                    c.c.max_outbound_frame_size)
            if n <= 0:
                c.pump()
                continue
            c.c.send_data(sid, data[off:off + n], end_stream=off + n == len(data))
            off += n
            c.flush()
        st, body = c.answer(sid)
        self.assertIn(st, (200, 201), body)
        st, r = self.s.request("GET", "/v1/template-files/" + sha)
        self.assertEqual(st, 200, r)

    def test_upload_with_a_wrong_key_answered_before_its_body(self):
        # An upload streams over HTTP/2 too (http/bodygate.h): its key is looked up on the
        # head, so a wrong one is answered while the client has sent 1 MiB of 12 and waits
        # (were its body read whole first, no answer would come).
        for path, field, code in (
                ("/v1/template-files/" + "a" * 64, ("authorization", "Bearer sp_not_a_key"),
                 lambda b: json.loads(b)["error"]["code"] == "unauthenticated"),
                ("/upload/template-files/" + "a" * 64, ("x-api-key", "sp_not_a_key"),
                 lambda b: json.loads(b)["code"] == 401)):
            c = self.client()
            sid = c.open("PUT", path, headers=[field, ("content-length", str(12 * MIB))])
            c.send(sid, MIB)
            st, body = c.answer(sid, "a wrong key's answer")
            self.assertEqual(st, 401, body)
            self.assertTrue(code(body), body)
            sid = c.open("GET", "/healthz", end=True)  # the connection goes on
            self.assertEqual(c.answer(sid)[0], 200)

    def test_large_bodies_at_once_are_bounded(self):
        hold = self.client()
        sid = hold.open("PUT", "/v1/template-files/" + "d" * 64, key=self.key,
                        headers=[("content-length", str(8 * MIB))])
        hold.send(sid, 1024)
        time.sleep(0.3 * MULT)
        c = self.client()
        sid2 = c.open("PUT", "/v1/template-files/" + "e" * 64, key=self.key,
                      headers=[("content-length", str(8 * MIB))])
        c.send(sid2, 8 * MIB, end=True, until=lambda: sid2 in c.status)
        st, body = c.answer(sid2)
        self.assertEqual(st, 503, body)
        self.assertIn("too many large request bodies", json.loads(body)["error"]["message"])
        # the client resets the held upload: its place is free again
        hold.c.reset_stream(sid)
        hold.flush()
        deadline = time.time() + 5 * MULT
        while True:
            sid3 = c.open("PUT", "/v1/template-files/" + "f" * 64, key=self.key,
                          headers=[("content-length", str(2 * MIB))])
            c.send(sid3, 2 * MIB, end=True)
            st, body = c.answer(sid3)
            if st != 503 or time.time() > deadline:
                break
            time.sleep(0.1)
        self.assertNotEqual(st, 503, body)

    def test_streams_in_one_read(self):
        # two requests' heads and bodies in one write: the gate hands h2o the first head
        # before that stream's body, then the second's; one refused, one read whole
        c = self.client()
        a = c.open("POST", "/v1/sandboxes", key=self.key, flush=False,
                   headers=[("content-type", "application/json"),
                            ("content-length", str(2 * MIB))])
        c.c.send_data(a, b"x" * 16384)
        b = c.open("POST", "/v1/sandboxes", key=self.key, flush=False,
                   headers=[("content-type", "application/json"), ("content-length", "5")])
        c.c.send_data(b, b"{oops", end_stream=True)
        c.flush()
        st, body = c.answer(a)
        self.assertEqual(st, 413, body)
        st, body = c.answer(b)
        self.assertEqual(st, 400, body)  # the route read it: not JSON
        self.assertNotIn(b"larger than", body)

    def test_rss_flat_under_refused_bodies(self):
        rss0 = self.s.rss_kb()
        for _ in range(5):
            c = self.client()
            sid = c.open("POST", "/v1/sandboxes", key=self.key,
                         headers=[("content-length", str(4 * self.CAP * MIB))])
            c.send(sid, 4 * self.CAP * MIB, end=True, until=lambda: sid in c.status)
            self.assertEqual(c.answer(sid)[0], 413)
        # 5 x 64 MiB refused: over 300 MiB had they been kept; ASan's RSS moves by tens of MiB
        self.assertLess(self.s.rss_kb() - rss0, 64 * 1024)

    @unittest.skipUnless(shutil.which("curl") and "HTTP2" in subprocess.run(
        ["curl", "--version"], capture_output=True, text=True).stdout, "no curl with HTTP/2")
    def test_curl_prior_knowledge_tls_and_upgrade(self):
        """curl's own framing, in the three ways it speaks HTTP/2 here: prior knowledge on the
        plain port, ALPN over TLS (its first flight carries the body's first frames), and an
        Upgrade: h2c request (answered over HTTP/1.1 instead, and gated as such)."""
        with tempfile.NamedTemporaryFile() as f:
            f.truncate(32 * MIB)
            base = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{http_version} "
                    "%{size_upload}", "-X", "POST", "--data-binary", "@" + f.name,
                    "-H", "Content-Type: application/json", "-H", "Authorization: Bearer " +
                    self.key]
            for how, url in ((["--http2-prior-knowledge"], "http://127.0.0.1:%d"),
                             (["--http2", "-k"], "https://127.0.0.1:%d"),
                             (["--http2"], "http://127.0.0.1:%d")):
                # curl 7.88 (Debian 12) races on an answer that comes while it still sends:
                # when the 413 and the RST_STREAM(NO_ERROR) after it (RFC 9113 8.1) are read
                # before its next send, that send finds the stream closed and curl exits 92
                # ("stream 1 closed") without the answer (up to 6 in 200 here). The frames
                # themselves are checked with the h2 package above; curl tries again then
                # (three in a row lost it once, beside the VM suites of a CI).
                for _ in range(8):
                    r = subprocess.run(base + ["-v"] + how +
                                       [url % self.s.port + "/v1/sandboxes"],
                                       capture_output=True, text=True, timeout=60 * MULT)
                    if not (r.returncode == 92 and "stream 1 closed" in r.stderr):
                        break
                st, ver, sent = r.stdout.split()
                want = "1.1" if url.startswith("http:") and "--http2" in how else "2"
                self.assertEqual((int(st), ver), (413, want), (how, r.stdout, r.stderr))
                if want == "2":  # HTTP/1's refusal drains what a client sends anyway
                    self.assertLess(int(sent), 20 * MIB, how)
            # a client that waits for the go-ahead (h2o sends no 100 over HTTP/2) gets the
            # refusal on the head, without sending its body or waiting out its timeout
            for how, url in ((["--http2-prior-knowledge"], "http://127.0.0.1:%d"),
                             (["--http2", "-k"], "https://127.0.0.1:%d")):
                t0 = time.time()
                r = subprocess.run(base + how + ["-H", "Expect: 100-continue",
                                                 "--expect100-timeout", "20",
                                                 url % self.s.port + "/v1/sandboxes"],
                                   capture_output=True, text=True, timeout=60 * MULT)
                st, ver, sent = r.stdout.split()
                self.assertEqual((int(st), ver, int(sent)), (413, "2", 0), (how, r.stderr))
                self.assertLess(time.time() - t0, 10, how)
        st, r = self.s.request("GET", "/v1/sandboxes", key=self.key)
        self.assertEqual(st, 200, r)


if __name__ == "__main__":
    unittest.main()
