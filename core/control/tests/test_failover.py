"""PostgreSQL failover to a standby at another address, under a running fleet (one API node and
two workers on the test driver, core/control/fleet.h). The nodes' --database-url names both
servers, as libpq reads it; spaced connects only to one that takes writes
(target_session_attrs=read-write unless the URL says otherwise). The primary crashes; while
the standby is still read-only every node answers 503 and connects nowhere; once it is
promoted every node finds it by itself. Replication is synchronous, so every write
acknowledged before the crash is there; no worker is declared lost (the promoted server's
postmaster started long before: the sweep's own lease renewals, broken by the outage, are
what hold it back); every sandbox still runs on its worker, in the state it was left in;
lifecycle and creates work again."""
import os
import shutil
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
from harness import PgCluster, skip_unless_pg, tmpdir, wait_until  # noqa: E402
from test_fleet import FleetClient, fake_state  # noqa: E402

TIMEOUT_S = 2  # --heartbeat-timeout-s


def psql(pg, sql):
    """One query on pg's database "space", its rows as text lines (-At); None when it fails
    (the server is down)."""
    argv = [os.path.join(pg.bindir, "psql"), "-h", pg.sock, "-U", "postgres", "-At", "-v",
            "ON_ERROR_STOP=1", "-c", sql, "space"]
    if pg.as_postgres:
        argv = ["runuser", "-u", "postgres", "--"] + argv
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                       cwd="/", timeout=30)
    return r.stdout.strip() if r.returncode == 0 else None


@skip_unless_pg
class FailoverTest(FleetClient, unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.primary = PgCluster()
        cls.standby = None
        cls.shared = tmpdir("sp-shared-")
        cls.nodes = []
        try:
            cls.standby = cls.primary.standby()
        except BaseException:
            cls.tearDownClass()
            raise
        # no target_session_attrs: spaced asks for read-write itself
        url = ("host=%s,%s port=5432,5432 dbname=space user=postgres"
               % (cls.primary.sock, cls.standby.sock))
        env = {"SPACE_FAKE_DELAY_MS": "20", "SPACE_FAKE_SHARED_DIR": cls.shared}
        fleet = ["--heartbeat-timeout-s", str(TIMEOUT_S), "--lost-grace-s", "8"]
        cls.start_fleet(url, env, fleet, ("a", "b"), 4)  # tears the class down on a failure

    @classmethod
    def tearDownClass(cls):
        for n in cls.nodes:
            n.destroy()
        for pg in (cls.standby, cls.primary):
            if pg is not None:
                pg.destroy()
        shutil.rmtree(cls.shared, ignore_errors=True)

    def test_failover_to_standby(self):
        sids = [self.created(placement={"labels": {"zone": z}}) for z in ("a", "b")]
        for sid in sids:
            self.wait_state(sid, "running")
        st, r = self.act(sids[1], "pause")  # acknowledged just before the crash
        self.assertEqual(st, 200, r)
        # the standby has it (synchronous replication), and is read-only
        self.assertEqual(psql(self.standby, "SELECT pg_is_in_recovery()"), "t")
        self.assertEqual(psql(self.standby, "SELECT desired_state FROM sandboxes WHERE id = '%s'"
                              % sids[1]), "paused")
        gens = psql(self.primary, "SELECT id || ' ' || generation || ' ' || state FROM workers "
                    "ORDER BY id")
        self.assertEqual(len(gens.splitlines()), 2, gens)

        self.primary.crash()
        time.sleep(TIMEOUT_S * 2)
        # no server takes writes: the nodes do not settle for the read-only standby
        st, r = self.api.request("GET", "/v1/sandboxes/" + sids[0])
        self.assertEqual(st, 503, r)
        self.assertEqual(psql(self.standby, "SELECT count(*) FROM pg_stat_activity WHERE "
                              "datname = 'space' AND backend_type = 'client backend' AND "
                              "application_name <> 'psql'"), "0")
        t0 = time.monotonic()
        self.standby.promote()
        wait_until(lambda: all(n.request("GET", "/healthz")[0] == 200 for n in self.nodes),
                   "every node healthy on the promoted standby", 30, 0.1)
        back_s = time.monotonic() - t0
        wait_until(lambda: self.api.request("GET", "/v1/sandboxes/" + sids[0])[0] == 200,
                   "the API reads again", 30, 0.1)
        print("failover: every node healthy %.2f s after the promotion" % back_s, flush=True)
        time.sleep(TIMEOUT_S * 3)  # sweeps judge heartbeats again by now
        # nothing lost: the workers as they were, each sandbox on its worker in its state
        self.assertEqual(psql(self.standby, "SELECT id || ' ' || generation || ' ' || state "
                              "FROM workers ORDER BY id"), gens)
        self.assertEqual(psql(self.standby, "SELECT count(*) FROM events WHERE kind = 'lost'"),
                         "0")
        for sid, w, want in zip(sids, self.workers, ("running", "paused")):
            got = self.state(sid)
            self.assertEqual((got["state"], got["error"]), (want, None), got)
            self.assertEqual(fake_state(w, sid), want)
        # every node's connections are on the new primary, and it all works there
        n = psql(self.standby, "SELECT count(DISTINCT pid) FROM pg_stat_activity WHERE "
                 "datname = 'space' AND backend_type = 'client backend'")
        self.assertGreaterEqual(int(n), len(self.nodes), n)
        st, r = self.act(sids[1], "wake")
        self.assertEqual(st, 200, r)
        self.assertEqual(fake_state(self.workers[1], sids[1]), "running")
        for z in ("a", "b"):
            self.wait_state(self.created(placement={"labels": {"zone": z}}), "running")
        st, r = self.api.request("GET", "/v1/sandboxes?limit=100")
        self.assertEqual((st, len(r["sandboxes"])), (200, 4), r)
        self.delete_all()


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    unittest.main(verbosity=2)
