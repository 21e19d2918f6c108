"""Per-team quotas (core/control/svc.h) on both surfaces, against a real PostgreSQL and
spaced-test: small server defaults (--team-max-*), over a quota 429 naming it, its limit and
the use; deleting or suspending frees a place, pausing does not; `spaced teams set-quota`
overrides one team's limits; concurrent creates for the last place: exactly one wins. The
snapshot-disk quota: the fake driver writes each snapshot's files at SNAP bytes and measures
them, so suspends and sandbox snapshots hold a known size; past the limit a client's suspend
(E2B pause) and a snapshot (both APIs) are 429, deleting frees it."""
import os
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, pg_bindir, skip_unless_pg, wait_s  # noqa: E402

SB = {"template": "base", "cpu_count": 1, "memory_mb": 256}
MIB = 1 << 20
SNAP = 3 * MIB  # each snapshot's files (SPACE_FAKE_SNAPSHOT_BYTES), against a 5 MiB default


@skip_unless_pg
class QuotaTest(unittest.TestCase):
    TEAMS = ("alpha", "beta", "gamma", "delta", "e2b", "cpu", "disk", "e2bdisk", "e2bsize")

    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=cls.TEAMS, runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20", "SPACE_FAKE_SNAPSHOT_BYTES": str(SNAP)},
                         args=["--team-max-sandboxes", "3", "--team-max-vcpus", "8",
                               "--team-max-memory-mb", "4096", "--team-max-snapshot-mb", "5"])
        cls.s = cls.p.s

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    def key(self, team):
        return self.p.keys[team]

    def create(self, team, **body):
        """POST /v1/sandboxes as team: (status, body)."""
        return self.s.request("POST", "/v1/sandboxes", dict(SB, **body), key=self.key(team))

    def created(self, team, **body):
        st, r = self.create(team, **body)
        self.assertEqual(st, 202, r)
        return r["sandbox"]["id"]

    def running(self, team):
        """A new sandbox of team's, running: its id."""
        return self.s.create_ready(wait=30, key=self.key(team), **SB)

    def delete(self, team, sid):
        st, r = self.s.request("DELETE", "/v1/sandboxes/%s?wait=%d" % (sid, wait_s(30)),
                               key=self.key(team), timeout=wait_s(30) + 10)
        self.assertEqual(st, 200, r)

    def act(self, team, sid, what):
        st, r = self.s.request("POST", "/v1/sandboxes/%s/%s?wait=%d" % (sid, what, wait_s(30)),
                               key=self.key(team), timeout=wait_s(30) + 10)
        return st, r

    def assertOver(self, resp, *says):
        st, body = resp
        self.assertEqual(st, 429, body)
        self.assertEqual(body["error"]["code"], "quota_exceeded", body)
        for s in says:
            self.assertIn(s, body["error"]["message"])

    def test_sandboxes_default_delete_frees_and_other_team_unaffected(self):
        sids = [self.created("alpha") for _ in range(3)]
        self.assertOver(self.create("alpha"), "team quota exceeded", "sandboxes",
                        "3 running or paused", "limit 3")
        # another team is not held back by alpha's use
        other = self.created("beta")
        self.delete("beta", other)
        # deleting frees the place at once
        self.delete("alpha", sids.pop())
        sids.append(self.created("alpha"))
        self.assertOver(self.create("alpha"), "limit 3")
        for sid in sids:
            self.delete("alpha", sid)

    def test_paused_counts_suspended_does_not(self):
        sids = [self.running("gamma") for _ in range(3)]
        st, r = self.act("gamma", sids[0], "pause")
        self.assertEqual(st, 200, r)
        self.assertOver(self.create("gamma"), "3 running or paused")
        st, r = self.act("gamma", sids[1], "suspend")
        self.assertEqual(st, 200, r)
        self.assertEqual(r["sandbox"]["state"], "suspended", r)
        extra = self.created("gamma")
        # waking the suspended one would make 4 running or paused
        self.assertOver(self.act("gamma", sids[1], "wake"), "sandboxes", "limit 3")
        self.delete("gamma", extra)
        st, r = self.act("gamma", sids[1], "wake")
        self.assertEqual(st, 200, r)
        for sid in sids:
            self.delete("gamma", sid)

    def test_vcpus_and_memory(self):
        a = self.created("cpu", cpu_count=6, memory_mb=1024)
        self.assertOver(self.create("cpu", cpu_count=4), "vCPUs", "6 in use + 4 asked",
                        "limit 8")
        b = self.created("cpu", cpu_count=1, memory_mb=2048)
        self.assertOver(self.create("cpu", memory_mb=2048),
                        "memory", "3072 MiB in use + 2048 asked", "limit 4096 MiB")
        self.delete("cpu", a)
        self.delete("cpu", b)

    def test_set_quota_overrides_one_team(self):
        self.s.cli("teams", "set-quota", "delta", "--sandboxes", "1", "--vcpus", "64")
        line = [ln for ln in self.s.cli("teams", "list").stdout.splitlines()
                if " delta " in ln][0].split()
        self.assertEqual(line[-4:], ["1", "64", "default", "default"])
        sid = self.created("delta")
        self.assertOver(self.create("delta"), "1 running or paused", "limit 1")
        # back to the server's default (3)
        self.s.cli("teams", "set-quota", "delta", "--sandboxes", "default")
        more = [self.created("delta") for _ in range(2)]
        self.assertOver(self.create("delta"), "limit 3")
        for x in [sid] + more:
            self.delete("delta", x)
        # bad values and unknown teams are refused
        r = self.s.cli("teams", "set-quota", "delta", "--sandboxes", "-1", check=False)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--sandboxes", r.stderr)
        r = self.s.cli("teams", "set-quota", "nosuch", "--vcpus", "2", check=False)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("not found", r.stderr)
        r = self.s.cli("teams", "set-quota", "delta", check=False)
        self.assertEqual(r.returncode, 2, r.stderr)

    def test_concurrent_creates_for_the_last_place(self):
        self.s.cli("teams", "set-quota", "delta", "--sandboxes", "1")
        try:
            for _ in range(3):
                n = 8
                start = threading.Barrier(n)
                results = [None] * n

                def go(i):
                    start.wait()
                    results[i] = self.create("delta")

                threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                won = [r for st, r in results if st == 202]
                self.assertEqual(len(won), 1, results)
                self.assertEqual(sorted(st for st, _ in results), [202] + [429] * (n - 1),
                                 results)
                self.delete("delta", won[0]["sandbox"]["id"])
        finally:
            self.s.cli("teams", "set-quota", "delta", "--sandboxes", "default")

    def test_create_waits_for_a_create_in_flight_and_counts_it(self):
        # Deterministic form of the race: another server's create for the last place holds the
        # team's row (space_team_quota) and has written its sandbox, not yet committed. Ours
        # must wait for it, then count its row: 429, never a second sandbox.
        self.s.cli("teams", "set-quota", "delta", "--sandboxes", "1")
        psql = subprocess.Popen([os.path.join(pg_bindir(), "psql"), "-X", "-q", "-A", "-t", "-v",
                                 "ON_ERROR_STOP=1", self.p.pg.url], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sid = "quotaraceinflight01"
        try:
            psql.stdin.write(
                "BEGIN;\n"
                "SELECT space_team_quota(id, 1, 256, 3, 8, 4096) FROM teams WHERE name = 'delta';\n"
                "INSERT INTO sandboxes (id, team_id, template, cpu_count, memory_mb, access_token)"
                " SELECT '%s', id, 'base', 1, 256, 'quota-race-token' FROM teams"
                " WHERE name = 'delta';\n"
                "SELECT 'held';\n" % sid)
            psql.stdin.flush()
            self.assertEqual([psql.stdout.readline(), psql.stdout.readline()],
                             ["t\n", "held\n"])
            results = []
            t = threading.Thread(target=lambda: results.append(self.create("delta")))
            t.start()
            self.wait_for_lock()
            self.assertTrue(t.is_alive(), results)
            psql.stdin.write("COMMIT;\nSELECT 'committed';\n")
            psql.stdin.flush()
            self.assertEqual(psql.stdout.readline(), "committed\n")
            t.join(30 * MULT)
            self.assertOver(results[0], "1 running or paused", "limit 1")
            psql.stdin.write("UPDATE sandboxes SET desired_state = 'deleted' WHERE id = '%s';\n"
                             "SELECT pg_notify('space_sandbox', '%s');\n" % (sid, sid))
            psql.stdin.close()
            self.assertEqual(psql.wait(timeout=30 * MULT), 0, psql.stderr.read())
        finally:
            if psql.poll() is None:
                psql.kill()
                psql.wait()
            psql.stdout.close()
            psql.stderr.close()
            self.s.cli("teams", "set-quota", "delta", "--sandboxes", "default")

    def wait_for_lock(self):
        """Returns once a statement of spaced's waits for a lock (the team's row)."""
        deadline = time.time() + 30 * MULT
        while time.time() < deadline:
            r = subprocess.run([os.path.join(pg_bindir(), "psql"), "-X", "-A", "-t",
                                self.p.pg.url, "-c",
                                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type ="
                                " 'Lock' AND query LIKE 'WITH t AS%'"],
                               capture_output=True, text=True, timeout=30)
            if r.stdout.strip() == "1":
                return
            time.sleep(0.05)
        self.fail("no create waited for the team's row")

    def test_admin_api_sets_and_shows_quotas(self):
        admin = self.s.cli("admin-key", "rotate").stdout.strip()

        def req(method, path, body=None):
            return self.s.request(method, "/v1/admin" + path, body, key=admin)

        st, t = req("POST", "/teams", {"name": "adm"})
        self.assertEqual(st, 201, t)
        self.assertEqual(t["quota"], {"sandboxes": None, "vcpus": None, "memory_mb": None,
                                      "snapshot_mb": None})
        key = self.s.cli("keys", "create", "--team", "adm").stdout.strip()
        st, t = req("POST", "/teams/adm/quota", {"sandboxes": 1, "memory_mb": 512,
                                                 "snapshot_mb": 0})
        self.assertEqual((st, t["quota"]), (200, {"sandboxes": 1, "vcpus": None,
                                                  "memory_mb": 512, "snapshot_mb": 0}), t)
        st, teams = req("GET", "/teams")
        self.assertEqual([x["quota"] for x in teams["teams"] if x["name"] == "adm"],
                         [{"sandboxes": 1, "vcpus": None, "memory_mb": 512, "snapshot_mb": 0}])
        self.assertIn("adm", self.s.cli("teams", "list").stdout)
        st, r = self.s.request("POST", "/v1/sandboxes", dict(SB, memory_mb=1024), key=key)
        self.assertOver((st, r), "memory: 0 MiB in use + 1024 asked, limit 512 MiB")
        st, r = self.s.request("POST", "/v1/sandboxes?wait=%d" % wait_s(30), SB, key=key,
                               timeout=wait_s(30) + 10)
        self.assertEqual(st, 200, r)
        sid = r["sandbox"]["id"]
        self.assertOver(self.s.request("POST", "/v1/sandboxes", SB, key=key), "limit 1")
        # snapshot disk 0: no snapshot may be held, so none may be written
        self.assertOver(self.s.request("POST", "/v1/sandboxes/%s/snapshots" % sid, {}, key=key),
                        "snapshot disk: 0 MiB held, limit 0 MiB")
        # absent fields are left, null goes back to the default
        st, t = req("POST", "/teams/%s/quota" % t["id"], {"sandboxes": None})
        self.assertEqual((st, t["quota"]), (200, {"sandboxes": None, "vcpus": None,
                                                  "memory_mb": 512, "snapshot_mb": 0}), t)
        for bad in ({"sandboxes": -1}, {"vcpus": "2"}, {"disk": 1}, {"sandboxes": 2 ** 40},
                    {"snapshot_mb": -5}, {"snapshot_mb": 1.5}):
            st, r = req("POST", "/teams/adm/quota", bad)
            self.assertEqual(st, 400, (bad, r))
        st, r = req("POST", "/teams/nosuch/quota", {"vcpus": 1})
        self.assertEqual(st, 404, r)
        st, r = self.s.request("POST", "/v1/admin/teams/adm/quota", {"vcpus": 1}, key=key)
        self.assertEqual(st, 401, r)
        st, r = self.s.request("DELETE", "/v1/sandboxes/%s?wait=%d" % (sid, wait_s(30)), key=key,
                               timeout=wait_s(30) + 10)
        self.assertEqual(st, 200, r)

    def snapshot(self, team, sid):
        """POST /v1/sandboxes/{sid}/snapshots?wait= as team: (status, body)."""
        return self.s.request("POST", "/v1/sandboxes/%s/snapshots?wait=%d" % (sid, wait_s(30)),
                              {}, key=self.key(team), timeout=wait_s(30) + 10)

    def psql(self, sql):
        r = subprocess.run([os.path.join(pg_bindir(), "psql"), "-X", "-A", "-t", self.p.pg.url,
                            "-c", sql], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout.strip()

    def test_snapshot_disk_native(self):
        a, b, c = (self.running("disk") for _ in range(3))
        # the limit (5 MiB) is checked before, the size (3 MiB each) measured after
        for sid in (a, b):
            st, r = self.act("disk", sid, "suspend")
            self.assertEqual((st, r["sandbox"]["state"]), (200, "suspended"), r)
            self.assertEqual(r["sandbox"]["snapshot_bytes"], SNAP, r)
        self.assertOver(self.act("disk", c, "suspend"), "team quota exceeded",
                        "snapshot disk: 6 MiB held, limit 5 MiB")
        self.assertOver(self.snapshot("disk", c), "snapshot disk: 6 MiB held, limit 5 MiB")
        st, r = self.s.request("GET", "/v1/sandboxes/" + c, key=self.key("disk"))
        self.assertEqual(r["state"], "running", r)  # refused, not half done
        # a wake frees what the suspend held
        st, r = self.act("disk", a, "wake")
        self.assertEqual(st, 200, r)
        self.assertEqual(r["sandbox"]["snapshot_bytes"], 0, r)
        st, r = self.snapshot("disk", c)
        self.assertEqual(st, 201, r)
        snap = r["snapshot"]
        self.assertEqual((snap["state"], snap["bytes"]), ("ready", SNAP), snap)
        # 3 MiB suspended + 3 MiB snapshot
        self.assertOver(self.act("disk", a, "suspend"), "6 MiB held, limit 5 MiB")
        self.assertOver(self.snapshot("disk", a), "6 MiB held, limit 5 MiB")
        # deleting the snapshot frees its share
        st, r = self.s.request("DELETE", "/v1/snapshots/" + snap["id"], key=self.key("disk"))
        self.assertEqual(st, 200, r)
        st, r = self.act("disk", a, "suspend")
        self.assertEqual(st, 200, r)
        # the team's own limit overrides the default, and the listing shows it
        self.s.cli("teams", "set-quota", "disk", "--snapshot-mb", "100")
        try:
            line = [ln for ln in self.s.cli("teams", "list").stdout.splitlines()
                    if " disk " in ln][0].split()
            self.assertEqual(line[-4:], ["default", "default", "default", "100"])
            st, r = self.act("disk", c, "suspend")
            self.assertEqual(st, 200, r)
            self.assertEqual(self.psql(
                "SELECT sum(snapshot_bytes) FROM sandboxes s JOIN teams t ON t.id = s.team_id"
                " WHERE t.name = 'disk' AND s.observed_state <> 'deleted'"), str(3 * SNAP))
            r = self.s.cli("teams", "set-quota", "disk", "--snapshot-mb", "x", check=False)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("--snapshot-mb", r.stderr)
        finally:
            self.s.cli("teams", "set-quota", "disk", "--snapshot-mb", "default")
        # the server's suspends (a deadline's) are never refused, even past the limit
        st, r = self.act("disk", c, "wake")
        self.assertEqual(st, 200, r)
        d = self.s.create_ready(wait=30, key=self.key("disk"), timeout_s=1,
                                deadline_action="suspend", **SB)
        deadline = time.time() + 30 * MULT
        while time.time() < deadline:
            st, r = self.s.request("GET", "/v1/sandboxes/" + d, key=self.key("disk"))
            if r["state"] == "suspended":
                break
            time.sleep(0.2)
        self.assertEqual((r["state"], r["snapshot_bytes"]), ("suspended", SNAP), r)
        for sid in (a, b, c, d):
            self.delete("disk", sid)

    def e2b(self, team, method, path, body=None):
        return self.s.request(method, path, body, key="",
                              headers={"X-API-KEY": self.key(team)}, timeout=120)

    def test_e2b_snapshot_disk(self):
        sids = []
        for _ in range(3):
            st, sb = self.e2b("e2bdisk", "POST", "/sandboxes", {"templateID": "base",
                                                                 "timeout": 600})
            self.assertEqual(st, 201, sb)
            sids.append(sb["sandboxID"])
        for sid in sids[:2]:
            st, r = self.e2b("e2bdisk", "POST", "/sandboxes/%s/pause" % sid)
            self.assertEqual(st, 204, r)
        st, body = self.e2b("e2bdisk", "POST", "/sandboxes/%s/pause" % sids[2])
        self.assertEqual((st, body["code"]), (429, 429), body)
        self.assertIn("team quota exceeded: snapshot disk: 6 MiB held, limit 5 MiB",
                      body["message"])
        st, body = self.e2b("e2bdisk", "POST", "/sandboxes/%s/snapshots" % sids[2], {})
        self.assertEqual((st, body["code"]), (429, 429), body)
        self.assertIn("snapshot disk: 6 MiB held, limit 5 MiB", body["message"])
        # the refused pause left it running, with its deadline
        st, r = self.e2b("e2bdisk", "GET", "/sandboxes/" + sids[2])
        self.assertEqual((st, r["state"]), (200, "running"), r)
        st, _ = self.e2b("e2bdisk", "DELETE", "/sandboxes/" + sids[0])
        self.assertEqual(st, 204)
        st, body = self.e2b("e2bdisk", "POST", "/sandboxes/%s/snapshots" % sids[2], {})
        self.assertEqual(st, 201, body)
        for sid in sids[1:]:
            self.e2b("e2bdisk", "DELETE", "/sandboxes/" + sid)

    def test_e2b_vcpus_memory_and_resume(self):
        # E2B creates take the template's size (base: 1 vCPU, 256 MiB)
        try:
            self.s.cli("teams", "set-quota", "e2bsize", "--vcpus", "1")
            st, a = self.e2b("e2bsize", "POST", "/sandboxes", {"templateID": "base",
                                                                "timeout": 600})
            self.assertEqual(st, 201, a)
            st, body = self.e2b("e2bsize", "POST", "/sandboxes", {"templateID": "base"})
            self.assertEqual((st, body["code"]), (429, 429), body)
            self.assertIn("vCPUs: 1 in use + 1 asked, limit 1", body["message"])
            self.s.cli("teams", "set-quota", "e2bsize", "--vcpus", "default", "--memory-mb",
                       "300")
            st, body = self.e2b("e2bsize", "POST", "/sandboxes", {"templateID": "base"})
            self.assertEqual((st, body["code"]), (429, 429), body)
            self.assertIn("memory: 256 MiB in use + 256 asked, limit 300 MiB", body["message"])
            # a resume (wake of a paused = suspended sandbox) holds its share anew
            st, r = self.e2b("e2bsize", "POST", "/sandboxes/%s/pause" % a["sandboxID"])
            self.assertEqual(st, 204, r)
            st, b = self.e2b("e2bsize", "POST", "/sandboxes", {"templateID": "base"})
            self.assertEqual(st, 201, b)
            st, body = self.e2b("e2bsize", "POST", "/sandboxes/%s/resume" % a["sandboxID"],
                                {"timeout": 600})
            self.assertEqual((st, body["code"]), (429, 429), body)
            self.assertIn("memory: 256 MiB in use + 256 asked, limit 300 MiB", body["message"])
            self.e2b("e2bsize", "DELETE", "/sandboxes/" + b["sandboxID"])
            st, r = self.e2b("e2bsize", "POST", "/sandboxes/%s/resume" % a["sandboxID"],
                             {"timeout": 600})
            self.assertEqual(st, 201, r)
            self.e2b("e2bsize", "DELETE", "/sandboxes/" + a["sandboxID"])
        finally:
            self.s.cli("teams", "set-quota", "e2bsize", "--vcpus", "default", "--memory-mb",
                       "default")

    def test_e2b_over_quota_is_429(self):
        h = {"X-API-KEY": self.key("e2b")}

        def create():
            return self.s.request("POST", "/sandboxes", {"templateID": "base", "timeout": 600},
                                  key="", headers=h, timeout=120)

        sids = []
        for _ in range(3):
            st, sb = create()
            self.assertEqual(st, 201, sb)
            sids.append(sb["sandboxID"])
        st, body = create()
        self.assertEqual(st, 429, body)
        self.assertEqual(body["code"], 429)
        self.assertIn("team quota exceeded: sandboxes: 3 running or paused, limit 3",
                      body["message"])
        st, _ = self.s.request("DELETE", "/sandboxes/" + sids.pop(), key="", headers=h)
        self.assertEqual(st, 204)
        st, sb = create()
        self.assertEqual(st, 201, sb)
        sids.append(sb["sandboxID"])
        for sid in sids:
            self.s.request("DELETE", "/sandboxes/" + sid, key="", headers=h)


if __name__ == "__main__":
    unittest.main()
