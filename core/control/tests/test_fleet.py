"""Many hosts on one PostgreSQL (core/control/fleet.h): one API node and three workers, each a
spaced-test process with its own data dir and port on the test driver, sharing a "snapshot
directory" (SPACE_FAKE_SHARED_DIR) so a sandbox suspended on one worker wakes on another.
Placement spreads creates by capacity and never overcommits a worker under concurrent creates;
labels pin; a worker records the templates it holds snapshots of, and placement prefers it; /v1/workers is the admin key's; a drain moves every sandbox away; a worker that
stops answering is declared lost (its running sandboxes "lost", its suspended ones wake
elsewhere), re-adopts its sandboxes when it comes back within the grace, and stops the VM of a
sandbox deleted meanwhile (fencing); a PostgreSQL outage loses no worker and no sandbox."""
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import unittest
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
from harness import (MULT, PgCluster, Spaced, free_port, skip_unless_pg, tmpdir,  # noqa: E402
                     wait_s, wait_until)

TIMEOUT_S = 2  # --heartbeat-timeout-s
GRACE_S = 8    # --lost-grace-s
SB = {"template": "base", "cpu_count": 1, "memory_mb": 256}


def cluster_key(d):
    """A new cluster key file in directory d (--cluster-key-file); its path."""
    key = os.path.join(d, "cluster.key")
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, os.urandom(24).hex().encode())
    os.close(fd)
    return key


def fake_state(node, sid):
    """What the test driver of node holds for sandbox sid: running|paused|suspended, or None."""
    try:
        with open(os.path.join(node.data_dir, "fake", sid)) as f:
            return f.read().strip()
    except OSError:
        return None


class FleetClient:
    """Requests to a fleet through its API node cls.api (admin key cls.admin; workers
    cls.workers, their ids cls.wid), shared by the fleet tests."""

    @classmethod
    def start_fleet(cls, url, env, args, zones, vcpus, worker_args=None):
        """Starts cls.api (role api, team alpha's key cls.key, the admin key cls.admin) and a
        worker per zone (labels zone=Z, vcpus each, 4096 MiB; worker_args(w, zone) may add
        serve options and set attributes), all on url with args, into cls.nodes; waits until
        every worker is active.
        On a failure, the class's tearDownClass undoes what was started."""
        try:
            cls.api = Spaced(database_url=url, runtime="test", env=env,
                             args=["--role", "api"] + args)
            cls.nodes.append(cls.api)
            cls.key = cls.api.cli("keys", "create", "--team", "alpha").stdout.strip()
            cls.api.key = cls.key
            cls.api.start()
            with open(os.path.join(cls.api.data_dir, "admin-key")) as f:
                cls.admin = f.read().strip()
            cls.workers = []
            for zone in zones:
                w = Spaced(database_url=url, runtime="test", env=env,
                           args=["--role", "worker", "--worker-vcpus", str(vcpus),
                                 "--worker-memory-mb", "4096", "--worker-labels", "zone=" + zone]
                           + args)
                if worker_args is not None:
                    w.args += worker_args(w, zone)
                w.key = cls.key
                cls.nodes.append(w)
                w.start()
                cls.workers.append(w)
            cls.wid = {}
            for w in cls.workers:
                with open(os.path.join(w.data_dir, "worker-id")) as f:
                    cls.wid[w] = f.read().strip()
            cls.wait_for(lambda: len([x for x in cls.list_workers()
                                      if x["state"] == "active"]) == len(zones),
                         "%d workers active" % len(zones))
        except BaseException:
            cls.tearDownClass()
            raise

    @staticmethod
    def wait_for(cond, what, timeout=20):
        wait_until(cond, what, timeout, 0.1)

    @classmethod
    def list_workers(cls):
        st, r = cls.api.request("GET", "/v1/workers", key=cls.admin)
        assert st == 200, (st, r)
        return r["workers"]

    def worker(self, w):
        st, r = self.api.request("GET", "/v1/workers/" + self.wid[w], key=self.admin)
        self.assertEqual(st, 200, r)
        return r

    def post_worker(self, w, what):
        """POST /v1/workers/{w}/{what} (drain, undrain) with the admin key; must answer 200."""
        st, r = self.api.request("POST", "/v1/workers/%s/%s" % (self.wid[w], what),
                                 key=self.admin)
        self.assertEqual(st, 200, r)
        return r

    def placed_on(self, sid):
        for w in self.workers:
            if any(s["id"] == sid for s in self.worker(w)["sandboxes"]):
                return w
        return None

    def psql(self):
        """A psql session on the fleet's database (stdin and stdout are pipes, lines unbuffered)."""
        argv = [os.path.join(self.pg.bindir, "psql"), "-h", self.pg.sock, "-U", "postgres",
                "-At", "-v", "ON_ERROR_STOP=1", "space"]
        if self.pg.as_postgres:
            argv = ["runuser", "-u", "postgres", "--"] + argv
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                bufsize=1, cwd="/")

    def query(self, sql):
        """One psql query's rows, as text lines (-At)."""
        p = self.psql()
        out, _ = p.communicate(sql + ";\n", timeout=30)
        return out.strip()

    def create(self, **body):
        return self.api.request("POST", "/v1/sandboxes", dict(SB, **body))

    def created(self, **body):
        st, r = self.create(**body)
        self.assertEqual(st, 202, r)
        return r["sandbox"]["id"]

    def state(self, sid):
        st, r = self.api.request("GET", "/v1/sandboxes/" + sid)
        self.assertEqual(st, 200, r)
        return r

    def wait_state(self, sid, want, timeout=20):
        self.wait_for(lambda: self.state(sid)["state"] == want, "%s %s" % (sid, want), timeout)
        return self.state(sid)

    def act(self, sid, what):
        st, r = self.api.request("POST", "/v1/sandboxes/%s/%s?wait=%d" % (sid, what, wait_s(20)),
                                 timeout=wait_s(20) + 10)
        return st, r

    def delete(self, sid):
        self.api.request("DELETE", "/v1/sandboxes/%s?wait=%d" % (sid, wait_s(20)),
                         timeout=wait_s(20) + 10)

    def delete_all(self):
        st, r = self.api.request("GET", "/v1/sandboxes?limit=1000")
        for sb in r["sandboxes"]:
            self.delete(sb["id"])
        self.wait_for(lambda: all(w["used"]["vcpus"] == 0 for w in self.list_workers()),
                      "no sandbox left")


