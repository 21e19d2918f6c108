"""Many hosts on real VMs: one PostgreSQL, an API node and two workers (QEMU), one shared
snapshot dir, one cluster key; every request goes through the API node.

- A drain of the worker a running sandbox is on moves it to the other worker by suspend and
  wake (core/control/fleet.c over the shared snapshot dir, core/runtime/qemu/shared.c): its
  file is there and its background process is still counting, and its VM runs on one worker.
  The first worker's spaced restarts (settling what moved away from it must not touch the
  sandbox's VM on the other worker, in a cgroup of the same name on this one host), and a
  drain of the second worker moves the sandbox back, running, its file and counter kept.
- A worker whose spaced is killed (its VMs live on) and restarted within the grace re-adopts
  its running sandbox: lost for a moment, then running with its process still counting.
- A worker killed with its VMs is declared lost within the heartbeat timeout: its running
  sandbox turns lost with the reason (its memory is gone) and can be deleted; a sandbox that
  was suspended on it wakes on the other worker with its file; a snapshot taken of the running
  one before (written to the snapshot dir too, whole; the taker's own copy a RAM delta) forks
  on the other worker, which copies it in as a delta over its own template snapshot's RAM:
  its file there, its counter going on. A template built from that snapshot through the API
  node is built on the worker left, from its copy, and its sandbox has the snapshot's file.
  Deleted, its shared copy goes, and that worker's copy once the fork is deleted.
- Templates built through the API node: the build and its log go to the template's worker
  (the builder: md5(name/id) first), its files to the snapshot dir; the builder publishes the
  version in the shared snapshot dir; a sandbox of it on the other worker imports it from
  there (its start_cmd server up at once, its copied files there). With the builder drained,
  a child of that template is built on the other worker from the published parent, and its
  sandboxes have both templates' files; the first build's log still reads through the API
  node (logs are kept in the snapshot dir). Once both are deleted, their published versions
  and every worker's copies go, the parent only after its child.
- Throughout, no sandbox has a VM on two workers (every QEMU's command line is scanned).

Each worker has a data dir of its own holding the shared e2e data dir's base template build
(files hard-linked, directories its own, as e2e/test_snapdir.c does), so neither touches the
data dir the other VM suites use.
"""
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import (MULT, PgCluster, Spaced, read_number_cmd, vm_skip_reason, wait_s,  # noqa: E402
                     wait_until)
import fleet  # noqa: E402
from fleet import qemu_cmdlines  # noqa: E402
from test_templates import build, logs  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
TIMEOUT_S = 3  # --heartbeat-timeout-s
BASE_GRACE_S = 5  # SPACE_SHARED_BASE_GRACE_S: how long an unnamed published template RAM stays
CACHE_S = 6  # --build-cache-s: versions are looked over every CACHE_S / 2 s
COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.5; done"
READ_COUNT = read_number_cmd("/tmp/count")


def worker_data_dir(path):
    """A data dir holding DATA's current base template build, files linked."""
    fleet.worker_data_dir(DATA, path)


class FleetVmTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        why = vm_skip_reason(DATA)
        if why:
            raise unittest.SkipTest(why)
        # Beside DATA, so that links work and the published templates are cheap.
        cls.root = os.path.join(os.path.dirname(os.path.abspath(DATA)),
                                "fleet-vm-%d" % os.getpid())
        os.makedirs(cls.root)
        cls.snap = os.path.join(cls.root, "snapshots")
        os.makedirs(cls.snap)
        cls.keyfile = os.path.join(cls.root, "cluster.key")
        fd = os.open(cls.keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, os.urandom(24).hex().encode())
        os.close(fd)
        cls.pg = None
        cls.nodes = []
        cls.sids = []
        try:
            cls.pg = PgCluster()
            common = ["--cluster-key-file", cls.keyfile, "--heartbeat-timeout-s", str(TIMEOUT_S),
                      "--lost-grace-s", "30"]
            cls.api = Spaced(database_url=cls.pg.url, args=["--role", "api"] + common)
            cls.nodes.append(cls.api)
            cls.api.key = cls.api.cli("keys", "create", "--team", "alpha").stdout.strip()
            cls.api.start()
            with open(os.path.join(cls.api.data_dir, "admin-key")) as f:
                cls.admin = f.read().strip()
            cls.workers = []
            for n in ("w1", "w2"):
                d = os.path.join(cls.root, n)
                worker_data_dir(d)
                w = Spaced(database_url=cls.pg.url, data_dir=d,
                           env={"SPACE_SHARED_BASE_GRACE_S": str(BASE_GRACE_S)},
                           args=["--role", "worker", "--snapshot-dir", cls.snap,
                                 "--build-cache-s", str(CACHE_S),
                                 "--worker-vcpus", "8", "--worker-memory-mb", "8192",
                                 "--worker-labels", "node=" + n] + common)
                w.key = cls.api.key
                cls.nodes.append(w)
                w.start(timeout=120)
                with open(os.path.join(d, "worker-id")) as f:
                    w.wid = f.read().strip()
                cls.workers.append(w)
            cls.wait_for(lambda: len([x for x in cls.list_workers()
                                      if x["state"] == "active"]) == 2, "2 workers active")
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for sid in cls.sids:
            cls.api.delete_quietly(sid)
        for n in cls.nodes:
            n.destroy()
        # VMs of a worker this test killed: never left behind.
        for pid, line in qemu_cmdlines():
            if cls.root in line:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if cls.pg is not None:
            cls.pg.destroy()
        if os.environ.get("SP_TEST_KEEP") != "1":
            shutil.rmtree(cls.root, ignore_errors=True)

    # ---- helpers ----

    @staticmethod
    def wait_for(cond, what, timeout=30):
        wait_until(cond, what, timeout, 0.2)

    @classmethod
    def list_workers(cls):
        st, r = cls.api.request("GET", "/v1/workers", key=cls.admin)
        assert st == 200, (st, r)
        return r["workers"]

    def placed_on(self, sid):
        for w in self.workers:
            st, r = self.api.request("GET", "/v1/workers/" + w.wid, key=self.admin)
            self.assertEqual(st, 200, r)
            if any(s["id"] == sid for s in r["sandboxes"]):
                return w
        return None

    def state(self, sid):
        st, r = self.api.request("GET", "/v1/sandboxes/" + sid)
        self.assertEqual(st, 200, r)
        return r["state"]

    def create(self, on=None):
        body = {"template": "base"}
        if on is not None:
            body["placement"] = {"labels": {"node": on}}
        sid = self.api.create_ready(wait=240, **body)
        self.sids.append(sid)
        return sid

    def sh(self, sid, script, **kw):
        return self.api.command(sid, script, **kw)

    def start_counter(self, sid):
        st, r = self.api.request("POST", "/v1/sandboxes/%s/commands" % sid,
                                 {"argv": ["sh", "-c", COUNTER], "background": True})
        self.assertIn(st, (200, 201, 202), r)
        self.wait_for(lambda: self.count(sid) >= 3, "the counter counting")

    def count(self, sid):
        return int(self.sh(sid, READ_COUNT)["stdout"].strip())

    def vms_of(self, sid):
        """The workers whose driver has a live QEMU for sid: the pid in its VM dir's qemu.pid
        (a spare clone's dir is renamed to the sandbox's, so its command line may name the
        spare) is a running qemu-system process."""
        out = []
        for w in self.workers:
            try:
                with open(os.path.join(w.data_dir, "vms", sid, "qemu.pid")) as f:
                    pid = int(f.read().strip())
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    argv0 = f.read().split(b"\0")[0]
            except (OSError, ValueError):
                continue
            if os.path.basename(argv0).startswith(b"qemu-system"):
                out.append(w)
        return out

    @staticmethod
    def ram_kind(snapdir):
        with open(os.path.join(snapdir, "snapshot", "manifest.json")) as f:
            return json.load(f)["ram"]

    @staticmethod
    def ram_base_shared(snapdir):
        with open(os.path.join(snapdir, "snapshot", "manifest.json")) as f:
            return json.load(f).get("ram_base_shared")

    def assert_one_vm(self, sid, where):
        self.assertEqual([w.wid for w in self.vms_of(sid)], [where.wid])

    # ---- tests ----

    def drain_moves(self, sid, src, dst):
        """Drains src (where sid runs), waits for sid running on dst with its file and its
        counter going on, one VM (on dst), and undrains src."""
        before = self.count(sid)
        t0 = time.time()
        st, r = self.api.request("POST", "/v1/workers/%s/drain" % src.wid, key=self.admin)
        self.assertEqual(st, 200, r)
        self.wait_for(lambda: self.placed_on(sid) is dst and self.state(sid) == "running",
                      "the sandbox running on worker %s" % dst.wid, 240)
        print("drain: one sandbox moved in %.1f s" % (time.time() - t0), file=sys.stderr)
        self.assertEqual(self.sh(sid, "cat /root/f")["stdout"], "kept\n")
        after = self.count(sid)
        self.assertGreaterEqual(after, before)
        self.wait_for(lambda: self.count(sid) > after, "the counter still counting")
        self.assert_one_vm(sid, dst)
        st, r = self.api.request("POST", "/v1/workers/%s/undrain" % src.wid, key=self.admin)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["state"], "active")

    def test_a_drain_moves_a_running_sandbox_there_and_back(self):
        sid = self.create()
        a = self.placed_on(sid)
        b = [w for w in self.workers if w is not a][0]
        self.sh(sid, "echo kept > /root/f")
        self.start_counter(sid)
        self.assert_one_vm(sid, a)
        self.drain_moves(sid, a, b)
        # a's spaced restarts: settling what was placed on it (comeback), the sandbox that left
        # it among them, it must leave that sandbox's VM on b alone
        a.kill(signal.SIGKILL)
        a.start(timeout=120)
        self.wait_for(lambda: "fleet registered worker=" in a.read_log(), "the worker back")
        time.sleep(1)
        self.assertEqual(self.state(sid), "running")
        n = self.count(sid)
        self.wait_for(lambda: self.count(sid) > n, "the counter still counting on " + b.wid)
        self.assert_one_vm(sid, b)
        # and back to the worker it came from, active again
        self.drain_moves(sid, b, a)
        self.assertIn(sid, [m["id"] for m in self.api.request(
            "GET", "/v1/workers/" + b.wid, key=self.admin)[1]["moved"]])

    def test_b_restart_within_grace_readopts(self):
        w = self.workers[0]
        sid = self.create(on="w1")
        self.assertIs(self.placed_on(sid), w)
        self.start_counter(sid)
        w.kill(signal.SIGKILL)  # spaced only: its VMs live on
        self.wait_for(lambda: self.state(sid) == "lost", "the sandbox lost", 60)
        st, r = self.api.request("GET", "/v1/sandboxes/" + sid)
        self.assertIn("lost", r.get("error") or "", r)
        w.start(timeout=120)
        self.wait_for(lambda: self.state(sid) == "running", "the sandbox re-adopted", 60)
        n = self.count(sid)
        self.wait_for(lambda: self.count(sid) > n, "the counter still counting")
        self.assertIs(self.placed_on(sid), w)
        self.assert_one_vm(sid, w)

    def test_c_templates_built_through_the_api_node(self):
        api = self.api
        for sid in self.sids:  # a drain below moves nothing but what this test makes
            api.delete_quietly(sid)
        self.sids.clear()
        nonce = "%d-%d" % (os.getpid(), time.time())
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            data = ("copied-" + nonce + "\n").encode()
            ti = tarfile.TarInfo("app/copied.txt")
            ti.size, ti.mode = len(data), 0o640
            tf.addfile(ti, io.BytesIO(data))
        body = buf.getvalue()
        fk = hashlib.sha256(body).hexdigest()
        st, r = api.request("PUT", "/v1/template-files/" + fk, raw=body)
        self.assertEqual((st, r.get("existed")), (201, False), r)
        st, r = api.request("GET", "/v1/template-files/" + fk)
        self.assertEqual(st, 200, r)
        # the file uploaded through the API node is kept in the snapshot dir for any worker
        # (looked at now: once the build is over, it is collected CACHE_S after its last use)
        self.assertTrue([t for t in os.listdir(os.path.join(self.snap, "template-files"))
                         if os.path.exists(os.path.join(self.snap, "template-files", t, fk))])
        t0 = time.time()
        b = build(api, {"name": "fleetweb", "from": "base", "steps": [
            {"run": "mkdir -p /srv && echo %s > /srv/nonce" % nonce},
            {"copy": {"files": fk, "src": "app", "dest": "/srv/app"}}],
            "start_cmd": "cd /srv && python3 -m http.server 8000",
            "ready_cmd": "curl -sf http://127.0.0.1:8000/nonce"})
        print("fleet: template built through the API node in %.1f s" % (time.time() - t0),
              file=sys.stderr)
        self.assertEqual(b["status"], "succeeded", b)
        text = [x.get("line") for x in logs(api, "fleetweb", b["id"])]
        self.assertTrue(any("template snapshot ready" in (t or "") for t in text), text)
        # built on the template's builder (md5(name/id) first), published for every worker
        builder = min(self.workers,
                      key=lambda w: hashlib.md5(("fleetweb/" + w.wid).encode()).hexdigest())
        other = [w for w in self.workers if w is not builder][0]
        version = b["version"]
        self.assertTrue(os.path.exists(os.path.join(builder.data_dir, "templates", "fleetweb",
                                                    version, "manifest.json")))
        self.assertFalse(os.path.exists(os.path.join(other.data_dir, "templates", "fleetweb")))
        for f in ("manifest.json", "rootfs.qcow2"):
            self.assertTrue(os.path.exists(os.path.join(self.snap, "templates", "fleetweb",
                                                        version, f)), f)
        want = "%s\ncopied-%s\n" % (nonce, nonce)
        for w in (other, builder):
            sid = api.create_ready(wait=240, template="fleetweb",
                                   placement={"labels": {"node": os.path.basename(w.data_dir)}})
            self.sids.append(sid)
            self.assertIs(self.placed_on(sid), w)
            c = self.sh(sid, "curl -sf http://127.0.0.1:8000/nonce; cat /srv/app/copied.txt")
            self.assertEqual(c["stdout"], want, c)
        self.assertTrue(os.path.exists(os.path.join(other.data_dir, "templates", "fleetweb",
                                                    version, "manifest.json")))
        self.assertIn("template version imported from the snapshot dir template=fleetweb",
                      other.read_log())

        # The builder drained: the next build goes to the other worker, from the parent the
        # database names (built elsewhere, imported from the snapshot dir).
        for sid in self.sids:
            api.delete_quietly(sid)
        self.sids.clear()
        st, r = api.request("POST", "/v1/workers/%s/drain" % builder.wid, key=self.admin)
        self.assertEqual(st, 200, r)
        try:
            b2 = build(api, {"name": "fleetweb2", "from": "fleetweb",
                             "steps": [{"run": "echo child > /srv/child"}]})
            self.assertEqual(b2["status"], "succeeded", b2)
            self.assertTrue(os.path.exists(os.path.join(other.data_dir, "templates",
                                                        "fleetweb2", b2["version"])))
            self.assertFalse(os.path.exists(os.path.join(builder.data_dir, "templates",
                                                         "fleetweb2")))
            sid = api.create_ready(wait=240, template="fleetweb2")
            self.sids.append(sid)
            self.assertIs(self.placed_on(sid), other)
            c = self.sh(sid, "cat /srv/nonce /srv/app/copied.txt /srv/child")
            self.assertEqual(c["stdout"], want + "child\n", c)
            # the first build's log, written by the drained builder, from the one now answering
            self.assertEqual([x.get("line") for x in logs(api, "fleetweb", b["id"])], text)
        finally:
            st, r = api.request("POST", "/v1/workers/%s/undrain" % builder.wid, key=self.admin)
            self.assertEqual(st, 200, r)

        # Versions nothing uses leave the snapshot dir (and every worker), once deleted: the
        # parent only with its child, whose image is layered on the parent's published copy.
        for sid in self.sids:
            api.delete_quietly(sid)
        self.sids.clear()
        pub = os.path.join(self.snap, "templates", "fleetweb", version)
        pub2 = os.path.join(self.snap, "templates", "fleetweb2", b2["version"])
        info = json.loads(subprocess.run(
            ["qemu-img", "info", "-U", "--output=json", os.path.join(pub2, "rootfs.qcow2")],
            check=True, capture_output=True, text=True).stdout)
        layered = pub in info.get("full-backing-filename", info.get("backing-filename", ""))
        st, r = api.request("DELETE", "/v1/templates/fleetweb")
        self.assertEqual(st, 200, r)
        if layered:
            time.sleep(1.5 * CACHE_S)  # sweeps on every worker (one each CACHE_S / 2)
            self.assertTrue(os.path.exists(pub), "a parent of a published version removed")
        st, r = api.request("DELETE", "/v1/templates/fleetweb2")
        self.assertEqual(st, 200, r)
        self.wait_for(lambda: not os.path.exists(pub) and not os.path.exists(pub2),
                      "unused published versions removed", timeout=12 * CACHE_S)
        # each worker's own copies go at its next look (the child's first: it held its parent)
        self.wait_for(lambda: not any(os.path.exists(os.path.join(w.data_dir, "templates", n))
                                      for w in self.workers for n in ("fleetweb", "fleetweb2")),
                      "the workers' copies removed", timeout=12 * CACHE_S)
        self.assertTrue(any("removed a published template version nothing uses" in w.read_log()
                            for w in self.workers))
        # a built-in's published version stays, used or not
        self.assertTrue(os.listdir(os.path.join(self.snap, "templates", "base")))

    SDK_PY = r"""
import os, sys, tempfile
from e2b import Sandbox, Template, wait_for_url
name, nonce = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory() as ctx:
    with open(os.path.join(ctx, "motd"), "w") as f:
        f.write("motd-" + nonce + "\n")
    tpl = (Template(file_context_path=ctx).from_base_image()
           .copy("motd", "/srv/www/motd", user="root")
           .run_cmd("echo site-" + nonce + " > /srv/www/index.html", user="root")
           .set_start_cmd("cd /srv/www && python3 -m http.server 8000",
                          wait_for_url("http://127.0.0.1:8000/index.html")))
    logs = []
    info = Template.build(tpl, name, cpu_count=1, memory_mb=256, on_build_logs=logs.append)
    assert info.template_id == name, info
    assert any("step" in getattr(e, "message", "") for e in logs), logs[:10]
sb = Sandbox.create(name, timeout=300)
r = sb.commands.run("curl -sf http://127.0.0.1:8000/index.html; cat /srv/www/motd")
assert r.stdout == "site-%s\nmotd-%s\n" % (nonce, nonce), r.stdout
sb.kill()
assert Sandbox.delete_snapshot(name) is True
print("OK", flush=True)
"""

    def test_d_e2b_sdk_builds_through_the_api_node(self):
        """The pinned Python SDK's Template builder against the API node: its file upload
        (the link the builder worker signs, on the API node's address), the build, its log
        and status all forwarded to the builder; a sandbox of it runs its start command."""
        py = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                          "pysdk", "python3"))
        py = os.environ.get("CONFORMANCE_PYTHON") or py
        if not os.access(py, os.X_OK):
            self.skipTest("the pinned Python SDK (../shared/pysdk) is not beside the project")
        base = "http://%s:%d" % (self.api.host, self.api.port)
        env = dict(os.environ, E2B_API_URL=base, E2B_SANDBOX_URL=base, E2B_API_KEY=self.api.key)
        env.pop("E2B_DOMAIN", None)
        nonce = "%d-%d" % (os.getpid(), time.time())
        r = subprocess.run([py, "-c", self.SDK_PY, "fleetpy", nonce], capture_output=True,
                           text=True, env=env, timeout=600 * MULT)
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "OK"), r.stderr[-3000:])

    def test_z_killed_worker_lost_suspended_wakes_elsewhere(self):
        # The victim is where an unpinned create lands (a pin would hold the suspended one's
        # wake to the lost worker); the running one is pinned there beside it.
        sid = self.create()
        victim = self.placed_on(sid)
        other = [w for w in self.workers if w is not victim][0]
        running = self.create(on="w1" if victim is self.workers[0] else "w2")
        self.assertIs(self.placed_on(running), victim)
        self.sh(sid, "echo before-suspend > /root/g")
        st, r = self.api.request("POST", "/v1/sandboxes/%s/suspend?wait=%d" % (sid, wait_s(120)),
                                 timeout=wait_s(120) + 10)
        self.assertEqual(st, 200, r)
        self.assertEqual(self.state(sid), "suspended")
        # A snapshot of the running one, its counter going: written to the snapshot dir too.
        self.sh(running, "echo in-snapshot > /root/h")
        self.start_counter(running)
        before = self.count(running)
        st, r = self.api.request("POST", "/v1/sandboxes/%s/snapshots?wait=%d"
                                 % (running, wait_s(120)), {}, timeout=wait_s(120) + 10)
        self.assertEqual(st, 201, r)
        self.assertEqual(r["snapshot"]["state"], "ready", r)
        snap = r["snapshot"]["id"]
        self.assertEqual(self.ram_kind(os.path.join(victim.data_dir, "snapshots", snap)),
                         "delta")
        # the shared copy is that delta too, over the template RAM published beside it
        shared = os.path.join(self.snap, "snapshots", snap)
        self.assertEqual(self.ram_kind(shared), "delta")
        base = os.path.join(self.snap, "snapshots", ".bases", self.ram_base_shared(shared))
        self.assertTrue(os.path.isfile(os.path.join(base, "mem.ram")), base)
        with open(os.path.join(base, "sha256")) as f:
            self.assertRegex(f.read(), r"^[0-9a-f]{64}$")
        # The worker and its VMs die.
        victim.kill(signal.SIGKILL)
        for pid, line in qemu_cmdlines():
            if victim.data_dir in line:
                os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        self.wait_for(lambda: any(x["id"] == victim.wid and x["state"] == "lost"
                                  for x in self.list_workers()), "the worker lost", 60)
        print("worker lost: declared %.1f s after the kill (heartbeat timeout %d s)"
              % (time.time() - t0, TIMEOUT_S), file=sys.stderr)
        self.wait_for(lambda: self.state(running) == "lost", "its running sandbox lost")
        st, r = self.api.request("GET", "/v1/sandboxes/" + running)
        self.assertIn(victim.wid, r.get("error") or "", r)
        self.assertTrue(r.get("lost_at"), r)
        st, r = self.api.request("POST", "/v1/sandboxes/%s/wake?wait=%d" % (sid, wait_s(240)),
                                 timeout=wait_s(240) + 10)
        self.assertEqual(st, 200, r)
        self.assertEqual(self.state(sid), "running")
        self.assertIs(self.placed_on(sid), other)
        self.assertEqual(self.sh(sid, "cat /root/g")["stdout"], "before-suspend\n")
        self.assert_one_vm(sid, other)
        self.assertEqual(self.vms_of(running), [])
        st, r = self.api.request("DELETE", "/v1/sandboxes/%s?wait=%d" % (running, wait_s(60)),
                                 timeout=wait_s(60) + 10)
        self.assertIn(st, (200, 204), r)
        # The snapshot outlives its worker: a fork of it runs on the other one (which copied it
        # in), with the file and the counter going on from where the snapshot caught it. That
        # worker has a template snapshot of base by now (a sandbox of it ran there), as a
        # worker in service does: its copy is made a delta over that one's RAM.
        warm = self.create(on="w1" if other is self.workers[0] else "w2")
        self.api.delete_quietly(warm)
        # A published template RAM that does not match its checksum is refused: the fork fails
        # and the worker keeps nothing of the snapshot; matching again, it is taken.
        ram = os.path.join(base, "mem.ram")
        with open(ram, "r+b") as f:
            f.seek(1 << 20)
            byte = f.read(1)
            f.seek(1 << 20)
            f.write(bytes([byte[0] ^ 0xFF]))
        try:
            st, r = self.api.request("POST", "/v1/sandboxes?wait=%d" % wait_s(120),
                                     {"snapshot": snap}, timeout=wait_s(120) + 20)
            self.assertEqual((st, r["operation"]["status"]), (200, "failed"), r)
            self.api.delete_quietly(r["sandbox"]["id"])
            with open(other.log_path) as f:
                self.assertIn("the template RAM does not match its checksum", f.read())
            self.assertFalse(os.path.exists(os.path.join(other.data_dir, "snapshots", snap)))
        finally:
            with open(ram, "r+b") as f:
                f.seek(1 << 20)
                f.write(byte)
        fork = self.api.create_ready(wait=240, snapshot=snap)
        self.sids.append(fork)
        self.assertIs(self.placed_on(fork), other)
        self.assert_one_vm(fork, other)
        self.assertEqual(self.sh(fork, "cat /root/h")["stdout"], "in-snapshot\n")
        n = self.count(fork)
        self.assertGreaterEqual(n, before)
        self.wait_for(lambda: self.count(fork) > n, "the fork's counter counting")
        copy = os.path.join(other.data_dir, "snapshots", snap)
        self.assertTrue(os.path.isdir(copy))
        self.assertTrue(os.path.isfile(os.path.join(other.data_dir, "snapshots", ".verified",
                                                    os.path.basename(base))))
        # that worker's own copy is a delta over its own template snapshot's RAM (its forks
        # load only their own pages), not over the published one
        self.assertEqual(self.ram_kind(copy), "delta")
        self.assertIsNone(self.ram_base_shared(copy))
        # A template built from the snapshot, through the API node: its builder can only be the
        # worker left (the snapshot's own is lost), which starts the builder from its copy.
        tname = "fromsnap%d" % os.getpid()
        b = build(self.api, {"name": tname, "from": {"snapshot": snap},
                             "steps": [{"run": "cp /root/h /root/h2"}]})
        self.assertEqual(b["status"], "succeeded", b)
        try:
            tsid = self.api.create_ready(wait=240, template=tname)
            self.sids.append(tsid)
            self.assertIs(self.placed_on(tsid), other)
            self.assertEqual(self.sh(tsid, "cat /root/h /root/h2")["stdout"],
                             "in-snapshot\nin-snapshot\n")
            self.api.delete_quietly(tsid)
        finally:
            self.api.request("DELETE", "/v1/templates/" + tname)
        # Deleted: the shared copy goes at once, the other worker's once its fork is gone, the
        # published template RAM once no shared copy names it (and its grace has passed).
        st, r = self.api.request("DELETE", "/v1/snapshots/" + snap)
        self.assertIn(st, (200, 204), r)
        self.wait_for(lambda: not os.path.exists(shared), "the shared copy removed", 60)
        self.wait_for(lambda: not os.path.exists(base), "the published template RAM removed",
                      60 + BASE_GRACE_S)
        # the other worker checked that RAM against its checksum once, and forgets it now
        mark = os.path.join(other.data_dir, "snapshots", ".verified", os.path.basename(base))
        self.wait_for(lambda: not os.path.exists(mark), "the worker's mark of it removed", 60)
        self.assertEqual(self.sh(fork, "cat /root/h")["stdout"], "in-snapshot\n")
        st, r = self.api.request("DELETE", "/v1/sandboxes/%s?wait=%d" % (fork, wait_s(60)),
                                 timeout=wait_s(60) + 10)
        self.assertIn(st, (200, 204), r)
        self.wait_for(lambda: not os.path.exists(copy), "the worker's copy removed", 60)

if __name__ == "__main__":
    unittest.main(verbosity=2)
