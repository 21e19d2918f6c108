"""Sandbox snapshots ("forks") on the native API, against a real PostgreSQL and spaced-test
(the test driver's checkpoint writes <data-dir>/fake/<snapshot>.ckpt; a boot from a snapshot
records it in <sandbox>.from)."""
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, PlatformTest, skip_unless_pg  # noqa: E402


def fake(s, name):
    return os.path.join(s.data_dir, "fake", name)


@skip_unless_pg
class SnapshotTest(PlatformTest):
    def req(self, *a, **kw):
        return self.s.request(*a, **kw)

    def assertError(self, resp, status, code=None, says=None):
        st, body = resp
        self.assertEqual(st, status, body)
        self.assertIn("error", body, body)
        if code:
            self.assertEqual(body["error"]["code"], code)
        if says:
            self.assertIn(says, body["error"]["message"])

    def snap(self, sid, status=201, **body):
        st, r = self.req("POST", "/v1/sandboxes/%s/snapshots?wait=30" % sid, body)
        self.assertEqual(st, status, r)
        return r

    def test_take_and_fork(self):
        sid, _ = self.s.create(env={"A": "1"}, cpu_count=2, memory_mb=512)
        r = self.snap(sid)
        sn, op = r["snapshot"], r["operation"]
        self.assertRegex(sn["id"], r"^snap-[a-z0-9]{16}$")
        self.assertEqual((sn["state"], sn["sandbox_id"], sn["template"], sn["cpu_count"],
                          sn["memory_mb"], sn["name"], sn["error"]),
                         ("ready", sid, "base", 2, 512, None, None))
        self.assertEqual((op["kind"], op["status"], op["sandbox_id"], op["snapshot_id"]),
                         ("snapshot", "succeeded", sid, sn["id"]))
        self.assertTrue(os.path.exists(fake(self.s, sn["id"] + ".ckpt")))
        # the source goes on running, and its operation is an ordinary one
        self.assertEqual(self.req("GET", "/v1/sandboxes/" + sid)[1]["state"], "running")
        self.assertEqual(self.s.wait_op(op["id"])["snapshot_id"], sn["id"])
        st, got = self.req("GET", "/v1/snapshots/" + sn["id"])
        self.assertEqual((st, got), (200, sn))
        forks = []
        for _ in range(3):
            st, c = self.req("POST", "/v1/sandboxes?wait=30", {"snapshot": sn["id"],
                                                               "env": {"B": "2"}})
            self.assertEqual(st, 200, c)
            self.assertEqual(c["operation"]["status"], "succeeded", c)
            fb = c["sandbox"]
            self.assertEqual((fb["state"], fb["template"], fb["cpu_count"], fb["memory_mb"]),
                             ("running", "base", 2, 512))
            with open(fake(self.s, fb["id"] + ".from")) as f:
                self.assertEqual(f.read().strip(), sn["id"])
            forks.append(fb["id"])
        self.assertEqual(len(set(forks + [sid])), 4)
        # a wake of a fork is an ordinary restore
        st, r = self.req("POST", "/v1/sandboxes/%s/suspend?wait=30" % forks[0])
        self.assertEqual(r["sandbox"]["state"], "suspended", r)
        st, r = self.req("POST", "/v1/sandboxes/%s/wake?wait=30" % forks[0])
        self.assertEqual(r["sandbox"]["state"], "running", r)

    def test_async_and_paused_source(self):
        sid, _ = self.s.create()
        st, r = self.req("POST", "/v1/sandboxes/%s/pause?wait=30" % sid)
        self.assertEqual(r["sandbox"]["state"], "paused", r)
        st, r = self.req("POST", "/v1/sandboxes/%s/snapshots" % sid, {"name": "Paused-One"})
        self.assertEqual(st, 202, r)
        self.assertEqual((r["snapshot"]["state"], r["operation"]["status"]),
                         ("creating", "running"))
        self.assertEqual(r["snapshot"]["name"], "paused-one")
        op = self.s.wait_op(r["operation"]["id"])
        self.assertEqual(op["status"], "succeeded", op)
        st, sn = self.req("GET", "/v1/snapshots/" + r["snapshot"]["id"])
        self.assertEqual(sn["state"], "ready")
        self.assertEqual(self.req("GET", "/v1/sandboxes/" + sid)[1]["state"], "paused")

    def test_bad_input(self):
        sid, _ = self.s.create()
        path = "/v1/sandboxes/%s/snapshots" % sid
        self.assertError(self.req("POST", path, raw=b"{", headers={"Content-Type":
                                                                   "application/json"}), 400)
        self.assertError(self.req("POST", path, raw=b"[]", headers={"Content-Type":
                                                                    "application/json"}), 400)
        self.assertError(self.req("POST", path, {"name": 5}), 400, "invalid_argument")
        self.assertError(self.req("POST", path, {"nmae": "x"}), 400)
        self.assertError(self.req("POST", path, {"name": "Bad Name!"}), 400, says="alias")
        self.assertError(self.req("POST", path, {"name": "x:"}), 400)
        self.assertError(self.req("POST", path, {"name": "a" * 65}), 400)
        self.assertError(self.req("POST", "/v1/sandboxes/nosuchsandbox/snapshots", {}), 404)
        self.assertError(self.req("POST", "/v1/sandboxes/NOT-AN-ID/snapshots", {}), 404)
        self.assertError(self.req("POST", path, {}, key=self.other_key), 404)
        self.assertError(self.req("GET", "/v1/snapshots/snap-0000000000000000"), 404)
        self.assertError(self.req("GET", "/v1/snapshots/nope"), 404)
        self.assertError(self.req("DELETE", "/v1/snapshots/nope"), 404)
        self.assertError(self.req("PUT", "/v1/snapshots"), 405)
        sn = self.snap(sid)["snapshot"]
        # another team sees nothing of it
        self.assertError(self.req("GET", "/v1/snapshots/" + sn["id"], key=self.other_key), 404)
        self.assertError(self.req("DELETE", "/v1/snapshots/" + sn["id"], key=self.other_key), 404)
        self.assertEqual(self.req("GET", "/v1/snapshots", key=self.other_key)[1]["snapshots"], [])
        self.assertError(self.req("POST", "/v1/sandboxes", {"snapshot": sn["id"]},
                                  key=self.other_key), 404, says="not found")
        # creates: both, wrong types, sizes, unknown
        self.assertError(self.req("POST", "/v1/sandboxes", {"snapshot": sn["id"],
                                                            "template": "base"}), 400,
                         says="not both")
        self.assertError(self.req("POST", "/v1/sandboxes", {"snapshot": 7}), 400)
        self.assertError(self.req("POST", "/v1/sandboxes", {"snapshot": sn["id"],
                                                            "cpu_count": 2}), 400)
        self.assertError(self.req("POST", "/v1/sandboxes", {"snapshot": "snap-zzzzzzzzzzzzzzzz"}),
                         404, says="not found")
        self.assertError(self.req("POST", "/v1/sandboxes", {"snapshot": "../x"}), 404)
        self.assertError(self.req("POST", "/v1/sandboxes", {}), 400)
        # only a running or paused sandbox
        st, r = self.req("POST", "/v1/sandboxes/%s/suspend?wait=30" % sid)
        self.assertEqual(r["sandbox"]["state"], "suspended", r)
        self.assertError(self.req("POST", path, {}), 409, "conflict", says="suspended")
        st, r = self.req("DELETE", "/v1/sandboxes/%s?wait=30" % sid)
        self.assertEqual(st, 200, r)
        self.assertError(self.req("POST", path, {}), 404)
        # sandboxes made from it outlive their source
        st, c = self.req("POST", "/v1/sandboxes?wait=30", {"snapshot": sn["id"]})
        self.assertEqual(c["sandbox"]["state"], "running", c)

    def test_names(self):
        sid, _ = self.s.create()
        a = self.snap(sid, name="web:default")["snapshot"]
        self.assertEqual(a["name"], "web")
        # a name is a pointer: a new snapshot under it takes it, the older keeps its id
        a2 = self.snap(sid, name="WEB")["snapshot"]
        self.assertEqual(a2["name"], "web")
        st, old = self.req("GET", "/v1/snapshots/" + a["id"])
        self.assertEqual((st, old["name"]), (200, None), old)
        st, c = self.req("POST", "/v1/sandboxes?wait=30", {"snapshot": a["id"]})
        self.assertEqual(c["sandbox"]["state"], "running", c)
        self.assertEqual(self.req("DELETE", "/v1/snapshots/" + a2["id"])[0], 200)
        b = self.snap(sid, name="web:v1.2")["snapshot"]
        self.assertEqual(b["name"], "web:v1.2")
        self.assertEqual(self.req("DELETE", "/v1/snapshots/" + a["id"])[0], 200)
        self.assertEqual(self.snap(sid, name="web")["snapshot"]["name"], "web")

    def test_failed_snapshot(self):
        sid, _ = self.s.create(env={"SPACE_FAKE_FAIL": "checkpoint"})
        r = self.snap(sid, status=200)
        self.assertEqual(r["snapshot"]["state"], "failed")
        self.assertIn("injected", r["snapshot"]["error"])
        self.assertEqual(r["operation"]["status"], "failed")
        self.assertIn("injected", r["operation"]["error"]["message"])
        self.assertEqual(self.req("GET", "/v1/sandboxes/" + sid)[1]["state"], "running")
        self.assertError(self.req("POST", "/v1/sandboxes", {"snapshot": r["snapshot"]["id"]}),
                         409, says="failed")
        self.assertEqual(self.req("DELETE", "/v1/snapshots/" + r["snapshot"]["id"])[0], 200)

    def test_list_and_pages(self):
        a, _ = self.s.create(metadata={"list": "1"})
        b, _ = self.s.create(metadata={"list": "2"})
        ids = [self.snap(a)["snapshot"]["id"] for _ in range(3)]
        other = self.snap(b)["snapshot"]["id"]
        st, r = self.req("GET", "/v1/snapshots?sandbox_id=%s&limit=2" % a)
        self.assertEqual(st, 200, r)
        self.assertEqual([x["id"] for x in r["snapshots"]], ids[::-1][:2])
        self.assertIsNotNone(r["next_cursor"])
        st, r2 = self.req("GET", "/v1/snapshots?sandbox_id=%s&limit=2&cursor=%s"
                          % (a, r["next_cursor"]))
        self.assertEqual([x["id"] for x in r2["snapshots"]], ids[:1])
        self.assertIsNone(r2["next_cursor"])
        st, r = self.req("GET", "/v1/snapshots?limit=1000")
        got = [x["id"] for x in r["snapshots"]]
        self.assertTrue(set(ids + [other]) <= set(got))
        self.assertEqual(self.req("GET", "/v1/snapshots?sandbox_id=NOPE")[1]["snapshots"], [])
        self.assertError(self.req("GET", "/v1/snapshots?limit=0"), 400)
        self.assertError(self.req("GET", "/v1/snapshots?cursor=bogus"), 400)
        self.assertError(self.req("GET", "/v1/snapshots?cursor=12_snap-x"), 400)

    def test_delete_twice(self):
        sid, _ = self.s.create()
        sn = self.snap(sid)["snapshot"]
        st, c = self.req("POST", "/v1/sandboxes?wait=30", {"snapshot": sn["id"]})
        fork = c["sandbox"]["id"]
        st, r = self.req("DELETE", "/v1/snapshots/" + sn["id"])
        self.assertEqual((st, r), (200, {"id": sn["id"], "deleted": True}))
        self.assertFalse(os.path.exists(fake(self.s, sn["id"] + ".ckpt")))
        self.assertError(self.req("DELETE", "/v1/snapshots/" + sn["id"]), 404)
        self.assertError(self.req("GET", "/v1/snapshots/" + sn["id"]), 404)
        self.assertNotIn(sn["id"], [x["id"] for x in
                                    self.req("GET", "/v1/snapshots")[1]["snapshots"]])
        self.assertError(self.req("POST", "/v1/sandboxes", {"snapshot": sn["id"]}), 404)
        self.assertEqual(self.req("GET", "/v1/sandboxes/" + fork)[1]["state"], "running")