@skip_unless_pg
class FleetTest(FleetClient, unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pg = PgCluster()
        cls.shared = tmpdir("sp-shared-")
        cls.nodes = []
        env = {"SPACE_FAKE_DELAY_MS": "20", "SPACE_FAKE_SHARED_DIR": cls.shared}
        fleet = ["--heartbeat-timeout-s", str(TIMEOUT_S), "--lost-grace-s", str(GRACE_S)]

        def metrics(w, zone):
            w.mport = free_port()
            return ["--metrics-listen", "127.0.0.1:%d" % w.mport]
        cls.start_fleet(cls.pg.url, env, fleet, ("a", "b", "c"), 4, metrics)

    @classmethod
    def tearDownClass(cls):
        for n in cls.nodes:
            if n.proc is not None:
                n.proc.send_signal(signal.SIGCONT)
            n.destroy()
        cls.pg.destroy()
        shutil.rmtree(cls.shared, ignore_errors=True)

    def tearDown(self):
        for w in self.workers:  # a failed test may leave one stopped
            if w.proc is not None:
                w.proc.send_signal(signal.SIGCONT)
        self.delete_all()

    # ---- roles ----

    def test_a_roles_refuse_without_database_or_address(self):
        binary = self.api.binary
        d = tmpdir("sp-role-")
        try:
            for args, says in ((["--role", "api"], "--database-url"),
                               (["--role", "worker"], "--database-url"),
                               (["--role", "worker", "--database-url", self.pg.url, "--listen",
                                 "0.0.0.0:1"], "--advertise"),
                               (["--role", "boss"], "--role"),
                               (["--worker-labels", "zone"], "--worker-labels")):
                r = subprocess.run([binary, "serve", "--data-dir", d, "--runtime", "test"] + args,
                                   capture_output=True, text=True, timeout=60,
                                   env=dict(os.environ, SPACE_DATABASE_URL=""))
                self.assertEqual(r.returncode, 2, (args, r.stderr))
                self.assertIn(says, r.stderr)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    # ---- the operator's view ----

    def test_b_workers_admin_only(self):
        ws = self.list_workers()
        self.assertEqual(sorted(w["id"] for w in ws), sorted(self.wid.values()))
        for w in ws:
            self.assertEqual(w["role"], "worker")
            self.assertEqual(w["capacity"], {"vcpus": 4, "memory_mb": 4096})
            self.assertLess(w["heartbeat_age_s"], TIMEOUT_S)
            self.assertEqual(w["accelerator"], "test")
            self.assertIn(w["labels"]["zone"], ("a", "b", "c"))
            self.assertTrue(w["address"].startswith("127.0.0.1:"), w)
        one = self.worker(self.workers[0])
        self.assertEqual(one["id"], self.wid[self.workers[0]])
        self.assertEqual(one["sandboxes"], [])
        for path in ("/v1/workers", "/v1/workers/" + one["id"]):
            st, r = self.api.request("GET", path)  # a team's key
            self.assertEqual(st, 403, r)
            self.assertNotIn(one["id"], json.dumps(r))
            st, r = self.api.request("GET", path, key="")
            self.assertEqual(st, 401, r)
        st, r = self.api.request("POST", "/v1/workers/%s/drain" % one["id"])
        self.assertEqual(st, 403, r)
        st, r = self.api.request("GET", "/v1/workers/nosuchworker", key=self.admin)
        self.assertEqual(st, 404, r)

    def test_b2_template_builds_go_to_a_worker(self):
        """An API node runs no builds: a build and its files go to a worker, which needs the
        cluster key (this fleet has none: a 503 naming it); reads are served here."""
        for method, path, body, e2b in (
                ("POST", "/v1/templates", {"name": "x", "from": "base"}, False),
                ("PUT", "/v1/template-files/" + "a" * 64, b"", False),
                ("GET", "/v1/templates/x/builds/" + "b" * 24, None, False),
                ("GET", "/v1/templates/x/builds/%s/logs" % ("b" * 24), None, False),
                ("POST", "/v3/templates", {"name": "x"}, True),
                ("POST", "/v2/templates/x/builds/" + "b" * 24, {}, True),
                ("GET", "/templates/x/builds/%s/status" % ("b" * 24), None, True),
                ("GET", "/templates/x/files/" + "a" * 64, None, True)):
            h = {"X-API-KEY": self.key} if e2b else None
            raw = body if isinstance(body, bytes) else None
            st, r = self.api.request(method, path, None if raw is not None else body,
                                     key="" if e2b else None, raw=raw, headers=h)
            self.assertEqual(st, 503, (path, r))
            self.assertIn("--cluster-key-file", json.dumps(r), path)
        st, r = self.api.request("GET", "/v1/templates")
        self.assertEqual(st, 200, r)
        self.assertIn("base", [t["name"] for t in r["templates"]])
        st, r = self.api.request("GET", "/templates", key="", headers={"X-API-KEY": self.key})
        self.assertEqual(st, 200, r)

    # ---- placement ----

    def test_c_spread_by_capacity_then_capacity_error(self):
        sids = [self.created() for _ in range(12)]
        used = {w["id"]: w["used"]["vcpus"] for w in self.list_workers()}
        self.assertEqual(sorted(used.values()), [4, 4, 4], used)
        st, r = self.create()
        self.assertEqual(st, 503, r)
        self.assertEqual(r["error"]["code"], "capacity", r)
        self.assertIn("no worker has room", r["error"]["message"])
        # E2B: a 503 with its error body, at once
        h = {"X-API-KEY": self.key}
        t0 = time.time()
        st, r = self.api.request("POST", "/sandboxes", {"templateID": "base"}, key="", headers=h)
        self.assertEqual(st, 503, r)
        self.assertEqual(r["code"], 503, r)
        self.assertIn("no worker has room", r["message"])
        self.assertLess(time.time() - t0, 5 * MULT)
        for sid in sids:
            self.wait_state(sid, "running")
        # each sandbox runs on the worker it was placed on, and only there
        for w in self.workers:
            for s in self.worker(w)["sandboxes"]:
                self.assertEqual(fake_state(w, s["id"]), "running")
                for other in self.workers:
                    if other is not w:
                        self.assertIsNone(fake_state(other, s["id"]))
        self.delete_all()

    def test_d_concurrent_creates_never_overcommit(self):
        # 2 GiB each: 2 per worker, 6 places; one taken first leaves 5
        first = self.created(memory_mb=2048)
        results = []

        def one():
            results.append(self.create(memory_mb=2048))

        threads = [threading.Thread(target=one) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ok = [r for st, r in results if st == 202]
        full = [r for st, r in results if st == 503]
        self.assertEqual(len(ok), 5, results)
        self.assertEqual(len(full), 15, results)
        for r in full:
            self.assertEqual(r["error"]["code"], "capacity", r)
        for w in self.list_workers():
            self.assertLessEqual(w["used"]["memory_mb"], w["capacity"]["memory_mb"], w)
            self.assertEqual(w["used"]["memory_mb"], 4096, w)
        self.delete(first)
        self.delete_all()

    def test_d2_placement_waits_only_for_its_worker(self):
        # A transaction holding one worker's row (as a placement on it does until it commits)
        # holds back only placements on that worker: the others go elsewhere meanwhile. Locking
        # every candidate, as placement once did, made each create wait for all the others.
        # The row is held FOR KEY SHARE: that stops a placement's FOR UPDATE like a placement's
        # own lock does, but not the worker's heartbeat (an update of no key column), so the
        # worker stays fresh however long the test takes.
        lo = min(self.workers, key=lambda w: self.wid[w])
        first = self.created(placement={"labels": {"zone": self.worker(lo)["labels"]["zone"]}},
                             cpu_count=2)
        # lo has less room now: an unpinned create ranks it last, and goes elsewhere
        locker = self.psql()
        try:
            locker.stdin.write("BEGIN;\nSELECT 'held' FROM workers WHERE id = '%s' FOR KEY SHARE;\n"
                               % self.wid[lo])
            self.assertEqual([locker.stdout.readline().strip() for _ in range(2)],
                             ["BEGIN", "held"])
            done = []
            t = threading.Thread(target=lambda: done.append(self.create()))
            t.start()
            t.join(10 * MULT)
            self.assertEqual(len(done), 1, "an unpinned create waited for another worker's lock")
            self.assertEqual(done[0][0], 202, done)
            self.assertIsNot(self.placed_on(done[0][1]["sandbox"]["id"]), lo)
            # one pinned to lo waits for the lock, and is placed there once it is given back
            t = threading.Thread(target=lambda: done.append(
                self.create(placement={"labels": {"zone": self.worker(lo)["labels"]["zone"]}})))
            t.start()
            t.join(1)
            self.assertEqual(len(done), 1, "a create on a locked worker did not wait")
            locker.stdin.write("COMMIT;\n")
            t.join(10 * MULT)
            self.assertEqual(len(done), 2)
            self.assertEqual(done[1][0], 202, done)
            self.assertIs(self.placed_on(done[1][1]["sandbox"]["id"]), lo)
        finally:
            locker.stdin.close()
            locker.wait(10)
        self.delete(first)
        self.delete_all()

    def test_e_labels_pin(self):
        b = self.workers[1]
        sids = [self.created(placement={"labels": {"zone": "b"}}) for _ in range(3)]
        for sid in sids:
            self.assertIs(self.placed_on(sid), b)
        st, r = self.create(placement={"labels": {"zone": "z"}})
        self.assertEqual(st, 503, r)
        self.assertEqual(r["error"]["code"], "capacity")
        self.assertIn("zone", r["error"]["message"])
        for bad in ({"labels": {"zone": 1}}, {"labels": ["zone"]}, {"zone": "b"}, "b",
                    {"labels": {"zo ne": "b"}}, {"labels": {"k%d" % i: "v" for i in range(17)}}):
            st, r = self.create(placement=bad)
            self.assertEqual(st, 400, (bad, r))
        # 4 vCPUs in zone b: the fourth fits, the fifth does not
        sids.append(self.created(placement={"labels": {"zone": "b"}}))
        st, r = self.create(placement={"labels": {"zone": "b"}})
        self.assertEqual(st, 503, r)
        self.delete_all()

    def test_e2_template_locality(self):
        # The worker that sorts last by id: with room equal everywhere, the one placement would
        # pick last, were it not the one holding the template's snapshot.
        t = max(self.workers, key=lambda w: self.wid[w])
        zone = self.worker(t)["labels"]["zone"]
        tmpl = "code-interpreter-v1"  # no other test creates it: no other worker holds it
        sid = self.created(template=tmpl, placement={"labels": {"zone": zone}})
        self.wait_state(sid, "running")
        self.delete(sid)
        self.wait_for(lambda: all(w["used"]["vcpus"] == 0 for w in self.list_workers()),
                      "no sandbox left")
        self.wait_for(lambda: tmpl in self.worker(t)["templates"], "the template recorded")
        for w in self.list_workers():
            if w["id"] == self.wid[t]:
                self.assertEqual(w["templates"][tmpl],
                                 [{"cpu_count": 1, "memory_mb": 256, "spares": 0}], w)
            else:
                self.assertNotIn(tmpl, w["templates"], w)
        # unpinned: there (the second one too, though t has less room left by then)
        sids = [self.created(template=tmpl) for _ in range(2)]
        for sid in sids:
            self.assertIs(self.placed_on(sid), t)
        self.delete_all()

    def test_e3_template_locality_by_size(self):
        # A template snapshot serves one size: the worker holding the size asked for wins over
        # one holding the template at another size, even when that one sorts first by id.
        tmpl = "code-interpreter-v1"
        lo = min(self.workers, key=lambda w: self.wid[w])
        hi = max(self.workers, key=lambda w: self.wid[w])
        small = {"cpu_count": 1, "memory_mb": 256}
        big = {"cpu_count": 2, "memory_mb": 512}
        for w, size in ((hi, small), (lo, big)):
            zone = self.worker(w)["labels"]["zone"]
            sid = self.created(template=tmpl, placement={"labels": {"zone": zone}}, **size)
            self.wait_state(sid, "running")
            self.delete(sid)
        self.wait_for(lambda: all(w["used"]["vcpus"] == 0 for w in self.list_workers()),
                      "no sandbox left")

        def sizes(w):
            return [{"cpu_count": e["cpu_count"], "memory_mb": e["memory_mb"]}
                    for e in self.worker(w)["templates"].get(tmpl, [])]
        self.wait_for(lambda: small in sizes(hi) and big in sizes(lo), "both sizes recorded")
        self.assertNotIn(small, sizes(lo))  # else the case below shows nothing
        self.assertNotIn(big, sizes(hi))
        # unpinned, room equal everywhere: the small one goes to hi, not to lo (lower id, and
        # holding the template too), twice (hi has less room left by the second)
        for _ in range(2):
            self.assertIs(self.placed_on(self.created(template=tmpl, **small)), hi)
        self.assertIs(self.placed_on(self.created(template=tmpl, **big)), lo)
        self.delete_all()

    @staticmethod
    def metrics(w):
        """Worker w's /metrics, as lines."""
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % w.mport, timeout=10) as r:
            return r.read().decode().splitlines()

    def scans(self, w):
        """The controller scans worker w has made."""
        for line in self.metrics(w):
            if line.startswith("space_controller_scans_total "):
                return float(line.split()[1])
        return 0.0

    def test_e4_a_create_wakes_only_its_worker(self):
        # Each create notifies the workers; only the one it is placed on has anything to do,
        # so the others scan on their 1 s timer alone, not once per create.
        a, others = self.workers[0], self.workers[1:]
        zone = self.worker(a)["labels"]["zone"]
        before = {w: self.scans(w) for w in self.workers}
        t0 = time.time()
        n = 0
        while n < 30 or time.time() - t0 < 2:
            sid = self.created(placement={"labels": {"zone": zone}})
            self.wait_state(sid, "running")
            self.delete(sid)
            n += 1
        secs = time.time() - t0
        grew = {w: self.scans(w) - before[w] for w in self.workers}
        self.assertGreaterEqual(grew[a], n, (n, secs, grew))  # its own: one per create at least
        for w in others:  # the timer's, about one a second, and a few to spare
            self.assertLess(grew[w], secs + 5, (n, secs, grew[w]))
        self.delete_all()

    def notices(self, w):
        """The changes worker w's controller heard of, by whom they concern."""
        got = {"this": 0.0, "other": 0.0, "any": 0.0}
        for line in self.metrics(w):
            if line.startswith("space_controller_notices_total{"):
                got[line.split('worker="')[1].split('"')[0]] = float(line.split()[-1])
        return got

    def test_e4b_every_change_names_its_worker(self):
        # Not only creates: a deadline, a drain's suspend and its move, and an undrain's
        # return name the worker the sandbox is placed on, so no change wakes every worker.
        # (A readoption is one more writer: test_k.)
        a, b, c = self.workers
        admin = self.admin
        post = self.post_worker

        before = {w: self.notices(w) for w in self.workers}
        try:
            sid = self.created(placement={"labels": {"zone": "a"}}, timeout_s=1,
                               deadline_action="suspend")
            self.wait_state(sid, "suspended")  # the deadline's sweep
            self.delete(sid)
            post(b, "drain")  # so that the unpinned create lands on a
            post(c, "drain")
            sid = self.created()
            self.assertIs(self.placed_on(sid), a)
            self.wait_state(sid, "running")
            post(b, "undrain")
            post(a, "drain")  # suspended on a, placed on b, woken there
            self.wait_for(lambda: self.placed_on(sid) is b
                          and self.state(sid)["state"] == "running", "moved to b", 30)
        finally:
            for w in self.workers:
                self.api.request("POST", "/v1/workers/%s/undrain" % self.wid[w], key=admin)
        grew = {w: {k: v - before[w][k] for k, v in self.notices(w).items()}
                for w in self.workers}
        for w in self.workers:
            self.assertEqual(grew[w]["any"], 0, (self.wid[w], grew[w]))
        self.assertGreater(grew[a]["this"], 0, grew[a])
        self.assertGreater(grew[b]["this"], 0, grew[b])
        self.assertGreater(grew[c]["other"], 0, grew[c])  # heard them all, acted on none
        self.delete_all()

    # ---- drain ----

    def test_f_drain_moves_everything(self):
        a = self.workers[0]
        sids = [self.created() for _ in range(6)]  # two on each worker
        on_a = [s for s in sids if self.placed_on(s) is a]
        self.assertEqual(len(on_a), 2)
        for sid in sids:
            self.wait_state(sid, "running")
        self.assertEqual(self.act(on_a[1], "pause")[0], 200)
        st, r = self.api.request("POST", "/v1/workers/%s/drain" % self.wid[a], key=self.admin)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["state"], "draining")
        self.wait_for(lambda: self.worker(a)["sandboxes"] == [], "worker a empty", 30)
        moved = {m["id"]: m for m in self.worker(a)["moved"]}
        self.assertEqual(sorted(moved), sorted(on_a))
        self.assertEqual(self.wait_state(on_a[0], "running")["state"], "running")
        self.assertEqual(self.wait_state(on_a[1], "paused")["state"], "paused")
        for sid in on_a:
            w = self.placed_on(sid)
            self.assertIsNot(w, a)
            self.assertIn(fake_state(w, sid), ("running", "paused"))
            self.assertNotIn(fake_state(a, sid), ("running", "paused"))
        # no new placements on a draining worker
        extra = self.created()
        self.assertIsNot(self.placed_on(extra), a)
        st, r = self.api.request("POST", "/v1/workers/%s/undrain" % self.wid[a], key=self.admin)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["state"], "active")
        self.delete_all()

    def test_f2_drain_there_and_back(self):
        a, b, c = self.workers
        admin = self.admin
        post = self.post_worker

        try:
            post(b, "drain")  # so that the unpinned create lands on a
            post(c, "drain")
            sid = self.created()
            self.assertIs(self.placed_on(sid), a)
            self.wait_state(sid, "running")
            post(b, "undrain")
            for src, dst in ((a, b), (b, a), (a, b), (b, a)):
                post(src, "drain")
                self.wait_for(lambda: self.placed_on(sid) is dst
                              and self.state(sid)["state"] == "running",
                              "running on %s" % self.wid[dst], 30)
                self.assertEqual(fake_state(dst, sid), "running")
                post(src, "undrain")
        finally:
            for w in self.workers:
                self.api.request("POST", "/v1/workers/%s/undrain" % self.wid[w], key=admin)
        self.delete_all()

    # ---- loss ----

    def wait_worker_state(self, w, want, timeout=20):
        self.wait_for(lambda: self.worker(w)["state"] == want,
                      "worker %s %s" % (self.wid[w], want), timeout)

    def test_g_lost_readopted_within_grace_suspended_wakes_elsewhere(self):
        c = self.workers[2]
        run = self.created(placement={"labels": {"zone": "c"}})
        susp = self.created(placement={"labels": {"zone": "c"}})
        self.wait_state(run, "running")
        self.wait_state(susp, "running")
        self.assertEqual(self.act(susp, "suspend")[0], 200)
        t0 = time.time()
        c.proc.send_signal(signal.SIGSTOP)  # silent, VMs alive: a partition
        try:
            self.wait_worker_state(c, "lost", 10)
            lost = self.wait_state(run, "lost", 10)
            self.assertLess(time.time() - t0, (TIMEOUT_S + 4) * MULT)
            self.assertIn("worker %s lost at" % self.wid[c], lost["error"])
            self.assertTrue(lost["lost_at"])
            self.assertEqual(lost["desired_state"], "running")
            st, r = self.act(run, "pause")
            self.assertEqual(st, 409, r)
            # E2B does not show it
            st, r = self.api.request("GET", "/sandboxes/" + run, key="",
                                     headers={"X-API-KEY": self.key})
            self.assertEqual(st, 404, r)
            # the suspended one was left alone; pinned to zone c, which only c has, it cannot
            # wake anywhere else: at once a capacity error (test_h wakes one elsewhere)
            self.assertEqual(self.state(susp)["state"], "suspended")
            st, r = self.act(susp, "wake")
            self.assertEqual(st, 503, r)
            self.assertEqual(r["error"]["code"], "capacity")
        finally:
            c.proc.send_signal(signal.SIGCONT)
        self.wait_worker_state(c, "active", 10)
        back = self.wait_state(run, "running", 10)
        self.assertEqual(back["error"], None)
        self.assertNotIn("lost_at", back)
        self.assertEqual(fake_state(c, run), "running")
        self.delete_all()

    def test_h_suspended_wakes_elsewhere_and_old_worker_never_runs_it(self):
        c = self.workers[2]
        # unpinned, placed on c: fill a and b first with pinned ones
        fill = [self.created(placement={"labels": {"zone": z}}, cpu_count=4)
                for z in ("a", "b")]
        susp = self.created()
        self.assertIs(self.placed_on(susp), c)
        self.wait_state(susp, "running")
        self.assertEqual(self.act(susp, "suspend")[0], 200)
        for sid in fill:
            self.delete(sid)
        c.proc.send_signal(signal.SIGSTOP)
        try:
            self.wait_worker_state(c, "lost", 10)
            st, r = self.act(susp, "wake")
            self.assertEqual(st, 200, r)
            self.assertEqual(self.wait_state(susp, "running")["state"], "running")
            w = self.placed_on(susp)
            self.assertIsNot(w, c)
            self.assertEqual(fake_state(w, susp), "running")
        finally:
            c.proc.send_signal(signal.SIGCONT)
        self.wait_worker_state(c, "active", 10)
        time.sleep(2 * TIMEOUT_S)
        # c never resumed it: its own copy stays a suspended leftover
        self.assertNotIn(fake_state(c, susp), ("running", "paused"))
        self.assertIn(susp, [m["id"] for m in self.worker(c)["moved"]])
        self.delete_all()

    def test_i_deleted_while_lost_is_fenced(self):
        c = self.workers[2]
        sid = self.created(placement={"labels": {"zone": "c"}})
        self.wait_state(sid, "running")
        c.proc.send_signal(signal.SIGSTOP)
        try:
            self.wait_state(sid, "lost", 10)
            self.delete(sid)
            self.wait_for(lambda: self.api.request("GET", "/v1/sandboxes/" + sid)[0] == 404,
                          "deleted", 10)
            self.assertEqual(fake_state(c, sid), "running")  # the partitioned VM still runs
        finally:
            c.proc.send_signal(signal.SIGCONT)
        self.wait_for(lambda: fake_state(c, sid) is None, "fenced", 10)

    def test_j_lost_past_grace_stays_lost_and_is_fenced(self):
        c = self.workers[2]
        sid = self.created(placement={"labels": {"zone": "c"}})
        self.wait_state(sid, "running")
        c.proc.send_signal(signal.SIGSTOP)
        try:
            self.wait_state(sid, "lost", 10)
            time.sleep(GRACE_S + 1)
        finally:
            c.proc.send_signal(signal.SIGCONT)
        self.wait_worker_state(c, "active", 10)
        self.wait_for(lambda: fake_state(c, sid) is None, "fenced", 10)
        self.assertEqual(self.state(sid)["state"], "lost")
        self.delete(sid)
        self.wait_for(lambda: self.api.request("GET", "/v1/sandboxes/" + sid)[0] == 404,
                      "deleted", 10)

    def test_l_drain_outlives_loss_and_its_moves_finish(self):
        a, b, c = self.workers
        post = self.post_worker

        # a and b full: c's drain suspends its two and finds no room to move them
        fill = [self.created(placement={"labels": {"zone": z}}, cpu_count=4)
                for z in ("a", "b")]
        sids = [self.created() for _ in range(2)]
        for sid in sids:
            self.assertIs(self.placed_on(sid), c)
            self.wait_state(sid, "running")
        try:
            self.assertEqual(post(c, "drain")["drain"], True)
            self.wait_for(lambda: all(self.state(s)["state"] == "suspended" for s in sids),
                          "suspended to move")
            time.sleep(TIMEOUT_S)  # a few drain steps: still no room
            self.assertTrue(all(self.placed_on(s) is c for s in sids))
            c.proc.send_signal(signal.SIGSTOP)
            self.wait_worker_state(c, "lost", 10)
            # a lost worker records the operator's wish and stays lost
            r = post(c, "undrain")
            self.assertEqual((r["state"], r["drain"]), ("lost", False))
            r = post(c, "drain")
            self.assertEqual((r["state"], r["drain"]), ("lost", True))
            for sid in fill:
                self.delete(sid)
            # room again: the sweep moves them in the lost worker's stead, back to running
            for sid in sids:
                self.wait_for(lambda: self.placed_on(sid) not in (None, c)
                              and self.state(sid)["state"] == "running", "%s moved" % sid, 20)
                self.assertEqual(fake_state(self.placed_on(sid), sid), "running")
        finally:
            c.proc.send_signal(signal.SIGCONT)
        # back, still draining: it takes nothing new and never runs what moved
        self.wait_worker_state(c, "draining", 10)
        self.assertTrue(self.worker(c)["drain"])
        extra = self.created()
        self.assertIsNot(self.placed_on(extra), c)
        time.sleep(2 * TIMEOUT_S)
        for sid in sids:
            self.assertNotIn(fake_state(c, sid), ("running", "paused"))
            self.assertIn(sid, [m["id"] for m in self.worker(c)["moved"]])
        r = post(c, "undrain")
        self.assertEqual((r["state"], r["drain"]), ("active", False))
        self.delete_all()

    def test_k_killed_worker_restarted_within_grace_readopts(self):
        b = self.workers[1]
        others = [w for w in self.workers if w is not b]
        sid = self.created(placement={"labels": {"zone": "b"}})
        self.wait_state(sid, "running")
        before = {w: self.notices(w)["any"] for w in others}
        b.kill(signal.SIGKILL)
        self.wait_state(sid, "lost", 10)
        b.start()
        self.assertEqual(self.wait_state(sid, "running", 10)["state"], "running")
        self.assertEqual(fake_state(b, sid), "running")
        # the readoption's notice named b: the others heard no change for every worker
        self.assertEqual({self.wid[w]: self.notices(w)["any"] - before[w] for w in others},
                         {self.wid[w]: 0 for w in others})
        self.delete_all()

    def test_m_database_outage_loses_nothing(self):
        """PostgreSQL stops for three heartbeat timeouts and comes back (a failover, as the
        nodes see it): every node recovers by itself; no worker is declared lost, though every
        heartbeat is old when the database returns (the sweep judges none until the database
        and its own renewals have run unbroken for a timeout and the reconnect backoff, by the
        database's clock, by which time the workers have beaten again); no sandbox turns lost
        even for a moment, each still runs on its worker; creates and lifecycle work on every
        worker again."""
        zones = ("a", "b", "c")
        sids = [self.created(placement={"labels": {"zone": z}}) for z in zones]
        for sid in sids:
            self.wait_state(sid, "running")
        gens = self.query("SELECT id || ' ' || generation || ' ' || state FROM workers "
                          "ORDER BY id")
        self.pg.stop()
        try:
            time.sleep(TIMEOUT_S * 3)
            st, r = self.api.request("GET", "/v1/sandboxes/" + sids[0])
            self.assertEqual(st, 503, r)
        finally:
            self.pg.start()
        self.wait_for(lambda: all(n.request("GET", "/healthz")[0] == 200 for n in self.nodes),
                      "every node healthy again", 30)
        time.sleep(TIMEOUT_S * 3)  # sweeps judge heartbeats again by now
        self.assertEqual(self.query("SELECT id || ' ' || generation || ' ' || state FROM workers "
                                    "ORDER BY id"), gens)
        self.assertEqual(self.query("SELECT count(*) FROM events WHERE kind = 'lost' AND "
                                    "sandbox_id IN ('%s')" % "','".join(sids)), "0")
        for sid, w in zip(sids, self.workers):
            got = self.state(sid)
            self.assertEqual((got["state"], got["error"]), ("running", None), got)
            self.assertNotIn("lost_at", got)
            self.assertIs(self.placed_on(sid), w)
            self.assertEqual(fake_state(w, sid), "running")
        st, r = self.act(sids[0], "pause")
        self.assertEqual(st, 200, r)
        for z in zones:
            self.wait_state(self.created(placement={"labels": {"zone": z}}), "running")
        self.delete_all()


