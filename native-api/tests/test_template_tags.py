"""Template tags and versions on both APIs (core/control/tmpl.h), without VMs: the test driver
boots nothing from a template's files, so versions are made in the database as a build would
record them. Creates by name:tag pin the tag's version, tags move and go, bad input gets the
right status, another team sees nothing."""
import json
import os
import shutil
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import Platform, PlatformTest, skip_unless_pg, tmpdir, wait_until  # noqa: E402
from test_secrets import psql  # noqa: E402

V1 = "1" * 64
V2 = "2" * 64
V3 = "3" * 64
B1 = "11111111-1111-4111-8111-111111111111"
B2 = "22222222-2222-4222-8222-222222222222"


@skip_unless_pg
class TemplateTagsTest(PlatformTest):
    ENV = {"SPACE_E2B_DOMAIN": "sbx.test:3443"}

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.team = psql(cls.p.pg, "SELECT id FROM teams WHERE name = 'alpha'").strip()
        # "tagged": v1 (default, stable), v2 (v2), v3 (no tag), as builds record them
        psql(cls.p.pg, """
            INSERT INTO templates (name, status, team_id, parent, build_id, cpu_count, memory_mb)
              VALUES ('tagged', 'ready', '%(t)s', 'base', '%(v1)s', 1, 256);
            INSERT INTO template_builds (id, team_id, template, status, request, hash)
              VALUES ('%(b1)s', '%(t)s', 'tagged', 'succeeded', '{}', '%(v1)s'),
                     ('%(b2)s', '%(t)s', 'tagged', 'succeeded', '{}', '%(v2)s');
            INSERT INTO template_versions (template, hash, build_id, cpu_count, memory_mb, env,
                                           disk_mb, size_bytes)
              VALUES ('tagged', '%(v1)s', '%(b1)s', 1, 256, '{"V": "one"}', 2048, 41943040),
                     ('tagged', '%(v2)s', '%(b2)s', 2, 512, '{"V": "two"}', 4096, 8192),
                     ('tagged', '%(v3)s', 'oldstyleid0000000000', 1, 256, '{}', NULL, NULL);
            INSERT INTO template_tags (template, tag, hash) VALUES
              ('tagged', 'default', '%(v1)s'), ('tagged', 'stable', '%(v1)s'),
              ('tagged', 'v2', '%(v2)s');
        """ % dict(t=cls.team, v1=V1, v2=V2, v3=V3, b1=B1, b2=B2))

    def req(self, *a, **kw):
        return self.s.request(*a, **kw)

    def e2b(self, method, path, body=None, key=None):
        h = {"X-API-KEY": self.s.key if key is None else key}
        return self.s.request(method, path, body=body, key="", headers=h, timeout=60)

    def version_of(self, sid):
        return psql(self.p.pg, "SELECT coalesce(template_version, '') FROM sandboxes"
                               " WHERE id = '%s'" % sid).strip()

    def create(self, template):
        st, r = self.req("POST", "/v1/sandboxes?wait=20", {"template": template})
        self.assertEqual(st, 200, r)
        return r["sandbox"]

    def test_1_create_by_tag_pins_the_version(self):
        sb = self.create("tagged:v2")
        self.assertEqual((self.version_of(sb["id"]), sb["cpu_count"], sb["memory_mb"]),
                         (V2, 2, 512))
        sb = self.create("tagged")
        self.assertEqual((self.version_of(sb["id"]), sb["cpu_count"]), (V1, 1))
        self.assertEqual(self.version_of(self.create("tagged:default")["id"]), V1)
        self.assertEqual(self.version_of(self.create("tagged:stable")["id"]), V1)
        # built-in templates: their one version, "default" only
        self.assertEqual(self.version_of(self.create("base:default")["id"]), "")
        st, r = self.req("POST", "/v1/sandboxes", {"template": "base:v2"})
        self.assertEqual(st, 404, r)
        self.assertIn("tag 'v2' does not exist for template 'base'", r["error"]["message"])
        st, r = self.req("POST", "/v1/sandboxes", {"template": "tagged:nope"})
        self.assertEqual(st, 404, r)
        self.assertEqual(r["error"]["message"], "tag 'nope' does not exist for template 'tagged'")
        st, r = self.req("POST", "/v1/sandboxes", {"template": "nosuch:v2"})
        self.assertEqual(st, 404, r)
        for bad in ("tagged:Bad", "tagged:", "tagged:%s" % B1, "tagged:a b", "tagged:a:b"):
            st, r = self.req("POST", "/v1/sandboxes", {"template": bad})
            self.assertEqual(st, 400, (bad, r))
        # another team: nothing, whatever the tag
        for name in ("tagged", "tagged:v2", "tagged:nope"):
            st, r = self.req("POST", "/v1/sandboxes", {"template": name}, key=self.other_key)
            self.assertEqual(st, 404, (name, r))

    def test_2_native_tags(self):
        st, t = self.req("GET", "/v1/templates/tagged")
        self.assertEqual(st, 200, t)
        self.assertEqual({(x["tag"], x["version"]) for x in t["tags"]},
                         {("default", V1), ("stable", V1), ("v2", V2)})
        self.assertEqual({v["version"]: sorted(v["tags"]) for v in t["versions"]},
                         {V1: ["default", "stable"], V2: ["v2"], V3: []})
        # sizes are the versions' records (no node's disk is looked at: this one has none)
        self.assertEqual({v["version"]: (v["disk_mb"], v["size_bytes"]) for v in t["versions"]},
                         {V1: (2048, 41943040), V2: (4096, 8192), V3: (None, None)})
        self.assertIn("builds", t)
        # move by version prefix and by another tag
        st, r = self.req("PUT", "/v1/templates/tagged/tags/exp", {"version": V3[:12]})
        self.assertEqual((st, r.get("version"), r.get("tag")), (200, V3, "exp"), r)
        st, r = self.req("PUT", "/v1/templates/tagged/tags/stable", {"from_tag": "v2"})
        self.assertEqual((st, r.get("version"), r.get("build_id")), (200, V2, B2), r)
        sb = self.create("tagged:stable")
        self.assertEqual(self.version_of(sb["id"]), V2)
        # bad input
        cases = [
            ("PUT", "/v1/templates/tagged/tags/Bad", {"version": V1}, 400),
            ("PUT", "/v1/templates/tagged/tags/%s" % B1, {"version": V1}, 400),
            ("PUT", "/v1/templates/tagged/tags/x", {}, 400),
            ("PUT", "/v1/templates/tagged/tags/x", {"version": V1, "from_tag": "v2"}, 400),
            ("PUT", "/v1/templates/tagged/tags/x", {"version": "zz"}, 400),
            ("PUT", "/v1/templates/tagged/tags/x", {"bogus": 1}, 400),
            ("PUT", "/v1/templates/tagged/tags/x", {"version": "4" * 64}, 404),
            ("PUT", "/v1/templates/tagged/tags/x", {"from_tag": "nope"}, 404),
            ("PUT", "/v1/templates/nosuch/tags/x", {"version": V1}, 404),
            ("PUT", "/v1/templates/base/tags/x", {"version": V1}, 404),
            ("DELETE", "/v1/templates/tagged/tags/default", None, 400),
            ("DELETE", "/v1/templates/tagged/tags/nope", None, 404),
            ("DELETE", "/v1/templates/tagged/tags/Bad", None, 400),
        ]
        for method, path, body, want in cases:
            st, r = self.req(method, path, body)
            self.assertEqual(st, want, (method, path, body, r))
        st, r = self.req("PUT", "/v1/templates/tagged/tags/x", {"from_tag": "nope"})
        self.assertEqual(r["error"]["message"], "tag 'nope' does not exist for template 'tagged'")
        # another team
        st, r = self.req("PUT", "/v1/templates/tagged/tags/x", {"version": V1},
                         key=self.other_key)
        self.assertEqual(st, 404, r)
        st, r = self.req("DELETE", "/v1/templates/tagged/tags/exp", key=self.other_key)
        self.assertEqual(st, 404, r)
        st, r = self.req("GET", "/v1/templates/tagged", key=self.other_key)
        self.assertEqual(st, 404, r)
        # a tag goes
        st, r = self.req("DELETE", "/v1/templates/tagged/tags/exp")
        self.assertEqual(st, 200, r)
        st, r = self.req("POST", "/v1/sandboxes", {"template": "tagged:exp"})
        self.assertEqual(st, 404, r)
        # bad tags on a build request
        for body in ({"name": "tagged:Bad", "from": "base"},
                     {"name": "tagged", "from": "base", "tags": ["ok", B1]},
                     {"name": "tagged", "from": "base", "tags": "v1"},
                     {"name": "tagged:", "from": "base"}):
            st, r = self.req("POST", "/v1/templates", body)
            self.assertEqual(st, 400, (body, r))
            self.assertIn("tag", r["error"]["message"], (body, r))
        # a parent named by a tag: looked up first (here v2's files are not on disk: the test
        # driver builds nothing), an unknown tag or another team's template is not found
        for parent, key, why in (("tagged:nope", None, "no such tag"),
                                 ({"template": "tagged:nope"}, None, "no such tag"),
                                 ("tagged:v2", None, "tagged@%s" % V2[:8]),
                                 ("tagged:v2", self.p.keys["beta"], "no such tag"),
                                 ("tagged:Bad!", None, "not found")):
            st, r = self.req("POST", "/v1/templates", {"name": "child", "from": parent}, key=key)
            self.assertEqual(st, 404, (parent, r))
            self.assertIn(why, r["error"]["message"], (parent, r))

    def test_3_e2b_tags(self):
        st, r = self.e2b("GET", "/templates/tagged/tags")
        self.assertEqual(st, 200, r)
        tags = {x["tag"]: x["buildID"] for x in r}
        self.assertEqual((tags["default"], tags["v2"]), (B1, B2))
        for x in r:
            self.assertEqual(len(x["buildID"]), 36, x)
            self.assertTrue(x["createdAt"])
        st, r = self.e2b("POST", "/templates/tags", {"target": "tagged:v2", "tags": ["prod"]})
        self.assertEqual((st, r), (201, {"tags": ["prod"], "buildID": B2}))
        st, r = self.e2b("POST", "/templates/tags", {"target": "tagged", "tags": ["old"]})
        self.assertEqual((st, r.get("buildID")), (201, B1), r)
        st, r = self.e2b("POST", "/templates/tags", {"target": "tagged:nope", "tags": ["x"]})
        self.assertEqual(st, 404, r)
        st, r = self.e2b("POST", "/templates/tags", {"target": "tagged:v2", "tags": [B1]})
        self.assertEqual(st, 400, r)
        st, r = self.e2b("POST", "/templates/tags", {"target": "tagged:v2", "tags": ["x"]},
                         key=self.other_key)
        self.assertEqual(st, 404, r)
        # exists: name, name:tag, ns/name:tag
        for name, want in (("tagged", 200), ("tagged:prod", 200), ("tagged:nope", 404),
                           ("%s/tagged:v2" % self.team, 200), ("base:default", 200),
                           ("base:v2", 404), ("nope-123", 404)):
            st, r = self.e2b("GET", "/templates/aliases/" + name)
            self.assertEqual(st, want, (name, r))
        # creates: by tag, with the team's namespace; unknown tag: 404 naming it
        st, r = self.e2b("POST", "/sandboxes", {"templateID": "tagged:prod"})
        self.assertEqual(st, 201, r)
        self.assertEqual(self.version_of(r["sandboxID"]), V2)
        st, r = self.e2b("POST", "/sandboxes", {"templateID": "%s/tagged:v2" % self.team})
        self.assertEqual(st, 201, r)
        self.assertEqual(self.version_of(r["sandboxID"]), V2)
        st, r = self.e2b("POST", "/sandboxes", {"templateID": "tagged:nope"})
        self.assertEqual(st, 404, r)
        self.assertIn("tag 'nope' does not exist for template 'tagged'", r["message"])
        # remove: default and a name with a tag are 400; then the tag is gone
        st, r = self.e2b("DELETE", "/templates/tags", {"name": "tagged", "tags": ["default"]})
        self.assertEqual(st, 400, r)
        st, r = self.e2b("DELETE", "/templates/tags", {"name": "tagged:v2", "tags": ["prod"]})
        self.assertEqual(st, 400, r)
        st, r = self.e2b("DELETE", "/templates/tags", {"name": "tagged", "tags": ["prod"]},
                         key=self.other_key)
        self.assertEqual(st, 404, r)
        st, r = self.e2b("DELETE", "/templates/tags", {"name": "tagged", "tags": ["prod"]})
        self.assertEqual(st, 204, r)
        st, r = self.e2b("POST", "/sandboxes", {"templateID": "tagged:prod"})
        self.assertEqual(st, 404, r)
        # a build request's name and tags: bad ones are 400 before anything is reserved
        for body in ({"name": "x:Bad!"}, {"name": "x", "tags": [B2]},
                     {"name": "other-team/x:v1"}):
            st, r = self.e2b("POST", "/v3/templates", body)
            self.assertEqual(st, 400, (body, r))


