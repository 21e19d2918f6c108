"""End to end on real microVMs through the native HTTP API (shipped spaced, QEMU driver).

Needs SP_TEST_DATA_DIR with a built `base` template (the e2e.template fixture makes it) and
root. Runs its own PostgreSQL so the shared data dir only holds images and VMs.
"""
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, free_port, Platform, read_number_cmd, vm_skip_reason, wait_s  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
READ_COUNTER = read_number_cmd("/tmp/counter")  # the background counter's value


def skip_reason():
    return vm_skip_reason(DATA)


def vm_processes(sid):
    out = subprocess.run(["pgrep", "-f", "vms/" + sid], capture_output=True, text=True).stdout
    return [p for p in out.split() if p]


@unittest.skipIf(skip_reason(), skip_reason())
class VmApiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.mport = free_port()
        cls.p = Platform(teams=(None,), binary=os.environ["SPACED"], data_dir=DATA,
                         env={"SPACE_ACCEL": os.environ.get("SPACE_ACCEL", "auto")},
                         args=["--metrics-listen", "127.0.0.1:%d" % cls.mport])
        cls.s, cls.pg = cls.p.s, cls.p.pg

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    def req(self, *a, **kw):
        return self.s.request(*a, **kw)

    def run_cmd(self, sid, body, status=200):
        st, r = self.req("POST", "/v1/sandboxes/%s/commands" % sid, body, timeout=120)
        self.assertEqual(st, status, r)
        return r

    def create(self, **fields):
        sid = self.s.create_ready(template="base", **fields)
        self.addCleanup(self.s.delete_quietly, sid)
        return sid

    def total(self, family):
        """The sum of a metric family's samples (all label sets), from /metrics."""
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.mport, timeout=30) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(family + "{") or line.startswith(family + " "))

    def ops(self):
        """space_lifecycle_operations_total{op=...,outcome="success"} by op, from /metrics."""
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.mport, timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith('space_lifecycle_operations_total{') and \
                    'outcome="success"' in line:
                op = line.split('op="')[1].split('"')[0]
                out[op] = float(line.rsplit(" ", 1)[1])
        return out

    def lifecycle(self, sid, verb, want):
        st, r = self.req("POST", "/v1/sandboxes/%s/%s?wait=%d" % (sid, verb, wait_s(60)), timeout=70 * MULT)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["operation"]["status"], "succeeded", r)
        self.assertEqual(r["sandbox"]["state"], want)
        return r

    def test_commands_and_files_on_a_real_vm(self):
        sid = self.create(env={"FROM_CREATE": "yes"})
        r = self.run_cmd(sid, {"cmd": "uname -r"})
        kernel = r["stdout"].strip()
        self.assertEqual(r["exit_code"], 0)
        self.assertRegex(kernel, r"^\d+\.\d+\.\d+-\d+-amd64$")
        self.assertNotEqual(kernel, os.uname().release)  # the guest's own kernel

        r = self.run_cmd(sid, {"argv": ["id", "-un"], "user": "user"})
        self.assertEqual(r["stdout"].strip(), "user")
        # E2B's view: the running VM's disk size, the same in the detail and in the list
        import http.client
        sizes = []
        for path in ("/sandboxes/%s" % sid, "/v2/sandboxes?state=running&limit=100"):
            c = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=30)
            c.request("GET", path, headers={"X-API-Key": self.s.key})
            resp = c.getresponse()
            body = json.loads(resp.read())
            c.close()
            self.assertEqual(resp.status, 200, body)
            item = body if isinstance(body, dict) else \
                [x for x in body if x["sandboxID"] == sid][0]
            sizes.append(item["diskSizeMB"])
        self.assertGreater(sizes[0], 0)
        self.assertEqual(sizes[0], sizes[1])
        r = self.run_cmd(sid, {"argv": ["id", "-un"]})
        self.assertEqual(r["stdout"].strip(), "root")
        r = self.run_cmd(sid, {"cmd": "echo $FOO:$PWD", "env": {"FOO": "bar"}, "cwd": "/tmp"})
        self.assertEqual(r["stdout"], "bar:/tmp\n")
        r = self.run_cmd(sid, {"cmd": "echo oops >&2; exit 7"})
        self.assertEqual((r["exit_code"], r["stderr"]), (7, "oops\n"))
        r = self.run_cmd(sid, {"argv": ["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"],
                               "stdin": "hello vm"})
        self.assertEqual(r["stdout"], "mv olleh\n")

        # Background: start, drop the first reader mid-stream, re-attach, signal.
        r = self.run_cmd(sid, {"cmd": "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done",
                               "background": True})
        cid = r["id"]
        import http.client
        c = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=30)
        c.request("GET", "/v1/sandboxes/%s/commands/%s/output" % (sid, cid),
                  headers={"Authorization": "Bearer " + self.s.key})
        resp = c.getresponse()
        first = resp.readline()
        self.assertIn(b"start", first)
        c.close()  # the client goes away; the process must not
        # Until the guest printed tick 3 (a loaded TCG guest may need more than a second):
        # re-attach for a moment at a time, each time reading the replay from the start.
        deadline = time.time() + 60 * MULT
        while time.time() < deadline:
            c = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=2)
            c.request("GET", "/v1/sandboxes/%s/commands/%s/output" % (sid, cid),
                      headers={"Authorization": "Bearer " + self.s.key})
            resp, seen = c.getresponse(), b""
            try:
                while b"tick 3" not in seen:
                    line = resp.readline()
                    if not line:
                        break
                    seen += line
            except OSError:  # the 2 s read timeout: nothing new yet
                pass
            c.close()
            if b"tick 3" in seen:
                break
        st, lst = self.req("GET", "/v1/sandboxes/%s/commands" % sid)
        mine = [x for x in lst["commands"] if x["id"] == cid]
        self.assertTrue(mine and mine[0]["running"], lst)
        st, r = self.req("POST", "/v1/sandboxes/%s/commands/%s/signal" % (sid, cid), {"signal": "SIGTERM"})
        self.assertEqual(st, 200, r)
        st, body = self.req("GET", "/v1/sandboxes/%s/commands/%s/output" % (sid, cid), timeout=60)
        lines = [json.loads(x) for x in body.decode().splitlines()] if isinstance(body, bytes) else []
        text = "".join(x.get("data", "") for x in lines if x["type"] == "stdout")
        self.assertIn("tick 3", text)  # replayed output from before the re-attach
        self.assertEqual(lines[-1]["type"], "exit")
        self.assertEqual(lines[-1]["signal"], 15)

        # 50 MiB up and down with a checksum.
        blob = os.urandom(50 << 20)
        t0 = time.time()
        st, ent = self.req("PUT", "/v1/sandboxes/%s/files?path=/home/user/big.bin" % sid, raw=blob,
                           timeout=300)
        up = time.time() - t0
        self.assertEqual(st, 200, ent)
        self.assertEqual(ent["size"], len(blob))
        r = self.run_cmd(sid, {"cmd": "sha256sum /home/user/big.bin"})
        self.assertEqual(r["stdout"].split()[0], hashlib.sha256(blob).hexdigest())
        t0 = time.time()
        st, got = self.req("GET", "/v1/sandboxes/%s/files?path=/home/user/big.bin" % sid, timeout=300)
        down = time.time() - t0
        self.assertEqual(st, 200)
        self.assertEqual(hashlib.sha256(got).hexdigest(), hashlib.sha256(blob).hexdigest())
        print("\n50 MiB upload %.2f s, download %.2f s" % (up, down), file=sys.stderr)

        # list / stat / move / remove
        st, _ = self.req("POST", "/v1/sandboxes/%s/files/mkdir" % sid, {"path": "/home/user/d/e"})
        self.assertEqual(st, 200)
        st, _ = self.req("PUT", "/v1/sandboxes/%s/files?path=/home/user/d/e/f.txt" % sid, raw=b"abc")
        self.assertEqual(st, 200)
        st, lst = self.req("GET", "/v1/sandboxes/%s/files/list?path=/home/user/d&depth=3" % sid)
        self.assertEqual(st, 200, lst)
        self.assertIn("/home/user/d/e/f.txt", [e["path"] for e in lst["entries"]])
        st, _ = self.req("POST", "/v1/sandboxes/%s/files/move" % sid,
                         {"from": "/home/user/d/e/f.txt", "to": "/home/user/g.txt"})
        self.assertEqual(st, 200)
        st, ent = self.req("GET", "/v1/sandboxes/%s/files/stat?path=/home/user/g.txt" % sid)
        self.assertEqual((st, ent["size"], ent["type"]), (200, 3, "file"))
        st, _ = self.req("DELETE", "/v1/sandboxes/%s/files?path=/home/user/d&recursive=true" % sid)
        self.assertEqual(st, 200)
        st, _ = self.req("GET", "/v1/sandboxes/%s/files/stat?path=/home/user/d" % sid)
        self.assertEqual(st, 404)

        # delete leaves no process, overlay or socket behind
        self.assertTrue(vm_processes(sid))
        vmdir = os.path.join(DATA, "vms", sid)
        self.assertTrue(os.path.exists(os.path.join(vmdir, "disk.qcow2")))
        st, r = self.req("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
        self.assertEqual(r["operation"]["status"], "succeeded", r)
        self.assertEqual(vm_processes(sid), [])
        self.assertFalse(os.path.exists(vmdir))

    def test_pause_suspend_cycles_keep_files_and_processes(self):
        before = self.ops()
        spares0 = self.total("space_spare_pool_requests_total")
        sid = self.create()
        # the create asked the spare pool (a hit or a miss); agent channels came up (a spare's
        # comes up when the spare is made, so not necessarily at this create)
        self.assertGreater(self.total("space_spare_pool_requests_total"), spares0)
        self.assertGreater(self.total("space_agent_channel_connects_total"), 0)
        self.run_cmd(sid, {"cmd": "echo keep > /home/user/kept.txt"})
        r = self.run_cmd(sid, {"cmd": "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; "
                                      "sleep 0.1; done", "background": True})
        cid = r["id"]

        def counter():
            return int(self.run_cmd(sid, {"cmd": READ_COUNTER})["stdout"])

        time.sleep(0.5)
        last = counter()
        for cycle in range(5):
            for verb, rest in (("pause", "paused"), ("suspend", "suspended")):
                self.lifecycle(sid, verb, rest)
                self.assertEqual(self.req("POST", "/v1/sandboxes/%s/commands" % sid,
                                          {"cmd": "true"})[0], 409)
                self.lifecycle(sid, "wake", "running")
                self.assertEqual(self.run_cmd(sid, {"cmd": "cat /home/user/kept.txt"})["stdout"],
                                 "keep\n")
                time.sleep(0.4)
                now = counter()
                self.assertGreater(now, last, "counter stopped after %s cycle %d" % (verb, cycle))
                last = now
        st, lst = self.req("GET", "/v1/sandboxes/%s/commands" % sid)
        self.assertTrue([x for x in lst["commands"] if x["id"] == cid and x["running"]])
        # delete of a suspended sandbox frees its snapshot
        self.lifecycle(sid, "suspend", "suspended")
        vmdir = os.path.join(DATA, "vms", sid)
        self.assertTrue(os.path.exists(vmdir))
        st, r = self.req("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
        self.assertEqual(r["operation"]["status"], "succeeded", r)
        self.assertFalse(os.path.exists(vmdir))
        # its files went into vms/.trash at once, and a worker thread unlinks them (a RAM file
        # of a GiB holds the loop up to 135 ms): the space is freed, not only the name
        trash = os.path.join(DATA, "vms", ".trash")
        deadline = time.time() + 10 * MULT
        while os.path.isdir(trash) and os.listdir(trash) and time.time() < deadline:
            time.sleep(0.05)
        self.assertEqual(os.listdir(trash) if os.path.isdir(trash) else [], [])
        # the operator's counters saw each operation on the real VM (--metrics-listen)
        after = self.ops()
        moved = {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}
        self.assertEqual(moved, {"create": 1, "pause": 5, "suspend": 6, "wake": 10, "delete": 1},
                         moved)

    def test_a_new_size_builds_a_template_snapshot(self):
        # A size no create asked for before (a fresh one each run: the data dir is shared) gets
        # its template snapshot built on first use, and the operator's counter says so.
        builds0 = self.total("space_template_snapshot_builds_total")
        # Not 288 or 320: e2e.forks and e2e.sizes need those sizes to have no snapshot yet
        mem = random.choice([m for m in range(258, 378, 2) if m not in (288, 320)])
        sid = self.create(memory_mb=mem)
        self.assertEqual(self.run_cmd(sid, {"cmd": "echo up"})["stdout"], "up\n")
        deadline = time.time() + 60 * MULT
        while self.total("space_template_snapshot_builds_total") <= builds0:
            self.assertLess(time.time(), deadline, "no template snapshot build counted (%d MiB)"
                            % mem)
            time.sleep(0.5)

    def test_idle_limit_suspends_a_real_vm(self):
        sid = self.create(idle_timeout_s=3)
        self.run_cmd(sid, {"cmd": "echo idle > /home/user/idle.txt"})
        deadline = time.time() + 60 * MULT
        sb = None
        while time.time() < deadline:
            st, sb = self.req("GET", "/v1/sandboxes/" + sid)
            if sb["state"] == "suspended":
                break
            time.sleep(0.5)
        self.assertEqual(sb["state"], "suspended", sb)
        self.assertGreater(sb["snapshot_bytes"], 0, sb)  # what the suspended sandbox costs
        self.assertEqual(vm_processes(sid), [])  # no CPU, no memory: the VM is gone
        self.lifecycle(sid, "wake", "running")
        self.assertEqual(self.run_cmd(sid, {"cmd": "cat /home/user/idle.txt"})["stdout"], "idle\n")
        st, r = self.req("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
        self.assertEqual(r["operation"]["status"], "succeeded", r)

    def test_vms_survive_a_spaced_restart(self):
        sid = self.create()
        sus = self.create()
        self.run_cmd(sid, {"cmd": "echo before > /tmp/marker"})
        self.run_cmd(sus, {"cmd": "echo suspended-before > /home/user/marker"})
        self.lifecycle(sus, "suspend", "suspended")
        pids = vm_processes(sid)
        self.s.kill()  # SIGKILL: no cleanup
        self.assertEqual(vm_processes(sid), pids)  # the VM kept running
        self.s.start()
        r = self.run_cmd(sid, {"cmd": "cat /tmp/marker"})
        self.assertEqual(r["stdout"], "before\n")
        self.lifecycle(sus, "wake", "running")
        r = self.run_cmd(sus, {"cmd": "cat /home/user/marker"})
        self.assertEqual(r["stdout"], "suspended-before\n")
        for x in (sid, sus):
            st, r = self.req("DELETE", "/v1/sandboxes/%s?wait=60" % x, timeout=70)
            self.assertEqual(r["operation"]["status"], "succeeded", r)

    def test_agent_channel_survives_hellos_left_by_earlier_spaceds(self):
        # A spaced killed after its HELLO reached the guest but before the agent read it
        # (the agent was busy, or the VM stopped) leaves that HELLO for the agent to answer
        # later, ahead of the answer to the next spaced's. The next spaced must take only the
        # answer to its own HELLO and keep the channel. The agent is stopped inside the guest
        # for a few seconds here, so the HELLOs of two spaced starts wait for it.
        sid = self.create()
        self.run_cmd(sid, {"cmd": "echo before > /tmp/marker"})
        self.run_cmd(sid, {"cmd": "w=$(pidof -o 1 space-agent); sleep 1; kill -STOP $w;"
                                  " sleep %d; kill -CONT $w" % (8 * MULT), "background": True})
        time.sleep(2)
        for _ in range(2):
            self.s.kill()  # SIGKILL: no cleanup
            self.s.start()  # re-adopts the VM, connects, sends HELLO: no answer yet
            time.sleep(0.5)
        r = self.run_cmd(sid, {"cmd": "cat /tmp/marker"})  # waits for the agent
        self.assertEqual(r["stdout"], "before\n")
        log = self.s.read_log()
        self.assertIn("ignored the answer to an earlier hello", log)
        self.assertNotIn("unexpected hello", log)
        self.assertEqual(log.count("channel up path=%s" % os.path.join(DATA, "vms", sid)), 1, log)


if __name__ == "__main__":
    unittest.main()