class KeyedFleet(FleetClient):
    """A fleet with a cluster key, started for the class: an API node and two workers of 2
    vCPUs (zones a and b), each with the class's SHARED snapshot dir when it wants one
    (cls.dir/snapshots: cls.snap) and its ARGS."""

    SHARED = False
    ARGS = []

    @classmethod
    def setUpClass(cls):
        cls.pg = PgCluster()
        cls.nodes = []
        cls.dir = tmpdir("sp-keyed-")
        cls.snap = os.path.join(cls.dir, "snapshots")
        os.makedirs(cls.snap)
        env = None
        if cls.SHARED:  # the test driver's counterpart of the snapshot dir
            env = {"SPACE_FAKE_SHARED_DIR": os.path.join(cls.snap, "fake")}
            os.makedirs(env["SPACE_FAKE_SHARED_DIR"])
        fleet = ["--heartbeat-timeout-s", str(TIMEOUT_S), "--lost-grace-s", str(GRACE_S),
                 "--cluster-key-file", cluster_key(cls.dir)] + cls.ARGS
        cls.start_fleet(cls.pg.url, env, fleet, ("a", "b"), 2,
                        (lambda w, zone: ["--snapshot-dir", cls.snap]) if cls.SHARED else None)

    @classmethod
    def tearDownClass(cls):
        for n in cls.nodes:
            n.destroy()
        cls.pg.destroy()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def snapshot_in(self, zone):
        """A running sandbox in zone and a snapshot of it taken through the API node, ready:
        (sandbox id, snapshot id)."""
        src = self.created(placement={"labels": {"zone": zone}})
        self.wait_state(src, "running")
        st, r = self.api.request("POST", "/v1/sandboxes/%s/snapshots?wait=%d" % (src, wait_s(20)),
                                 {}, timeout=wait_s(20) + 10)
        self.assertEqual(st, 201, r)
        self.assertEqual(r["snapshot"]["state"], "ready", r)
        return src, r["snapshot"]["id"]


