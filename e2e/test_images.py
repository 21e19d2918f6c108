"""Templates built from container images (core/control/ociimg.h), on real VMs.

An OCI image is made here without any network: a busybox root (the host's busybox-static)
with a file, ENV, WORKDIR and a CMD (busybox httpd), put together with umoci and pushed with
skopeo to Debian's docker-registry on loopback: one open, one behind htpasswd. A template
built from it boots: the file is there, the ENV is set, the CMD is serving, the user is
`user`. A second build of the same digest (a Dockerfile FROM it) takes the image from the
digest cache; the registry behind a password takes the right credentials and refuses wrong or
missing ones, which are never written anywhere; an unreachable registry fails the build
naming it; a Docker Hub reference goes to the --registry-mirror. An image nothing uses
leaves the digest cache once its --build-cache-s is up, not before.
Needs root, skopeo, umoci, docker-registry, htpasswd (tests/oci_registry.py) and SP_TEST_DATA_DIR
(`base` built).
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, VmSuite, free_port  # noqa: E402
from oci_registry import Registry, make_image, missing_tools, push  # noqa: E402
from test_templates import build, logs  # noqa: E402
from test_vm_api import skip_reason  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
SECRET = "s3cret-%d" % os.getpid()
CACHE_S = 10  # --build-cache-s: test_5 waits for it


def line_texts(s, name, bid):
    return [x.get("line") or "" for x in logs(s, name, bid)]


@unittest.skipIf(skip_reason() or missing_tools(), skip_reason() or missing_tools())
class ImageTemplateTest(VmSuite):
    TEMPLATES = ("img", "imgdock", "imgpriv", "imgbad", "imgmir", "imgsec", "imggc")

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="sp-images-")
        cls.open = Registry(cls.work)
        cls.locked = Registry(cls.work, "puller", SECRET)
        cls.ref1 = make_image(cls.work, "one", "hello-from-image")
        push(cls.ref1, cls.open.host + "/img:1")
        push(cls.ref1, cls.open.host + "/library/mirrored:1")  # Docker Hub's layout
        cls.ref2 = make_image(cls.work, "two", "hello-behind-a-password", user="user")
        push(cls.ref2, cls.locked.host + "/private/img:2", creds="puller:" + SECRET)
        # secrets (a registry password in a team secret) need a master key
        key = os.path.join(cls.work, "master.key")
        with open(key, "w") as f:
            f.write(base64.b64encode(os.urandom(32)).decode())
        os.chmod(key, 0o600)
        cls.ARGS = ("--registry-mirror", cls.open.host, "--master-key-file", key,
                    "--build-cache-s", str(CACHE_S))
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        cls.open.stop()
        cls.locked.stop()
        shutil.rmtree(cls.work, ignore_errors=True)

    def cmd_ran(self, sid, want):
        """The image's ENTRYPOINT + CMD left its line and is still running (sleep)."""
        deadline = time.time() + 30 * MULT
        while True:
            c = self.s.command(sid, "cat /tmp/cmd-ran; for p in /proc/[0-9]*; do "
                                    "head -c 5 $p/cmdline 2>/dev/null | grep -q '^sleep' && "
                                    "stat -c %U $p; done")
            if c["stdout"] == want or time.time() > deadline:
                return c
            time.sleep(0.5)

    def import_seconds(self, lines):
        for text in lines:
            if text.startswith("image ") and (" imported in " in text or " cache in " in text):
                return float(text.split(" in ")[-1].split(" s")[0])
        raise AssertionError("no import line in %s" % lines)

    def test_1_image_boots_with_its_config(self):
        s = self.s
        t0 = time.time()
        b = build(s, {"name": "img", "from": {"image": self.open.host + "/img:1"},
                      "steps": [{"run": "echo built-on-image > /srv/built.txt", "user": "root"}]})
        print("image template build %.1f s" % (time.time() - t0))
        lines = line_texts(s, "img", b["id"])
        self.assertEqual(b["status"], "succeeded", (b, lines[-15:]))
        self.assertTrue([x for x in lines if " imported in " in x], lines)
        st, t = s.request("GET", "/v1/templates/img")
        self.assertEqual(st, 200, t)
        self.assertTrue(t["parent"].startswith("oci."), t)
        sid = self.create("img")
        c = s.command(sid, "cat /srv/hello.txt /srv/built.txt; echo \"$HELLO\"; id -un user")
        self.assertEqual(c["stdout"], "hello-from-image\nbuilt-on-image\nfrom image\nuser\n", c)
        # the image's ENTRYPOINT + CMD was started by the template snapshot, as root (the image
        # names no USER), in its WORKDIR, with its ENV
        want = "from image|/srv|root\nroot\n"
        self.assertEqual(self.cmd_ran(sid, want)["stdout"], want)
        self.__class__.first_import = self.import_seconds(lines)

    def test_2_same_digest_from_the_cache_dockerfile(self):
        s = self.s
        df = "FROM %s/img:1\nRUN echo from-dockerfile > /srv/df.txt\n" % self.open.host
        b = build(s, {"name": "imgdock", "from": {"dockerfile": df}})
        lines = line_texts(s, "imgdock", b["id"])
        self.assertEqual(b["status"], "succeeded", (b, lines[-15:]))
        self.assertTrue([x for x in lines if "not pulled again (digest cache)" in x], lines)
        cached = self.import_seconds(lines)
        first = getattr(self.__class__, "first_import", None)
        print("image import %s s, from the digest cache %.2f s" % (first, cached))
        if first is not None:
            self.assertLess(cached, first)
        sid = self.create("imgdock")
        c = s.command(sid, "cat /srv/df.txt /srv/hello.txt")
        self.assertEqual(c["stdout"], "from-dockerfile\nhello-from-image\n", c)

    def test_3_credentials(self):
        s = self.s
        ref = self.locked.host + "/private/img:2"
        for auth, why in ((None, "refused the credentials"),
                          ({"username": "puller", "password": "wrong-one"},
                           "refused the credentials")):
            body = {"name": "imgbad", "from": {"image": ref}}
            if auth:
                body["from"]["auth"] = auth
            b = build(s, body)
            self.assertEqual(b["status"], "failed", b)
            self.assertIn(why, b["error"])
            self.assertIn(self.locked.host, b["error"])
        b = build(s, {"name": "imgpriv",
                      "from": {"image": ref, "auth": {"username": "puller", "password": SECRET}}})
        lines = line_texts(s, "imgpriv", b["id"])
        self.assertEqual(b["status"], "succeeded", (b, lines[-15:]))
        sid = self.create("imgpriv")
        self.assertEqual(s.command(sid, "cat /srv/hello.txt")["stdout"],
                         "hello-behind-a-password\n")
        # this image names USER user: its CMD runs as that user (su: busybox has no runuser)
        want = "from image|/srv|user\nuser\n"
        self.assertEqual(self.cmd_ran(sid, want)["stdout"], want)
        # the password is nowhere: not in the log, the build record, any manifest or log file
        st, r = s.request("GET", "/v1/templates/imgpriv/builds/%s" % b["id"])
        self.assertNotIn(SECRET, json.dumps(r))
        self.assertNotIn(SECRET, json.dumps(lines))
        hits = subprocess.run(["grep", "-rl", "--binary-files=without-match", SECRET,
                               os.path.join(DATA, "templates"), os.path.join(DATA, "builds"),
                               os.path.join(DATA, "tmp")], capture_output=True, text=True)
        self.assertEqual(hits.stdout, "")

    def test_3b_credentials_from_a_team_secret(self):
        """The registry password from a team secret (password_secret): a secret the team lacks
        is refused before anything runs; a secret with the wrong password fails the pull like a
        wrong password; the right one builds, and its value is nowhere on disk."""
        s = self.s
        ref = self.locked.host + "/private/img:2"

        def body(name, secret):
            return {"name": name, "from": {"image": ref, "auth": {"username": "puller",
                                                                 "password_secret": secret}}}
        st, r = s.request("POST", "/v1/templates", body("imgsec", "NO_SUCH_SECRET"))
        self.assertEqual(st, 400, r)
        self.assertIn("secret 'NO_SUCH_SECRET' does not exist", json.dumps(r), r)
        st, r = s.request("POST", "/v1/templates",
                          {"name": "imgsec", "from": {"image": ref, "auth": {
                              "username": "puller", "password": "x", "password_secret": "A"}}})
        self.assertEqual(st, 400, r)
        wrong, right = "REG_WRONG_%d" % os.getpid(), "REG_PASS_%d" % os.getpid()
        st, r = s.request("POST", "/v1/secrets", {"name": wrong, "value": "wrong-one"})
        self.assertEqual(st, 201, r)
        b = build(s, body("imgsec", wrong))
        self.assertEqual(b["status"], "failed", b)
        self.assertIn("refused the credentials", b["error"])
        st, r = s.request("POST", "/v1/secrets", {"name": right, "value": SECRET})
        self.assertEqual(st, 201, r)
        b = build(s, body("imgsec", right))
        lines = line_texts(s, "imgsec", b["id"])
        self.assertEqual(b["status"], "succeeded", (b, lines[-15:]))
        self.assertIn("registry credentials: user puller, password from secret " + right, lines)
        sid = self.create("imgsec")
        self.assertEqual(s.command(sid, "cat /srv/hello.txt")["stdout"],
                         "hello-behind-a-password\n")
        st, r = s.request("GET", "/v1/templates/imgsec/builds/%s" % b["id"])
        self.assertNotIn(SECRET, json.dumps(r))
        hits = subprocess.run(["grep", "-rl", "--binary-files=without-match", SECRET,
                               os.path.join(DATA, "templates"), os.path.join(DATA, "builds"),
                               os.path.join(DATA, "tmp")], capture_output=True, text=True)
        self.assertEqual(hits.stdout, "")

    def test_4_unreachable_registry_and_mirror(self):
        s = self.s
        port = free_port()  # nothing listens there
        b = build(s, {"name": "imgbad", "from": {"image": "127.0.0.1:%d/img:1" % port}})
        self.assertEqual(b["status"], "failed", b)
        self.assertIn("cannot reach the image registry 127.0.0.1:%d" % port, b["error"])
        # a Docker Hub reference goes to the mirror (same digest: from the cache)
        b = build(s, {"name": "imgmir", "from": {"image": "mirrored:1"},
                      "steps": [{"run": "exit 7"}]})
        lines = line_texts(s, "imgmir", b["id"])
        self.assertTrue([x for x in lines if "asking the mirror " + self.open.host in x], lines)
        self.assertTrue([x for x in lines if "digest cache" in x], lines)
        self.assertEqual((b["status"], b["failed_step"]), ("failed", 3), b)  # env, workdir, run

    def image_dir(self, name):
        st, t = self.s.request("GET", "/v1/templates/" + name)
        self.assertEqual(st, 200, t)
        self.assertTrue(t["parent"].startswith("oci."), t)
        return os.path.join(DATA, "templates", t["parent"])

    def versions(self, path):
        return sorted(v for v in os.listdir(path) if len(v) == 64) if os.path.isdir(path) else []

    def wait_gone(self, path, what, secs):
        deadline = time.time() + secs * MULT
        while os.path.exists(path) and time.time() < deadline:
            time.sleep(0.5)
        self.assertFalse(os.path.exists(path), what)

    def test_5_unused_image_leaves_the_digest_cache(self):
        """--build-cache-s (CACHE_S here): an image stays while a template version is layered on
        it, also one kept only by a sandbox of a deleted template, however long ago it was
        used; once nothing holds it and its time is up it is removed (after the version, which
        the periodic collection removes once its sandbox went), and a later build pulls it
        again."""
        s = self.s
        push(make_image(self.work, "gc", "gc-%d" % os.getpid()), self.open.host + "/gc:1")
        b = build(s, {"name": "imggc", "from": {"image": self.open.host + "/gc:1"}})
        self.assertEqual(b["status"], "succeeded", b)
        idir = self.image_dir("imggc")
        (ver,) = self.versions(idir)
        (mine,) = self.versions(os.path.join(DATA, "templates", "imggc"))
        sid = self.create("imggc")
        st, r = s.request("DELETE", "/v1/templates/imggc")
        self.assertIn(st, (200, 202, 204), r)
        # long unused, but under a version a sandbox holds: kept through two collections
        old = time.time() - 10 * CACHE_S
        os.utime(os.path.join(idir, ver), (old, old))
        time.sleep(CACHE_S + 1)
        self.assertEqual(self.versions(idir), [ver])
        self.assertEqual(self.versions(os.path.join(DATA, "templates", "imggc")), [mine])
        # the sandbox goes: the next collection removes the version (and the deleted
        # template's directory with it), then the image
        s.delete_quietly(sid)
        self.sids.remove(sid)
        self.wait_gone(os.path.join(DATA, "templates", "imggc"), "version or its dir kept",
                       CACHE_S * 2 + 10)
        self.wait_gone(idir, "image kept", 10)
        # pulled again; used a moment ago, so kept when its template goes at once
        b = build(s, {"name": "imggc", "from": {"image": self.open.host + "/gc:1"}})
        lines = line_texts(s, "imggc", b["id"])
        self.assertEqual(b["status"], "succeeded", (b, lines[-15:]))
        self.assertTrue([x for x in lines if " imported in " in x], lines)
        (ver,) = self.versions(idir)
        os.utime(os.path.join(idir, ver))
        touched = time.time()
        (mine,) = self.versions(os.path.join(DATA, "templates", "imggc"))
        st, r = s.request("DELETE", "/v1/templates/imggc")
        self.assertIn(st, (200, 202, 204), r)
        self.wait_gone(os.path.join(DATA, "templates", "imggc", mine), "version kept", 10)
        if time.time() - touched < CACHE_S - 1:  # a loaded machine may have taken longer
            self.assertEqual(self.versions(idir), [ver])
        self.wait_gone(idir, "image kept past its time", CACHE_S * 2 + 10)


if __name__ == "__main__":
    if skip_reason() or missing_tools():
        print("skipped:", skip_reason() or missing_tools())
        sys.exit(77)
    unittest.main(verbosity=2)
