"""Credentials added outside the VM, end to end on a real microVM.

A team secret and a sandbox rule ("for api.cred.test, set Authorization to 'Bearer {secret}'")
make the host's egress proxy add the credential to the guest's requests: over HTTPS (the
proxy terminates TLS with the sandbox's CA, which the guest trusts, and re-originates it
with verification); plain HTTP to such a destination is refused. Test servers on the host's
loopback stand in for the destinations: spaced-test resolves their names to 127.0.0.1
(SPACE_TEST_EGRESS_HOSTS) and trusts their test CA (SPACE_TEST_UPSTREAM_CA); the shipped
spaced has neither.

A rule with "env" gives the guest's processes a placeholder (space-placeholder:<secret name>)
to send where the key would go; the proxy swaps the real value in, and when the rules drop
the env, later processes no longer have it.

Then the secret is searched for inside the guest: every file on every disk filesystem, the
raw root block device, every process's environment and memory (the agent's included). The
same search finds a decoy planted the way a leak would happen, so a clean result means
something.

Needs SP_TEST_DATA_DIR with a built `base` template (with the egress-capable agent), root,
PostgreSQL and the openssl command.
"""
import base64
import http.server
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import KEEP, MULT, Platform, vm_skip_reason, wait_s  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
SECRET = "cred-" + base64.b32encode(os.urandom(15)).decode().lower()
DECOY = "decoy-" + base64.b32encode(os.urandom(15)).decode().lower()


def skip_reason():
    reason = vm_skip_reason(DATA)
    if reason is not None:
        return reason
    if shutil.which("openssl") is None:
        return "the openssl command is not installed"
    if not os.environ.get("SPACED_TEST"):
        return "SPACED_TEST (spaced-test) is not set"
    return None


def openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True, capture_output=True)


def make_pki(d):
    """A test CA with a leaf for api.cred.test, and a self-signed rogue for rogue.cred.test."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=space e2e upstream CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign", cwd=d)
    openssl("req", *ec, "-keyout", "api.key", "-out", "api.csr", "-subj", "/CN=api.cred.test",
            cwd=d)
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("subjectAltName=DNS:api.cred.test\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "api.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "api.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    openssl("req", "-x509", *ec, "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2",
            "-subj", "/CN=rogue.cred.test", "-addext", "subjectAltName=DNS:rogue.cred.test",
            cwd=d)


class Recorder:
    """Requests a test server saw: path, Authorization values, connection."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = []

    def add(self, r):
        with self.lock:
            self.requests.append(r)

    def snapshot(self):
        with self.lock:
            return list(self.requests)