@skip_unless_pg
class FleetSnapshotTest(KeyedFleet, unittest.TestCase):
    """Sandbox snapshots on many hosts (core/control/snap.h, migration 20): an API node with the
    cluster key and two workers of 2 vCPUs. A snapshot taken through the API node (native and
    E2B) is taken by the sandbox's worker and holds its files there; every sandbox made from it
    is placed there, and none when that worker has no room (capacity) or is draining (a 503
    naming it), while other creates go elsewhere; one deleted through the API node has its
    files released by its worker."""

    @staticmethod
    def ckpt(w, snap):
        return os.path.exists(os.path.join(w.data_dir, "fake", snap + ".ckpt"))

    def from_snapshot(self, snap):
        return self.api.request("POST", "/v1/sandboxes", {"snapshot": snap})

    def test_snapshots_live_on_their_worker(self):
        a, b = self.workers
        src, snap = self.snapshot_in("a")
        self.assertTrue(self.ckpt(a, snap))
        self.assertFalse(self.ckpt(b, snap))
        # E2B's create_snapshot through the API node too
        h = {"X-API-KEY": self.key}
        st, e = self.api.request("POST", "/sandboxes/%s/snapshots" % src, {}, key="", headers=h,
                                 timeout=wait_s(20) + 10)
        self.assertEqual(st, 201, e)
        e2b_snap = e["snapshotID"].split(":")[0]
        self.assertTrue(self.ckpt(a, e2b_snap))
        # a fork goes where the files are, though b has more room
        st, r = self.from_snapshot(snap)
        self.assertEqual(st, 202, r)
        fork = r["sandbox"]["id"]
        self.wait_state(fork, "running")
        self.assertIs(self.placed_on(fork), a)
        # a is full now (2 vCPUs): a fork has nowhere to go, a plain create goes to b
        st, r = self.from_snapshot(snap)
        self.assertEqual(st, 503, r)
        self.assertEqual(r["error"]["code"], "capacity", r)
        other = self.created()
        self.assertIs(self.placed_on(other), b)
        # a draining (with nothing to move): forks are refused, naming the worker
        self.delete_all()
        self.post_worker(a, "drain")
        try:
            st, r = self.from_snapshot(e2b_snap)
            self.assertEqual(st, 503, r)
            self.assertIn(self.wid[a], r["error"]["message"])
            self.assertIn("draining", r["error"]["message"])
        finally:
            self.post_worker(a, "undrain")
        # deleted through the API node: the worker releases the files
        for s_id in (snap, e2b_snap):
            st, r = self.api.request("DELETE", "/v1/snapshots/" + s_id)
            self.assertIn(st, (200, 204), r)
        self.wait_for(lambda: not self.ckpt(a, snap) and not self.ckpt(a, e2b_snap),
                      "the deleted snapshots' files released", 40 * MULT)
        self.delete_all()


