"""Templates built through the native API (core/control/tmpl.h), on real VMs.

A template is built from `base` with steps (files with modes, env, workdir, user), a start_cmd
HTTP server and its ready_cmd; a sandbox of it has the files, env and user, and the server
answers at once. The same inputs again finish from the cache; one changed step makes a new
version while the old one stays on disk for the sandbox that uses it; a failing step fails the
build naming the step and leaves the previous version in service; deleting a template in use
leaves its sandboxes running. Bad requests get the right status; another team sees nothing;
a spaced killed mid-build fails the build at its next start and leaves no builder VM. A
build's steps reach the network as a sandbox's do (apt installs a package from the host's
Debian mirror); with its egress policy's internet off, the step that reaches out fails.
Needs root and SP_TEST_DATA_DIR (the e2e data dir with `base` built).
"""
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, VmSuite, wait_s, wait_until  # noqa: E402
from test_vm_api import skip_reason  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")

NONCE = "%d-%d" % (os.getpid(), time.time())  # the shared data dir keeps versions of earlier runs
STEPS = [
    {"run": "mkdir -p /srv/site && chown user /srv/site && echo %s > /srv/nonce" % NONCE},
    {"env": {"GREETING": "hi there", "APP_MODE": "prod's"}},
    {"workdir": "/srv/site"},
    {"user": "user"},
    {"run": "echo hello-from-template > index.html && chmod 0640 index.html"},
    {"run": ["/bin/sh", "-c", "echo \"$GREETING\" > greeting.txt; pwd > where.txt; id -un > who.txt"]},
    {"run": "echo step-output-line; echo to-stderr >&2", "user": "root", "env": {"EXTRA": "1"}},
]


def build(s, body, key=None, timeout=900):
    """POST /v1/templates, then wait for the build's end; returns the build record."""
    st, r = s.request("POST", "/v1/templates", body, key=key, timeout=60)
    assert st == 202, (st, r)
    b = r["build"]
    deadline = time.time() + timeout * MULT
    while b["status"] in ("queued", "building") and time.time() < deadline:
        st, r = s.request("GET", "/v1/templates/%s/builds/%s?wait=%d" % (b["template"], b["id"],
                                                                         wait_s(120)),
                          key=key, timeout=150)
        assert st in (200, 202), (st, r)
        b = r["build"]
    return b


def logs(s, name, bid, offset=0, key=None):
    st, text = s.request("GET", "/v1/templates/%s/builds/%s/logs?offset=%d" % (name, bid, offset),
                         key=key, timeout=60)
    assert st == 200, (st, text)
    if isinstance(text, (dict, list)):  # one line parses as JSON on its own
        return [text]
    text = text.decode() if isinstance(text, bytes) else (text or "")
    return [json.loads(x) for x in text.splitlines() if x]


