"""Many hosts on one machine, each node in a network namespace of its own (tests/netns.py: a
bridge, one veth pair and one address per node): 2 API nodes and 3 QEMU workers, one
PostgreSQL on the bridge address, one shared snapshot dir, one cluster key. Every node listens
on its own address, port 3000, and advertises it; the test reaches them over the bridge.

Workers offer room for 6, 4 and 2 `base` sandboxes (1 vCPU, 256 MiB each), 12 in all.
1. 12 creates at once through alternating API nodes fill the workers exactly by their room;
   every sandbox answers a command through the API node that did not create it, a file written
   through one API node reads back through the other on every worker (3 MiB: past the 1 MiB a
   node reads whole, so its body streams through the API node as it comes; and through E2B's
   envd /files once), E2B lists (v1 and v2)
   through either API node show every sandbox's disk size, and through the other API node an
   E2B envd call (Connect, unary) and a forwarded port (HTTP and a WebSocket upgrade).
2. With room for 2 left, 5 creates race for it: 2 win, 3 get the `capacity` error at once, and
   no worker runs more VMs than its room.
3. The pinned E2B Python SDK (../shared/pysdk beside the project, or CONFORMANCE_PYTHON), and
   the JS SDK when conformance/js's locked packages install, against one API node for a sandbox
   on a worker: create, commands.run, files write/read, kill.
4. One worker killed with its VMs, another's spaced only, at once: within the heartbeat timeout
   both are lost and their running sandboxes `lost` with the reason; the second, restarted
   within the grace, re-adopts its sandboxes (a process still counting); a sandbox suspended on
   the first wakes on another worker with its file and its process.
5. An API node killed while a client streams a command's output through it: the client's read
   ends with an error at once, not a hang; the sandbox answers through the other API node.
Throughout no sandbox has a VM on two workers (each worker's VMs scanned in its data dir).

Everything (namespaces, veths, the bridge, the nodes, their VMs, PostgreSQL, the run's
directory beside SP_TEST_DATA_DIR) is removed at the end, after a failure too, and what a killed
run left behind (its pid gone) is removed at the start.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import netns  # noqa: E402
from fleet import (PORT_SERVER, kill_qemus, live_vms, vm_pid, websocket_echo,  # noqa: E402
                   worker_data_dir)
from harness import (MULT, PgCluster, Spaced, read_number_cmd, vm_skip_reason, wait_s,  # noqa: E402
                     wait_until)

DATA = os.environ.get("SP_TEST_DATA_DIR")
PORT = 3000
TIMEOUT_S = 3  # --heartbeat-timeout-s
GRACE_S = 40  # --lost-grace-s
ROOM = {"w1": 6, "w2": 4, "w3": 2}  # base sandboxes (1 vCPU, 256 MiB) each worker holds
MEM_MB = 256
CREATES_AT_ONCE = 3
RUN_PREFIX = "fleet-netns-"
COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.5; done"
READ_COUNT = read_number_cmd("/tmp/count")


def pysdk_python():
    env = os.environ.get("CONFORMANCE_PYTHON")
    if env:
        return env
    p = os.path.join(HERE, "..", "..", "shared", "pysdk", "python3")
    return os.path.abspath(p) if os.access(p, os.X_OK) else None


def skip_reason():
    return vm_skip_reason(DATA) or netns.skip_reason()


def clean_stale_runs(parent):
    """A killed run's directory beside the data dir (its pid gone): its VMs and PostgreSQL
    killed, the directory removed."""
    for name in os.listdir(parent):
        m = re.match(re.escape(RUN_PREFIX) + r"(\d+)$", name)
        if m is None or netns.pid_alive(int(m.group(1))):
            continue
        d = os.path.join(parent, name)
        kill_qemus(d + "/")
        try:
            with open(os.path.join(d, "pg", "data", "postmaster.pid")) as f:
                os.kill(int(f.readline()), signal.SIGQUIT)
        except (OSError, ValueError):
            pass
        shutil.rmtree(d, ignore_errors=True)


def in_threads(fns, at_once=None):
    """Runs each fn in a thread of its own, all at once or at_once at a time: their results
    (an exception raised is the result)."""
    out = [None] * len(fns)
    sem = threading.Semaphore(at_once or len(fns))

    def run(i):
        with sem:
            try:
                out[i] = fns[i]()
            except BaseException as e:  # noqa: B902 - reported to the caller
                out[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def raise_any(results):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class FleetNetnsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        why = skip_reason()
        if why:
            raise unittest.SkipTest(why)
        t0 = time.time()
        parent = os.path.dirname(os.path.abspath(DATA))
        clean_stale_runs(parent)
        cls.lab = None
        cls.pg = None
        cls.apis, cls.workers, cls.nodes, cls.sids = [], [], [], []
        cls.root = os.path.join(parent, RUN_PREFIX + str(os.getpid()))
        os.makedirs(cls.root)
        try:
            cls.setUpNodes()
        except BaseException:
            cls.tearDownClass()
            raise
        print("setup: %d nodes up in %.1f s (stale namespaces and links removed: %s)"
              % (len(cls.nodes), time.time() - t0, cls.lab.cleaned or "none"), file=sys.stderr)

    @classmethod
    def setUpNodes(cls):
        cls.lab = netns.Netns(["api1", "api2", "w1", "w2", "w3"])
        cls.pg = PgCluster(listen=cls.lab.host, root=os.path.join(cls.root, "pg"))
        cls.snap = os.path.join(cls.root, "snapshots")
        os.makedirs(cls.snap)
        cls.keyfile = os.path.join(cls.root, "cluster.key")
        fd = os.open(cls.keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, os.urandom(24).hex().encode())
        os.close(fd)
        common = ["--cluster-key-file", cls.keyfile, "--heartbeat-timeout-s", str(TIMEOUT_S),
                  "--lost-grace-s", str(GRACE_S)]

        def node(name, args, **kw):
            addr = cls.lab.addr[name]
            n = Spaced(binary=os.environ["SPACED"], database_url=cls.pg.url, host=addr,
                       port=PORT, wrap=cls.lab.wrap(name),
                       args=args + ["--advertise", "%s:%d" % (addr, PORT)] + common, **kw)
            n.name = name
            cls.nodes.append(n)
            return n

        for name in ("api1", "api2"):
            cls.apis.append(node(name, ["--role", "api"]))
        key = cls.apis[0].cli("keys", "create", "--team", "alpha").stdout.strip()
        for name, room in ROOM.items():
            d = os.path.join(cls.root, name)
            worker_data_dir(DATA, d)
            # No spare clones: a worker's VMs are its sandboxes', which the scans count.
            w = node(name, ["--role", "worker", "--snapshot-dir", cls.snap,
                            "--worker-vcpus", str(room), "--worker-memory-mb",
                            str(room * MEM_MB), "--worker-labels", "node=" + name],
                     data_dir=d, env={"SPACE_POOL_SIZE": "0"})
            cls.workers.append(w)
        for n in cls.nodes:
            n.key = key
        # api1 first: the node that starts on an empty fleet writes the admin key it made.
        cls.apis[0].start(timeout=120)
        raise_any(in_threads([lambda n=n: n.start(timeout=120) for n in cls.nodes[1:]]))
        with open(os.path.join(cls.apis[0].data_dir, "admin-key")) as f:
            cls.admin = f.read().strip()
        for w in cls.workers:
            with open(os.path.join(w.data_dir, "worker-id")) as f:
                w.wid = f.read().strip()
        cls.by_wid = {w.wid: w for w in cls.workers}
        wait_until(lambda: len([x for x in cls.list_workers() if x["state"] == "active"]) == 3,
                   "3 workers active", 30, 0.2)

    @classmethod
    def tearDownClass(cls):
        api = cls.live_api()
        for sid in cls.sids if api is not None else []:
            api.delete_quietly(sid)
        for n in cls.nodes:
            n.destroy()
        kill_qemus(cls.root + "/")  # VMs of a worker killed here: never left behind
        if cls.pg is not None:
            cls.pg.destroy()
        if cls.lab is not None:
            cls.lab.destroy()
        if os.environ.get("SP_TEST_KEEP") != "1":
            shutil.rmtree(cls.root, ignore_errors=True)

    # ---- helpers ----

    @classmethod
    def live_api(cls):
        for a in cls.apis:
            if a.proc is not None and a.proc.poll() is None:
                return a
        return None

    @classmethod
    def list_workers(cls):
        st, r = cls.live_api().request("GET", "/v1/workers", key=cls.admin)
        assert st == 200, (st, r)
        return r["workers"]

    def worker_state(self, w):
        return [x["state"] for x in self.list_workers() if x["id"] == w.wid][0]

    def placement(self):
        """{sandbox id: worker} for every sandbox the fleet places (any state but deleted)."""
        out = {}
        for w in self.workers:
            st, r = self.live_api().request("GET", "/v1/workers/" + w.wid, key=self.admin)
            self.assertEqual(st, 200, r)
            for s in r["sandboxes"]:
                out[s["id"]] = w
        return out

    def sandbox(self, sid, api=None):
        st, r = (api or self.live_api()).request("GET", "/v1/sandboxes/" + sid)
        self.assertEqual(st, 200, r)
        return r

    def state(self, sid):
        return self.sandbox(sid)["state"]

    def create(self, api, **body):
        sid = api.create_ready(wait=240, template="base", **body)
        self.sids.append(sid)
        return sid

    def delete(self, sid):
        st, r = self.live_api().request("DELETE", "/v1/sandboxes/%s?wait=%d" % (sid, wait_s(60)),
                                        timeout=wait_s(60) + 10)
        self.assertIn(st, (200, 204), r)
        self.sids.remove(sid)

    def sh(self, sid, script, api=None):
        return (api or self.live_api()).command(sid, script)

    def start_counter(self, sid):
        st, r = self.live_api().request("POST", "/v1/sandboxes/%s/commands" % sid,
                                        {"argv": ["sh", "-c", COUNTER], "background": True})
        self.assertIn(st, (200, 201, 202), r)
        wait_until(lambda: self.count(sid) >= 2, "the counter counting", 30, 0.2)

    def count(self, sid):
        return int(self.sh(sid, READ_COUNT)["stdout"].strip() or 0)

    def vms(self):
        """{sandbox id: [workers with a live VM for it]}, every worker's data dir scanned."""
        out = {}
        for w in self.workers:
            for sid in live_vms(w.data_dir):
                out.setdefault(sid, []).append(w)
        return out

    def assert_one_vm_each(self):
        """No sandbox has VMs on two workers; every running one has its VM on the worker the
        fleet placed it on, and no worker runs more VMs than its room."""
        vms = self.vms()
        for sid, ws in vms.items():
            self.assertEqual(len(ws), 1, "%s has VMs on %s" % (sid, [w.name for w in ws]))
        placed = self.placement()
        for sid, w in placed.items():
            if self.state(sid) == "running":
                self.assertEqual([x.name for x in vms.get(sid, [])], [w.name], sid)
        # room counts sandboxes: a worker's spare clones and template snapshot builders (made
        # ahead of creates) are its own VMs, outside any sandbox's room
        for w in self.workers:
            n = len([s for s, ws in vms.items() if ws[0] is w and s in placed])
            self.assertLessEqual(n, ROOM[w.name], "%s runs %d sandbox VMs" % (w.name, n))

    def on(self, name, placed=None):
        """The sandboxes this test made that run on worker name."""
        placed = placed or self.placement()
        return [s for s in self.sids if placed.get(s) is not None and placed[s].name == name
                and self.state(s) == "running"]

    def envd_host(self, sid, port=49983):
        return "%d-%s.space.localhost:%d" % (port, sid, PORT)

    # ---- tests ----

    def test_1_spread_by_room_and_data_plane_through_either_api(self):
        t0 = time.time()
        # Each create names the API node that made it; CREATES_AT_ONCE at a time (12 at once
        # starve each other's guests past the 60 s boot limit on two cores under TCG).
        times = []

        def one(i):
            t = time.time()
            sid = self.create(self.apis[i % 2])
            times.append(time.time() - t)
            return sid, i % 2
        made = raise_any(in_threads([lambda i=i: one(i) for i in range(sum(ROOM.values()))],
                                    CREATES_AT_ONCE))
        print("12 creates through 2 API nodes, %d at a time: %.1f s (each %.1f s median, %.1f s"
              " at most)" % (CREATES_AT_ONCE, time.time() - t0, sorted(times)[len(times) // 2],
                             max(times)), file=sys.stderr)
        placed = self.placement()
        got = {name: len([s for s, _ in made if placed[s].name == name]) for name in ROOM}
        self.assertEqual(got, ROOM)
        for x in self.list_workers():
            self.assertEqual(x["used"]["vcpus"], x["capacity"]["vcpus"], x)
            self.assertEqual(x["used"]["memory_mb"], x["capacity"]["memory_mb"], x)
        self.assert_one_vm_each()

        # A command in every sandbox through the API node that did not create it.
        def other_cmd(sid, made_by):
            r = self.sh(sid, "echo $((6*7)) from $(hostname)", api=self.apis[1 - made_by])
            return r
        outs = raise_any(in_threads([lambda s=s, i=i: other_cmd(s, i) for s, i in made]))
        for r in outs:
            self.assertEqual((r["exit_code"], r["stdout"].split()[0]), (0, "42"), r)

        # E2B lists through either API node, which runs no VMs: every sandbox's disk size, as
        # its worker recorded it on the row (issue 20).
        for api in self.apis:
            for path in ("/sandboxes", "/v2/sandboxes?limit=100"):
                resp, body = api.exchange("GET", path, headers={"X-API-Key": api.key})
                self.assertEqual(resp.status, 200, body)
                sizes = {it["sandboxID"]: it["diskSizeMB"] for it in json.loads(body)}
                for sid, _ in made:
                    self.assertGreater(sizes.get(sid, 0), 0, (path, sid, sizes))

        # A file through one API node, read back through the other, on every worker: larger
        # than what a node reads whole (1 MiB), so it streams through the API node.
        for k, name in enumerate(ROOM):
            sid = self.on(name, placed)[0]
            w, r = self.apis[k % 2], self.apis[1 - k % 2]
            blob = os.urandom(3 << 20)
            st, _ = w.request("PUT", "/v1/sandboxes/%s/files?path=/root/f" % sid, raw=blob,
                              timeout=120)
            self.assertIn(st, (200, 201, 204))
            resp, got = r.exchange("GET", "/v1/sandboxes/%s/files?path=/root/f" % sid,
                                   headers={"Authorization": "Bearer " + r.key}, timeout=120)
            self.assertEqual((resp.status, got == blob), (200, True), name)

        # Through api2, for a sandbox api1 made: an E2B envd call and a forwarded port.
        sid = [s for s, i in made if i == 0][0]
        api = self.apis[1]
        token = self.sandbox(sid)["access_token"]
        # envd's /files upload (multipart), streamed through too, read back through api1
        blob = os.urandom(3 << 20)
        sep = "spaceboundary%s" % os.urandom(8).hex()
        form = (("--%s\r\nContent-Disposition: form-data; name=\"file\"; filename=\"e.bin\"\r\n"
                 "Content-Type: application/octet-stream\r\n\r\n" % sep).encode() + blob
                + ("\r\n--%s--\r\n" % sep).encode())
        resp, body = api.exchange("POST", "/files?path=/root/e.bin&username=root", raw=form,
                                  headers={"Host": self.envd_host(sid), "X-Access-Token": token,
                                           "Content-Type": "multipart/form-data; boundary=" + sep},
                                  timeout=120)
        self.assertEqual(resp.status, 200, body)
        resp, got = self.apis[0].exchange("GET", "/files?path=/root/e.bin&username=root",
                                          headers={"Host": self.envd_host(sid),
                                                   "X-Access-Token": token}, timeout=120)
        self.assertEqual((resp.status, got == blob), (200, True), body)
        resp, body = api.exchange("POST", "/filesystem.Filesystem/Stat",
                                  raw=json.dumps({"path": "/etc/hostname"}).encode(),
                                  headers={"Host": self.envd_host(sid),
                                           "X-Access-Token": token,
                                           "Content-Type": "application/json",
                                           "Connect-Protocol-Version": "1"})
        self.assertEqual(resp.status, 200, body)
        self.assertEqual(json.loads(body)["entry"]["name"], "hostname", body)
        st, r = api.request("POST", "/v1/sandboxes/%s/commands" % sid,
                            {"argv": ["python3", "-c", PORT_SERVER], "background": True})
        self.assertIn(st, (200, 201, 202), r)
        host = self.envd_host(sid, 8080)
        deadline = time.time() + 60 * MULT
        while True:
            resp, body = api.exchange("GET", "/hello", headers={"Host": host})
            if resp.status == 200 or time.time() > deadline:
                break
            time.sleep(0.3)  # the server in the guest is starting
        self.assertEqual((resp.status, body), (200, b"port ok /hello"))
        head, back = websocket_echo(api.host, PORT, host, b"hello websocket")
        self.assertTrue(head.startswith(b"HTTP/1.1 101"), head)
        self.assertEqual(back, b"HELLO WEBSOCKET")

    def test_2_race_for_the_last_room(self):
        placed = self.placement()
        self.delete(self.on("w1", placed)[0])
        self.delete(self.on("w3", placed)[0])

        def one(i):
            t = time.time()
            api = self.apis[i % 2]
            st, r = api.request("POST", "/v1/sandboxes?wait=%d" % wait_s(240),
                                {"template": "base"}, timeout=wait_s(240) + 20)
            if st == 200:
                self.sids.append(r["sandbox"]["id"])
            return st, r, time.time() - t
        got = raise_any(in_threads([lambda i=i: one(i) for i in range(5)]))
        won = [r for st, r, _ in got if st == 200]
        lost = [(st, r, dt) for st, r, dt in got if st != 200]
        self.assertEqual(len(won), 2, got)
        for r in won:
            self.assertEqual(r["operation"]["status"], "succeeded", r)
        for st, r, dt in lost:
            self.assertEqual((st, r["error"]["code"]), (503, "capacity"), r)
            self.assertLess(dt, 10 * MULT, "a capacity error after %.1f s" % dt)
        print("race: 2 of 5 won, the others' capacity errors in %.2f s at most"
              % max(dt for _, _, dt in lost), file=sys.stderr)
        placed = self.placement()
        self.assertEqual(sorted(placed[r["sandbox"]["id"]].name for r in won), ["w1", "w3"])
        for x in self.list_workers():
            self.assertEqual(x["used"]["vcpus"], x["capacity"]["vcpus"], x)
        self.assert_one_vm_each()

    SDK_PY = r"""
import os, sys
from e2b import Sandbox
sb = Sandbox.create("base", timeout=300)
print("ID", sb.sandbox_id, flush=True)
r = sb.commands.run("echo sdk-$((6*7))")
assert r.exit_code == 0 and r.stdout.strip() == "sdk-42", r
sb.files.write("/tmp/sdk.txt", "written by the python sdk")
assert sb.files.read("/tmp/sdk.txt") == "written by the python sdk"
sys.stdin.readline()  # the test checks where it runs
sb.kill()
print("OK", flush=True)
"""

    SDK_JS = r"""
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";
import readline from "node:readline";
const req = createRequire(process.env.SDK_JS_DIR + "/package.json");
const { Sandbox } = await import(pathToFileURL(req.resolve("e2b")).href);
const sb = await Sandbox.create("base", { timeoutMs: 300000 });
console.log("ID " + sb.sandboxId);
const r = await sb.commands.run("echo js-$((6*7))");
if (r.exitCode !== 0 || r.stdout.trim() !== "js-42") throw new Error(JSON.stringify(r));
await sb.files.write("/tmp/sdk.txt", "written by the js sdk");
if ((await sb.files.read("/tmp/sdk.txt")) !== "written by the js sdk") throw new Error("read");
await new Promise((ok) => readline.createInterface({ input: process.stdin }).once("line", ok));
await sb.kill();
console.log("OK");
process.exit(0);
"""

    def run_sdk(self, argv, what, env):
        """Runs an SDK script against api1; checks the sandbox it made while it waits: on a
        worker, running, with one VM, and gone after its kill."""
        api = self.apis[0]
        base = "http://%s:%d" % (api.host, PORT)
        env = dict(os.environ, E2B_API_URL=base, E2B_SANDBOX_URL=base, E2B_API_KEY=api.key,
                   **env)
        env.pop("E2B_DOMAIN", None)
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        try:
            line = p.stdout.readline()
            if not line.startswith("ID "):
                p.stdin.close()
                self.fail("%s: %s%s%s" % (what, line, p.stdout.read(), p.stderr.read()))
            sid = line.split()[1]
            self.sids.append(sid)
            placed = self.placement()
            self.assertIn(sid, placed)
            self.assertEqual(self.state(sid), "running")
            self.assertEqual([w.name for w in self.vms().get(sid, [])], [placed[sid].name])
            p.stdin.write("\n")
            p.stdin.flush()
            out, err = p.communicate(timeout=120 * MULT)
            self.assertEqual((p.returncode, out.strip()), (0, "OK"), "%s: %s" % (what, err))
            print("%s SDK through %s: a sandbox on %s" % (what, api.name, placed[sid].name),
                  file=sys.stderr)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        wait_until(lambda: sid not in self.vms(), "the killed sandbox's VM gone", 30, 0.2)
        self.sids.remove(sid)

    def js_sdk_dir(self):
        """conformance/js with its locked packages installed (npm ci), else None."""
        d = os.path.join(HERE, "..", "conformance", "js")
        if shutil.which("node") is None:
            return None
        r = subprocess.run([os.path.join(d, "run.sh")], capture_output=True, text=True,
                           env=dict(os.environ, CONFORMANCE_INSTALL_ONLY="1"), timeout=600)
        return os.path.abspath(d) if r.returncode == 0 else None

    def test_3_e2b_sdks_through_one_api_node(self):
        placed = self.placement()
        self.delete(self.on("w2", placed)[0])  # room for one
        py = pysdk_python()
        if py is None:
            self.skipTest("the pinned Python SDK (../shared/pysdk) is not beside the project")
        self.run_sdk([py, "-c", self.SDK_PY], "python", {})
        js = self.js_sdk_dir()
        if js is None:
            print("js SDK: skipped (node or conformance/js's locked packages missing)",
                  file=sys.stderr)
            return
        self.run_sdk(["node", "--input-type=module", "-e", self.SDK_JS], "js",
                     {"SDK_JS_DIR": js})

    def test_4_worker_loss_and_readoption(self):
        placed = self.placement()
        victim, back = self.by_name("w2"), self.by_name("w1")
        # On the victim: one sandbox suspended with a file and a process, the rest running.
        susp = self.on("w2", placed)[0]
        self.sh(susp, "echo before-suspend > /root/g")
        self.start_counter(susp)
        n0 = self.count(susp)
        st, r = self.live_api().request("POST", "/v1/sandboxes/%s/suspend?wait=%d"
                                        % (susp, wait_s(120)), timeout=wait_s(120) + 10)
        self.assertEqual(st, 200, r)
        self.assertEqual(self.state(susp), "suspended")
        lost = self.on("w2", placed)
        self.assertTrue(lost)
        kept = self.on("w1", placed)
        self.start_counter(kept[0])
        # Room for the wake elsewhere: one fewer on w3.
        self.delete(self.on("w3", placed)[0])

        t0 = time.time()
        victim.kill(signal.SIGKILL)
        kill_qemus(victim.data_dir + "/")
        back.kill(signal.SIGKILL)  # spaced only: its VMs live on
        wait_until(lambda: self.worker_state(victim) == "lost"
                   and self.worker_state(back) == "lost", "both workers lost", 60, 0.1)
        dt = time.time() - t0
        for sid in lost + kept:
            wait_until(lambda: self.state(sid) == "lost", "%s lost" % sid, 30, 0.1)
        print("workers lost: declared %.1f s after the kill, their sandboxes lost %.1f s after"
              " (heartbeat timeout %d s)" % (dt, time.time() - t0, TIMEOUT_S), file=sys.stderr)
        self.assertLess(dt, TIMEOUT_S * 3 * MULT + 5)
        for sid in lost:
            r = self.sandbox(sid)
            self.assertIn(victim.wid, r.get("error") or "", r)
            self.assertTrue(r.get("lost_at"), r)
            self.assertIsNone(vm_pid(victim.data_dir, sid))

        # The spaced-only kill comes back within the grace: its sandboxes re-adopted.
        pids = {sid: vm_pid(back.data_dir, sid) for sid in kept}
        t1 = time.time()
        back.start(timeout=120)
        self.assertLess(time.time() - t0, GRACE_S)
        for sid in kept:
            wait_until(lambda: self.state(sid) == "running", "%s re-adopted" % sid, 60, 0.2)
        print("re-adopted %d sandboxes %.1f s after the restart"
              % (len(kept), time.time() - t1), file=sys.stderr)
        self.assertEqual({sid: vm_pid(back.data_dir, sid) for sid in kept}, pids)
        n = self.count(kept[0])
        wait_until(lambda: self.count(kept[0]) > n, "the counter still counting", 30, 0.2)

        # The suspended one wakes elsewhere, with its file and its process.
        st, r = self.live_api().request("POST", "/v1/sandboxes/%s/wake?wait=%d"
                                        % (susp, wait_s(240)), timeout=wait_s(240) + 10)
        self.assertEqual(st, 200, r)
        self.assertEqual(self.state(susp), "running")
        where = self.placement()[susp]
        self.assertIsNot(where, victim)
        self.assertEqual(self.sh(susp, "cat /root/g")["stdout"], "before-suspend\n")
        n = self.count(susp)
        self.assertGreaterEqual(n, n0)
        wait_until(lambda: self.count(susp) > n, "the woken counter counting", 30, 0.2)
        for sid in lost:
            self.delete(sid)
        self.assert_one_vm_each()

    def test_5_api_node_killed_mid_stream(self):
        placed = self.placement()
        sid = self.on("w3", placed)[0]
        api, other = self.apis[1], self.apis[0]
        conn, resp = api.open_stream("POST", "/v1/sandboxes/%s/commands" % sid,
                                     {"cmd": "i=0; while [ $i -lt 600 ]; do i=$((i+1)); "
                                             "echo line $i; sleep 0.1; done", "stream": True},
                                     timeout=20)
        self.assertEqual(resp.status, 200)
        seen = []
        while len(seen) < 5:
            line = resp.readline()
            self.assertTrue(line, seen)
            ev = json.loads(line)
            if ev.get("type") == "stdout":
                seen.append(ev["data"])
        api.kill(signal.SIGKILL)
        t0 = time.time()
        ended = None
        try:
            while True:
                line = resp.readline()
                if not line:
                    ended = "closed"
                    break
                if json.loads(line).get("type") == "exit":
                    ended = "exit"
                    break
        except (OSError, ValueError) as e:
            ended = type(e).__name__
        except Exception as e:  # http.client's IncompleteRead and kin
            ended = type(e).__name__
        finally:
            conn.close()
        dt = time.time() - t0
        print("API node killed mid-stream: the client's read ended (%s) %.2f s after"
              % (ended, dt), file=sys.stderr)
        self.assertNotEqual(ended, "exit")
        self.assertLess(dt, 10)
        # The sandbox is unaffected, through the other API node.
        self.assertEqual(self.sandbox(sid, other)["state"], "running")
        r = self.sh(sid, "echo still-here", api=other)
        self.assertEqual(r["stdout"], "still-here\n")
        self.assert_one_vm_each()

    def by_name(self, name):
        return [w for w in self.workers if w.name == name][0]


if __name__ == "__main__":
    if skip_reason():
        print("skipped:", skip_reason())
        sys.exit(77)
    unittest.main(verbosity=2)