@skip_unless_pg
class FleetSharedSnapshotTest(KeyedFleet, unittest.TestCase):
    """Sandbox snapshots for the whole fleet (core/control/snap.h, migration 22): with a shared
    snapshot dir, a snapshot is written there too (the test driver's counterpart:
    SPACE_FAKE_SHARED_DIR) and its row says so; a fork goes to the taker while it has room,
    else to another worker, which copies it in; with the taker draining, forks still work
    (elsewhere); deleted through the API node, the taker's files, the other worker's copy and
    the shared copy all go."""

    SHARED = True

    @staticmethod
    def ckpt(w, snap):
        return os.path.exists(os.path.join(w.data_dir, "fake", snap + ".ckpt"))

    def shared_ckpt(self, snap):
        return os.path.exists(os.path.join(self.snap, "fake", snap + ".ckpt"))

    def fork(self, snap):
        st, r = self.api.request("POST", "/v1/sandboxes", {"snapshot": snap})
        self.assertEqual(st, 202, r)
        self.wait_state(r["sandbox"]["id"], "running")
        return r["sandbox"]["id"]

    def test_forks_go_anywhere(self):
        a, b = self.workers
        src, snap = self.snapshot_in("a")
        self.assertTrue(self.ckpt(a, snap) and self.shared_ckpt(snap))
        self.assertFalse(self.ckpt(b, snap))
        out = self.query("SELECT shared, worker_id FROM snapshots WHERE id = '%s'" % snap)
        self.assertEqual(out, "t|%s" % self.wid[a])
        # the taker first, while it has room; then the other worker, which copies it in
        first = self.fork(snap)
        self.assertIs(self.placed_on(first), a)
        second = self.fork(snap)
        self.assertIs(self.placed_on(second), b)
        self.assertTrue(self.ckpt(b, snap))
        # the taker draining: forks go elsewhere, not refused
        self.delete_all()
        self.post_worker(a, "drain")
        try:
            third = self.fork(snap)
            self.assertIs(self.placed_on(third), b)
        finally:
            self.post_worker(a, "undrain")
        # deleted through the API node: every copy goes
        st, r = self.api.request("DELETE", "/v1/snapshots/" + snap)
        self.assertIn(st, (200, 204), r)
        self.wait_for(lambda: not (self.ckpt(a, snap) or self.ckpt(b, snap) or
                                   self.shared_ckpt(snap)),
                      "the deleted snapshot's files released everywhere", 40 * MULT)
        self.delete_all()


