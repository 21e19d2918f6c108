"""Operating a running platform: the management commands beside a serving spaced on the
embedded PostgreSQL (keys, teams, admin-key), and the admin API (/v1/admin) with its key.
Runs on the test driver (no VMs)."""
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Spaced, skip_unless_pg  # noqa: E402


def read(path):
    with open(path) as f:
        return f.read().strip()


@skip_unless_pg
class OpsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = Spaced(runtime="test")
        try:
            cls.s.start()
        except BaseException:
            cls.s.destroy()
            raise
        cls.admin = read(os.path.join(cls.s.data_dir, "admin-key"))

    @classmethod
    def tearDownClass(cls):
        cls.s.destroy()

    def eventually_status(self, path, key, want, timeout=10):
        """Revocation reaches a server through NOTIFY: allow it a moment."""
        deadline = time.time() + timeout * MULT
        while True:
            st, body = self.s.request("GET", path, key=key)
            if st == want or time.time() > deadline:
                return st, body
            time.sleep(0.1)

    def admin_req(self, method, path, body=None, key=None, raw=None):
        return self.s.request(method, "/v1/admin" + path, body=body, raw=raw,
                              key=self.admin if key is None else key)

    # ---- the command line beside serve ----

    def test_key_files(self):
        for name in ("api-key", "admin-key"):
            st = os.stat(os.path.join(self.s.data_dir, name))
            self.assertEqual(st.st_mode & 0o777, 0o600, name)
        self.assertTrue(self.admin.startswith("sk_"))
        self.assertNotEqual(self.admin, self.s.key)
        self.assertIn("admin key", self.s.read_log())

    def test_keys_while_serving(self):
        r = self.s.cli("keys", "create", "--team", "other", "--name", "ops test")
        key = r.stdout.strip()
        self.assertTrue(key.startswith("sk_"), r)
        self.assertIn("for team other", r.stderr)
        st, body = self.s.request("GET", "/v1/sandboxes", key=key)
        self.assertEqual(st, 200, body)
        self.assertEqual(body["sandboxes"], [])
        # its sandbox is its team's alone
        st, r2 = self.s.request("POST", "/v1/sandboxes", {"template": "base"}, key=key)
        self.assertEqual(st, 202, r2)
        sid = r2["sandbox"]["id"]
        st, mine = self.s.request("GET", "/v1/sandboxes", key=key)
        self.assertEqual([x["id"] for x in mine["sandboxes"]], [sid])
        st, theirs = self.s.request("GET", "/v1/sandboxes/" + sid)
        self.assertEqual(st, 404, theirs)

        out = self.s.cli("keys", "list").stdout
        prefix = key[:11]
        line = next(l for l in out.splitlines() if prefix in l)
        self.assertIn("other", line)
        kid = line.split()[0]
        only = self.s.cli("keys", "list", "--team", "other").stdout.splitlines()
        self.assertEqual(len(only), 2, only)  # header and the one key
        self.assertIn(prefix, only[1])

        self.s.request("DELETE", "/v1/sandboxes/%s?wait=30" % sid, key=key, timeout=40)
        self.s.cli("keys", "revoke", kid)
        st, body = self.eventually_status("/v1/sandboxes", key, 401)
        self.assertEqual(st, 401, body)
        self.assertEqual(body["error"]["code"], "unauthenticated", body)
        r = self.s.cli("keys", "revoke", kid, check=False)
        self.assertEqual(r.returncode, 1)
        self.assertIn("no active key", r.stderr)
        # the serving process is untouched
        st, _ = self.s.request("GET", "/v1/sandboxes")
        self.assertEqual(st, 200)

    def test_teams_while_serving(self):
        r = self.s.cli("teams", "create", "cli-team")
        self.assertEqual(len(r.stdout.strip()), 20, r)
        out = self.s.cli("teams", "list").stdout
        self.assertIn("cli-team", out)
        self.assertIn("default", out)
        r = self.s.cli("teams", "create", "cli-team", check=False)
        self.assertEqual(r.returncode, 1)
        self.assertIn("exists", r.stderr)
        for bad in ("has space", "", ".dot", "x" * 65, "slash/no"):
            r = self.s.cli("teams", "create", bad, check=False)
            self.assertEqual(r.returncode, 2, (bad, r))
            self.assertIn("team name", r.stderr)
        r = self.s.cli("teams", "frobnicate", check=False)
        self.assertEqual(r.returncode, 2)

    def test_pool_and_prebuild_options(self):
        """--pool-size, --pool-memory-mb, --pool-reserve-mb, --prebuild-sizes and
        --egress-memory-mb (also config-file keys) take their ranges and refuse anything else
        before anything starts."""
        for opt, bad in (("--pool-size", "257"), ("--pool-size", "-1"), ("--pool-memory-mb", "0"),
                         ("--pool-memory-mb", "x"), ("--prebuild-sizes", "65"),
                         ("--prebuild-sizes", ""), ("--pool-reserve-mb", "-1"),
                         ("--pool-reserve-mb", "1G"), ("--egress-memory-mb", "63"),
                         ("--egress-memory-mb", "1G")):
            r = self.s.cli("serve", opt, bad, check=False)
            self.assertEqual(r.returncode, 2, (opt, bad, r))
            self.assertIn(opt + " wants", r.stderr)
        conf = os.path.join(self.s.data_dir, "bad-pool.conf")
        with open(conf, "w") as f:
            f.write("pool-size = 999\n")
        r = self.s.cli("serve", "--config", conf, check=False)
        self.assertEqual((r.returncode, "--pool-size wants" in r.stderr), (2, True), r)
        with open(conf, "w") as f:
            f.write("egress-memory-mb = 10\n")
        r = self.s.cli("serve", "--config", conf, check=False)
        self.assertEqual((r.returncode, "--egress-memory-mb wants" in r.stderr), (2, True), r)

    def test_template_list_while_serving(self):
        r = self.s.cli("template", "list")
        self.assertIn("base", r.stdout)

    # ---- the admin API ----

    def test_admin_auth(self):
        st, body = self.admin_req("GET", "/teams", key="")
        self.assertEqual(st, 401, body)
        self.assertEqual(body["error"]["code"], "unauthenticated")
        st, body = self.admin_req("GET", "/teams", key=self.s.key)  # a team's key
        self.assertEqual(st, 401, body)
        st, body = self.admin_req("GET", "/teams", key="sk_" + "x" * 43)
        self.assertEqual(st, 401, body)
        st, body = self.admin_req("GET", "/teams", key="k" * 5000)
        self.assertEqual(st, 401, body)
        # the admin key opens no team route
        for path in ("/v1/sandboxes", "/v1/templates", "/v1/secrets"):
            st, body = self.s.request("GET", path, key=self.admin)
            self.assertEqual(st, 401, (path, body))
        st, body = self.admin_req("GET", "/teams")
        self.assertEqual(st, 200, body)
        self.assertIn("default", [t["name"] for t in body["teams"]])

    def test_admin_onboarding(self):
        st, team = self.admin_req("POST", "/teams", {"name": "acme"})
        self.assertEqual(st, 201, team)
        self.assertEqual(team["name"], "acme")
        self.assertEqual(team["active_keys"], 0)
        self.assertEqual(len(team["id"]), 20)
        st, body = self.admin_req("POST", "/teams", {"name": "acme"})
        self.assertEqual(st, 409, body)
        self.assertEqual(body["error"]["code"], "conflict")

        st, k1 = self.admin_req("POST", "/teams/acme/keys", {"name": "ci"})
        self.assertEqual(st, 201, k1)
        self.assertTrue(k1["key"].startswith("sk_"))
        self.assertEqual(k1["prefix"], k1["key"][:11])
        self.assertEqual((k1["team"], k1["team_id"], k1["name"]), ("acme", team["id"], "ci"))
        self.assertIsNone(k1["revoked_at"])
        st, k2 = self.admin_req("POST", "/teams/%s/keys" % team["id"], raw=b"")  # by ID, no body
        self.assertEqual(st, 201, k2)
        self.assertEqual(k2["name"], "")

        st, body = self.s.request("GET", "/v1/sandboxes", key=k1["key"])
        self.assertEqual(st, 200, body)

        st, lst = self.admin_req("GET", "/teams/acme/keys")
        self.assertEqual(st, 200, lst)
        self.assertEqual([k["id"] for k in lst["keys"]], [k1["id"], k2["id"]])
        self.assertTrue(all("key" not in k for k in lst["keys"]))  # secrets are shown once
        st, teams = self.admin_req("GET", "/teams")
        acme = next(t for t in teams["teams"] if t["name"] == "acme")
        self.assertEqual(acme["active_keys"], 2)

        st, rv = self.admin_req("DELETE", "/teams/acme/keys/" + k1["id"])
        self.assertEqual(st, 200, rv)
        self.assertEqual(rv["id"], k1["id"])
        self.assertIsNotNone(rv["revoked_at"])
        st, body = self.eventually_status("/v1/sandboxes", k1["key"], 401)
        self.assertEqual(st, 401, body)
        st, body = self.s.request("GET", "/v1/sandboxes", key=k2["key"])
        self.assertEqual(st, 200, body)
        st, body = self.admin_req("DELETE", "/teams/acme/keys/" + k1["id"])
        self.assertEqual(st, 404, body)
        # by prefix, too
        st, rv = self.admin_req("DELETE", "/teams/acme/keys/" + k2["prefix"])
        self.assertEqual(st, 200, rv)
        st, lst = self.admin_req("GET", "/teams/acme/keys")
        self.assertTrue(all(k["revoked_at"] for k in lst["keys"]), lst)
        # the CLI sees what the API made
        self.assertIn(k1["prefix"], self.s.cli("keys", "list", "--team", "acme").stdout)

    def test_admin_team_scope(self):
        self.admin_req("POST", "/teams", {"name": "t-one"})
        self.admin_req("POST", "/teams", {"name": "t-two"})
        st, k = self.admin_req("POST", "/teams/t-one/keys", {})
        self.assertEqual(st, 201, k)
        # another team's key ID is not found through this team
        st, body = self.admin_req("DELETE", "/teams/t-two/keys/" + k["id"])
        self.assertEqual(st, 404, body)
        st, body = self.s.request("GET", "/v1/sandboxes", key=k["key"])
        self.assertEqual(st, 200, body)
        st, lst = self.admin_req("GET", "/teams/t-two/keys")
        self.assertEqual((st, lst["keys"]), (200, []))

    def test_admin_bad_input(self):
        cases = [
            ("POST", "/teams", None, b"", 400),
            ("POST", "/teams", None, b"{not json", 400),
            ("POST", "/teams", None, b"[1,2]", 400),
            ("POST", "/teams", {}, None, 400),
            ("POST", "/teams", {"name": 5}, None, 400),
            ("POST", "/teams", {"name": None}, None, 400),
            ("POST", "/teams", {"name": "ok", "extra": 1}, None, 400),
            ("POST", "/teams", {"name": "has space"}, None, 400),
            ("POST", "/teams", {"name": ""}, None, 400),
            ("POST", "/teams", {"name": "x" * 65}, None, 400),
            ("POST", "/teams", {"name": "nul\u0000byte"}, None, 400),
            ("POST", "/teams", {"name": "caf\u00e9"}, None, 400),
            ("POST", "/teams/default/keys", {"name": 3}, None, 400),
            ("POST", "/teams/default/keys", {"name": "n" * 129}, None, 400),
            ("POST", "/teams/default/keys", {"nom": "x"}, None, 400),
            ("POST", "/teams/default/keys", None, b"\"str\"", 400),
            ("POST", "/teams/no-such-team/keys", {}, None, 404),
            ("POST", "/teams/" + "t" * 1000 + "/keys", {}, None, 404),
            ("GET", "/teams/no-such-team/keys", None, None, 404),
            ("GET", "/teams/%27%3B%20drop%20table%20teams/keys", None, None, 404),
            ("DELETE", "/teams/default/keys/nope", None, None, 404),
            ("DELETE", "/teams/default/keys/" + "k" * 500, None, None, 404),
            ("DELETE", "/teams/no-such-team/keys/nope", None, None, 404),
            ("PUT", "/teams", None, b"{}", 405),
            ("DELETE", "/teams", None, None, 405),
            ("GET", "/teams/default/keys/x", None, None, 405),
            ("GET", "/nothing", None, None, 404),
            ("GET", "", None, None, 404),
        ]
        for method, path, body, raw, want in cases:
            st, r = self.admin_req(method, path, body=body, raw=raw)
            self.assertEqual(st, want, (method, path, body, raw, r))
            self.assertIsInstance(r, dict, (method, path))
            self.assertIn("code", r["error"], (method, path))
        big = b'{"name":"' + b"a" * (2 * 1024 * 1024) + b'"}'
        st, r = self.admin_req("POST", "/teams", raw=big)
        self.assertEqual(st, 413, r)
        # still serving
        st, _ = self.admin_req("GET", "/teams")
        self.assertEqual(st, 200)

    def test_openapi_has_admin(self):
        st, doc = self.s.request("GET", "/v1/openapi.json")
        self.assertEqual(st, 200)
        for p in ("/v1/admin/teams", "/v1/admin/teams/{team}/keys",
                  "/v1/admin/teams/{team}/keys/{key}"):
            self.assertIn(p, doc["paths"])

    def test_zz_admin_key_rotate(self):  # last: it changes the admin key
        r = self.s.cli("admin-key", "rotate")
        new = r.stdout.strip()
        self.assertTrue(new.startswith("sk_"))
        self.assertEqual(read(os.path.join(self.s.data_dir, "admin-key")), new)
        self.assertEqual(os.stat(os.path.join(self.s.data_dir, "admin-key")).st_mode & 0o777,
                         0o600)
        st, body = self.admin_req("GET", "/teams", key=self.admin)
        self.assertEqual(st, 401, body)
        st, body = self.admin_req("GET", "/teams", key=new)
        self.assertEqual(st, 200, body)
        type(self).admin = new


@skip_unless_pg
class StoppedTest(unittest.TestCase):
    def test_commands_without_serve(self):
        """No serve running: the command starts the embedded cluster itself, and stops it."""
        s = Spaced(runtime="test")
        try:
            s.start()
            s.stop()
            key = s.cli("keys", "create", "--team", "later").stdout.strip()
            self.assertIn("later", s.cli("teams", "list").stdout)
            pidfile = os.path.join(s.data_dir, "pg", "data", "postmaster.pid")
            self.assertFalse(os.path.exists(pidfile), "the command left PostgreSQL running")
            s.start()
            st, body = s.request("GET", "/v1/sandboxes", key=key)
            self.assertEqual(st, 200, body)
            # the admin key is made once: a restart keeps it
            st, body = s.request("GET", "/v1/admin/teams",
                                 key=read(os.path.join(s.data_dir, "admin-key")))
            self.assertEqual(st, 200, body)
        finally:
            s.destroy()


if __name__ == "__main__":
    unittest.main()
