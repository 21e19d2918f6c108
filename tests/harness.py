"""Test harness shared by the HTTP-level suites: a private PostgreSQL cluster,
a spaced process, and a small JSON HTTP client (requests, streams, creates and
commands); the start-up every suite shares (Platform) and the suite classes on
it (PlatformTest on the test driver, VmSuite on real microVMs). Standard library
only.

Environment:
  SPACED, SPACED_TEST   paths of the built binaries (set by ctest)
  SP_TEST_KEEP=1        keep temporary directories and logs
  SP_TEST_TIMEOUT_MULT  stretch timeouts on slow machines
"""
import http.client
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse

MULT = float(os.environ.get("SP_TEST_TIMEOUT_MULT", "1"))
KEEP = os.environ.get("SP_TEST_KEEP") == "1"


def wait_s(seconds):
    """A ?wait= value: seconds stretched by SP_TEST_TIMEOUT_MULT, within the API's 300 s cap
    (a longer wait is then a client-side loop, not a 400)."""
    return min(300, int(seconds * MULT))


def wait_until(cond, what, timeout=30, step=0.1):
    """Polls cond() every step seconds until it is true; fails (AssertionError naming what)
    after timeout seconds, stretched by SP_TEST_TIMEOUT_MULT."""
    deadline = time.time() + timeout * MULT
    while time.time() < deadline:
        if cond():
            return
        time.sleep(step)
    raise AssertionError("timed out waiting for " + what)


def pg_bindir():
    base = "/usr/lib/postgresql"
    if os.path.isdir(base):
        vers = sorted((v for v in os.listdir(base) if v.isdigit()), key=int)
        if vers:
            return os.path.join(base, vers[-1], "bin")
    return None


def skip_unless_pg(testcase_cls):
    import unittest
    if pg_bindir() is None:
        return unittest.skip("PostgreSQL server binaries are not installed")(testcase_cls)
    return testcase_cls


def vm_skip_reason(data):
    """Why a suite that boots VMs from the templates in data (SP_TEST_DATA_DIR, where the
    e2e.template fixture builds them) cannot run here, or None: the base template, root and
    PostgreSQL are needed."""
    if data is None or not os.path.exists(os.path.join(data, "templates", "base", "current")):
        return "SP_TEST_DATA_DIR has no built base template"
    if os.geteuid() != 0:
        return "needs root"
    if pg_bindir() is None:
        return "PostgreSQL is not installed"
    return None


def kernel_python():
    """A Python on PATH (or this one) that can run IPython kernels (ipykernel and jupyter_client,
    the host test packages), else None."""
    seen, cands = set(), [sys.executable]
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cands.append(os.path.join(d, "python3"))
    for c in cands:
        real = os.path.realpath(c)
        if real in seen or not os.access(c, os.X_OK):
            continue
        seen.add(real)
        r = subprocess.run([c, "-c", "import ipykernel, jupyter_client"],
                           capture_output=True, timeout=60)
        if r.returncode == 0:
            return c
    return None


def skip_unless_agent(testcase_cls):
    """For suites that run commands through space-agent-host (the test driver starts one per
    sandbox when SPACE_FAKE_AGENT names it; ctest sets it): it switches users, so root only."""
    import unittest
    if not os.environ.get("SPACE_FAKE_AGENT"):
        return unittest.skip("SPACE_FAKE_AGENT (space-agent-host) is not set")(testcase_cls)
    if os.geteuid() != 0:
        return unittest.skip("needs root: the agent switches users")(testcase_cls)
    return testcase_cls


class PeakRss:
    """`with PeakRss(s) as p:` samples s.rss_kb() every `every` s in a thread while the block
    runs; p.kib is the highest seen (0 when s is None: nothing is sampled)."""

    def __init__(self, s, every=0.05):
        import threading
        self.s, self.every, self.kib = s, every, 0
        self.done = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.done.wait(self.every):
            self.kib = max(self.kib, self.s.rss_kb())

    def __enter__(self):
        if self.s is not None:
            self.t.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.s is not None:
            self.t.join()
        return False


