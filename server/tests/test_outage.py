"""Database outage: PostgreSQL stops under a running spaced; requests get 503 with a
JSON error; when it comes back the server recovers by itself."""
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, skip_unless_pg  # noqa: E402


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


if __name__ == "__main__":
    unittest.main()
