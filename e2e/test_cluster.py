"""Two nodes, one PostgreSQL: a sandbox running on node B (real VM) used through node A, whose
dispatch forwards its data plane to B (http/proxy.c), signed with the shared cluster key.

B runs the VMs on the shared template data dir; A is started after B's create finished (so
that B's controller owns the row) with a data dir of its own holding the base template
(tests/fleet.py's worker_data_dir) and the label node=a, and runs one sandbox of its own,
pinned there: it answers the control plane from the database and forwards the rest. The test
writes B's `workers` row itself (the address it reaches B at). Through A: a native command, a
file upload and download, code execution, E2B envd (Connect RPC and /files on the envd host),
a forwarded port over HTTP and WebSocket, a command session attached over WebSocket, E2B's
many-sandbox metrics (gathered from both workers), a sandbox's disk size in lists and details
(recorded on its row by its worker, the same through either node; a row from before that gets
it when its worker restarts), and the errors when B is gone or does not answer.
"""
import base64
import hashlib
import http.client
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, Platform, Spaced, pg_bindir, vm_skip_reason  # noqa: E402
from fleet import PORT_SERVER, kill_qemus, websocket_echo, worker_data_dir  # noqa: E402
from wsclient import WebSocket  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
CI = "code-interpreter-v1"

def envelope(flags, payload):
    return struct.pack(">BI", flags, len(payload)) + payload


class ClusterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        why = vm_skip_reason(DATA)
        if why is None and not os.path.exists(os.path.join(DATA, "templates", CI, "current")):
            why = "SP_TEST_DATA_DIR has no built %s template" % CI
        if why:
            raise unittest.SkipTest(why)
        cls.keydir = os.path.join("/tmp", "sp-ck-e2e-%d" % os.getpid())
        os.makedirs(cls.keydir, exist_ok=True)
        cls.keyfile = os.path.join(cls.keydir, "cluster.key")
        fd = os.open(cls.keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        cls.a = None
        cls.sid = None
        cls.a_sid = None
        cls.a_dir = None
        cls.p = Platform(teams=("alpha",), binary=os.environ["SPACED"], data_dir=DATA,
                         args=["--cluster-key-file", cls.keyfile])
        cls.b = cls.p.s
        try:
            cls.setUpNodes()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def setUpNodes(cls):
        cls.sid = cls.b.create_ready(wait=240, template=CI)
        st, sb = cls.b.request("GET", "/v1/sandboxes/" + cls.sid)
        assert st == 200, (st, sb)
        cls.token = sb["access_token"]
        with open(os.path.join(DATA, "worker-id")) as f:
            cls.b_worker = f.read().strip()
        # B registered itself at start (core/control/fleet.c); the row is written here too so
        # the address is the one this test reaches B at, whatever B advertises.
        cls.sql("INSERT INTO workers (id, address) VALUES ('%s', '127.0.0.1:%d')"
                " ON CONFLICT (id) DO UPDATE SET address = EXCLUDED.address"
                % (cls.b_worker, cls.b.port))
        # A: started once B owns the sandbox; its own data dir with the base template, no
        # spares, labelled so that a sandbox can be pinned to it.
        cls.a_dir = os.path.join(cls.keydir, "a")
        worker_data_dir(DATA, cls.a_dir)
        cls.a = Spaced(binary=os.environ["SPACED"], database_url=cls.p.pg.url,
                       data_dir=cls.a_dir, env={"SPACE_POOL_SIZE": "0"},
                       args=["--cluster-key-file", cls.keyfile, "--worker-labels", "node=a"])
        cls.a.key = cls.b.key
        cls.a.start(timeout=120)
        cls.a_sid = cls.a.create_ready(wait=240, template="base",
                                       placement={"labels": {"node": "a"}})
        st, r = cls.b.request("POST", "/v1/sandboxes/%s/commands" % cls.sid,
                              {"argv": ["python3", "-c", PORT_SERVER], "background": True})
        assert st in (200, 201, 202), (st, r)

    @classmethod
    def tearDownClass(cls):
        if cls.a is not None:
            if cls.a_sid is not None:
                cls.a.delete_quietly(cls.a_sid)
            cls.a.destroy()
        if cls.a_dir is not None:
            kill_qemus(cls.a_dir + "/")  # never left behind, whatever failed
        if cls.sid is not None:
            cls.b.delete_quietly(cls.sid)
        cls.p.destroy()
        if os.environ.get("SP_TEST_KEEP") != "1":
            shutil.rmtree(cls.keydir, ignore_errors=True)

    @classmethod
    def sql(cls, text):
        r = subprocess.run([os.path.join(pg_bindir(), "psql"), "-X", "-q", "-A", "-t", "-v",
                            "ON_ERROR_STOP=1", cls.p.pg.url, "-c", text],
                           check=True, capture_output=True, text=True)
        return r.stdout.strip()

    def envd_host(self, node, port=49983):
        return "%d-%s.space.localhost:%d" % (port, self.sid, node.port)

    def test_native_command_files_code(self):
        r = self.a.command(self.sid, "echo through-a; hostname")
        self.assertEqual(r["exit_code"], 0, r)
        self.assertIn("through-a", r["stdout"])
        blob = os.urandom(8 << 20)
        st, _ = self.a.request("PUT", "/v1/sandboxes/%s/files?path=/tmp/blob" % self.sid,
                               raw=blob, timeout=300)
        self.assertIn(st, (200, 201, 204))
        r = self.a.command(self.sid, "sha256sum /tmp/blob")
        self.assertEqual(r["stdout"].split()[0], hashlib.sha256(blob).hexdigest())
        resp, got = self.a.exchange("GET", "/v1/sandboxes/%s/files?path=/tmp/blob" % self.sid,
                                    headers={"Authorization": "Bearer " + self.a.key},
                                    timeout=300)
        self.assertEqual(resp.status, 200)
        self.assertEqual(hashlib.sha256(got).hexdigest(), hashlib.sha256(blob).hexdigest())
        c = http.client.HTTPConnection("127.0.0.1", self.a.port, timeout=180 * MULT)
        c.request("POST", "/v1/sandboxes/%s/execute" % self.sid,
                  body=json.dumps({"code": "x = 6 * 7\nprint(x)"}),
                  headers={"Authorization": "Bearer " + self.a.key,
                           "Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read().decode()
        c.close()
        self.assertEqual(r.status, 200, raw)
        events = [json.loads(line) for line in raw.split("\n") if line]
        self.assertEqual(events[-1]["type"], "end", events)
        self.assertIn("42", raw)
        # the control plane is A's own (the database), not forwarded
        st, sb = self.a.request("GET", "/v1/sandboxes/" + self.sid)
        self.assertEqual((st, sb["state"]), (200, "running"))

    def test_e2b_envd(self):
        host = self.envd_host(self.a)
        c = http.client.HTTPConnection("127.0.0.1", self.a.port, timeout=120 * MULT)
        p = {"process": {"cmd": "/bin/bash", "args": ["-c", "echo envd-through-a"]},
             "stdin": False}
        c.request("POST", "/process.Process/Start", body=envelope(0, json.dumps(p).encode()),
                  headers={"Host": host, "X-Access-Token": self.token,
                           "Content-Type": "application/connect+json",
                           "connect-protocol-version": "1"})
        r = c.getresponse()
        self.assertEqual(r.status, 200)
        out = b""
        while True:
            h = r.read(5)
            if len(h) < 5:
                break
            flags, n = struct.unpack(">BI", h)
            m = json.loads(r.read(n))
            if flags & 2:
                break
            out += base64.b64decode(m["event"].get("data", {}).get("stdout", ""))
        c.close()
        self.assertIn(b"envd-through-a", out)
        resp, body = self.a.exchange("GET", "/files?path=/etc/hostname",
                                     headers={"Host": host, "X-Access-Token": self.token})
        self.assertEqual(resp.status, 200, body)
        self.assertTrue(body.strip())

    def test_forwarded_port_http_and_websocket(self):
        host = self.envd_host(self.a, 8080)
        deadline = time.time() + 60 * MULT
        while True:
            resp, body = self.a.exchange("GET", "/hello", headers={"Host": host})
            if resp.status == 200 or time.time() > deadline:
                break
            time.sleep(0.5)  # the server in the guest is starting
        self.assertEqual((resp.status, body), (200, b"port ok /hello"))
        head, back = websocket_echo("127.0.0.1", self.a.port, host, b"hello websocket")
        self.assertTrue(head.startswith(b"HTTP/1.1 101"), head)
        self.assertEqual(back, b"HELLO WEBSOCKET")

    def e2b(self, node, path):
        resp, body = node.exchange("GET", path, headers={"X-API-Key": node.key})
        return resp.status, json.loads(body) if body else None

    def test_session_attach_over_websocket(self):
        # Created through A (forwarded to B, which holds the session), attached through A.
        st, sess = self.a.request("POST", "/v1/sandboxes/%s/sessions" % self.sid,
                                  {"cmd": "read line; echo got:$line; read more; stty size;"
                                   " exit 7", "pty": True})
        self.assertEqual(st, 201, sess)
        self.assertIn(self.sid, sess["attach_url"])
        url = sess["attach_url"] + "?token=" + sess["attach_token"]
        # A wrong token is refused by B through A; without one, A refuses it itself.
        for bad in ("sat_" + "x" * 43, ""):
            ws = WebSocket(self.a.port, sess["attach_url"] + "?token=" + bad)
            ws.close()
            self.assertEqual(ws.status, 401, ws.body)
        # The session is B's: A does not hold it under the older path.
        st, r = self.a.request("GET", "/v1/attach/" + sess["id"], key=sess["attach_token"])
        self.assertEqual(st, 404, r)
        ws = WebSocket(self.a.port, url, timeout=60)
        self.assertEqual(ws.status, 101, ws.body)
        op, p = ws.recv()
        self.assertEqual((op, json.loads(p)["type"]), (1, "start"))
        ws.send_binary(b"typed\n")
        out = b""
        while b"got:typed" not in out:
            op, p = ws.recv()
            self.assertEqual(op, 2, p)
            out += p[1:]
        ws.send_json({"type": "resize", "rows": 33, "cols": 101})
        ws.send_binary(b"\n")
        events, more, _ = ws.collect()
        ws.close()
        self.assertIn(b"33 101", more, (events, out, more))
        self.assertEqual(events[-1]["type"], "exit", events)
        self.assertEqual(events[-1]["exit_code"], 7, events)
        # A session unknown everywhere: 404 from B through A.
        ws = WebSocket(self.a.port, "/v1/attach/%s/se%s?token=%s"
                       % (self.sid, "0" * 22, sess["attach_token"]))
        ws.close()
        self.assertEqual(ws.status, 404, ws.body)

    def test_e2b_metrics_and_disk_from_both_workers(self):
        path = "/sandboxes/metrics?sandbox_ids=%s,%s" % (self.a_sid, self.sid)
        st, r = self.e2b(self.a, path)
        self.assertEqual(st, 200, r)
        self.assertEqual(sorted(r["sandboxes"]), sorted([self.a_sid, self.sid]), r)
        for m in r["sandboxes"].values():
            self.assertGreater(m["memTotal"], 0, r)
            self.assertGreater(m["diskTotal"], 0, r)
        # B's own answer is the same set: each node gathers from the other.
        st, r = self.e2b(self.b, path)
        self.assertEqual((st, sorted(r["sandboxes"])), (200, sorted([self.a_sid, self.sid])))
        own = self.own_disk_sizes()
        for node in (self.a, self.b):
            for sid in (self.a_sid, self.sid):
                st, d = self.e2b(node, "/sandboxes/" + sid)
                self.assertEqual(st, 200, d)
                self.assertEqual(d["diskSizeMB"], own[sid], (node.port, sid, d))

    def own_disk_sizes(self):
        """Each sandbox's diskSizeMB as its own worker's detail gives it (non-zero)."""
        own = {}
        for node, sid in ((self.a, self.a_sid), (self.b, self.sid)):
            st, d = self.e2b(node, "/sandboxes/" + sid)
            self.assertEqual(st, 200, d)
            self.assertGreater(d["diskSizeMB"], 0, (node.port, sid, d))
            own[sid] = d["diskSizeMB"]
        return own

    def listed_disk_sizes(self, node):
        """diskSizeMB of both sandboxes in node's lists, v1 and v2 (path -> {id: size})."""
        out = {}
        for path in ("/sandboxes", "/v2/sandboxes?state=running&limit=100"):
            st, items = self.e2b(node, path)
            self.assertEqual(st, 200, items)
            out[path] = {it["sandboxID"]: it["diskSizeMB"] for it in items
                         if it["sandboxID"] in (self.a_sid, self.sid)}
        return out

    def test_e2b_list_disk_size_from_any_node(self):
        # Lists show every sandbox's disk size as its worker does, through either node: the
        # worker records it on the row, so no node asks another (issue 20).
        own = self.own_disk_sizes()
        for node in (self.a, self.b):
            for path, got in self.listed_disk_sizes(node).items():
                self.assertEqual(got, own, (node.port, path))

    def test_y_disk_size_of_a_row_from_before(self):
        # A row written before its worker recorded disk sizes (migration 16): a detail through
        # the other node asks the worker; a list there shows 0 for it. The worker, restarted as
        # after an upgrade (its VM outlives it), records the size, and lists show it again.
        own = self.own_disk_sizes()
        self.sql("UPDATE sandboxes SET disk_mb = NULL WHERE id = '%s'" % self.a_sid)
        st, d = self.e2b(self.b, "/sandboxes/" + self.a_sid)
        self.assertEqual((st, d["diskSizeMB"]), (200, own[self.a_sid]), d)
        for path, got in self.listed_disk_sizes(self.b).items():
            self.assertEqual(got, {self.a_sid: 0, self.sid: own[self.sid]}, path)
        self.a.kill()
        self.a.start(timeout=120)
        deadline = time.time() + 30 * MULT
        q = "SELECT coalesce(disk_mb, 0) FROM sandboxes WHERE id = '%s'" % self.a_sid
        while time.time() < deadline and self.sql(q) != str(own[self.a_sid]):
            time.sleep(0.2)
        self.assertEqual(self.sql(q), str(own[self.a_sid]))
        for path, got in self.listed_disk_sizes(self.b).items():
            self.assertEqual(got, own, path)

    def test_z_worker_silent(self):
        # B's row pointing at a socket that takes connections and never answers: the gathered
        # answers come within their bound, without B's figures; the disk size is the row's,
        # shown at once without B.
        own = self.own_disk_sizes()
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        self.sql("UPDATE workers SET address = '127.0.0.1:%d' WHERE id = '%s'"
                 % (silent.getsockname()[1], self.b_worker))
        try:
            t0 = time.time()
            st, r = self.e2b(self.a, "/sandboxes/metrics?sandbox_ids=%s,%s"
                             % (self.a_sid, self.sid))
            self.assertEqual((st, sorted(r["sandboxes"])), (200, [self.a_sid]), r)
            self.assertLess(time.time() - t0, 10 * MULT)
            t0 = time.time()
            st, d = self.e2b(self.a, "/sandboxes/" + self.sid)
            self.assertEqual((st, d["diskSizeMB"]), (200, own[self.sid]), d)
            for path, got in self.listed_disk_sizes(self.a).items():
                self.assertEqual(got, own, path)
            self.assertLess(time.time() - t0, 2 * MULT)
        finally:
            silent.close()
            self.sql("UPDATE workers SET address = '127.0.0.1:%d' WHERE id = '%s'"
                     % (self.b.port, self.b_worker))

    def test_z_worker_unreachable(self):
        # B's row pointing nowhere: A answers 502 naming the sandbox, at once.
        self.sql("UPDATE workers SET address = '127.0.0.1:1' WHERE id = '%s'" % self.b_worker)
        try:
            t0 = time.time()
            st, r = self.a.request("POST", "/v1/sandboxes/%s/commands" % self.sid,
                                   {"cmd": ["true"]})
            self.assertEqual(st, 502, r)
            self.assertIn(self.sid, r["error"]["message"])
            st, sess = self.b.request("POST", "/v1/sandboxes/%s/sessions" % self.sid,
                                      {"cmd": "true"})
            self.assertEqual(st, 201, sess)
            st, r = self.a.request("GET", sess["attach_url"], key=sess["attach_token"])
            self.assertEqual(st, 502, r)
            self.assertIn(self.sid, r["error"]["message"])
            self.assertLess(time.time() - t0, 10)
        finally:
            self.sql("UPDATE workers SET address = '127.0.0.1:%d' WHERE id = '%s'"
                     % (self.b.port, self.b_worker))


if __name__ == "__main__":
    unittest.main(verbosity=2)