@skip_unless_pg
class FleetBuildTest(KeyedFleet, unittest.TestCase):
    """Template builds on many workers (core/control/fleet.h: sp_fleet_builder): an API node
    with the cluster key and two workers sharing a snapshot dir. The API node sends each
    template's build requests to the worker whose md5(name/id) sorts first, so builds of
    different templates spread over the workers and every request about one goes to the same
    one; files and E2B upload links work through any worker (files in the snapshot dir, links
    signed with a key derived from the cluster key)."""

    SHARED = True
    ARGS = ["--log-level", "debug"]  # the API node says where it sends each build request

    def builder(self, name):
        return min(self.workers, key=lambda w: hashlib.md5(
            ("%s/%s" % (name, self.wid[w])).encode()).hexdigest())

    def sent_to(self, mark):
        """The workers the API node sent build requests to since mark (a log length)."""
        log = self.api.read_log()[mark:]
        return [w for w in self.workers
                if "template build request to worker=%s" % self.wid[w] in log]

    def test_builds_spread_by_template_name(self):
        names = {}
        for i in range(200):
            names.setdefault(self.builder("spread-%d" % i), "spread-%d" % i)
        self.assertEqual(len(names), 2, "no two names pick different workers")
        h = {"X-API-KEY": self.key}
        for w, n in names.items():
            for method, path, body, e2b in (
                    ("POST", "/v1/templates", {"name": n, "from": "base"}, False),
                    ("POST", "/v1/templates", {"name": n + ":v2", "from": "base"}, False),
                    ("GET", "/v1/templates/%s/builds/%s" % (n, "b" * 24), None, False),
                    ("GET", "/v1/templates/%s/builds/%s/logs" % (n, "b" * 24), None, False),
                    ("POST", "/v2/templates/%s/builds/%s" % (n, "b" * 24), {}, True),
                    ("GET", "/templates/%s/builds/%s/status" % (n, "b" * 24), None, True)):
                mark = len(self.api.read_log())
                st, r = self.api.request(method, path, body, key="" if e2b else None,
                                         headers=h if e2b else None)
                self.assertIn(st, (400, 404), (path, r))  # answered by the worker
                self.assertEqual(self.sent_to(mark), [w], (method, path))

    def test_files_and_upload_links_on_any_worker(self):
        a, b = self.workers
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            data = os.urandom(16).hex().encode()
            ti = tarfile.TarInfo("f.txt")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        body = buf.getvalue()
        fk = hashlib.sha256(body).hexdigest()
        # native upload through the API node: kept in the snapshot dir, seen by both workers
        st, r = self.api.request("PUT", "/v1/template-files/" + fk, raw=body)
        self.assertEqual((st, r.get("existed")), (201, False), r)
        stored = [os.path.join(self.snap, "template-files", t, fk)
                  for t in os.listdir(os.path.join(self.snap, "template-files"))]
        self.assertTrue(any(os.path.isfile(p) for p in stored), stored)
        for w in (a, b):
            st, r = w.request("GET", "/v1/template-files/" + fk)
            self.assertEqual(st, 200, (w.data_dir, r))
        # an E2B upload link made by a, used at b
        h = {"X-API-KEY": self.key}
        ek = hashlib.sha256(b"e2b-" + body).hexdigest()
        st, r = a.request("GET", "/templates/spread/files/" + ek, key="", headers=h)
        self.assertEqual((st, r.get("present")), (201, False), r)
        link = urllib.parse.urlsplit(r["url"])
        st, r = b.request("PUT", link.path + "?" + link.query, key="", raw=body,
                          headers={"Content-Type": "application/octet-stream"})
        self.assertIn(st, (200, 201), r)
        st, r = a.request("GET", "/templates/spread/files/" + ek, key="", headers=h)
        self.assertEqual((st, r.get("present")), (201, True), r)
        # a token changed by one character is refused
        tok = urllib.parse.parse_qs(link.query)["token"][0]
        bad = ("A" if tok[0] != "A" else "B") + tok[1:]
        st, r = b.request("PUT", link.path + "?token=" + urllib.parse.quote(bad), key="",
                          raw=body, headers={"Content-Type": "application/octet-stream"})
        self.assertEqual((st, r.get("message")), (403, "bad upload link"), r)

    def build_row(self, prefix, k, runs_on, builder):
        """A template whose name routes to builder, with a build row as a running build on
        runs_on leaves: (name, build id)."""
        team = self.query("SELECT id FROM teams WHERE name = 'alpha'")
        name = next(n for n in ("%s-%d" % (prefix, i) for i in range(100))
                    if self.builder(n) is builder)
        bid = "%08x-0000-4000-8000-%012x" % (os.getpid(), k)
        self.query("INSERT INTO templates (name, status, team_id) VALUES ('%s', 'building', '%s');"
                   "INSERT INTO template_builds (id, team_id, template, status, request,"
                   " worker_id) VALUES ('%s', '%s', '%s', 'building', '{}', '%s')"
                   % (name, team, bid, team, name, self.wid[runs_on]))
        return name, bid

    def test_long_poll_where_the_build_does_not_run(self):
        """A ?wait= on a build answers when the build ends, asked on a node that does not run
        it (core/control/tmpl.c: remote waiters, NOTIFY space_builds): here a's build (a row
        as a running build leaves), asked at b directly and through the API node (which sends
        it to the name's builder, b); a's restart fails it. A short wait still answers at its
        end with the build unfinished."""
        a, b = self.workers
        name, bid = self.build_row("poll", 77, runs_on=a, builder=b)
        path = "/v1/templates/%s/builds/%s?wait=" % (name, bid)
        t0 = time.monotonic()
        st, r = b.request("GET", path + "1")
        self.assertEqual((st, r["build"]["status"]), (202, "building"), r)
        self.assertGreaterEqual(time.monotonic() - t0, 0.9)
        got = {}

        def poll(node, key):
            t = time.monotonic()
            st, r = node.request("GET", path + "120", timeout=150)
            got[key] = (st, r.get("build", r).get("status"), time.monotonic() - t)
        polls = [threading.Thread(target=poll, args=x) for x in ((b, "b"), (self.api, "api"))]
        for t in polls:
            t.start()
        time.sleep(2)
        self.assertEqual(got, {}, "answered before the build ended")
        a.stop()
        a.start()
        for t in polls:
            t.join(150)
        for k in ("b", "api"):
            st, status, took = got[k]
            self.assertEqual((st, status), (200, "failed"), (k, got))
            self.assertLess(took, 60, (k, got))
        self.wait_for(lambda: all(x["state"] == "active" for x in self.list_workers()),
                      "both workers active again")

    def test_long_poll_outlives_a_read_that_fails(self):
        """A remote waiter's read that fails (the table gone for a moment, as a database out
        of reach would) does not end the wait: it reads again later and answers when the
        build ends."""
        a, b = self.workers
        name, bid = self.build_row("pollf", 78, runs_on=a, builder=b)
        got = {}

        def poll():
            t = time.monotonic()
            st, r = b.request("GET", "/v1/templates/%s/builds/%s?wait=60" % (name, bid),
                              timeout=90)
            got["b"] = (st, r.get("build", r).get("status"), time.monotonic() - t)
        t = threading.Thread(target=poll)
        t.start()
        time.sleep(1)
        self.query("ALTER TABLE template_builds RENAME TO template_builds_away;"
                   "SELECT pg_notify('space_builds', '%s')" % bid)
        time.sleep(2.5)  # b's read after the NOTIFY failed, and its reads again
        self.query("ALTER TABLE template_builds_away RENAME TO template_builds")
        time.sleep(1.5)
        self.assertEqual(got, {}, "answered while the build runs")
        self.query("UPDATE template_builds SET status = 'failed', error = 'stopped here'"
                   " WHERE id = '%s'; SELECT pg_notify('space_builds', '%s')" % (bid, bid))
        t.join(90)
        st, status, took = got["b"]
        self.assertEqual((st, status), (200, "failed"), got)
        self.assertLess(took, 30, got)

    def test_unfinished_builds_fail_only_with_their_worker(self):
        """A node that starts fails the builds its previous process left unfinished: a
        worker only its own (and rows from before builds named their worker), an API node
        none. A worker declared lost fails those it was running (its builder VMs are gone)."""
        a, b = self.workers
        team = self.query("SELECT id FROM teams WHERE name = 'alpha'")
        ids = {k: "%08x-0000-4000-8000-%012x" % (os.getpid(), i)
               for i, k in enumerate(("a", "b", "old"))}
        owner = {"a": "'%s'" % self.wid[a], "b": "'%s'" % self.wid[b], "old": "NULL"}
        self.query(";\n".join(
            "INSERT INTO templates (name, status, team_id) VALUES ('unfin-%s', 'building', '%s');"
            "INSERT INTO template_builds (id, team_id, template, status, request, worker_id)"
            " VALUES ('%s', '%s', 'unfin-%s', 'building', '{}', %s)"
            % (k, team, ids[k], team, k, owner[k]) for k in ids))

        def status(k):
            return self.query("SELECT b.status || ' ' || m.status || ' ' || coalesce(b.error, '')"
                              " FROM template_builds b JOIN templates m ON m.name = b.template"
                              " WHERE b.id = '%s'" % ids[k])
        self.api.stop()
        self.api.start()
        b.stop()
        b.start()
        self.wait_for(lambda: status("b").startswith("failed"), "b's build failed")
        self.assertEqual(status("b"), "failed failed the server restarted during the build")
        self.assertTrue(status("old").startswith("failed failed"), status("old"))
        self.assertEqual(status("a"), "building building")
        a.kill(signal.SIGKILL)
        try:
            self.wait_for(lambda: status("a").startswith("failed"), "a's build failed", 30)
            self.assertRegex(status("a"), r"^failed failed the worker running the build \(%s\)"
                                          r" was lost at " % self.wid[a])
        finally:
            a.start()
            self.wait_for(lambda: all(x["state"] == "active" for x in self.list_workers()),
                          "both workers active again")


if __name__ == "__main__":
    unittest.main(verbosity=2)