@skip_unless_pg
class SnapshotRestartTest(unittest.TestCase):
    """A snapshot being taken when spaced dies is failed at the next start."""

    def test_crash_left_creating(self):
        p = Platform(teams=("alpha",), runtime="test", env={"SPACE_FAKE_DELAY_MS": "1500"})
        try:
            s = p.s
            sid, _ = s.create()
            st, r = s.request("POST", "/v1/sandboxes/%s/snapshots" % sid, {})
            self.assertEqual(st, 202, r)
            snap_id, op_id = r["snapshot"]["id"], r["operation"]["id"]
            s.kill()  # SIGKILL before the driver's 1.5 s are up
            s.start()
            deadline = time.time() + 10 * MULT
            while True:
                st, sn = s.request("GET", "/v1/snapshots/" + snap_id)
                if sn["state"] != "creating" or time.time() > deadline:
                    break
                time.sleep(0.1)
            self.assertEqual(sn["state"], "failed", sn)
            self.assertIn("restarted", sn["error"])
            op = s.wait_op(op_id)
            self.assertEqual(op["status"], "failed", op)
            self.assertFalse(os.path.exists(fake(s, snap_id + ".ckpt")))
            st, r = s.request("POST", "/v1/sandboxes", {"snapshot": snap_id})
            self.assertEqual(st, 409, r)
            # a new one is taken as usual after the restart
            st, r = s.request("POST", "/v1/sandboxes/%s/snapshots?wait=30" % sid, {})
            self.assertEqual((st, r["snapshot"]["state"]), (201, "ready"), r)
        finally:
            p.destroy()


