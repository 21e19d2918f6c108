"""E2B's snapshots (spec e2b-templates.md section 4) against a real PostgreSQL and spaced-test
(the test driver's checkpoint): create_snapshot, list_snapshots, delete_snapshot and creates
from a snapshot id, as the SDKs send them."""
import os
import re
import sys
import unittest
import urllib.parse

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import PlatformTest, skip_unless_pg  # noqa: E402


@skip_unless_pg
class E2BSnapshotTest(PlatformTest):
    def req(self, method, path, body=None, key=None, raw=None):
        h = {"X-API-KEY": self.s.key if key is None else key}
        return self.s.request(method, path, body=body, key="", raw=raw, headers=h, timeout=120)

    def raw_req(self, method, path):
        r, text = self.s.exchange(method, path, headers={"X-API-KEY": self.s.key}, timeout=60)
        import json
        return r.status, (json.loads(text) if text else None), r

    def assertError(self, resp, status, says=None):
        st, body = resp
        self.assertEqual(st, status, body)
        self.assertEqual(body["code"], status)
        self.assertIsInstance(body["message"], str)
        if says:
            self.assertIn(says, body["message"])

    def create(self, template="base"):
        st, sb = self.req("POST", "/sandboxes", {"templateID": template, "timeout": 600})
        self.assertEqual(st, 201, sb)
        return sb["sandboxID"]

    def test_snapshot_and_create_from_it(self):
        sid = self.create()
        st, info = self.req("POST", "/sandboxes/%s/snapshots" % sid, {})
        self.assertEqual(st, 201, info)
        self.assertRegex(info["snapshotID"], r"^snap-[a-z0-9]{16}:default$")
        self.assertEqual(info["names"], [])
        # the sandbox keeps running
        st, d = self.req("GET", "/sandboxes/" + sid)
        self.assertEqual(d["state"], "running")
        snap = info["snapshotID"]
        for tid in (snap, snap[: -len(":default")]):
            st, sb = self.req("POST", "/sandboxes", {"templateID": tid, "timeout": 600})
            self.assertEqual(st, 201, sb)
            self.assertNotEqual(sb["sandboxID"], sid)
            self.assertEqual(sb["templateID"], "base")
        # named: <team namespace>/<alias>:<tag>
        st, named = self.req("POST", "/sandboxes/%s/snapshots" % sid, {"name": "conf-snap"})
        self.assertEqual(st, 201, named)
        m = re.match(r"^([a-z0-9]{20})/conf-snap:default$", named["snapshotID"])
        self.assertIsNotNone(m, named)
        ns = m.group(1)
        self.assertEqual(named["names"], [ns + "/conf-snap"])
        st, tagged = self.req("POST", "/sandboxes/%s/snapshots" % sid,
                              {"name": "%s/Conf-Snap:V1" % ns})
        self.assertEqual(st, 201, tagged)
        self.assertEqual((tagged["snapshotID"], tagged["names"]),
                         (ns + "/conf-snap:v1", [ns + "/conf-snap"]))
        for tid in (named["snapshotID"], named["names"][0], "conf-snap", "conf-snap:v1",
                    tagged["snapshotID"]):
            st, sb = self.req("POST", "/sandboxes", {"templateID": tid, "timeout": 600})
            self.assertEqual(st, 201, (tid, sb))
        # names of other namespaces, unknown ones
        self.assertError(self.req("POST", "/sandboxes", {"templateID": "other/conf-snap"}), 404)
        self.assertError(self.req("POST", "/sandboxes", {"templateID": ns + "/nope"}), 404)
        self.assertError(self.req("POST", "/sandboxes",
                                  {"templateID": "snap-0000000000000000:default"}), 404)
        self.assertError(self.req("POST", "/sandboxes", {"templateID": "no-such-thing"}), 404)
        # another team cannot use or see them
        self.assertError(self.req("POST", "/sandboxes", {"templateID": snap},
                                  key=self.other_key), 404)
        self.assertEqual(self.req("GET", "/snapshots", key=self.other_key), (200, []))

    def test_errors(self):
        sid = self.create()
        path = "/sandboxes/%s/snapshots" % sid
        self.assertError(self.req("POST", "/sandboxes/nosuchsandbox/snapshots", {}), 404,
                         says="Sandbox 'nosuchsandbox' not found")
        self.assertError(self.req("POST", path, {}, key=self.other_key), 404, says="not found")
        self.assertError(self.req("POST", path, {"name": 3}), 400)
        self.assertError(self.req("POST", path, {"name": "bad name"}), 400)
        self.assertError(self.req("POST", path, {"name": "a/b/c"}), 400)
        self.assertError(self.req("POST", path, {"name": "someoneelse/x"}), 400,
                         says="namespace")
        self.assertError(self.req("POST", path, raw=b"{"), 400)
        st, first = self.req("POST", path, {"name": "dup"})
        self.assertEqual(st, 201)
        # E2B: a snapshot under a name in use becomes that name's new build
        st, second = self.req("POST", path, {"name": "dup"})
        self.assertEqual(st, 201, second)
        self.assertEqual(second["names"], first["names"])
        # E2B's pause (our suspend): 409
        st, _ = self.req("POST", "/sandboxes/%s/pause" % sid)
        self.assertEqual(st, 204)
        self.assertError(self.req("POST", path, {}), 409)

    def test_list_and_pages(self):
        a, b = self.create(), self.create()
        made = [self.req("POST", "/sandboxes/%s/snapshots" % a, {})[1]["snapshotID"]
                for _ in range(3)]
        other = self.req("POST", "/sandboxes/%s/snapshots" % b, {})[1]["snapshotID"]
        st, items, r = self.raw_req("GET", "/snapshots?sandboxID=%s&limit=2" % a)
        self.assertEqual(st, 200, items)
        self.assertEqual([i["snapshotID"] for i in items], made[::-1][:2])
        token = r.getheader("x-next-token")
        self.assertTrue(token)
        st, items, r = self.raw_req("GET", "/snapshots?sandboxID=%s&limit=2&nextToken=%s"
                                    % (a, urllib.parse.quote(token)))
        self.assertEqual([i["snapshotID"] for i in items], made[:1])
        self.assertFalse(r.getheader("x-next-token"))
        st, items, _ = self.raw_req("GET", "/snapshots?limit=500")
        self.assertEqual(st, 200)
        got = [i["snapshotID"] for i in items]
        self.assertTrue(set(made + [other]) <= set(got))
        for i in items:
            self.assertEqual(set(i), {"snapshotID", "names"})
        self.assertError(self.req("GET", "/snapshots?limit=0"), 400)
        self.assertError(self.req("GET", "/snapshots?nextToken=bogus"), 400)

    def test_delete(self):
        sid = self.create()
        plain = self.req("POST", "/sandboxes/%s/snapshots" % sid, {})[1]["snapshotID"]
        named = self.req("POST", "/sandboxes/%s/snapshots" % sid,
                         {"name": "gone:v2"})[1]["snapshotID"]
        named2 = self.req("POST", "/sandboxes/%s/snapshots" % sid,
                          {"name": "gone2"})[1]["snapshotID"]
        # Python sends the id raw, JS percent-encoded
        self.assertEqual(self.req("DELETE", "/templates/" + plain), (204, None))
        self.assertError(self.req("DELETE", "/templates/" + plain), 404)
        self.assertEqual(self.req("DELETE", "/templates/" + named), (204, None))
        self.assertError(self.req("DELETE", "/templates/" + named), 404)
        self.assertEqual(self.req("DELETE", "/templates/" + urllib.parse.quote(named2, safe="")),
                         (204, None))
        self.assertError(self.req("DELETE", "/templates/" + urllib.parse.quote(named2, safe="")),
                         404)
        self.assertError(self.req("DELETE", "/templates/other/x:default"), 404)
        self.assertError(self.req("POST", "/sandboxes", {"templateID": plain}), 404)
        self.assertEqual(self.req("GET", "/snapshots?sandboxID=" + sid), (200, []))
        # templates are still deleted through the same path
        self.assertError(self.req("DELETE", "/templates/no-such-template"), 404)


if __name__ == "__main__":
    unittest.main(verbosity=2)
