"""Secrets and credential rules (native API) against a real PostgreSQL and spaced-test.

A secret's value goes in and never comes out: not in responses, errors, logs or the
database in the clear. Every call is scoped by team. Without a master key the API says how
to configure one; the embedded default creates <data-dir>/master.key (0600) on first start.
"""
import base64
import os
import stat
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import Platform, Spaced, skip_unless_pg  # noqa: E402

VALUE = "sk-test-VALUE-7c1e0a9b2d4f-never-shown"
VALUE2 = "rotated-VALUE-5d6e7f8091a2"


def psql(pg, sql):
    argv = [os.path.join(pg.bindir, "psql"), "-h", pg.sock, "-U", "postgres", "-d", "space",
            "-At", "-c", sql]
    if pg.as_postgres:
        argv = ["runuser", "-u", "postgres", "--"] + argv
    return subprocess.run(argv, capture_output=True, text=True, check=True, cwd="/").stdout


@skip_unless_pg
class SecretsApiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.master = base64.b64encode(os.urandom(32)).decode()
        cls.p = Platform(teams=("alpha", "beta"), runtime="test",
                         env={"SPACE_MASTER_KEY": cls.master, "SPACE_FAKE_DELAY_MS": "20"})
        cls.s = cls.p.s
        cls.other = cls.p.keys["beta"]

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    def req(self, method, path, body=None, key=None, raw=None):
        st, r = self.s.request(method, path, body, key=key, raw=raw)
        # Whatever the call, no response ever carries a value.
        text = r if isinstance(r, (str, bytes)) else repr(r)
        if isinstance(text, bytes):
            text = text.decode("latin-1")
        self.assertNotIn(VALUE, text)
        self.assertNotIn(VALUE2, text)
        return st, r

    def assertError(self, resp, status, code=None):
        st, body = resp
        self.assertEqual(st, status, body)
        self.assertIn("error", body)
        if code:
            self.assertEqual(body["error"]["code"], code)
        return body["error"]["message"]

    def test_create_list_replace_delete(self):
        st, r = self.req("POST", "/v1/secrets", {"name": "OPENAI", "value": VALUE})
        self.assertEqual(st, 201, r)
        self.assertEqual(r["name"], "OPENAI")
        self.assertNotIn("value", r)
        self.assertTrue(r["created_at"].endswith("Z"))
        self.assertError(self.req("POST", "/v1/secrets", {"name": "OPENAI", "value": "x"}), 409,
                         "conflict")
        st, r = self.req("GET", "/v1/secrets")
        self.assertEqual(st, 200)
        names = [x["name"] for x in r["secrets"]]
        self.assertIn("OPENAI", names)
        for x in r["secrets"]:
            self.assertEqual(sorted(x), ["created_at", "name", "updated_at"])
        st, r = self.req("PUT", "/v1/secrets/OPENAI", raw=('{"value": "%s"}' % VALUE2).encode())
        self.assertEqual(st, 200, r)
        self.assertEqual(r["name"], "OPENAI")
        self.assertError(self.req("PUT", "/v1/secrets/NOPE", raw=b'{"value": "x"}'), 404)
        # Sealed in the database: neither value appears anywhere in the table.
        dump = psql(self.p.pg, "SELECT team_id, name, box FROM secrets")
        self.assertIn("OPENAI", dump)
        self.assertNotIn(VALUE, dump)
        self.assertNotIn(VALUE2, dump)
        self.assertIn("v1:", dump)
        st, r = self.req("DELETE", "/v1/secrets/OPENAI")
        self.assertEqual(st, 200, r)
        self.assertError(self.req("DELETE", "/v1/secrets/OPENAI"), 404, "not_found")
        st, r = self.req("GET", "/v1/secrets")
        self.assertNotIn("OPENAI", [x["name"] for x in r["secrets"]])

    def test_bad_input_never_echoes_the_value(self):
        cases = [
            ({"value": VALUE}, "name"),
            ({"name": "A"}, "value"),
            ({"name": "has space", "value": VALUE}, "name"),
            ({"name": "1digit", "value": VALUE}, "name"),
            ({"name": "A" * 65, "value": VALUE}, "name"),
            ({"name": "A", "value": 42}, "value"),
            ({"name": "A", "value": ""}, "empty"),
            ({"name": "A", "value": VALUE + "\r\nX-Injected: 1"}, "control"),
            ({"name": "A", "value": "x" * 9000}, "longer"),
            ({"name": "A", "value": VALUE, "extra": 1}, "unknown field"),
            ([VALUE], "object"),
        ]
        for body, word in cases:
            msg = self.assertError(self.req("POST", "/v1/secrets", body), 400)
            self.assertIn(word, msg, (body, msg))
            self.assertNotIn("X-Injected", msg)
        # Malformed JSON: the parser's text would quote the body near the error.
        for raw in ['{"name": "A", "value": "%s' % VALUE, '{"name": "A", "value": "%s" x}' % VALUE,
                    '{"name": "A", "name": "B", "value": "%s"}' % VALUE]:
            st, r = self.s.request("POST", "/v1/secrets", raw=raw.encode(),
                                   headers={"Content-Type": "application/json"})
            self.assertEqual(st, 400, r)
            self.assertNotIn(VALUE[:12], repr(r))
            st, r = self.s.request("PUT", "/v1/secrets/A", raw=raw.replace('"name": "A", ', "")
                                   .encode())
            self.assertIn(st, (400, 404), r)
            self.assertNotIn(VALUE[:12], repr(r))
        self.assertError(self.req("PUT", "/v1/secrets/A", raw=b""), 400)
        self.assertError(self.req("PUT", "/v1/secrets/A", raw=b"[1]"), 400)
        big = ('{"name": "A", "value": "%s"}' % ("x" * (2 << 20))).encode()
        self.assertEqual(self.s.request("POST", "/v1/secrets", raw=big)[0], 413)
        self.assertError(self.req("GET", "/v1/secrets", key=""), 401)
        self.assertEqual(self.req("PATCH", "/v1/secrets")[0], 405)

    def test_other_team_sees_nothing(self):
        st, _ = self.req("POST", "/v1/secrets", {"name": "MINE", "value": VALUE})
        self.assertEqual(st, 201)
        st, r = self.req("GET", "/v1/secrets", key=self.other)
        self.assertEqual(st, 200)
        self.assertNotIn("MINE", [x["name"] for x in r["secrets"]])
        self.assertError(self.req("DELETE", "/v1/secrets/MINE", key=self.other), 404)
        self.assertError(self.req("PUT", "/v1/secrets/MINE", raw=b'{"value": "x"}',
                                  key=self.other), 404)
        # The same name in another team is another secret.
        st, _ = self.req("POST", "/v1/secrets", {"name": "MINE", "value": "beta"}, key=self.other)
        self.assertEqual(st, 201)
        # A rule may only name the caller's own secrets.
        rule = [{"host": "api.example.com", "header": "Authorization", "secret": "ALPHAONLY"}]
        self.req("POST", "/v1/secrets", {"name": "ALPHAONLY", "value": VALUE})
        msg = self.assertError(self.req("POST", "/v1/sandboxes",
                                        {"template": "base", "credentials": rule},
                                        key=self.other), 400)
        self.assertIn("ALPHAONLY", msg)
        sid, _ = self.s.create(credentials=rule)
        self.assertError(self.req("GET", "/v1/sandboxes/%s/credentials" % sid, key=self.other),
                         404)
        self.assertError(self.req("PUT", "/v1/sandboxes/%s/credentials" % sid,
                                  raw=b'{"credentials": []}', key=self.other), 404)
        self.req("DELETE", "/v1/sandboxes/" + sid)

    def test_credentials_at_create_and_put(self):
        self.req("POST", "/v1/secrets", {"name": "GH", "value": VALUE})
        rules = [{"host": "API.GitHub.com", "header": "Authorization", "secret": "GH",
                  "format": "token {secret}"},
                 {"host": "*.example.org", "header": "X-Api-Key", "secret": "GH"}]
        st, r = self.req("POST", "/v1/sandboxes", {"template": "base", "credentials": rules})
        self.assertEqual(st, 202, r)
        sid = r["sandbox"]["id"]
        st, r = self.req("GET", "/v1/sandboxes/%s/credentials" % sid)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["credentials"][0], {"host": "api.github.com", "header": "Authorization",
                                               "secret": "GH", "format": "token {secret}"})
        self.assertEqual(r["credentials"][1]["format"], "{secret}")
        # Replace, then clear.
        new = [{"host": "api.example.com", "header": "Authorization", "secret": "GH",
                "format": "Bearer {secret}"}]
        st, r = self.req("PUT", "/v1/sandboxes/%s/credentials" % sid,
                         raw=('{"credentials": %s}' % __import__("json").dumps(new)).encode())
        self.assertEqual(st, 200, r)
        self.assertEqual(r["credentials"][0]["host"], "api.example.com")
        st, r = self.req("PUT", "/v1/sandboxes/%s/credentials" % sid, raw=b'{"credentials": []}')
        self.assertEqual((st, r["credentials"]), (200, []))
        # Bad rules, at create and with PUT.
        bad = [
            ([{"host": "a.com", "header": "Authorization", "secret": "MISSING"}], "MISSING"),
            ([{"host": "a.com", "header": "Host", "secret": "GH"}], "Host"),
            ([{"host": "https://a.com/", "header": "A", "secret": "GH"}], "host"),
            ([{"host": "a.com", "header": "A", "secret": "GH", "format": "no placeholder"}],
             "{secret}"),
            ([{"host": "a.com", "header": "A"}], "secret"),
            ({"host": "a.com"}, "array"),
            ([{"host": "a.com", "header": "A", "secret": "GH", "x": 1}], "unknown"),
        ]
        for rules, word in bad:
            msg = self.assertError(self.req("POST", "/v1/sandboxes",
                                            {"template": "base", "credentials": rules}), 400)
            self.assertIn(word, msg)
            msg = self.assertError(self.req(
                "PUT", "/v1/sandboxes/%s/credentials" % sid,
                raw=__import__("json").dumps({"credentials": rules}).encode()), 400)
            self.assertIn(word, msg)
        self.assertError(self.req("PUT", "/v1/sandboxes/%s/credentials" % sid, raw=b"{}"), 400)
        self.assertError(self.req("PUT", "/v1/sandboxes/%s/credentials" % sid, raw=b"not json"),
                         400)
        self.assertError(self.req("GET", "/v1/sandboxes/nosuchsandbox/credentials"), 404)
        self.assertError(self.req("PUT", "/v1/sandboxes/nosuchsandbox/credentials",
                                  raw=b'{"credentials": []}'), 404)
        self.req("DELETE", "/v1/sandboxes/" + sid)

    def test_zz_log_never_has_a_value(self):
        # Runs last (name order): everything above went through this server.
        with open(self.s.log_path) as f:
            log = f.read()
        self.assertNotIn(VALUE, log)
        self.assertNotIn(VALUE2, log)
        self.assertNotIn(self.master, log)

    def test_openapi_documents_secrets(self):
        st, doc = self.req("GET", "/v1/openapi.json")
        self.assertEqual(st, 200)
        self.assertIn("/v1/secrets", doc["paths"])
        self.assertIn("/v1/secrets/{name}", doc["paths"])
        self.assertIn("/v1/sandboxes/{id}/credentials", doc["paths"])


