"""Data-plane authorization (README "Data-plane authorization"), on the test driver with a real
space-agent per sandbox (no VM: every check here happens before a VM would be touched).

Every data-plane route (envd's Connect RPCs, /files, /health and /envs, on the API address and
on the host name; the code interpreter's /execute and context calls; a forwarded port; the
native API's data routes) is walked with: no token, a wrong token, another team's sandbox id
with our token, an unknown id; the answers must be exact, and the last three identical. Signed
file URLs cannot have their user substituted (Basic header) nor their path (more files). A
sandbox asleep with autoResume is woken only by an authorized request. A large upload is
authorized on its head, before its body is read. Tokens are not stored in
a form that works, and a token kept in clear by an older server keeps working after the start
converts it.
"""
import base64
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import (MULT, Platform, free_port, pg_bindir, read_response,  # noqa: E402
                     skip_unless_agent, skip_unless_pg, wait_until)

MASTER = base64.b64encode(hashlib.sha256(b"test_authz master key").digest()).decode()
UNKNOWN = "nosuchsandbox00000000"
WRONG = "W" * 43


def sign(path, op, user, token, exp=None):
    raw = "%s:%s:%s:%s" % (path, op, user, token)
    if exp is not None:
        raw += ":%d" % exp
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


def connect_env(payload):
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