@skip_unless_pg
class SnapshotLimitTest(PlatformTest):
    """A team keeps at most SPACE_SNAP_TEAM_MAX snapshots (not deleted, not failed); another
    team is not held back by it; a delete makes room."""
    ENV = {"SPACE_SNAP_TEAM_MAX": "2"}

    def test_team_limit(self):
        sid, _ = self.s.create()
        path = "/v1/sandboxes/%s/snapshots?wait=30" % sid
        made = []
        for _ in range(2):
            st, r = self.s.request("POST", path, {})
            self.assertEqual(st, 201, r)
            made.append(r["snapshot"]["id"])
        st, r = self.s.request("POST", path, {})
        self.assertEqual(st, 409, r)
        self.assertIn("the most it may keep", r["error"]["message"])
        other = self.other_key
        st, c = self.s.request("POST", "/v1/sandboxes?wait=30", {"template": "base"}, key=other)
        self.assertEqual(st, 200, c)
        st, r = self.s.request("POST", "/v1/sandboxes/%s/snapshots?wait=30" % c["sandbox"]["id"],
                               {}, key=other)
        self.assertEqual(st, 201, r)
        self.assertEqual(self.s.request("DELETE", "/v1/snapshots/" + made[0])[0], 200)
        st, r = self.s.request("POST", path, {})
        self.assertEqual(st, 201, r)


if __name__ == "__main__":
    unittest.main(verbosity=2)
