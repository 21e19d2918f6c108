"""Crash safety on real microVMs: spaced is killed with SIGKILL at random moments during 50
mixed lifecycle operations on 5 sandboxes; after the last restart every sandbox converges to
its desired state and still has its files.

Needs SP_TEST_DATA_DIR with a built base template (the e2e.template fixture), and root.
SP_TEST_SEED picks the random sequence (printed, so a failure can be replayed).
"""
import os
import random
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, Platform, wait_s  # noqa: E402
from test_vm_api import skip_reason  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
TARGET = {"pause": "paused", "suspend": "suspended", "wake": "running"}


@unittest.skipIf(skip_reason(), skip_reason())
class FaultTest(unittest.TestCase):
    def test_sigkill_during_lifecycle_converges(self):
        seed = int(os.environ.get("SP_TEST_SEED", str(int(time.time()))))
        rnd = random.Random(seed)
        print("\nfault test seed %d" % seed, file=sys.stderr)
        p = Platform(teams=(None,), start=False, binary=os.environ["SPACED"], data_dir=DATA)
        s = p.s
        ids = []
        try:
            s.start()
            desired = {}
            for i in range(5):
                st, r = s.request("POST", "/v1/sandboxes?wait=%d" % wait_s(120),
                                  {"template": "base", "metadata": {"fault": str(seed)}},
                                  timeout=130 * MULT)
                self.assertEqual(r["operation"]["status"], "succeeded", r)
                sid = r["sandbox"]["id"]
                st, c = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                                  {"cmd": "echo %s-%d > /home/user/mark" % (sid, i)}, timeout=60)
                self.assertEqual((st, c["exit_code"]), (200, 0), c)
                ids.append(sid)
                desired[sid] = "running"

            kills = 0
            done = 0
            while done < 50:
                sid = rnd.choice(ids)
                verb = rnd.choice(["pause", "suspend", "wake", "wake"])
                try:
                    st, r = s.request("POST", "/v1/sandboxes/%s/%s" % (sid, verb), timeout=30)
                except OSError:
                    continue
                if st == 202:
                    desired[sid] = TARGET[verb]
                else:
                    self.assertEqual(st, 409, r)  # refused transitions change nothing
                done += 1
                time.sleep(rnd.uniform(0, 0.4))
                if rnd.random() < 0.2:
                    s.kill()  # SIGKILL at a random moment: actions may be mid-flight
                    kills += 1
                    time.sleep(rnd.uniform(0, 0.3))
                    s.start()
            print("fault test: 50 operations, %d SIGKILLs" % kills, file=sys.stderr)

            # Convergence: every sandbox reaches the state its last accepted request asked for.
            deadline = time.time() + 300 * MULT
            pending = set(ids)
            while pending and time.time() < deadline:
                for sid in list(pending):
                    st, sb = s.request("GET", "/v1/sandboxes/" + sid)
                    self.assertEqual(st, 200, sb)
                    self.assertNotEqual(sb["state"], "failed", sb)
                    if sb["state"] == desired[sid] and sb["desired_state"] == desired[sid]:
                        pending.discard(sid)
                time.sleep(0.5)
            self.assertEqual(pending, set(), "not converged: %s\n%s" % (
                {x: s.request("GET", "/v1/sandboxes/" + x)[1] for x in pending}, s.read_log()))

            # Files survived every path the sandbox took.
            for i, sid in enumerate(ids):
                if desired[sid] != "running":
                    st, r = s.request("POST", "/v1/sandboxes/%s/wake?wait=%d" % (sid, wait_s(60)),
                                      timeout=70 * MULT)
                    self.assertEqual(r["operation"]["status"], "succeeded", r)
                st, c = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                                  {"cmd": "cat /home/user/mark"}, timeout=60)
                self.assertEqual((st, c.get("stdout")), (200, "%s-%d\n" % (sid, i)),
                                 (sid, c, s.read_log()))
        finally:
            for sid in ids:  # after a failure too
                s.delete_quietly(sid)
            p.destroy()


if __name__ == "__main__":
    unittest.main()