@skip_unless_pg
class PublishedVersionsTest(unittest.TestCase):
    """The versions published in a shared snapshot dir (core/control/tmplver.c:
    sp_tmpl__collect_shared), without VMs: the test driver publishes nothing, so the published
    directories are laid out here as the QEMU driver lays them out (templates/<name>/<hash>/
    rootfs.qcow2 and manifest.json), old enough to be judged, and the rows as builds record
    them. One that nothing uses goes, with its row; one a tag, a sandbox, a published child
    names, a built-in's, and one published within the grace stay. A digest cache image goes
    once no published version is layered on it and no build in the fleet is unfinished."""

    @classmethod
    def setUpClass(cls):
        cls.snap = tmpdir("sp-pubgc-")
        cls.p = Platform(teams=("alpha",), runtime="test", start=False,
                         env={"SPACE_FAKE_DELAY_MS": "20"},
                         args=["--snapshot-dir", cls.snap, "--build-cache-s", "2"])
        cls.s = cls.p.s
        team = psql(cls.p.pg, "SELECT id FROM teams WHERE name = 'alpha'").strip()
        psql(cls.p.pg, """
            INSERT INTO templates (name, status, team_id, parent, build_id, cpu_count, memory_mb)
              VALUES ('keep', 'ready', '%(t)s', 'base', '%(v1)s', 1, 256),
                     ('busy', 'building', '%(t)s', 'base', NULL, 1, 256),
                     ('kid', 'ready', '%(t)s', 'gone', '%(v4)s', 1, 256);
            INSERT INTO templates (name, status, team_id, parent, cpu_count, memory_mb,
                                   deleted_at) VALUES ('gone', 'deleted', '%(t)s', 'base', 1,
                                   256, now());
            INSERT INTO template_versions (template, hash, build_id, cpu_count, memory_mb, env)
              VALUES ('keep', '%(v1)s', 'b1', 1, 256, '{}'), ('keep', '%(v2)s', 'b2', 1, 256,
                     '{}'), ('keep', '%(v3)s', 'b3', 1, 256, '{}'), ('keep', '%(v5)s', 'b5', 1,
                     256, '{}'), ('gone', '%(v1)s', 'b6', 1, 256, '{}'),
                     ('gone', '%(v2)s', 'b7', 1, 256, '{}'), ('kid', '%(v4)s', 'b8', 1, 256, '{}'),
                     ('keep', '%(vf)s', 'b9', 1, 256, '{}');
            INSERT INTO template_builds (id, team_id, template, status, request, worker_id)
              VALUES ('%(b1)s', '%(t)s', 'busy', 'building', '{}', 'another-worker');
            INSERT INTO template_tags (template, tag, hash) VALUES ('keep', 'default', '%(v1)s'),
              ('keep', 'pin', '%(v2)s'), ('kid', 'default', '%(v4)s'), ('keep', 'img', '%(vf)s');
        """ % dict(t=team, v1=V1, v2=V2, v3=V3, v4="4" * 64, v5="5" * 64, b1=B1,
                 vf="f" * 64))
        old = time.time() - 3600
        cls.dirs = {}
        for name, h, parent in (("keep", V1, None), ("keep", V2, None), ("keep", V3, None),
                                ("keep", "5" * 64, None), ("gone", V1, None), ("gone", V2, None),
                                ("kid", "4" * 64, ("gone", V2)), ("base", "b" * 64, None),
                                ("oci.deadbeef", "c" * 64, None), ("nosuch", "d" * 64, None),
                                ("oci.deadbeef", "e" * 64, None),
                                ("keep", "f" * 64, ("oci.deadbeef", "e" * 64))):
            d = os.path.join(cls.snap, "templates", name, h)
            os.makedirs(d)
            man = {"name": name, "spec": {}}
            if parent:
                man["parent"], man["spec"]["parent_hash"] = parent
            with open(os.path.join(d, "manifest.json"), "w") as f:
                json.dump(man, f)
            with open(os.path.join(d, "rootfs.qcow2"), "wb") as f:
                f.write(b"\0" * 4096)
            fresh = h == "5" * 64
            os.utime(d, (old, time.time() + 3600 if fresh else old))
            cls.dirs[name + "@" + h[:1]] = d
        cls.leftover = os.path.join(cls.snap, "templates", ".trash", "a1b2c3")  # a removal cut short
        os.makedirs(os.path.join(cls.leftover, "d", "x"))
        cls.s.start()

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()
        shutil.rmtree(cls.snap, ignore_errors=True)

    def rows(self, name):
        return set(psql(self.p.pg, "SELECT hash FROM template_versions WHERE template = '%s'"
                                   % name).split())

    def test_unused_published_versions_go(self):
        d = self.dirs
        # a sandbox pins keep@2 by its tag; then the tag goes: the sandbox holds it alone
        st, r = self.s.request("POST", "/v1/sandboxes?wait=20", {"template": "keep:pin"})
        self.assertEqual(st, 200, r)
        sid = r["sandbox"]["id"]
        st, r = self.s.request("DELETE", "/v1/templates/keep/tags/pin")
        self.assertIn(st, (200, 204), r)
        wait_until(lambda: not os.path.exists(d["keep@3"]) and not os.path.exists(d["gone@1"]),
                   "unused published versions removed", 30, 0.1)
        time.sleep(3)  # more sweeps: what stays, stays
        # the images too: a build (of "busy") is unfinished
        for k in ("keep@1", "keep@2", "keep@5", "gone@2", "kid@4", "base@b", "oci.deadbeef@c",
                  "nosuch@d", "oci.deadbeef@e"):
            self.assertTrue(os.path.exists(os.path.join(d[k], "rootfs.qcow2")), k)
        self.assertFalse(os.path.exists(self.leftover))
        self.assertEqual(self.rows("keep"), {V1, V2, "5" * 64, "f" * 64})  # keep@3's went
        self.assertEqual(self.rows("gone"), {V2})
        self.assertTrue(os.path.isdir(os.path.join(self.snap, "templates", "keep")))
        self.assertIn("removed a published template version nothing uses template=keep",
                      self.s.read_log())
        # the sandbox goes: so does the version it held; the child's tag goes: the child, then
        # its parent, then the deleted template's directory
        st, r = self.s.request("DELETE", "/v1/sandboxes/" + sid)
        self.assertIn(st, (200, 202, 204), r)
        st, r = self.s.request("DELETE", "/v1/templates/kid")
        self.assertEqual(st, 200, r)
        wait_until(lambda: not any(os.path.exists(d[k]) for k in ("keep@2", "kid@4", "gone@2")),
                   "versions no longer held removed", 30, 0.1)
        self.assertFalse(os.path.exists(os.path.join(self.snap, "templates", "gone")))
        self.assertFalse(os.path.exists(os.path.join(self.snap, "templates", "kid")))
        self.assertEqual(self.rows("gone") | self.rows("kid"), set())
        self.assertTrue(os.path.exists(d["keep@1"]) and os.path.exists(d["keep@5"]))
        # the build ends: the image nothing is layered on goes, the one keep@f is on stays
        psql(self.p.pg, "UPDATE template_builds SET status = 'failed' WHERE id = '%s'" % B1)
        wait_until(lambda: not os.path.exists(d["oci.deadbeef@c"]), "unused image removed", 30,
                   0.1)
        time.sleep(3)
        self.assertTrue(os.path.exists(d["oci.deadbeef@e"]) and os.path.exists(d["keep@f"]))
        self.assertIn("template=oci.deadbeef version=cccccccccccc image=1", self.s.read_log())


if __name__ == "__main__":
    unittest.main()