def serve(recorder, ctx=None):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def log_message(self, *a):
            pass

        def handle_one(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            recorder.add({"path": self.path, "auth": self.headers.get_all("Authorization") or [],
                          "conn": id(self.connection), "body": len(body)})
            out = b"ok %s\n" % self.path.encode()  # never the credential
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = handle_one
        do_POST = handle_one

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    if ctx is not None:
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


SCAN = r'''
import os, sys, time
needle = bytes.fromhex(sys.argv[1])
me = str(os.getpid())
parent = str(os.getppid())
hits, scanned = [], {"files": 0, "bytes": 0, "procs": 0, "mem": 0, "disk": 0}
t0 = time.time()

def phase(what):
    # on stderr as it goes: a scan cut off by its timeout still says where it was
    sys.stderr.write("%.1f s: %s\n" % (time.time() - t0, what))
    sys.stderr.flush()

def scan_stream(f, what):
    prev = b""
    while True:
        b = f.read(4 << 20)
        if not b:
            return False
        scanned["bytes"] += len(b)
        if needle in prev + b:
            hits.append(what)
            return True
        prev = b[-len(needle):]

# every file of the disk-backed and tmpfs filesystems (not proc, sys, dev)
phase("files")
for root, dirs, files in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
    for name in files:
        p = os.path.join(root, name)
        try:
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            if os.path.getsize(p) > (64 << 20):
                phase("file " + p)
            with open(p, "rb") as f:
                scanned["files"] += 1
                scan_stream(f, "file:" + p)
        except OSError:
            pass

# every process but this scan and its shell: environment, command line, memory
agent = None
phase("processes")
for pid in os.listdir("/proc"):
    if not pid.isdigit() or pid in (me, parent):
        continue
    phase("process %s" % pid)
    try:
        exe = os.readlink("/proc/%s/exe" % pid)
    except OSError:
        exe = ""
    if exe.endswith("space-agent"):
        agent = pid
    for what in ("environ", "cmdline"):
        try:
            with open("/proc/%s/%s" % (pid, what), "rb") as f:
                if needle in f.read():
                    hits.append("%s:%s:%s" % (what, pid, exe))
        except OSError:
            pass
    try:
        with open("/proc/%s/maps" % pid) as f:
            maps = f.read().splitlines()
        mem = open("/proc/%s/mem" % pid, "rb", 0)
    except OSError:
        continue
    scanned["procs"] += 1
    for line in maps:
        parts = line.split()
        if "r" not in parts[1] or "vsyscall" in line:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except (OSError, ValueError, OverflowError):
            continue
        scanned["mem"] += len(data)
        if needle in data:
            hits.append("mem:%s:%s:%s" % (pid, exe, parts[-1] if len(parts) > 5 else "anon"))
    mem.close()

# the raw root block device: deleted files and free blocks too
dev = None
with open("/proc/mounts") as f:
    for line in f:
        src, mnt = line.split()[:2]
        if mnt == "/" and src.startswith("/dev/"):
            dev = src
if dev and os.path.exists(dev):
    phase("disk " + dev)
    with open(dev, "rb") as f:
        t = time.time()
        scan_stream(f, "disk:" + dev)
        scanned["disk"] = int(time.time() - t)
phase("done")
print("AGENT", agent)
print("SCANNED", " ".join("%s=%d" % kv for kv in sorted(scanned.items())))
for h in hits:
    print("HIT", h)
'''


@unittest.skipIf(skip_reason(), skip_reason())
class CredentialsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="sp-cred-")
        make_pki(cls.tmp)
        cls.rec = Recorder()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(os.path.join(cls.tmp, "api.pem"), os.path.join(cls.tmp, "api.key"))
        cls.tls = serve(cls.rec, ctx)
        cls.plain = serve(cls.rec)
        cls.rogue_rec = Recorder()
        rctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        rctx.load_cert_chain(os.path.join(cls.tmp, "rogue.pem"),
                             os.path.join(cls.tmp, "rogue.key"))
        cls.rogue = serve(cls.rogue_rec, rctx)
        hosts = os.path.join(cls.tmp, "hosts")
        with open(hosts, "w") as f:
            f.write("127.0.0.1 api.cred.test plain.cred.test rogue.cred.test\n")
        cls.master = base64.b64encode(os.urandom(32)).decode()
        cls.p = Platform(teams=(None,), start=False, binary=os.environ["SPACED_TEST"],
                         data_dir=DATA,
                         env={"SPACE_ACCEL": os.environ.get("SPACE_ACCEL", "auto"),
                              "SPACE_MASTER_KEY": cls.master,
                              "SPACE_TEST_UPSTREAM_CA": os.path.join(cls.tmp, "ca.pem"),
                              "SPACE_TEST_EGRESS_HOSTS": hosts})
        cls.s, cls.pg = cls.p.s, cls.p.pg
        cls.sids = []
        cls.s.start()

    @classmethod
    def tearDownClass(cls):
        for sid in cls.sids:  # VMs outlive spaced: delete them first
            try:
                cls.s.request("DELETE", "/v1/sandboxes/%s?wait=%d" % (sid, wait_s(60)),
                              timeout=70 * MULT)
            except OSError:
                pass
        cls.p.destroy()
        for srv in (cls.tls, cls.plain, cls.rogue):
            srv.shutdown()
        if not KEEP:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def req(self, *a, **kw):
        st, r = self.s.request(*a, **kw)
        self.assertNotIn(SECRET, json.dumps(r) if not isinstance(r, (bytes, str)) else str(r))
        return st, r

    def run_cmd(self, sid, cmd, timeout_s=120, env=None):
        body = {"cmd": cmd, "timeout_s": int(timeout_s * MULT)}
        if env:
            body["env"] = env
        st, r = self.req("POST", "/v1/sandboxes/%s/commands" % sid, body,
                         timeout=timeout_s * MULT + 30)
        self.assertEqual(st, 200, r)
        return r

    def create(self, **fields):
        st, r = self.req("POST", "/v1/sandboxes?wait=%d" % wait_s(120),
                         dict(template="base", **fields), timeout=130 * MULT)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["operation"]["status"], "succeeded", (r, self.s.read_log()))
        self.sids.append(r["sandbox"]["id"])
        return r["sandbox"]["id"]

    def scan(self, sid, needle):
        st, _ = self.req("PUT", "/v1/sandboxes/%s/files?path=/root/scan.py" % sid,
                         raw=SCAN.encode())
        self.assertEqual(st, 200)
        r = self.run_cmd(sid, "python3 /root/scan.py %s" % needle.encode().hex(), timeout_s=900)
        self.assertEqual(r["exit_code"], 0, r)
        lines = r["stdout"].splitlines()
        hits = [ln[4:] for ln in lines if ln.startswith("HIT ")]
        agent = [ln.split()[1] for ln in lines if ln.startswith("AGENT ")][0]
        scanned = [ln for ln in lines if ln.startswith("SCANNED ")][0]
        return hits, agent, scanned

    def test_injection_and_no_trace_in_the_guest(self):
        st, r = self.req("POST", "/v1/secrets", {"name": "API_TOKEN", "value": SECRET})
        self.assertEqual(st, 201, r)
        tport, pport, rport = (self.tls.server_address[1], self.plain.server_address[1],
                               self.rogue.server_address[1])
        rules = [{"host": "api.cred.test", "header": "Authorization", "secret": "API_TOKEN",
                  "format": "Bearer {secret}", "env": "OPENAI_API_KEY"},
                 {"host": "plain.cred.test", "header": "Authorization", "secret": "API_TOKEN",
                  "format": "Bearer {secret}"},
                 {"host": "rogue.cred.test", "header": "Authorization", "secret": "API_TOKEN"}]
        sid = self.create(credentials=rules, egress={"allow": ["127.0.0.1"]})
        # The proxy settings and the sandbox CA reach the guest right after boot; wait for
        # both (and say so) rather than race them.
        t0 = time.time()
        ready = ("test -s /usr/local/share/ca-certificates/space-egress.crt"
                 " && test -n \"$HTTPS_PROXY\" && test -n \"$OPENAI_API_KEY\"")
        while self.run_cmd(sid, ready)["exit_code"] != 0:
            self.assertLess(time.time() - t0, 30 * MULT, "no egress config or CA in the guest")
            time.sleep(0.2)
        print("\nguest ready for egress %.2f s after create" % (time.time() - t0), file=sys.stderr)

        # The rule's env: a placeholder naming the secret, which the proxy swaps for the value.
        r = self.run_cmd(sid, "echo \"$OPENAI_API_KEY\"; sh -lc 'echo \"$OPENAI_API_KEY\"'")
        self.assertEqual(r["stdout"], "space-placeholder:API_TOKEN\n" * 2, r)
        r = self.run_cmd(sid, "curl -sS --fail-with-body "
                              "-H \"Authorization: Bearer $OPENAI_API_KEY\" "
                              "https://api.cred.test:%d/ph" % tport)
        self.assertEqual((r["exit_code"], r["stdout"]), (0, "ok /ph\n"), r)
        auth = [q["auth"] for q in self.rec.snapshot() if q["path"] == "/ph"]
        self.assertEqual(auth, [["Bearer " + SECRET]])

        # HTTPS, two requests on one kept-alive connection, the guest sending a placeholder.
        r = self.run_cmd(sid, "curl -sS --fail-with-body -H 'Authorization: Bearer placeholder' "
                              "https://api.cred.test:%d/one https://api.cred.test:%d/two"
                         % (tport, tport))
        self.assertEqual(r["exit_code"], 0, ("is the guest's loopback up? the agent's proxy "
                                             "listens on 127.0.0.1", r, self.s.read_log()))
        self.assertEqual(r["stdout"], "ok /one\nok /two\n")
        # Python's own HTTPS stack (urllib, proxy from the environment) trusts it too.
        r = self.run_cmd(sid, "python3 -c \"import urllib.request as u; "
                              "print(u.urlopen('https://api.cred.test:%d/py').read().decode())\""
                         % tport)
        self.assertEqual(r["exit_code"], 0, r)
        self.assertIn("ok /py", r["stdout"])
        # Plain HTTP to a destination with a rule: refused, so the secret never crosses the
        # network in clear, and the destination hears nothing.
        r = self.run_cmd(sid, "curl -sS -o /tmp/plain.txt -w '%%{http_code}' "
                              "http://plain.cred.test:%d/plain; cat /tmp/plain.txt" % pport)
        self.assertTrue(r["stdout"].startswith("403"), r)
        self.assertIn("over HTTPS only", r["stdout"])

        seen = {q["path"]: q for q in self.rec.snapshot()}
        self.assertNotIn("/plain", seen)
        for path in ("/one", "/two", "/py"):
            self.assertIn(path, seen)
            self.assertEqual(seen[path]["auth"], ["Bearer " + SECRET], path)
        self.assertEqual(seen["/one"]["conn"], seen["/two"]["conn"])  # keep-alive upstream

        # A destination that fails verification: a 502 saying why, and it never hears a request.
        r = self.run_cmd(sid, "curl -sS -o /tmp/rogue.txt -w '%%{http_code}' "
                              "https://rogue.cred.test:%d/x; cat /tmp/rogue.txt" % rport)
        self.assertTrue(r["stdout"].startswith("502"), r)
        self.assertIn("certificate verification failed", r["stdout"])
        self.assertEqual(self.rogue_rec.snapshot(), [])

        # The guest trusts the sandbox CA through its files and environment.
        r = self.run_cmd(sid, "cat /usr/local/share/ca-certificates/space-egress.crt; "
                              "echo SSL_CERT_FILE=$SSL_CERT_FILE")
        self.assertIn("BEGIN CERTIFICATE", r["stdout"])
        self.assertIn("SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt", r["stdout"])

        # A decoy placed the way a leak would be: in a file, in a process's environment, and
        # in the agent's memory (it keeps a running process's command line for listings).
        # The search must find it there...
        r = self.run_cmd(sid, "printf %%s %s > /var/tmp/decoy.txt" % DECOY)
        self.assertEqual(r["exit_code"], 0, r)
        st, r = self.req("POST", "/v1/sandboxes/%s/commands" % sid,
                         {"cmd": "exec sleep 900 # %s" % DECOY, "background": True,
                          "env": {"DECOY_ENV": DECOY}})
        self.assertIn(st, (200, 202), r)
        hits, agent, scanned = self.scan(sid, DECOY)
        self.assertTrue(agent, scanned)
        kinds = {h.split(":")[0] for h in hits}
        self.assertIn("file", kinds, (hits, scanned))
        self.assertIn("environ", kinds, (hits, scanned))
        self.assertTrue(any(h.startswith("mem:%s:" % agent) for h in hits), (hits, agent))
        # ...and finds nothing of the secret anywhere.
        hits, agent, scanned = self.scan(sid, SECRET)
        print("\nscan: %s agent=%s" % (scanned, agent), file=sys.stderr)
        self.assertEqual(hits, [], scanned)

        # Nor does any API answer, or the server's log.
        st, r = self.req("GET", "/v1/sandboxes/%s/credentials" % sid)
        self.assertEqual(st, 200)
        self.assertEqual(r["credentials"][0].get("env"), "OPENAI_API_KEY", r)
        self.assertNotIn(SECRET, self.s.read_log())

        # Rules without env: later processes no longer have the placeholder (nor do login
        # shells, which read /etc/profile.d).
        for rule in rules:
            rule.pop("env", None)
        st, r = self.req("PUT", "/v1/sandboxes/%s/credentials" % sid,
                         raw=json.dumps({"credentials": rules}).encode())
        self.assertEqual(st, 200, r)
        t0 = time.time()
        gone = "test -z \"${OPENAI_API_KEY+x}\" && sh -lc 'test -z \"${OPENAI_API_KEY+x}\"'"
        while self.run_cmd(sid, gone)["exit_code"] != 0:
            self.assertLess(time.time() - t0, 30 * MULT, "the placeholder stayed in the guest")
            time.sleep(0.2)
        print("placeholder gone %.2f s after PUT" % (time.time() - t0), file=sys.stderr)

    def test_rules_added_to_a_running_sandbox(self):
        """No rule at boot (no CA in the guest); a PUT adds one: the worker creates the CA,
        installs it in the running guest, and injects from then on; a rotated secret is used
        from its next request."""
        st, r = self.req("POST", "/v1/secrets", {"name": "LATE_TOKEN", "value": SECRET + "-late"})
        self.assertEqual(st, 201, r)
        sid = self.create(egress={"allow": ["127.0.0.1"]})
        r = self.run_cmd(sid, "test -e /usr/local/share/ca-certificates/space-egress.crt")
        self.assertNotEqual(r["exit_code"], 0)  # lazily: no rule, no CA
        r = self.run_cmd(sid, "test -z \"${LATE_KEY+x}\"")
        self.assertEqual(r["exit_code"], 0, r)
        rules = [{"host": "api.cred.test", "header": "Authorization", "secret": "LATE_TOKEN",
                  "env": "LATE_KEY"}]
        st, r = self.req("PUT", "/v1/sandboxes/%s/credentials" % sid,
                         raw=json.dumps({"credentials": rules}).encode())
        self.assertEqual(st, 200, r)
        t0 = time.time()
        while self.run_cmd(sid, "test -s /usr/local/share/ca-certificates/space-egress.crt"
                           " && test -n \"$LATE_KEY\"")["exit_code"] != 0:
            self.assertLess(time.time() - t0, 30 * MULT, "the CA or placeholder never reached "
                            "the guest")
            time.sleep(0.2)
        r = self.run_cmd(sid, "echo \"$LATE_KEY\"")
        self.assertEqual(r["stdout"], "space-placeholder:LATE_TOKEN\n", r)
        port = self.tls.server_address[1]
        url = "https://api.cred.test:%d/late" % port
        r = self.run_cmd(sid, "curl -sS --fail-with-body %s" % url)
        self.assertEqual(r["exit_code"], 0, r)
        st, _ = self.req("PUT", "/v1/secrets/LATE_TOKEN",
                         raw=json.dumps({"value": SECRET + "-rotated"}).encode())
        self.assertEqual(st, 200)
        t0 = time.time()
        while True:
            self.run_cmd(sid, "curl -sS --fail-with-body %s2" % url)
            auth = [q["auth"] for q in self.rec.snapshot() if q["path"] == "/late2"]
            if auth and auth[-1] == [SECRET + "-rotated"]:
                break
            self.assertLess(time.time() - t0, 30 * MULT, auth)
            time.sleep(0.2)
        seen = [q["auth"] for q in self.rec.snapshot() if q["path"] == "/late"]
        self.assertEqual(seen, [[SECRET + "-late"]])


if __name__ == "__main__":
    unittest.main()