@skip_unless_pg
class MasterKeyTest(unittest.TestCase):
    def test_without_a_key_the_api_says_how(self):
        p = Platform(teams=(None,), start=False, runtime="test")
        s = p.s
        s.env.pop("SPACE_MASTER_KEY", None)
        try:
            s.start()
            st, r = s.request("POST", "/v1/secrets", {"name": "A", "value": VALUE})
            self.assertEqual(st, 503, r)
            self.assertIn("SPACE_MASTER_KEY", r["error"]["message"])
            self.assertEqual(s.request("GET", "/v1/secrets")[0], 503)
            st, r = s.request("POST", "/v1/sandboxes", {"template": "base", "credentials": [
                {"host": "a.com", "header": "A", "secret": "B"}]})
            self.assertEqual(st, 503, r)
            self.assertFalse(os.path.exists(os.path.join(s.data_dir, "master.key")))
        finally:
            p.destroy()

    def test_bad_key_stops_the_server_without_showing_it(self):
        s = Spaced(runtime="test", env={"SPACE_MASTER_KEY": "bm90LTMyLWJ5dGVz"})
        try:
            with self.assertRaises(AssertionError) as cm:
                s.start(timeout=30)
            self.assertIn("SPACE_MASTER_KEY", str(cm.exception))
            self.assertNotIn("bm90LTMyLWJ5dGVz", str(cm.exception))
        finally:
            s.destroy()

    def test_embedded_default_creates_and_keeps_master_key(self):
        s = Spaced(runtime="test")
        s.env.pop("SPACE_MASTER_KEY", None)
        try:
            s.start()
            path = os.path.join(s.data_dir, "master.key")
            st = os.stat(path)
            self.assertEqual(stat.S_IMODE(st.st_mode), 0o600)
            with open(path) as f:
                first = f.read()
            self.assertEqual(len(base64.b64decode(first.strip())), 32)
            self.assertEqual(s.request("POST", "/v1/secrets", {"name": "E", "value": VALUE})[0],
                             201)
            s.stop()
            s.start()
            with open(path) as f:
                self.assertEqual(f.read(), first)
            self.assertEqual([x["name"] for x in s.request("GET", "/v1/secrets")[1]["secrets"]],
                             ["E"])
            self.assertNotIn(first.strip(), s.read_log())
        finally:
            s.destroy()


if __name__ == "__main__":
    unittest.main()