@skip_unless_pg
@skip_unless_agent
class AuthzTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=("alpha", "beta"), runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20", "SPACE_E2B_DEFAULT_USER": "nobody",
                              "SPACE_MASTER_KEY": MASTER})
        cls.s = cls.p.s
        cls.domain = "space.localhost:%d" % cls.s.port
        cls.a = cls.create("alpha")                                   # public (default)
        cls.priv = cls.create("alpha", network={"allowPublicTraffic": False})
        cls.b = cls.create("beta")                                    # another team's

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    @classmethod
    def api(cls, method, path, body=None, team="alpha"):
        h = {"X-API-KEY": cls.p.keys[team]}
        r, data = cls.s.exchange(method, path, body, headers=h)
        return r.status, (json.loads(data) if data else None)

    @classmethod
    def create(cls, team, **fields):
        body = {"templateID": "base", "timeout": 300, "metadata": {}, "envVars": {},
                "secure": True}
        body.update(fields)
        st, sb = cls.api("POST", "/sandboxes", body, team=team)
        assert st == 201, (st, sb)
        return sb

    @classmethod
    def sql(cls, text):
        r = subprocess.run([os.path.join(pg_bindir(), "psql"), "-X", "-q", "-A", "-t", "-v",
                            "ON_ERROR_STOP=1", cls.p.pg.url, "-c", text],
                           check=True, capture_output=True, text=True)
        return r.stdout.strip()

    def send(self, method, path, headers=None, body=None):
        c = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=60 * MULT)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    # ---- the routes ----

    def envd_routes(self):
        """(name, method, path, body, headers) of envd's routes, without sandbox or token."""
        rpc = {"Content-Type": "application/json", "connect-protocol-version": "1"}
        stream = {"Content-Type": "application/connect+json", "connect-protocol-version": "1"}
        start = json.dumps({"process": {"cmd": "/bin/true"}}).encode()
        return [
            ("process.List", "POST", "/process.Process/List", b"{}", rpc),
            ("process.Start", "POST", "/process.Process/Start", connect_env(start), stream),
            ("filesystem.Stat", "POST", "/filesystem.Filesystem/Stat",
             json.dumps({"path": "/tmp"}).encode(), rpc),
            ("files.get", "GET", "/files?path=%2Ftmp%2Fx", None, {}),
            ("files.post", "POST", "/files?path=%2Ftmp%2Fauthz-x", b"x",
             {"Content-Type": "application/octet-stream"}),
            ("health", "GET", "/health", None, {}),
            ("envs", "GET", "/envs", None, {}),
        ]

    def code_routes(self):
        j = {"Content-Type": "application/json"}
        return [
            ("execute", "POST", "/execute",
             json.dumps({"code": "1", "context_id": None, "language": None,
                         "env_vars": None}).encode(), j),
            ("contexts.list", "GET", "/contexts", None, j),
            ("contexts.create", "POST", "/contexts", b"{}", j),
            ("contexts.delete", "DELETE", "/contexts/abc", None, j),
            ("contexts.restart", "POST", "/contexts/abc/restart", None, j),
        ]

    def host(self, port, sid):
        return "%d-%s.%s" % (port, sid, self.domain)

    def walk(self, routes, where, sid, creds):
        """{route name: (status, body)} for each route, the sandbox sid chosen by `where`
        ("api": E2b-Sandbox-Id on the API address, else the port of a host name)."""
        out = {}
        for name, method, path, body, extra in routes:
            h = dict(extra)
            if where == "api":
                h["E2b-Sandbox-Id"] = sid
            else:
                h["Host"] = self.host(where, sid)
            h.update(creds)
            st, data = self.send(method, path, h, body)
            out[name] = (st, data)
        return out

    def assert_all(self, got, status, message, what):
        for name, (st, data) in got.items():
            self.assertEqual(st, status, "%s %s: %s" % (what, name, data))
            self.assertEqual(json.loads(data), {"code": status, "message": message},
                             "%s %s" % (what, name))

    def check_no_oracle(self, routes, where, cred_name, token, message):
        """Wrong token on our sandbox, our token on another team's, our token on an unknown
        id: exactly the same answers, and the one expected."""
        wrong = self.walk(routes, where, self.a["sandboxID"], {cred_name: WRONG})
        foreign = self.walk(routes, where, self.b["sandboxID"], {cred_name: token})
        unknown = self.walk(routes, where, UNKNOWN, {cred_name: token})
        self.assert_all(wrong, 401, message, "wrong token")
        self.assertEqual(foreign, wrong)
        self.assertEqual(unknown, wrong)
        # the same for the other team's own token on our sandbox
        other = self.walk(routes, where, self.a["sandboxID"],
                          {cred_name: self.b["envdAccessToken"]})
        self.assertEqual(other, wrong)

    # ---- envd ----

    def test_envd_no_token(self):
        for where in ("api", 49983):
            for sid in (self.a["sandboxID"], self.b["sandboxID"], UNKNOWN):
                got = self.walk(self.envd_routes(), where, sid, {})
                self.assert_all(got, 401, "missing X-Access-Token", "no token %s" % where)

    def test_envd_wrong_foreign_unknown(self):
        for where in ("api", 49983):
            self.check_no_oracle(self.envd_routes(), where, "X-Access-Token",
                                 self.a["envdAccessToken"],
                                 "invalid access token for this sandbox")

    def test_envd_right_token_passes(self):
        # The walk's routes do open with the token (what the failures above are measured
        # against): none of them answers 401.
        got = self.walk(self.envd_routes(), 49983, self.a["sandboxID"],
                        {"X-Access-Token": self.a["envdAccessToken"]})
        for name, (st, data) in got.items():
            self.assertNotEqual(st, 401, "%s: %s" % (name, data))
        self.assertEqual(got["health"][0], 204)
        self.assertEqual(got["process.List"][0], 200)
        # the traffic token is not envd's credential
        got = self.walk(self.envd_routes(), 49983, self.a["sandboxID"],
                        {"E2B-Traffic-Access-Token": self.a["trafficAccessToken"]})
        self.assert_all(got, 401, "missing X-Access-Token", "traffic token on envd")

    def test_token_alone_routes_by_its_hash(self):
        # E2B_SANDBOX_URL without E2b-Sandbox-Id (a class-level Sandbox.connect object).
        st, data = self.send("POST", "/process.Process/List",
                             {"Content-Type": "application/json",
                              "X-Access-Token": self.a["envdAccessToken"]}, b"{}")
        self.assertEqual(st, 200, data)
        st, data = self.send("POST", "/process.Process/List",
                             {"Content-Type": "application/json", "X-Access-Token": WRONG},
                             b"{}")
        self.assertEqual((st, json.loads(data)),
                         (401, {"code": 401,
                                "message": "invalid access token for this sandbox"}))

    # ---- the code interpreter ----

    def test_code_no_token(self):
        for sid in (self.a["sandboxID"], self.priv["sandboxID"], UNKNOWN):
            got = self.walk(self.code_routes(), 49999, sid, {})
            self.assert_all(got, 401, "missing X-Access-Token or E2B-Traffic-Access-Token",
                            "code without token")

    def test_code_wrong_foreign_unknown(self):
        for cred in ("X-Access-Token", "E2B-Traffic-Access-Token"):
            token = self.a["envdAccessToken" if cred == "X-Access-Token"
                           else "trafficAccessToken"]
            self.check_no_oracle(self.code_routes(), 49999, cred, token,
                                 "invalid access token for this sandbox")

    def test_code_contexts_open_with_either_token(self):
        # /execute's rule, for the context calls too: the JS SDK sends them only the traffic
        # token, which create returns for every sandbox.
        self.assertRegex(self.a["trafficAccessToken"] or "", "^[A-Za-z0-9]{43}$")
        self.assertNotEqual(self.a["trafficAccessToken"], self.a["envdAccessToken"])
        for creds in ({"X-Access-Token": self.a["envdAccessToken"]},
                      {"E2B-Traffic-Access-Token": self.a["trafficAccessToken"]}):
            got = self.walk(self.code_routes(), 49999, self.a["sandboxID"], creds)
            for name, (st, data) in got.items():
                self.assertNotEqual(st, 401, "%s %s: %s" % (creds, name, data))

    # ---- forwarded ports ----

    def test_port_public_private_unknown(self):
        port_routes = [("get", "GET", "/", None, {}), ("post", "POST", "/x", b"{}", {})]
        # a private sandbox's port without a token is exactly an unknown sandbox's
        priv = self.walk(port_routes, 8080, self.priv["sandboxID"], {})
        unknown = self.walk(port_routes, 8080, UNKNOWN, {})
        for name, (st, data) in unknown.items():
            self.assertEqual((st, json.loads(data)),
                             (502, {"sandboxId": UNKNOWN, "code": 502,
                                    "message": "The sandbox was not found"}), name)
        for name, (st, data) in priv.items():
            self.assertEqual((st, json.loads(data)),
                             (502, {"sandboxId": self.priv["sandboxID"], "code": 502,
                                    "message": "The sandbox was not found"}), name)
        # the public one goes through to the guest (nothing listens there: the guest's answer)
        pub = self.walk(port_routes, 8080, self.a["sandboxID"], {})
        for name, (st, data) in pub.items():
            self.assertNotIn(st, (401, 404), data)
            self.assertNotEqual(json.loads(data).get("message"), "The sandbox was not found")
        # with either token the private one goes through too, to the same guest answer
        for creds in ({"E2B-Traffic-Access-Token": self.priv["trafficAccessToken"]},
                      {"X-Access-Token": self.priv["envdAccessToken"]}):
            got = self.walk(port_routes, 8080, self.priv["sandboxID"], creds)
            for name, (st, data) in got.items():
                self.assertEqual(st, pub[name][0], "%s %s: %s" % (creds, name, data))
                self.assertEqual(json.loads(data).get("message"),
                                 json.loads(pub[name][1]).get("message"))
        for cred in ("X-Access-Token", "E2B-Traffic-Access-Token"):
            token = self.a["envdAccessToken" if cred == "X-Access-Token"
                           else "trafficAccessToken"]
            self.check_no_oracle(port_routes, 8080, cred, token,
                                 "invalid access token for this sandbox")

    # ---- native API data routes: another team's sandbox is an unknown one ----

    def test_native_foreign_is_unknown(self):
        routes = [("POST", "/v1/sandboxes/%s/commands", {"cmd": "true"}),
                  ("GET", "/v1/sandboxes/%s/commands", None),
                  ("GET", "/v1/sandboxes/%s/files?path=/tmp/x", None),
                  ("GET", "/v1/sandboxes/%s/files/stat?path=/tmp", None),
                  ("GET", "/v1/sandboxes/%s/files/list?path=/tmp", None),
                  ("GET", "/v1/sandboxes/%s", None),
                  ("GET", "/v1/sandboxes/%s/sessions", None),
                  ("GET", "/v1/sandboxes/%s/contexts", None),
                  ("POST", "/v1/sandboxes/%s/execute", {"code": "1"})]
        for method, path, body in routes:
            foreign = self.s.request(method, path % self.b["sandboxID"], body)
            unknown = self.s.request(method, path % UNKNOWN, body)
            self.assertEqual(foreign[0], 404, (path, foreign))
            self.assertEqual(foreign, unknown, path)

    # ---- signed file URLs ----

    def files(self, method, query, headers=None, body=None):
        return self.send(method, "/files?" + urllib.parse.urlencode(
            query, quote_via=urllib.parse.quote), headers, body)

    def test_signed_url_fixes_user(self):
        sid, tok = self.a["sandboxID"], self.a["envdAccessToken"]
        secret = "/tmp/authz-root-only-%d" % os.getpid()
        with open(secret, "w") as f:
            f.write("root only")
        os.chmod(secret, 0o600)
        self.addCleanup(os.unlink, secret)
        root = {"Authorization": "Basic " + base64.b64encode(b"root:").decode()}
        # the token may choose the user
        st, data = self.files("GET", {"path": secret},
                              dict(root, **{"E2b-Sandbox-Id": sid, "X-Access-Token": tok}))
        self.assertEqual((st, data), (200, b"root only"))
        # a URL signed for no user is the default user's: a Basic header cannot make it root's
        q = {"path": secret, "signature": sign(secret, "read", "", tok)}
        st, data = self.files("GET", q, dict(root, **{"E2b-Sandbox-Id": sid}))
        self.assertNotEqual(st, 200, data)
        self.assertNotIn(b"root only", data)
        # nor can username= (the signature covers it)
        q2 = dict(q, username="root")
        st, data = self.files("GET", q2, {"E2b-Sandbox-Id": sid})
        self.assertEqual((st, json.loads(data)), (401, {"code": 401,
                                                        "message": "invalid signature"}))
        # signed for root, it is root's
        q3 = {"path": secret, "username": "root", "signature": sign(secret, "read", "root", tok)}
        st, data = self.files("GET", q3, {"E2b-Sandbox-Id": sid})
        self.assertEqual((st, data), (200, b"root only"))

    def test_signed_upload_fixes_path(self):
        sid, tok = self.a["sandboxID"], self.a["envdAccessToken"]
        base = "/tmp/authz-up-%d" % os.getpid()
        signed, other = base + "-signed", base + "-other"
        for p in (signed, other):
            self.addCleanup(lambda p=p: os.path.exists(p) and os.unlink(p))
        q = {"path": signed, "username": "root", "signature": sign(signed, "write", "root", tok)}
        bnd = "authzb"
        mp = b""
        for fn, data in ((signed, b"a"), (other, b"b")):
            mp += (b"--%s\r\nContent-Disposition: form-data; name=\"file\"; filename=\"%s\"\r\n"
                   b"Content-Type: application/octet-stream\r\n\r\n%s\r\n"
                   % (bnd.encode(), fn.encode(), data))
        mp += b"--%s--\r\n" % bnd.encode()
        ct = {"Content-Type": "multipart/form-data; boundary=" + bnd, "E2b-Sandbox-Id": sid}
        st, data = self.files("POST", q, ct, mp)
        self.assertEqual(st, 401, data)
        self.assertFalse(os.path.exists(other))
        self.assertFalse(os.path.exists(signed))
        # one file, named otherwise in its part: written at the signed path
        one = (b"--%s\r\nContent-Disposition: form-data; name=\"file\"; filename=\"%s\"\r\n\r\n"
               b"one\r\n--%s--\r\n" % (bnd.encode(), other.encode(), bnd.encode()))
        st, data = self.files("POST", q, ct, one)
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)[0]["path"], signed)
        self.assertFalse(os.path.exists(other))
        # another path with the same signature, and a read signature used to write
        st, data = self.files("POST", dict(q, path=other), ct, one)
        self.assertEqual((st, json.loads(data)), (401, {"code": 401,
                                                        "message": "invalid signature"}))
        qr = dict(q, signature=sign(signed, "read", "root", tok))
        st, data = self.files("POST", qr, ct, one)
        self.assertEqual(st, 401, data)

    def head_only(self, method, path, headers, length):
        """Sends the head of a length-byte request alone: the answer, which must come without
        the body (a large body is left on the connection until the request is authorized)."""
        c = socket.create_connection(("127.0.0.1", self.s.port), timeout=10 * MULT)
        try:
            head = "%s %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: %d\r\n" % (
                method, path, self.s.port, length)
            head += "".join("%s: %s\r\n" % kv for kv in headers.items()) + "\r\n"
            t0 = time.time()
            c.sendall(head.encode())
            st, _, body = read_response(c)
            self.assertLess(time.time() - t0, 5 * MULT)
            return st, json.loads(body) if body else None
        finally:
            c.close()

    def test_large_upload_authorized_before_its_body(self):
        # An upload over --max-body-kb is left on its connection: a wrong token, a wrong
        # signature, or a private port without a token is answered on its head (were the 50 MiB
        # read first, no answer would come while the client waits to send them); the right token
        # then has its whole body read and written.
        sid, tok = self.a["sandboxID"], self.a["envdAccessToken"]
        big = 50 << 20
        path = "/tmp/authz-big-%d" % os.getpid()
        q = "/files?" + urllib.parse.urlencode({"path": path, "username": "root"})
        octet = {"Content-Type": "application/octet-stream", "E2b-Sandbox-Id": sid}
        st, r = self.head_only("POST", q, dict(octet, **{"X-Access-Token": WRONG}), big)
        self.assertEqual((st, r), (401, {"code": 401,
                                         "message": "invalid access token for this sandbox"}))
        signed = q + "&" + urllib.parse.urlencode(
            {"signature": sign(path, "write", "root", WRONG, int(time.time()) + 600),
             "signature_expiration": int(time.time()) + 600})
        st, r = self.head_only("POST", signed, octet, big)
        self.assertEqual((st, r), (401, {"code": 401, "message": "invalid signature"}))
        host = {"Host": self.host(8000, self.priv["sandboxID"])}
        c = socket.create_connection(("127.0.0.1", self.s.port), timeout=10 * MULT)
        try:
            c.sendall(("PUT /up HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n"
                       % (host["Host"], big)).encode())
            st, _, body = read_response(c)
            self.assertEqual(st, 502, body)  # unknown to a request without a token
        finally:
            c.close()
        data = os.urandom(3 << 20)
        st, body = self.send("POST", q, dict(octet, **{"X-Access-Token": tok}), data)
        self.assertEqual(st, 200, body)
        with open(path, "rb") as f:
            self.assertEqual(f.read(), data)
        os.unlink(path)

    def test_signed_url_no_oracle(self):
        # A signature made with our token: on another team's sandbox, an unknown one, or ours
        # with a bad signature, the same answer.
        tok = self.a["envdAccessToken"]
        q = {"path": "/tmp/x", "signature": sign("/tmp/x", "read", "", tok)}
        bad = dict(q, signature=sign("/tmp/x", "read", "", WRONG))
        got = [self.files("GET", bad, {"E2b-Sandbox-Id": self.a["sandboxID"]}),
               self.files("GET", q, {"E2b-Sandbox-Id": self.b["sandboxID"]}),
               self.files("GET", q, {"E2b-Sandbox-Id": UNKNOWN}),
               self.files("GET", q, {"Host": self.host(49983, UNKNOWN)})]
        for st, data in got:
            self.assertEqual((st, json.loads(data)),
                             (401, {"code": 401, "message": "invalid signature"}))
        # an expired one is refused before any lookup, alike for all
        old = int(time.time()) - 5
        qe = {"path": "/tmp/x", "signature": sign("/tmp/x", "read", "", tok, old),
              "signature_expiration": old}
        for s in (self.a["sandboxID"], self.b["sandboxID"], UNKNOWN):
            st, data = self.files("GET", qe, {"E2b-Sandbox-Id": s})
            self.assertEqual((st, json.loads(data)),
                             (401, {"code": 401, "message": "signature expired"}))

    # ---- wake on access only once authorized ----

    def state(self, sid):
        st, sb = self.api("GET", "/sandboxes/" + sid)
        self.assertEqual(st, 200, sb)
        return sb["state"]

    def test_wake_only_when_authorized(self):
        sb = self.create("alpha", autoPause=True, autoResume={"enabled": True},
                         network={"allowPublicTraffic": False})
        sid = sb["sandboxID"]
        st, r = self.api("POST", "/sandboxes/%s/pause" % sid)
        self.assertEqual(st, 204, r)
        wait_until(lambda: self.state(sid) == "paused", "paused", timeout=30)
        time.sleep(0.5)
        envd = self.envd_routes()
        tries = [self.walk(envd, 49983, sid, {}),
                 self.walk(envd, 49983, sid, {"X-Access-Token": WRONG}),
                 self.walk(self.code_routes(), 49999, sid, {"E2B-Traffic-Access-Token": WRONG}),
                 self.walk([("get", "GET", "/", None, {})], 8080, sid, {}),
                 {"signed": self.files("GET", {"path": "/tmp/x", "signature": sign(
                     "/tmp/x", "read", "", WRONG)}, {"E2b-Sandbox-Id": sid})}]
        for got in tries:
            for name, (st, data) in got.items():
                self.assertIn(st, (401, 502), "%s: %s" % (name, data))
        time.sleep(1)
        st, op = self.api("GET", "/sandboxes/" + sid)
        self.assertEqual(op["state"], "paused", "an unauthorized request woke it")
        st, row = 0, self.sql("SELECT desired_state FROM sandboxes WHERE id = '%s'" % sid)
        self.assertIn(row, ("paused", "suspended"))
        # an authorized one does
        st, data = self.send("GET", "/health", {"Host": self.host(49983, sid),
                                                "X-Access-Token": sb["envdAccessToken"]})
        self.assertEqual(st, 204, data)
        self.assertEqual(self.state(sid), "running")

    # ---- tokens at rest ----

    def test_tokens_not_stored(self):
        for sb in (self.a, self.priv, self.b):
            row = self.sql("SELECT row_to_json(s)::text FROM sandboxes s WHERE id = '%s'"
                           % sb["sandboxID"])
            self.assertNotIn(sb["envdAccessToken"], row)
            self.assertNotIn(sb["trafficAccessToken"], row)
            salt = self.sql("SELECT token_salt FROM sandboxes WHERE id = '%s'" % sb["sandboxID"])
            self.assertTrue(salt.startswith("m1."), salt)  # from the master key
        # connect and detail give the same tokens again
        st, c = self.api("POST", "/sandboxes/%s/connect" % self.a["sandboxID"], {"timeout": 300})
        self.assertIn(st, (200, 201), c)
        self.assertEqual((c["envdAccessToken"], c["trafficAccessToken"]),
                         (self.a["envdAccessToken"], self.a["trafficAccessToken"]))
        st, d = self.api("GET", "/sandboxes/" + self.a["sandboxID"])
        self.assertEqual(d["envdAccessToken"], self.a["envdAccessToken"])

    def restart(self):
        # On a port of its own: the test driver's agents (its "VMs") outlive spaced.
        self.s.stop()
        self.s.port = free_port()
        self.s.start()

    def test_zz_clear_token_converted_at_start(self):
        # A row as an older spaced wrote it: its token in clear, no salt.
        sb = self.create("alpha")
        sid = sb["sandboxID"]
        legacy = "L" * 20 + "egacyToken" + "0123456789abc"
        self.sql("UPDATE sandboxes SET access_token = '%s', token_salt = NULL, token_hash = NULL"
                 " WHERE id = '%s'" % (legacy, sid))
        self.restart()
        row = self.sql("SELECT row_to_json(s)::text FROM sandboxes s WHERE id = '%s'" % sid)
        self.assertNotIn(legacy, row)
        self.assertIn('"access_token":null', row)
        self.assertTrue(self.sql("SELECT token_salt FROM sandboxes WHERE id = '%s'"
                                 % sid).startswith("m0."))
        st, c = self.api("POST", "/sandboxes/%s/connect" % sid, {"timeout": 300})
        self.assertIn(st, (200, 201), c)
        self.assertEqual(c["envdAccessToken"], legacy)
        st, data = self.send("POST", "/process.Process/List",
                             {"Content-Type": "application/json", "X-Access-Token": legacy},
                             b"{}")
        self.assertEqual(st, 200, data)
        st, data = self.send("GET", "/health", {"Host": self.host(49983, sid),
                                                "X-Access-Token": legacy})
        self.assertEqual(st, 204, data)
        # and a second start leaves it as it is
        self.restart()
        st, c = self.api("POST", "/sandboxes/%s/connect" % sid, {"timeout": 300})
        self.assertEqual(c["envdAccessToken"], legacy)


if __name__ == "__main__":
    unittest.main(verbosity=2)
