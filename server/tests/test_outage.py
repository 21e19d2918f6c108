"""Database outage: PostgreSQL stops under a running spaced; requests get 503 with a
JSON error; when it comes back the server recovers by itself. And readiness: /healthz is not
200 before the node's worker row is in, so a create sent after it never finds no worker."""
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, pg_bindir, skip_unless_pg  # noqa: E402


@skip_unless_pg
class OutageTest(unittest.TestCase):
    def test_postgres_goes_away_and_comes_back(self):
        p = Platform(teams=(None,), start=False, runtime="test", env={"SPACE_FAKE_DELAY_MS": "20"})
        s, pg = p.s, p.pg
        try:
            s.start()
            sid, _ = s.create()
            pg.stop()
            for path in ("/v1/sandboxes", "/v1/sandboxes/" + sid, "/v1/templates"):
                st, body = s.request("GET", path)
                self.assertEqual(st, 503, (path, body))
                self.assertEqual(body["error"]["code"], "unavailable")
            st, body = s.request("POST", "/v1/sandboxes", {"template": "base"})
            self.assertEqual(st, 503, body)
            st, body = s.request("GET", "/healthz")
            self.assertEqual(st, 503, body)
            self.assertIsNone(s.proc.poll(), "spaced died during the outage")

            pg.start()
            deadline = time.time() + 20 * MULT
            while time.time() < deadline:
                if s.request("GET", "/healthz")[0] == 200:
                    break
                time.sleep(0.2)
            else:
                self.fail("no recovery:\n" + s.read_log())
            # Requests work again, the controller too (a new create reaches running).
            deadline = time.time() + 10 * MULT
            while time.time() < deadline:
                st, body = s.request("GET", "/v1/sandboxes/" + sid)
                if st == 200:
                    break
                time.sleep(0.2)
            self.assertEqual((st, body["state"]), (200, "running"), body)
            sid2, _ = s.create()
            st, sb = s.request("GET", "/v1/sandboxes/" + sid2)
            self.assertEqual(sb["state"], "running")
        finally:
            p.destroy()

    def test_not_ready_until_the_worker_is_registered(self):
        # A transaction holds the workers table, so spaced's registration waits for it: the
        # database answers, but placement would find no worker. /healthz must say so (503,
        # starting), and be 200 only once the row is in; a create right after succeeds.
        p = Platform(teams=(None,), start=False, runtime="test")
        s = p.s
        psql = subprocess.Popen([os.path.join(pg_bindir(), "psql"), "-X", "-q", "-A", "-t", "-v",
                                 "ON_ERROR_STOP=1", p.pg.url], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            psql.stdin.write("BEGIN;\nLOCK TABLE workers IN SHARE MODE;\nSELECT 'held';\n")
            psql.stdin.flush()
            self.assertEqual(psql.stdout.readline(), "held\n")
            s.start(wait=False)
            seen = None
            deadline = time.time() + 20 * MULT
            while time.time() < deadline:
                self.assertIsNone(s.proc.poll(), s.read_log())
                try:
                    st, body = s.request("GET", "/healthz", key="")
                except OSError:
                    time.sleep(0.05)
                    continue
                self.assertNotEqual(st, 200, body)  # the row cannot be in yet
                if st == 503 and body.get("status") == "starting":
                    seen = body
                    break
                time.sleep(0.05)
            self.assertIsNotNone(seen, "no 503 starting while the row was held:\n" + s.read_log())
            self.assertEqual(seen["database"], "up")
            time.sleep(0.5)  # still held: still not ready
            self.assertEqual(s.request("GET", "/healthz", key="")[0], 503)
            psql.stdin.write("COMMIT;\n")
            psql.stdin.close()
            self.assertEqual(psql.wait(timeout=30 * MULT), 0, psql.stderr.read())
            deadline = time.time() + 20 * MULT
            while time.time() < deadline:
                st, body = s.request("GET", "/healthz", key="")
                if st == 200:
                    break
                time.sleep(0.05)
            self.assertEqual((st, body["status"]), (200, "ok"), body)
            st, body = s.request("POST", "/v1/sandboxes", {"template": "base"})
            self.assertEqual(st, 202, body)
        finally:
            if psql.poll() is None:
                psql.kill()
                psql.wait()
            psql.stdout.close()
            psql.stderr.close()
            p.destroy()


if __name__ == "__main__":
    unittest.main()