def read_number_cmd(path):
    """A guest shell command that prints the number in path, read until the file holds one
    (for at most 5 s): a counter loop's `echo $i > path` truncates before it writes, and a
    read, a pause or a snapshot can land in between."""
    return ('for k in $(seq 1 100); do v=$(cat %s 2>/dev/null); [ -n "$v" ] && break; '
            'sleep 0.05; done; echo "$v"' % path)


def _port_free(port, kind):
    s = socket.socket(socket.AF_INET, kind)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port():
    """A loopback port free for TCP and UDP, below the kernel's ephemeral range: a port taken
    from that range and closed may go to an outgoing connection of a suite running beside
    this one before the server it is meant for binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    base = 10000 if lo > 11024 else 1024
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(base, max(lo, base + 1))
        if _port_free(port, socket.SOCK_STREAM) and _port_free(port, socket.SOCK_DGRAM):
            return port
    raise RuntimeError("no free port below the ephemeral range")


def connect_local(port, timeout, rcvbuf=None, host="127.0.0.1"):
    """A TCP connection to host:port (loopback by default). rcvbuf fixes its receive buffer (set before the
    connect): otherwise the kernel grows it, up to tcp_rmem's maximum (32 MiB here), for a
    reader that stopped, hiding whether the server holds the sender back."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
    except OSError:
        s.close()
        raise
    return s


def tmpdir(prefix):
    d = tempfile.mkdtemp(prefix=prefix)
    os.chmod(d, 0o711)
    return d


class PgCluster:
    """A throwaway PostgreSQL cluster on a unix socket, run as `postgres` when we are root.
    listen: also TCP on that address (port 5432, trust from its /24), and url names it, for
    nodes in other network namespaces; root: the cluster's directory (default a new temp dir).
    primary: instead of a new cluster, a streaming-replication standby of that one (a base
    backup of it, read-only until promote(); see standby())."""

    def __init__(self, listen=None, root=None, primary=None):
        self.listen = listen
        if root is not None:
            os.makedirs(root, mode=0o711)
        self.root = root or tmpdir("sp-pg-")
        self.data = os.path.join(self.root, "data")
        self.sock = os.path.join(self.root, "run")
        self.bindir = pg_bindir()
        self.as_postgres = os.geteuid() == 0
        os.makedirs(self.sock)
        if self.as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            os.chown(self.sock, pw.pw_uid, pw.pw_gid)
        if primary is not None:
            # the primary's files and settings, replication configured (-R: standby.signal and
            # primary_conninfo); a standby that is promoted waits for no standby of its own
            self._run(["pg_basebackup", "-h", primary.sock, "-U", "postgres", "-D", self.data,
                       "-R", "-X", "stream", "-c", "fast"])
            with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
                f.write("listen_addresses = '%s'\nunix_socket_directories = '%s'\n"
                        "synchronous_standby_names = ''\n" % (listen or "", self.sock))
            self.start()
            return
        self._run(["initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--locale=C",
                   "-E", "UTF8"])
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write("listen_addresses = '%s'\nunix_socket_directories = '%s'\nfsync = off\n"
                    % (listen or "", self.sock))
        if listen:
            with open(os.path.join(self.data, "pg_hba.conf"), "a") as f:
                f.write("host all all %s.0/24 trust\n" % listen.rsplit(".", 1)[0])
        self.start()
        self._run(["createdb", "-h", self.sock, "-U", "postgres", "space"])

    def standby(self, synchronous=True):
        """A new cluster streaming from this one (PgCluster(primary=self)). synchronous: this
        one's commits wait until the standby has them, so a failover loses no acknowledged
        write (synchronous_standby_names '*', reloaded)."""
        sb = PgCluster(primary=self)
        if synchronous:
            with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
                f.write("synchronous_standby_names = '*'\n")
            self._run(["pg_ctl", "-D", self.data, "reload"])
        return sb

    def _run(self, argv):
        argv = [os.path.join(self.bindir, argv[0])] + argv[1:]
        if self.as_postgres:
            argv = ["runuser", "-u", "postgres", "--"] + argv
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       cwd="/")

    @property
    def url(self):
        return self.db_url("space")

    def db_url(self, name):
        return "host=%s port=5432 dbname=%s user=postgres" % (self.listen or self.sock, name)

    def createdb(self, name):
        self._run(["createdb", "-h", self.sock, "-U", "postgres", name])
        return self.db_url(name)

    def start(self):
        self._run(["pg_ctl", "-D", self.data, "-l", os.path.join(self.root, "pg.log"), "-w",
                   "start"])

    def stop(self):
        self._run(["pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop"])

    def crash(self):
        """Stops at once, as a crash would (immediate mode: no checkpoint, clients cut off)."""
        self._run(["pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop"])

    def promote(self):
        """A standby becomes a primary (read-write), waiting until it is."""
        self._run(["pg_ctl", "-D", self.data, "-w", "promote"])

    def destroy(self):
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        if not KEEP:
            shutil.rmtree(self.root, ignore_errors=True)