@unittest.skipIf(skip_reason(), skip_reason())
class TemplateBuildTest(VmSuite):
    TEAMS = ("alpha", "beta")
    TEMPLATES = ("web", "web2", "slow", "cp", "dock", "sc", "tg", "tgc", "ly1", "ly2", "ly3",
                 "pkg", "pkgoff", "lim1", "lim2", "lim3", "dsk", "dsk2", "fsnap")
    MAX_LAYERS = 3
    # The default spare pool: spares of a version keep nothing on disk (test_8).
    ARGS = ("--template-max-layers", str(MAX_LAYERS))

    def test_1_build_use_cache_change_fail_delete(self):
        s = self.s
        # a process a step left running: in the template snapshot only when that snapshot is
        # made from the builder's (seeded), not from a boot of the new image
        keeper = {"run": "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! > keeper.pid"}
        body = {"name": "web", "from": "base", "description": "a site", "steps": STEPS + [keeper],
                "start_cmd": "python3 -m http.server 8000",
                "ready_cmd": "curl -sf http://127.0.0.1:8000/index.html"}
        t0 = time.time()
        b = build(s, body)
        first_s = time.time() - t0
        self.assertEqual(b["status"], "succeeded", b)
        self.assertFalse(b["cached"])
        v1 = b["version"]
        lines = logs(s, "web", b["id"])
        text = [x.get("line") for x in lines]
        self.assertIn("step-output-line", text)
        self.assertIn("to-stderr", text)
        out = [x for x in lines if x.get("line") == "step-output-line"][0]
        self.assertEqual((out["step"], out["stream"]), (7, "stdout"), out)
        # from an offset: the tail only
        self.assertEqual(logs(s, "web", b["id"], offset=len(lines) - 1), lines[-1:])
        self.assertIn("template snapshot ready (made from the builder's snapshot, no boot)", text)
        # the seed it was made from is gone
        self.assertFalse([d for d in os.listdir(os.path.join(DATA, "snapshots"))
                          if d.startswith("bs-")])

        st, t = s.request("GET", "/v1/templates/web")
        self.assertEqual(st, 200, t)
        self.assertEqual((t["status"], t["version"], t["parent"], t["builtin"]),
                         ("ready", v1, "base", False), t)

        sid = self.create("web")
        # the server was started by the template snapshot: it answers at once, from outside
        # through the forwarded-port route (the first request, no retry) and inside
        r, page = s.exchange("GET", "/index.html", headers={
            "Host": "8000-%s.space.localhost:%d" % (sid, s.port)})
        self.assertEqual((r.status, page), (200, b"hello-from-template\n"))
        c = s.command(sid, "curl -sf http://127.0.0.1:8000/index.html")
        self.assertEqual(c["stdout"], "hello-from-template\n", c)
        c = s.command(sid, "stat -c '%a %U' /srv/site/index.html; cat /srv/site/greeting.txt "
                           "/srv/site/where.txt /srv/site/who.txt; echo \"$GREETING|$APP_MODE\"")
        self.assertEqual(c["stdout"], "640 user\nhi there\n/srv/site\nuser\nhi there|prod's\n", c)
        c = s.command(sid, "p=$(cat /srv/site/keeper.pid); stat -c %U /proc/$p; "
                           "tr '\\0' ' ' < /proc/$p/cmdline")
        self.assertEqual(c["stdout"].split(), ["user", "sleep", "100000"], c)

        # the same inputs: from the cache, at once
        t0 = time.time()
        b2 = build(s, body)
        cached_s = time.time() - t0
        self.assertEqual((b2["status"], b2["cached"], b2["version"]), ("succeeded", True, v1), b2)
        print("build %.1f s, cached rebuild %.1f s" % (first_s, cached_s))
        self.assertLess(cached_s, first_s)

        # one changed step: a new version; the old one stays for the sandbox using it
        body3 = dict(body, steps=STEPS[:4] + [
            {"run": "echo version-two > index.html && chmod 0644 index.html"}])
        b3 = build(s, body3)
        self.assertEqual(b3["status"], "succeeded", b3)
        self.assertNotEqual(b3["version"], v1)
        self.assertTrue(os.path.exists(os.path.join(DATA, "templates", "web", v1,
                                                    "rootfs.qcow2")))
        self.assertEqual(s.command(sid, "cat /srv/site/index.html")["stdout"],
                         "hello-from-template\n")
        sid2 = self.create("web")
        self.assertEqual(s.command(sid2, "curl -sf http://127.0.0.1:8000/index.html")["stdout"],
                         "version-two\n")

        # a failing step fails the build, names it, and leaves the version in service
        bad = dict(body3, steps=body3["steps"] + [{"run": "echo about-to-fail; exit 3"}])
        b4 = build(s, bad)
        self.assertEqual((b4["status"], b4["failed_step"]), ("failed", 6), b4)
        self.assertIn("exited with code 3", b4["error"])
        self.assertIn("about-to-fail", b4["error"])
        st, t = s.request("GET", "/v1/templates/web")
        self.assertEqual((t["status"], t["version"]), ("ready", b3["version"]), t)
        self.assertFalse([d for d in os.listdir(os.path.join(DATA, "templates", "web"))
                          if d.startswith(".build-")])
        self.assertFalse([d for d in os.listdir(os.path.join(DATA, "vms"))
                          if d.startswith("bld-")])

        # delete in use: sandboxes keep running, new creates are refused, the list forgets it
        st, r = s.request("DELETE", "/v1/templates/web")
        self.assertEqual(st, 200, r)
        self.assertEqual(s.command(sid, "cat /srv/site/greeting.txt")["stdout"], "hi there\n")
        st, r = s.request("POST", "/v1/sandboxes", {"template": "web"})
        self.assertEqual(st, 404, r)
        st, r = s.request("GET", "/v1/templates")
        self.assertNotIn("web", [t["name"] for t in r["templates"]])
        self.assertIn("base", [t["name"] for t in r["templates"]])

    def test_2_bad_input_and_other_teams(self):
        s = self.s
        beta = self.p.keys["beta"]
        cases = [
            ({"name": "x", "from": "base", "bogus": 1}, 400, "unknown field"),
            ({"name": "Bad Name", "from": "base"}, 400, "name"),
            ({"name": "x", "from": "nope"}, 404, "not found"),
            ({"name": "x"}, 400, "from"),
            ({"name": "x", "from": {"image": "Debian:12"}}, 400, "lowercase"),
            ({"name": "x", "from": {"image": "debian:12", "bogus": 1}}, 400, "beside image"),
            ({"name": "x", "from": "base", "steps": [{"run": 5}]}, 400, "steps[0]"),
            ({"name": "x", "from": "base", "steps": [{"run": "a", "env": {"1BAD": "v"}}]}, 400,
             "variable name"),
            ({"name": "x", "from": "base", "steps": [{"workdir": "relative"}]}, 400, "absolute"),
            ({"name": "x", "from": "base", "steps": [{"run": "true", "nope": 1}]}, 400,
             "unknown field"),
            ({"name": "x", "from": "base", "steps": [{"copy": {}}]}, 400, "copy"),
            ({"name": "base", "from": "code-interpreter-v1"}, 409, "taken"),
            ({"name": "x", "from": "base", "cpu_count": 99}, 400, "cpu_count"),
            ({"name": "x", "from": "x"}, 400, "itself"),
        ]
        for body, want, msg in cases:
            st, r = s.request("POST", "/v1/templates", body)
            self.assertEqual(st, want, (body, r))
            self.assertIn(msg, json.dumps(r), (body, r))
        st, r = s.request("POST", "/v1/templates", raw=b"{not json",
                          headers={"Content-Type": "application/json"})
        self.assertEqual(st, 400, r)
        st, r = s.request("DELETE", "/v1/templates/base")
        self.assertEqual(st, 403, r)
        st, r = s.request("GET", "/v1/templates/web2/builds/aaaaaaaaaaaaaaaaaaaa")
        self.assertEqual(st, 404, r)

        # team alpha's template is invisible to beta, which cannot take its name either
        b = build(s, {"name": "web2", "from": "base", "steps": [{"run": "echo %s > /two" % NONCE}]})
        self.assertEqual(b["status"], "succeeded", b)
        st, r = s.request("GET", "/v1/templates/web2", key=beta)
        self.assertEqual(st, 404, r)
        st, r = s.request("GET", "/v1/templates/web2/builds/%s" % b["id"], key=beta)
        self.assertEqual(st, 404, r)
        st, r = s.request("GET", "/v1/templates/web2/builds/%s/logs" % b["id"], key=beta)
        self.assertEqual(st, 404, r)
        st, r = s.request("POST", "/v1/sandboxes", {"template": "web2"}, key=beta)
        self.assertEqual(st, 404, r)
        st, r = s.request("POST", "/v1/templates", {"name": "web2", "from": "base"}, key=beta)
        self.assertEqual(st, 409, r)
        st, r = s.request("POST", "/v1/templates", {"name": "mine", "from": "web2"}, key=beta)
        self.assertEqual(st, 404, r)
        st, r = s.request("DELETE", "/v1/templates/web2", key=beta)
        self.assertEqual(st, 404, r)
        st, r = s.request("GET", "/v1/templates", key=beta)
        self.assertNotIn("web2", [t["name"] for t in r["templates"]])

    def test_4_copy_files(self):
        s = self.s
        # a tree with modes, a nested dir and a relative symlink, as a gzip tar
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            def add(name, data=None, mode=0o644, kind=tarfile.REGTYPE, link=""):
                ti = tarfile.TarInfo(name)
                ti.type, ti.mode, ti.linkname = kind, mode, link
                ti.size = len(data) if data is not None else 0
                tf.addfile(ti, io.BytesIO(data) if data is not None else None)
            add("app", kind=tarfile.DIRTYPE, mode=0o755)
            add("app/run.sh", b"#!/bin/sh\necho run-" + NONCE.encode() + b"\n", mode=0o755)
            add("app/conf", kind=tarfile.DIRTYPE, mode=0o700)
            add("app/conf/settings.ini", b"[x]\n", mode=0o600)
            add("app/latest", kind=tarfile.SYMTYPE, link="run.sh")
            add("notes.txt", b"notes-" + NONCE.encode() + b"\n", mode=0o640)
        body = buf.getvalue()
        key = hashlib.sha256(body).hexdigest()
        st, r = s.request("PUT", "/v1/template-files/" + key, raw=body)
        self.assertEqual((st, r["existed"], r["entries"]), (201, False, 6), r)
        st, r = s.request("PUT", "/v1/template-files/" + key, raw=body)
        self.assertEqual((st, r["existed"]), (200, True), r)
        st, r = s.request("GET", "/v1/template-files/" + key)
        self.assertEqual(st, 200, r)
        st, r = s.request("GET", "/v1/template-files/" + key, key=self.p.keys["beta"])
        self.assertEqual(st, 404, r)  # another team's uploads are not this team's

        # refused uploads: each says why, and nothing is stored under the key
        def tar_of(*members):
            b = io.BytesIO()
            with tarfile.open(fileobj=b, mode="w") as tf:
                for ti in members:
                    tf.addfile(ti, io.BytesIO(b"x" * ti.size) if ti.size else None)
            return b.getvalue()

        def ti(name, kind=tarfile.REGTYPE, link="", size=0):
            t = tarfile.TarInfo(name)
            t.type, t.linkname, t.size = kind, link, size
            return t
        bad = [
            (tar_of(ti("/etc/cron.d/x", size=1)), "absolute path"),
            (tar_of(ti("a/../../x", size=1)), "'..'"),
            (tar_of(ti("dev", tarfile.CHRTYPE)), "device node"),
            (tar_of(ti("fifo", tarfile.FIFOTYPE)), "FIFO"),
            (tar_of(ti("esc", tarfile.SYMTYPE, "../../etc/shadow")), "outside"),
            (tar_of(ti("hl", tarfile.LNKTYPE, "/etc/shadow")), "hard link"),
            (b"this is not a tar file at all" * 40, "not a tar"),
        ]
        def host_files():  # what the uploads could touch on the host: their store, /etc
            seen = {}
            for top in (os.path.join(DATA, "template-files"), "/etc/cron.d"):
                for d, _, names in os.walk(top):
                    for n in names:
                        p = os.path.join(d, n)
                        st_ = os.lstat(p)
                        seen[p] = (st_.st_size, st_.st_mtime_ns)
            st_ = os.stat("/etc/shadow")
            seen["/etc/shadow"] = (st_.st_size, st_.st_mtime_ns)
            return seen

        before = host_files()
        for data, why in bad:
            k = hashlib.sha256(data).hexdigest()
            st, r = s.request("PUT", "/v1/template-files/" + k, raw=data)
            self.assertEqual(st, 400, (why, r))
            self.assertIn(why, r["error"]["message"])
            st, r = s.request("GET", "/v1/template-files/" + k)
            self.assertEqual(st, 404, r)
        self.assertEqual(host_files(), before)  # nothing written or changed on the host
        # larger than an upload may be (256 MiB): refused on its head, before a byte of it
        c = socket.create_connection(("127.0.0.1", s.port), timeout=30 * MULT)
        try:
            c.sendall(("PUT /v1/template-files/%s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       "Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n"
                       % ("2" * 64, s.key, 300 << 20)).encode())
            head = c.recv(4096).decode(errors="replace")
        finally:
            c.close()
        self.assertTrue(head.startswith("HTTP/1.1 413"), head)
        st, r = s.request("PUT", "/v1/template-files/" + "0" * 64, raw=body)
        self.assertEqual(st, 400, r)
        self.assertIn("SHA-256", r["error"]["message"])
        st, r = s.request("POST", "/v1/templates", {"name": "cp", "from": "base", "steps": [
            {"copy": {"files": "1" * 64, "src": "app", "dest": "/app"}}]})
        self.assertEqual(st, 400, r)
        self.assertIn("never uploaded", r["error"]["message"])

        b = build(s, {"name": "cp", "from": "base", "steps": [
            {"copy": {"files": key, "src": "app", "dest": "/opt/app", "user": "user"}},
            {"workdir": "/srv"},
            {"copy": {"files": key, "src": "notes.txt", "dest": "docs/", "mode": "0600"}},
            {"run": "/opt/app/run.sh > /srv/ran.txt"}]})
        self.assertEqual(b["status"], "succeeded", b)
        sid = self.create("cp")
        c = s.command(sid, "cd /opt/app && stat -c '%n %a %U' run.sh conf conf/settings.ini && "
                           "readlink latest && cat /srv/ran.txt && stat -c '%a %U' "
                           "/srv/docs/notes.txt && cat /srv/docs/notes.txt && "
                           "find /tmp/.space-copy -mindepth 1 2>/dev/null | wc -l")
        self.assertEqual(c["stdout"],
                         "run.sh 755 user\nconf 700 user\nconf/settings.ini 600 user\nrun.sh\n"
                         "run-%s\n600 root\nnotes-%s\n0\n" % (NONCE, NONCE), c)
        st, r = s.request("DELETE", "/v1/templates/cp")
        self.assertEqual(st, 200, r)

    def test_5_dockerfile(self):
        s = self.s
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            for name, data in (("site/index.html", b"docker-" + NONCE.encode() + b"\n"),
                               ("site/extra.txt", b"extra\n"), ("setup.sh", b"#!/bin/sh\necho set > /set\n")):
                ti = tarfile.TarInfo(name)
                ti.size, ti.mode = len(data), 0o644
                tf.addfile(ti, io.BytesIO(data))
        ctx = buf.getvalue()
        key = hashlib.sha256(ctx).hexdigest()
        st, r = s.request("PUT", "/v1/template-files/" + key, raw=ctx)
        self.assertIn(st, (200, 201), r)
        dockerfile = "\n".join([
            "# a Dockerfile with every instruction this server takes",
            "ARG GREETING=hello",
            "FROM base AS app",
            "ENV MODE=prod LABEL=\"a b\"",
            "RUN mkdir -p /srv && \\",
            "    chown user /srv",
            "WORKDIR /srv",
            "COPY --chown=user site/ www/",
            "ADD --chmod=0755 setup.sh /usr/local/bin/setup.sh",
            "RUN [\"/usr/local/bin/setup.sh\"]",
            "USER user",
            "WORKDIR www",
            "RUN echo \"$GREETING $MODE $LABEL\" > greeting.txt",
            "ENTRYPOINT [\"python3\", \"-m\", \"http.server\"]",
            "CMD [\"8000\"]",
            ""])
        b = build(s, {"name": "dock", "from": {"dockerfile": dockerfile, "context": key},
                      "ready_cmd": "curl -sf http://127.0.0.1:8000/index.html"})
        self.assertEqual(b["status"], "succeeded", b)
        sid = self.create("dock")
        c = s.command(sid, "curl -sf http://127.0.0.1:8000/index.html; cat /srv/www/greeting.txt "
                           "/set; stat -c '%U %a' /srv/www/extra.txt /usr/local/bin/setup.sh")
        self.assertEqual(c["stdout"], "docker-%s\nhello prod a b\nset\nuser 644\nroot 755\n"
                         % NONCE, c)
        for text, want in (("FROM base\nRUN true\nHEALTHCHECK CMD true\n",
                            "line 3: HEALTHCHECK is not supported"),
                           ("FROM Node\n", "line 1: FROM Node: neither a template name nor an image"),
                           ("FROM base\nFROM base\n", "multi-stage"),
                           ("FROM base\nCOPY a /a\n", "needs the build context")):
            st, r = s.request("POST", "/v1/templates",
                              {"name": "dock2", "from": {"dockerfile": text}})
            self.assertEqual(st, 400, (text, r))
            self.assertIn(want, r["error"]["message"])
        st, r = s.request("DELETE", "/v1/templates/dock")
        self.assertEqual(st, 200, r)

    def test_6_step_cache(self):
        """A changed step reruns from there: the steps before it come from a snapshot of an
        earlier build's builder (their commands do not run again), and the result is what
        running them all would give."""
        s = self.s
        # each long enough for a step cache snapshot (one that took up to 2.5 s before)
        steps = [{"run": "echo ran-one-%s; echo one > /one; sleep 2.7" % NONCE},
                 {"env": {"SC": "env-%s" % NONCE}},
                 {"run": "echo ran-two; echo \"two-$SC\" > /two; sleep 2.7"},
                 {"run": "echo three-a > /three"}]
        t0 = time.time()
        b1 = build(s, {"name": "sc", "from": "base", "steps": steps})
        first = time.time() - t0
        self.assertEqual(b1["status"], "succeeded", b1)
        text = [x.get("line") for x in logs(s, "sc", b1["id"])]
        self.assertIn("ran-one-%s" % NONCE, text)
        self.assertIn("steps 1-1: cached for later builds", text)
        self.assertIn("steps 1-3: cached for later builds", text)
        # the last step changed: steps 1-3 are not run again
        steps[3] = {"run": "echo three-b > /three"}
        t0 = time.time()
        b2 = build(s, {"name": "sc", "from": "base", "steps": steps})
        second = time.time() - t0
        self.assertEqual(b2["status"], "succeeded", b2)
        self.assertFalse(b2["cached"])
        text = [x.get("line") for x in logs(s, "sc", b2["id"])]
        self.assertIn("steps 1-3: cached: the builder starts as an earlier build left it "
                      "after them", text)
        self.assertNotIn("ran-one-%s" % NONCE, text)
        self.assertNotIn("ran-two", text)
        print("step cache: first build %.1f s, with steps 1-3 cached %.1f s" % (first, second))
        self.assertLess(second, first)  # 5.4 s of sleeps (and two snapshots) not done again
        sid = self.create("sc")
        c = s.command(sid, "cat /one /two /three; echo $SC")
        self.assertEqual(c["stdout"], "one\ntwo-env-%s\nthree-b\nenv-%s\n" % (NONCE, NONCE), c)
        # the third step changed: from step 1's snapshot, steps 2-4 run
        steps[2] = {"run": "echo ran-two-b; echo \"2b-$SC\" > /two"}
        b3 = build(s, {"name": "sc", "from": "base", "steps": steps})
        self.assertEqual(b3["status"], "succeeded", b3)
        text = [x.get("line") for x in logs(s, "sc", b3["id"])]
        self.assertIn("steps 1-1: cached: the builder starts as an earlier build left it "
                      "after them", text)
        self.assertNotIn("ran-one-%s" % NONCE, text)
        self.assertIn("ran-two-b", text)
        # force: nothing from the cache
        b4 = build(s, {"name": "sc", "from": "base", "steps": steps, "force": True})
        self.assertEqual(b4["status"], "succeeded", b4)
        self.assertIn("ran-one-%s" % NONCE, [x.get("line") for x in logs(s, "sc", b4["id"])])
        sid = self.create("sc")
        c = s.command(sid, "cat /one /two /three")
        self.assertEqual(c["stdout"], "one\n2b-env-%s\nthree-b\n" % NONCE, c)

    def test_3_restart_mid_build(self):
        s = self.s
        st, r = s.request("POST", "/v1/templates",
                          {"name": "slow", "from": "base", "steps": [{"run": "sleep 600"}]})
        self.assertEqual(st, 202, r)
        bid = r["build"]["id"]
        deadline = time.time() + 240 * MULT
        while time.time() < deadline:  # until the step runs in the builder
            if any(x.get("line") == "$ sleep 600" for x in logs(s, "slow", bid)):
                break
            time.sleep(0.5)
        else:
            self.fail("the step did not start: %s" % logs(s, "slow", bid))
        vm = "bld-" + bid.replace("-", "")[:20]  # the builder's VM id (tmpl.c vm_id_of)
        self.assertTrue(os.path.isdir(os.path.join(DATA, "vms", vm)))
        s.kill(signal.SIGKILL)
        # template snapshot seeds (tmpl_int.h) as processes leave them: one of a process that
        # is gone goes at start-up, one of a live process sharing the data dir stays
        gone = subprocess.Popen(["true"])
        gone.wait()
        seeds = {}
        for who, pid in (("gone", gone.pid), ("live", os.getpid())):
            seeds[who] = os.path.join(DATA, "snapshots", "bs-%d-bld-%s" % (pid, who))
            os.makedirs(os.path.join(seeds[who], "snapshot"))
            with open(os.path.join(seeds[who], "snapshot", "manifest.json"), "w") as f:
                f.write("{}")
        # a discarded version whose removal the kill cut short goes at the next start
        left = os.path.join(DATA, "templates", ".trash", "Kq3xZ1", "d")
        os.makedirs(os.path.join(left, "sub"))
        with open(os.path.join(left, "sub", "rootfs.qcow2"), "wb") as f:
            f.truncate(1 << 20)
        s.start()
        wait_until(lambda: not os.path.exists(seeds["gone"]), "the leftover seed removed")
        wait_until(lambda: not os.path.exists(os.path.dirname(left)),
                   "the leftover discarded files removed")
        self.assertFalse(os.path.exists(os.path.join(seeds["live"], "deleted")))
        shutil.rmtree(seeds["live"])
        deadline = time.time() + 60 * MULT
        while time.time() < deadline:
            st, r = s.request("GET", "/v1/templates/slow/builds/" + bid)
            if r["build"]["status"] == "failed" and \
                    not os.path.exists(os.path.join(DATA, "vms", vm)):
                break
            time.sleep(0.5)
        self.assertEqual(r["build"]["status"], "failed", r)
        self.assertIn("restarted", r["build"]["error"])
        self.assertFalse(os.path.exists(os.path.join(DATA, "vms", vm)))
        st, r = s.request("GET", "/v1/templates/slow")
        self.assertEqual((st, r.get("status")), (200, "failed"), r)
        st, r = s.request("POST", "/v1/sandboxes", {"template": "slow"})
        self.assertNotEqual(st, 202, r)


    def test_7_versions_and_tags(self):
        """web:v1 and web:v2, creates from each tag and the default, a tag moved: the sandbox on
        the old version runs on and wakes on its version; the template deleted while sandboxes
        use two versions: their files stay; an unused version is removed."""
        s = self.s
        tdir = os.path.join(DATA, "templates", "tg")

        def step(v):
            return [{"run": "echo %s-%s > /v" % (v, NONCE)}]

        b1 = build(s, {"name": "tg:v1", "from": "base", "steps": step("one")})
        self.assertEqual(b1["status"], "succeeded", b1)
        self.assertEqual(len(b1["id"]), 36, b1)  # a UUID
        b2 = build(s, {"name": "tg:v2", "tags": ["default"], "from": "base", "steps": step("two")})
        self.assertEqual(b2["status"], "succeeded", b2)
        v1, v2 = b1["version"], b2["version"]
        st, t = s.request("GET", "/v1/templates/tg")
        self.assertEqual(st, 200, t)
        self.assertEqual({(x["tag"], x["version"]) for x in t["tags"]},
                         {("v1", v1), ("v2", v2), ("default", v2)}, t)
        self.assertEqual(t["version"], v2)
        for v in t["versions"]:
            self.assertGreater(v["size_bytes"], 0, v)
        # the list: each template with its versions (tags, sizes) and its last build
        st, r = s.request("GET", "/v1/templates")
        self.assertEqual(st, 200, r)
        lt = [x for x in r["templates"] if x["name"] == "tg"][0]
        self.assertEqual([(x["version"], sorted(x["tags"])) for x in lt["versions"]],
                         [(v2, ["default", "v2"]), (v1, ["v1"])], lt)
        sizes = {x["version"]: x["size_bytes"] for x in t["versions"]}
        with open(os.path.join(os.path.dirname(__file__), "..", "templates", "base",
                               "template.json")) as f:
            disk_mb = json.load(f)["disk_mb"]  # a step build keeps its parent's disk
        for x in lt["versions"]:
            self.assertEqual(x["size_bytes"], sizes[x["version"]], (x, t))
            self.assertEqual(x["disk_mb"], disk_mb, x)
        self.assertEqual((lt["version"], lt["last_build_id"], lt["last_build_status"],
                          lt["disk_mb"], lt["size_bytes"]),
                         (v2, b2["id"], "succeeded", disk_mb, sizes[v2]), lt)
        base = [x for x in r["templates"] if x["name"] == "base"][0]
        self.assertEqual((base["builtin"], base["versions"]), (True, []), base)

        def cat(sid):
            return s.command(sid, "cat /v")["stdout"].strip()

        s1 = self.create("tg:v1")
        s2 = self.create("tg")
        s3 = self.create("tg:v2")
        self.assertEqual((cat(s1), cat(s2), cat(s3)),
                         ("one-" + NONCE, "two-" + NONCE, "two-" + NONCE))

        # built from a tag other than default: that tag's version, not the current one
        bc = build(s, {"name": "tgc", "from": "tg:v1", "steps": [{"run": "echo c > /c"}]})
        self.assertEqual(bc["status"], "succeeded", bc)
        sc = self.create("tgc")
        self.assertEqual(s.command(sc, "cat /v /c")["stdout"], "one-%s\nc\n" % NONCE)
        bd = build(s, {"name": "tgc", "from": {"template": "tg:default"},
                       "steps": [{"run": "echo c > /c"}]})
        self.assertEqual(bd["status"], "succeeded", bd)
        self.assertNotEqual(bd["version"], bc["version"])
        self.assertEqual(s.command(self.create("tgc"), "cat /v")["stdout"], "two-%s\n" % NONCE)
        # built on a version no tag needs to name: by its hash (12 of its digits here)
        bv = build(s, {"name": "tgc", "from": {"template": "tg", "version": v1[:12]},
                       "steps": [{"run": "echo c > /c"}]})
        self.assertEqual((bv["status"], bv["version"]), ("succeeded", bc["version"]), bv)
        for parent, want in (("tg:nope", 404), ("tg:Bad!", 404), ("base:v1", 404),
                             ({"template": "tg", "version": "0" * 12}, 404),
                             ({"template": "base", "version": v1[:12]}, 404)):
            st, r = s.request("POST", "/v1/templates", {"name": "tgc", "from": parent})
            self.assertEqual(st, want, (parent, r))
            self.assertIn("not found", json.dumps(r), (parent, r))
        for parent, msg in (({"template": "tg", "version": "abc"}, "at least 8"),
                            ({"template": "tg:v1", "version": v1[:12]}, "not both")):
            st, r = s.request("POST", "/v1/templates", {"name": "tgc", "from": parent})
            self.assertEqual(st, 400, (parent, r))
            self.assertIn(msg, r["error"]["message"], parent)
        # another team's tagged template answers as one that does not exist
        st, r = s.request("POST", "/v1/templates", {"name": "tgc2", "from": "tg:v1"},
                          key=self.p.keys["beta"])
        self.assertEqual(st, 404, r)
        self.assertIn("not found", json.dumps(r), r)

        # default moves to v1: s2 keeps v2, also after suspend and wake; new creates get v1
        st, r = s.request("PUT", "/v1/templates/tg/tags/default", {"from_tag": "v1"})
        self.assertEqual((st, r.get("version")), (200, v1), r)
        self.assertEqual(cat(s2), "two-" + NONCE)
        st, r = s.request("POST", "/v1/sandboxes/%s/suspend?wait=%d" % (s2, wait_s(120)),
                          timeout=150 * MULT)
        self.assertEqual((st, r["sandbox"]["state"]), (200, "suspended"), r)
        st, r = s.request("POST", "/v1/sandboxes/%s/wake?wait=%d" % (s2, wait_s(120)),
                          timeout=150 * MULT)
        self.assertEqual((st, r["sandbox"]["state"]), (200, "running"), r)
        self.assertEqual(cat(s2), "two-" + NONCE)
        s4 = self.create("tg")
        self.assertEqual(cat(s4), "one-" + NONCE)

        # a version nothing uses goes when its tag moves away
        b3 = build(s, {"name": "tg:tmp", "from": "base", "steps": step("three")})
        self.assertEqual(b3["status"], "succeeded", b3)
        v3 = b3["version"]
        self.assertTrue(os.path.isdir(os.path.join(tdir, v3)))
        st, r = s.request("PUT", "/v1/templates/tg/tags/tmp", {"version": v1[:12]})
        self.assertEqual(st, 200, r)
        deadline = time.time() + 10 * MULT
        while os.path.isdir(os.path.join(tdir, v3)) and time.time() < deadline:
            time.sleep(0.2)
        self.assertFalse(os.path.isdir(os.path.join(tdir, v3)))
        # its files were moved aside at once and are unlinked off the loop (tmpl_int.h: discard)
        trash = os.path.join(DATA, "templates", ".trash")
        wait_until(lambda: not os.path.isdir(trash) or not os.listdir(trash),
                   "the discarded version's files removed")

        # the template deleted while sandboxes use v1 and v2: their files stay, they run on
        st, r = s.request("DELETE", "/v1/templates/tg/tags/v2")
        self.assertEqual(st, 200, r)
        st, r = s.request("DELETE", "/v1/templates/tg")
        self.assertEqual(st, 200, r)
        time.sleep(1)
        for v in (v1, v2):
            self.assertTrue(os.path.exists(os.path.join(tdir, v, "rootfs.qcow2")), v)
        self.assertEqual((cat(s1), cat(s2)), ("one-" + NONCE, "two-" + NONCE))
        st, r = s.request("POST", "/v1/sandboxes", {"template": "tg:v1"})
        self.assertEqual(st, 404, r)

    def test_9_packages_through_egress(self):
        # A build's steps reach the network through the egress proxy as a sandbox's commands
        # do, with the internet by default: apt installs a package from the host's Debian
        # mirror (as the E2B SDK's apt_install does), and a sandbox of the template runs it. A
        # build whose egress policy has the internet off is refused by the proxy and fails at
        # that step; a bad policy is a 400 naming the rule.
        s = self.s
        # the nonce: run afresh, never from the step cache of an earlier run
        apt = ("echo %s >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive"
               " apt-get install -y -qq --no-install-recommends hello" % NONCE)
        b = build(s, {"name": "pkg", "from": "base", "steps": [{"run": apt, "user": "root"}]})
        self.assertEqual(b["status"], "succeeded",
                         (b, [x.get("line") for x in logs(s, "pkg", b["id"])][-20:]))
        sid = self.create("pkg")
        self.assertEqual(s.command(sid, "hello")["stdout"], "Hello, world!\n")
        # the first mirror the guest's own apt sources name (the host's, as the rootfs got them)
        fetch = ("u=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null"
                 " | grep -v '^#' | grep -o 'https\\?://[^ ]*' | head -n 1) && [ -n \"$u\" ]"
                 " && curl -sS -f -m 30 -o /dev/null \"$u\"")
        b = build(s, {"name": "pkgoff", "from": "base", "egress": {"internet": False},
                      "steps": [{"run": "echo %s" % NONCE}, {"run": fetch}]})
        self.assertEqual((b["status"], b["failed_step"]), ("failed", 2), b)
        self.assertIn("403", b["error"])
        st, r = s.request("POST", "/v1/templates", {"name": "pkgoff", "from": "base",
                                                    "egress": {"allow": ["a..b"]}})
        self.assertEqual(st, 400, r)
        self.assertIn("egress.allow[0]", r["error"]["message"])

    def test_10_limits(self):
        """A step that hangs past its own timeout_s, and a build past its time limit: each
        fails naming the cause, leaves nothing in service and no builder behind. A step that
        writes more than the log keeps: the log ends with the cap's marker, the build goes on.
        Three builds of one team at once: the third waits, queued, until one of the first two
        has ended (two run at a time)."""
        s = self.s
        hang = {"name": "lim1", "from": "base",
                "steps": [{"run": "echo %s; echo start-hang; sleep 100000" % NONCE,
                           "timeout_s": 15}]}
        slow = {"name": "lim2", "from": "base", "timeout_s": 25,
                "steps": [{"run": "echo %s; sleep 100000" % NONCE}]}
        # each line is about 90 bytes of log (JSON with its time, step and stream)
        flood = {"name": "lim3", "from": "base",
                 "steps": [{"run": "echo %s; seq 1 400000" % NONCE}, {"run": "echo after"}]}
        ids = []
        for body in (hang, slow, flood):
            st, r = s.request("POST", "/v1/templates", body, timeout=60)
            self.assertEqual(st, 202, r)
            ids.append(r["build"]["id"])
        st, r = s.request("GET", "/v1/templates/lim3/builds/" + ids[2])
        self.assertEqual((st, r["build"]["status"], r["build"]["started_at"]),
                         (202, "queued", None), r)

        def done(name, bid):
            deadline = time.time() + 600 * MULT
            while True:
                st, r = s.request("GET", "/v1/templates/%s/builds/%s?wait=%d"
                                  % (name, bid, wait_s(120)), timeout=150)
                self.assertIn(st, (200, 202), r)
                if r["build"]["status"] not in ("queued", "building"):
                    return r["build"]
                self.assertLess(time.time(), deadline, r)

        b1, b2, b3 = done("lim1", ids[0]), done("lim2", ids[1]), done("lim3", ids[2])
        self.assertEqual((b1["status"], b1["failed_step"]), ("failed", 1), b1)
        self.assertIn("did not finish within its timeout_s", b1["error"])
        self.assertIn("start-hang", b1["error"])
        self.assertEqual(b2["status"], "failed", b2)
        self.assertIn("within its time limit of 25 s", b2["error"])
        self.assertEqual(b3["status"], "succeeded", b3)
        # the queued one started once one of the first two had ended
        self.assertGreaterEqual(b3["started_at"], min(b1["finished_at"], b2["finished_at"]))
        lines = logs(s, "lim3", ids[2])
        size = sum(len(json.dumps(x, separators=(",", ":"))) + 1 for x in lines)
        self.assertLessEqual(size, (16 << 20) + 256)  # the cap, and its marker
        self.assertIn("size limit", lines[-1]["line"], lines[-1])
        nums = [x["line"] for x in lines if x.get("stream") == "stdout" and x.get("step") == 1]
        self.assertEqual(nums[0], NONCE)
        self.assertGreater(len(nums), 100000)
        self.assertLess(len(nums), 400001)  # cut: not every line was kept
        self.assertEqual(nums[1:], [str(i) for i in range(1, len(nums))])  # in order, none lost
        self.assertNotIn("after", [x.get("line") for x in lines])  # past the cap
        for name in ("lim1", "lim2"):
            st, r = s.request("POST", "/v1/sandboxes", {"template": name})
            self.assertIn(st, (404, 409), (name, r))
            d = os.path.join(DATA, "templates", name)
            self.assertFalse([x for x in (os.listdir(d) if os.path.isdir(d) else [])
                              if x.startswith(".build-")], name)
        self.assertFalse([d for d in os.listdir(os.path.join(DATA, "vms"))
                          if d.startswith("bld-")])

    def test_11_disk_size(self):
        """disk_mb grows the builder's disk (and its filesystem, online) before the steps: a
        step can fill more than the parent's disk holds, and the template's sandboxes get the
        larger disk, as do templates built on it. A disk cannot shrink: 400."""
        s = self.s
        with open(os.path.join(os.path.dirname(__file__), "..", "templates", "base",
                               "template.json")) as f:
            base_mb = json.load(f)["disk_mb"]
        want = base_mb + 1024

        def size_mb(sid):  # the root filesystem's size, as df sees it
            return int(s.command(sid, "df -B1M --output=size / | tail -n 1")["stdout"])

        before = size_mb(self.create("base"))
        self.assertLess(before, base_mb + 1)
        # more than the parent's whole disk: only fits on the grown one (fallocate writes
        # no data, so the image stays small)
        fill = {"run": "echo %s && fallocate -l %dM /fill && ls -s --block-size=1M /fill && "
                       "rm /fill" % (NONCE, base_mb + 256), "user": "root"}
        b = build(s, {"name": "dsk", "from": "base", "disk_mb": want, "steps": [fill]})
        self.assertEqual(b["status"], "succeeded",
                         (b, [x.get("line") for x in logs(s, "dsk", b["id"])][-20:]))
        text = [x.get("line") for x in logs(s, "dsk", b["id"])]
        self.assertIn("growing the builder's disk from %d to %d MiB" % (base_mb, want), text)
        sid = self.create("dsk")
        grown = size_mb(sid)
        self.assertGreater(grown, before + 900, (before, grown))
        self.assertLess(grown, want + 1)
        st, r = s.request("GET", "/v1/templates")
        lt = [x for x in r["templates"] if x["name"] == "dsk"][0]
        self.assertEqual((lt["disk_mb"], lt["versions"][0]["disk_mb"]), (want, want), lt)
        # built on it: the grown disk, as its parent's
        b2 = build(s, {"name": "dsk2", "from": "dsk", "steps": [{"run": "echo %s" % NONCE}]})
        self.assertEqual(b2["status"], "succeeded", b2)
        self.assertEqual(size_mb(self.create("dsk2")), grown)
        # the same inputs without the disk asked for: another version (the disk is an input)
        b3 = build(s, {"name": "dsk", "from": "base", "steps": [{"run": "echo %s" % NONCE}]})
        self.assertEqual(b3["status"], "succeeded", b3)
        self.assertLessEqual(size_mb(self.create("dsk")), before)
        for disk, msg in ((base_mb - 1, "grow, not shrink"), (100, "disk_mb must be"),
                          ("big", "disk_mb must be")):
            st, r = s.request("POST", "/v1/templates",
                              {"name": "dsk", "from": "base", "disk_mb": disk})
            self.assertEqual(st, 400, (disk, r))
            self.assertIn(msg, r["error"]["message"])

    def test_12_from_snapshot(self):
        """A template built from a sandbox snapshot: the builder starts as the snapshot left
        the sandbox (its files, and its processes running), the steps run on that, and the
        template's sandboxes start with all of it. Another team's snapshot, an unknown one and
        a size other than the snapshot's are refused."""
        s = self.s
        src = self.create("base")
        counter = ("nohup python3 -c 'import os, time\ni = 0\nwhile True:\n    i += 1\n"
                   "    open(\"/tmp/c.tmp\", \"w\").write(str(i))\n"
                   "    os.rename(\"/tmp/c.tmp\", \"/tmp/c\")\n"
                   "    time.sleep(0.1)' >/dev/null 2>&1 &")
        s.command(src, counter)
        s.command(src, "echo in-sandbox-%s > /home/user/state.txt" % NONCE)

        def count(sid):
            c = s.command(sid, "for i in $(seq 1 50); do [ -s /tmp/c ] && break; sleep 0.2;"
                               " done; cat /tmp/c")
            return int(c["stdout"])

        deadline = time.time() + 20 * MULT
        while count(src) < 5:
            self.assertLess(time.time(), deadline)
            time.sleep(0.3)
        st, r = s.request("POST", "/v1/sandboxes/%s/snapshots?wait=%d" % (src, wait_s(120)),
                          {}, timeout=150 * MULT)
        self.assertEqual(st, 201, r)
        snap = r["snapshot"]["id"]
        at_snap = count(src)
        b = build(s, {"name": "fsnap", "from": {"snapshot": snap},
                      "steps": [{"run": "echo step-%s >> /home/user/state.txt; cat /tmp/c" % NONCE,
                                 "user": "root"}]})
        self.assertEqual(b["status"], "succeeded",
                         (b, [x.get("line") for x in logs(s, "fsnap", b["id"])][-20:]))
        text = [x.get("line") for x in logs(s, "fsnap", b["id"])]
        self.assertIn("the builder starts from snapshot %s" % snap, text)
        st, t = s.request("GET", "/v1/templates/fsnap")
        self.assertEqual(t["parent"], "base", t)
        sid = self.create("fsnap")
        c = s.command(sid, "cat /home/user/state.txt")
        self.assertEqual(c["stdout"], "in-sandbox-%s\nstep-%s\n" % (NONCE, NONCE), c)
        a = count(sid)
        self.assertGreaterEqual(a, at_snap - 50)  # the snapshot's process, going on from there
        deadline = time.time() + 20 * MULT
        while count(sid) <= a:
            self.assertLess(time.time(), deadline, "the counter does not run")
            time.sleep(0.3)
        for body, want, msg in (
                ({"from": {"snapshot": snap}, "memory_mb": 512}, 400, "the snapshot's size"),
                ({"from": {"snapshot": "snap-nope"}}, 404, "not found"),
                ({"from": {"snapshot": 7}}, 400, "from is required")):
            st, r = s.request("POST", "/v1/templates", dict(body, name="fsnap2"))
            self.assertEqual(st, want, (body, r))
            self.assertIn(msg, r["error"]["message"], body)
        st, r = s.request("POST", "/v1/templates", {"name": "fsnap2",
                                                    "from": {"snapshot": snap}},
                          key=self.p.keys["beta"])
        self.assertEqual(st, 404, r)

    def test_8_layers_squashed(self):
        """Templates built on templates: each one's image is a layer over its parent's until
        the parent's chain holds --template-max-layers images; then the build writes a
        standalone image. Sandboxes of every level see every level's files. Once the parents
        are rebuilt, the old version of a parent whose child was squashed is removed (nothing
        reads it), while the old version of a parent under a layered child is kept; the
        squashed child's sandboxes, old and new, still see every level's files."""
        s = self.s

        def chain(name, version):
            path = os.path.join(DATA, "templates", name, version, "rootfs.qcow2")
            out = subprocess.run(["qemu-img", "info", "-U", "--backing-chain", "--output=json",
                                  path], check=True, capture_output=True, text=True).stdout
            return [x["filename"] for x in json.loads(out)]

        def steps(name):
            return [{"run": "echo %s-%s > /%s" % (name, NONCE, name)}]

        parent, parent_len, levels = "base", None, []
        for i, name in enumerate(("ly1", "ly2", "ly3")):
            b = build(s, {"name": name, "from": parent, "steps": steps(name)})
            self.assertEqual(b["status"], "succeeded", b)
            files = chain(name, b["version"])
            if parent_len is None:  # base's own chain: what ly1 stacks on, unless squashed
                parent_len = len(files) - 1 if len(files) > 1 else self.MAX_LAYERS
            want = 1 if parent_len >= self.MAX_LAYERS else parent_len + 1
            self.assertEqual(len(files), want, (name, files))
            sid = self.create(name)
            c = s.command(sid, "cat " + " ".join("/ly%d" % (k + 1) for k in range(i + 1)))
            self.assertEqual(c["stdout"],
                             "".join("ly%d-%s\n" % (k + 1, NONCE) for k in range(i + 1)), c)
            levels.append({"name": name, "from": parent, "version": b["version"],
                           "squashed": want == 1, "sid": sid})
            parent, parent_len = name, len(files)
        # Collection goes by the disk chain: ly1's version is under ly2's layer; ly2's version
        # is named by ly3's manifest as its parent, but ly3's image was squashed and reads
        # nothing of it. (base is one file: with 3 layers at most, ly3 is the one squashed.)
        self.assertEqual([lv["squashed"] for lv in levels], [False, False, True], levels)
        ly1, ly2, ly3 = levels

        def vdir(lv):
            return os.path.join(DATA, "templates", lv["name"], lv["version"])

        def vms_naming(lv, spares):
            """The VM directories whose vm.json names the version's files: spare clones'
            (a directory .pool-*; a taken spare's old name is a link) or the others'."""
            needle = "/templates/%s/%s/" % (lv["name"], lv["version"])
            vms = os.path.join(DATA, "vms")
            found = []
            for d in os.listdir(vms):
                p = os.path.join(vms, d)
                spare = d.startswith(".pool-") and not os.path.islink(p)
                try:
                    with open(os.path.join(p, "vm.json")) as f:
                        if needle in f.read() and spare == spares:
                            found.append(d)
                except OSError:
                    pass
            return found

        def runtime_holds(lv):
            """Whether a VM other than a spare clone still names the version's files: the
            collector keeps such a version whatever its children are. A spare does not keep
            it: the collector drops it."""
            return bool(vms_naming(lv, spares=False))

        def spares_of(lv):
            """Waits (60 s at most) for a spare clone of lv's version: one is made after a
            create of its size while the host is idle, and stays until its size is idle for
            half an hour or the collector drops it."""
            deadline = time.time() + 60 * MULT
            while not vms_naming(lv, spares=True) and time.time() < deadline:
                time.sleep(0.5)
            return vms_naming(lv, spares=True)

        def collect(lv, gone):
            """Moves lv's template's default tag onto itself, a collection of its versions,
            until lv's version is gone (or 60 s passed) when gone is set, else once."""
            deadline = time.time() + 60 * MULT
            while True:
                st, r = s.request("PUT", "/v1/templates/%s/tags/default" % lv["name"],
                                  {"from_tag": "default"})
                self.assertEqual(st, 200, r)
                if not gone or not os.path.isdir(vdir(lv)) or time.time() > deadline:
                    return
                time.sleep(1)

        def rebuild(lv):
            """A new version of lv's template becomes its default and lv's sandbox goes, so
            that nothing but a child can keep the old version."""
            b = build(s, {"name": lv["name"], "from": lv["from"],
                          "steps": steps(lv["name"]) + [{"run": "echo again > /again"}]})
            self.assertEqual(b["status"], "succeeded", b)
            self.assertNotEqual(b["version"], lv["version"])
            s.delete_quietly(lv["sid"])
            deadline = time.time() + 60 * MULT
            while runtime_holds(lv) and time.time() < deadline:
                time.sleep(0.5)
            self.assertFalse(runtime_holds(lv), lv)

        # ly1's old version: collected while ly2's layer over it is on disk, so kept
        rebuild(ly1)
        collect(ly1, gone=False)
        # ly2's old version: removed, row and all, though ly3 names it as its parent and
        # spare clones of it (made after ly2's create) are there: they are dropped with it
        rebuild(ly2)
        self.assertTrue(spares_of(ly2), ly2)
        collect(ly2, gone=True)
        self.assertFalse(os.path.isdir(vdir(ly2)), ly2)
        deadline = time.time() + 30 * MULT
        while vms_naming(ly2, spares=True) and time.time() < deadline:
            time.sleep(0.5)
        self.assertEqual(vms_naming(ly2, spares=True), [], ly2)
        st, t = s.request("GET", "/v1/templates/ly2")
        self.assertEqual(st, 200, t)
        self.assertNotIn(ly2["version"], [v["version"] for v in t["versions"]], t)
        # ly1's collection ran a whole build ago: it kept the version under ly2's layer
        self.assertTrue(os.path.exists(os.path.join(vdir(ly1), "rootfs.qcow2")), ly1)
        # ly3 stands alone: its sandbox reads on, a new one boots, both see every level's
        # files; the template still names its parent
        self.assertEqual(chain("ly3", ly3["version"]), [os.path.join(vdir(ly3), "rootfs.qcow2")])
        cat = "cat /ly1 /ly2 /ly3"
        want = "".join("ly%d-%s\n" % (k + 1, NONCE) for k in range(3))
        self.assertEqual(s.command(ly3["sid"], cat)["stdout"], want)
        self.assertEqual(s.command(self.create("ly3"), cat)["stdout"], want)
        st, t = s.request("GET", "/v1/templates/ly3")
        self.assertEqual((st, t.get("parent")), (200, "ly2"), t)
        # with ly2's old layer gone, nothing holds ly1's old version: the next collection
        # (spares of it, if the pool still keeps its size, go with it)
        collect(ly1, gone=True)
        self.assertFalse(os.path.isdir(vdir(ly1)), ly1)
        # the collections let the current versions' spares be: ly3's create made one
        self.assertTrue(spares_of(ly3), ly3)

if __name__ == "__main__":
    unittest.main()
