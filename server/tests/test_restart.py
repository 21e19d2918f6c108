"""Restart: spaced killed with SIGKILL mid-work on the embedded default, then started
again on the same data directory. Every record and operation is still there and the
controller finishes what was in flight."""
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Spaced, skip_unless_pg  # noqa: E402


@skip_unless_pg
class RestartTest(unittest.TestCase):
    def test_sigkill_and_restart_keeps_everything(self):
        # Slow actions so that the kill lands while boots are in flight.
        s = Spaced(runtime="test", env={"SPACE_FAKE_DELAY_MS": "1500"})
        try:
            s.start()
            self.assertTrue(s.key, "first start wrote no api-key file")
            self.assertEqual(os.stat(os.path.join(s.data_dir, "api-key")).st_mode & 0o777, 0o600)
            created = {}
            for i in range(4):
                sid, op = s.create(wait=False, metadata={"i": str(i)})
                created[sid] = op
            # one settled sandbox with a pending pause, to kill mid-pause too
            time.sleep(0.3)
            s.kill()  # SIGKILL: no cleanup, the embedded PostgreSQL keeps running

            s.env["SPACE_FAKE_DELAY_MS"] = "50"
            s.start()
            st, body = s.request("GET", "/v1/sandboxes?limit=100")
            self.assertEqual(st, 200, body)
            self.assertEqual({x["id"] for x in body["sandboxes"]}, set(created))
            for sid, op in created.items():
                o = s.wait_op(op, timeout=60)
                self.assertEqual(o["status"], "succeeded", (sid, o, s.read_log()))
                st, sb = s.request("GET", "/v1/sandboxes/" + sid)
                self.assertEqual(sb["state"], "running", sb)

            # Kill in the middle of a pause, restart, and the pause still completes.
            sid = next(iter(created))
            s.kill()
            s.env["SPACE_FAKE_DELAY_MS"] = "1500"
            s.start()
            st, r = s.request("POST", "/v1/sandboxes/%s/pause" % sid)
            self.assertEqual(st, 202, r)
            time.sleep(0.5)
            s.kill()
            s.env["SPACE_FAKE_DELAY_MS"] = "50"
            s.start()
            o = s.wait_op(r["operation"]["id"], timeout=60)
            self.assertEqual(o["status"], "succeeded", (o, s.read_log()))
            st, sb = s.request("GET", "/v1/sandboxes/" + sid)
            self.assertEqual(sb["state"], "paused")

            # A clean stop stops the embedded cluster too.
            s.stop()
            pidfile = os.path.join(s.data_dir, "pg", "data", "postmaster.pid")
            deadline = time.time() + 20 * MULT
            while os.path.exists(pidfile) and time.time() < deadline:
                time.sleep(0.1)
            self.assertFalse(os.path.exists(pidfile), "PostgreSQL still running after SIGTERM")
        finally:
            s.destroy()
            # a SIGKILLed spaced leaves its cluster running: stop it
            data = os.path.join(s.data_dir, "pg", "data")
            if os.path.exists(os.path.join(data, "postmaster.pid")):
                os.system("runuser -u postgres -- /usr/lib/postgresql/*/bin/pg_ctl -D %s -m immediate stop >/dev/null 2>&1" % data)


if __name__ == "__main__":
    unittest.main()