class Spaced:
    """One spaced process; stdout/stderr go to a log file in its data dir. It listens on
    host:port (default loopback and a free port); wrap is an argv prefix its serve runs under
    (e.g. nsenter into a network namespace: it must exec in place, so that proc is spaced)."""

    def __init__(self, binary=None, data_dir=None, database_url=None, runtime=None, env=None,
                 args=(), host="127.0.0.1", port=None, wrap=()):
        self.binary = binary or os.environ.get("SPACED_TEST") or os.environ["SPACED"]
        self.owns_data = data_dir is None  # a shared data dir (templates) is never removed
        self.data_dir = data_dir or tmpdir("sp-data-")
        self.database_url = database_url
        self.runtime = runtime
        self.args = list(args)  # more `serve` options
        self.host = host
        self.port = port or free_port()
        self.wrap = list(wrap)
        self.env = dict(os.environ, **(env or {}))
        self.args = list(args)  # more `serve` options (e.g. --no-jail)
        self.proc = None
        self.key = None

    def cli(self, *args, check=True):
        argv = [self.binary] + list(args) + ["--data-dir", self.data_dir]
        if self.database_url:
            argv += ["--database-url", self.database_url]
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError("spaced %s failed: %s" % (args, r.stderr))
        return r

    def start(self, timeout=60, wait=True):
        """Starts spaced; wait: until /healthz answers 200 (False: returns once spawned)."""
        argv = self.wrap + [self.binary, "serve", "--listen", "%s:%d" % (self.host, self.port),
                "--data-dir", self.data_dir]
        if self.database_url:
            argv += ["--database-url", self.database_url]
        if self.runtime:
            argv += ["--runtime", self.runtime]
        argv += self.args
        self.log_path = os.path.join(self.data_dir, "spaced-%d.log" % int(time.time() * 1000))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        if not wait:
            return self
        deadline = time.time() + timeout * MULT
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("spaced exited with %d:\n%s" % (self.proc.returncode,
                                                                     self.read_log()))
            try:
                st, _ = self.request("GET", "/healthz")
                if st == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        else:
            raise AssertionError("spaced did not come up:\n" + self.read_log())
        keyfile = os.path.join(self.data_dir, "api-key")
        if self.key is None and os.path.exists(keyfile):
            with open(keyfile) as f:
                self.key = f.read().strip()
        return self

    def read_log(self):
        try:
            with open(self.log_path) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60 * MULT)
        self.proc = None
        if getattr(self, "log", None):
            self.log.close()
            self.log = None

    def stop(self):
        self.kill(signal.SIGTERM)

    def kill_fake_agents(self):
        """The test driver's agents (SPACE_FAKE_AGENT) outlive spaced, like VMs: end them."""
        fake = os.path.join(self.data_dir, "fake")
        for name in os.listdir(fake) if os.path.isdir(fake) else []:
            if name.endswith(".pid"):
                try:
                    with open(os.path.join(fake, name)) as f:
                        os.kill(int(f.read().strip()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass

    def destroy(self):
        if self.proc is not None and self.proc.poll() is not None:
            # it died on its own (a crash, an ASan report): what it said last, for the CI log
            print("spaced (%s) exited with %s before its suite ended; the end of its log:\n%s"
                  % (self.log_path, self.proc.returncode, self.read_log()), file=sys.stderr)
        self.kill(signal.SIGTERM)
        self.kill_fake_agents()
        if not KEEP and self.owns_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def exchange(self, method, path, body=None, raw=None, headers=None, timeout=30):
        """One HTTP/1.1 request on a connection of its own: (the response, its body's bytes).
        body goes as JSON, else raw (bytes) as it is; headers as given, nothing added but the
        JSON Content-Type."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout * MULT)
        h = dict(headers or {})
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            h["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=h)
            r = conn.getresponse()
            return r, r.read()
        finally:
            conn.close()

    def open_stream(self, method, path, body=None, key=None, raw=None, headers=None, timeout=30,
                    rcvbuf=None):
        """Sends one request on a connection of its own and returns (the connection, the
        response) with the body unread, for a stream (NDJSON) read as it comes; the caller
        closes the connection. body goes as JSON, else raw as it is; key is the bearer token
        (None: self.key; False or "": none); headers are added as given; rcvbuf as for
        connect_local."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout * MULT)
        if rcvbuf is not None:
            conn.sock = connect_local(self.port, timeout * MULT, rcvbuf, self.host)
        h = dict(headers or {})
        k = self.key if key is None else key
        if k:
            h["Authorization"] = "Bearer " + k
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            h["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=h)
        return conn, conn.getresponse()

    def request(self, method, path, body=None, key=None, raw=None, headers=None, timeout=30):
        h = dict(headers or {})
        k = key if key is not None else self.key
        if k:
            h["Authorization"] = "Bearer " + k
        r, text = self.exchange(method, path, body, raw, h, timeout)
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = text
        return r.status, parsed

    def wait_activity(self, sid, before, timeout=5):
        """Sandbox sid's record once its last_activity_at is later than before's (a record read
        earlier), polled every 0.1 s; after timeout seconds, the last one read."""
        deadline = time.time() + timeout * MULT
        while True:
            st, sb = self.request("GET", "/v1/sandboxes/" + sid)
            if sb["last_activity_at"] > before["last_activity_at"] or time.time() >= deadline:
                return sb
            time.sleep(0.1)

    def rss_kb(self):
        """spaced's resident memory, KiB (0 when /proc does not say)."""
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def wait_op(self, op_id, timeout=30):
        st, op = self.request("GET", "/v1/operations/%s?wait=%d" % (op_id, wait_s(timeout)),
                              timeout=timeout + 10)
        assert st == 200, (st, op)
        return op

    def delete_quietly(self, sid):
        """Deletes a sandbox in a test's cleanup, after a failure too: a VM left running would
        be re-adopted by every later spaced on the data dir. A deleted sandbox answers 404; a
        spaced that is down leaves the VM to the next one."""
        try:
            self.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
        except (OSError, http.client.HTTPException):
            pass

    def create(self, template="base", wait=True, **fields):
        body = dict(template=template, **fields)
        st, r = self.request("POST", "/v1/sandboxes", body)
        assert st == 202, (st, r)
        if wait:
            op = self.wait_op(r["operation"]["id"])
            assert op["status"] == "succeeded", op
        return r["sandbox"]["id"], r["operation"]["id"]

    def command(self, sid, cmd, **fields):
        """Runs cmd in sandbox sid (POST /v1/sandboxes/{sid}/commands, more body fields as
        given; up to 120 s): its result (stdout, stderr, exit_code), which must come with a 200."""
        st, c = self.request("POST", "/v1/sandboxes/%s/commands" % sid, dict(cmd=cmd, **fields),
                             timeout=120)
        assert st == 200, (st, c)
        return c

    def create_ready(self, wait=120, key=None, **body):
        """POST /v1/sandboxes?wait= (wait seconds, stretched by SP_TEST_TIMEOUT_MULT) with body
        as given (no template added): the sandbox's id once its create succeeded; fails the test
        (with spaced's log) otherwise. For VM suites, whose creates take seconds to minutes."""
        st, r = self.request("POST", "/v1/sandboxes?wait=%d" % wait_s(wait), body, key=key,
                             timeout=(wait + 20) * MULT)
        assert st == 200, (st, r)
        assert r["operation"]["status"] == "succeeded", (r, self.read_log())
        return r["sandbox"]["id"]


def q(s):
    return urllib.parse.quote(s, safe="")


class Platform:
    """The start-up every Python suite shares: a private PostgreSQL and one spaced on it, with
    one API key per team made before the start (keys[team]; spaced.key is the first team's;
    a team of None is the default team).

        p = Platform(teams=("alpha", "beta"), runtime="test", env={...})   # started
        p.s.request(...); p.keys["beta"]
        p.destroy()                                                       # both stopped

    Everything else (binary, data_dir, runtime, env, args) goes to Spaced. start=False leaves
    spaced stopped (a suite that adds keys or files first calls p.s.start())."""

    def __init__(self, teams=("alpha",), start=True, **spaced_kw):
        self.pg = PgCluster()
        self.s = None
        try:
            self.s = Spaced(database_url=self.pg.url, **spaced_kw)
            self.keys = {t: self.s.cli("keys", "create", *(["--team", t] if t else []))
                         .stdout.strip() for t in teams}
            self.s.key = self.keys[teams[0]] if teams else None
            if start:
                self.s.start()
        except BaseException:
            self.destroy()
            raise

    def destroy(self):
        if self.s is not None:
            self.s.destroy()
        self.pg.destroy()


class VmSuite(unittest.TestCase):
    """A suite class on real microVMs: one Platform for the class, SPACED on the templates in
    SP_TEST_DATA_DIR, with the class's TEAMS (cls.s.key is the first's) and ARGS (more `serve`
    options; a subclass may set cls.ARGS before super().setUpClass()). When the class ends, the
    sandboxes made with self.create are deleted, then the TEMPLATES the suite builds (the data
    dir is shared), then spaced and PostgreSQL stop. A subclass that needs more calls
    super().setUpClass() and super().tearDownClass()."""

    TEAMS = ("alpha",)
    ARGS = ()
    TEMPLATES = ()

    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=cls.TEAMS, binary=os.environ["SPACED"],
                         data_dir=os.environ.get("SP_TEST_DATA_DIR"), args=list(cls.ARGS))
        cls.s = cls.p.s
        cls.sids = []

    @classmethod
    def delete_sandboxes(cls):
        """Deletes what self.create made (a VM left running would be re-adopted by every later
        spaced on the shared data dir)."""
        for sid in cls.sids:
            cls.s.delete_quietly(sid)

    @classmethod
    def tearDownClass(cls):
        cls.delete_sandboxes()  # first: a template in use is not deleted
        for name in cls.TEMPLATES:
            try:
                cls.s.request("DELETE", "/v1/templates/" + name, timeout=30)
            except OSError:
                pass
        cls.p.destroy()

    def create(self, template=None, **body):
        """A sandbox (of template, else as body says) up within 240 s: its id."""
        if template is not None:
            body["template"] = template
        sid = self.s.create_ready(wait=240, **body)
        self.sids.append(sid)
        return sid


class PlatformTest(unittest.TestCase):
    """A suite class on one Platform, started for the class: teams alpha (cls.s.key) and beta
    (cls.other_key), the test driver, SPACE_FAKE_DELAY_MS=20 and the class's ENV. A subclass
    that needs more calls super().setUpClass() first (and super().tearDownClass())."""

    ENV = {}

    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=("alpha", "beta"), runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20", **cls.ENV})
        cls.s = cls.p.s
        cls.other_key = cls.p.keys["beta"]

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()


_left = {}  # bytes read past a response, by socket (pipelined responses)


def read_response(sock, timeout=10):
    """One HTTP/1 response from sock: (status, headers dict, body bytes)."""
    sock.settimeout(timeout * MULT)
    data = _left.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("connection closed before a response: %r" % data)
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    def more():
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("connection closed inside a response")
        return chunk

    if hdrs.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += more()
            line, rest = rest.split(b"\r\n", 1)
            n = int(line.split(b";")[0], 16)
            while len(rest) < n + 2:
                rest += more()
            body += rest[:n]
            rest = rest[n + 2:]
            if n == 0:
                _left[sock] = rest
                return status, hdrs, body
    if "content-length" not in hdrs:  # the body runs to the close
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            rest += chunk
        return status, hdrs, rest
    n = int(hdrs["content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    _left[sock] = rest[n:]
    return status, hdrs, rest[:n]
