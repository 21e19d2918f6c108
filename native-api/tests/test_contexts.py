"""Code contexts (native API): /v1/sandboxes/{id}/contexts and .../execute.

The test driver (spaced-test --runtime test) starts space-agent-host per sandbox when
SPACE_FAKE_AGENT names it (ctest sets it), so the agent's TCP_CONNECT to the code daemon
reaches 127.0.0.1 on this host. SPACE_CODE_PORT points spaced at a free port:

- ContextsTest runs the real daemon there (guest/code/space-code serve, IPython kernels as
  this user) and covers the routes end to end.
- DaemonEdgeTest has no daemon there, or a hostile stand-in written below (a guest is not
  trusted), and points SPACE_CODE_DAEMON at a script this test writes: it covers starting
  the daemon on demand (one start for concurrent requests), a template without it (409), a
  start that fails (503), and a daemon that sends garbage, huge lines or nothing.
"""
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import (MULT, Platform, free_port, kernel_python,  # noqa: E402
                     skip_unless_agent, skip_unless_pg)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DAEMON = os.path.join(REPO, "guest", "code", "space-code")


def skip_unless_daemon(cls):
    if not os.path.exists(DAEMON):
        return unittest.skip("guest/code/space-code is not in this tree")(cls)
    if kernel_python() is None:
        return unittest.skip("no python3 with ipykernel and jupyter_client (see "
                             "scripts/lib.sh)")(cls)
    return cls


def wait_port(port, timeout):
    deadline = time.time() + timeout * MULT
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


class Client:
    """Requests and NDJSON streams against one spaced."""

    def __init__(self, s):
        self.s = s

    def req(self, *a, **kw):
        return self.s.request(*a, **kw)

    def base(self, sid):
        return "/v1/sandboxes/%s" % sid

    def open_stream(self, path, body=None, raw=None, key=None, timeout=120, rcvbuf=None):
        return self.s.open_stream("POST", path, body, key=key or None, raw=raw,
                                  headers={"Content-Type": "application/json"} if raw else None,
                                  timeout=timeout, rcvbuf=rcvbuf)

    def stream(self, path, body, key=None, timeout=120):
        """(status, events or error body, content type)."""
        c, r = self.open_stream(path, body, key=key, timeout=timeout)
        try:
            ctype = r.getheader("Content-Type")
            if r.status != 200:
                return r.status, json.loads(r.read()), ctype
            return 200, [json.loads(line) for line in r], ctype
        finally:
            c.close()


class Assertions:
    def assertError(self, resp, status, code=None, msg=None):
        st, body = resp[0], resp[1]
        self.assertEqual(st, status, body)
        self.assertIsInstance(body, dict, body)
        self.assertIsInstance(body["error"]["message"], str)
        if code:
            self.assertEqual(body["error"]["code"], code, body)
        if msg:
            self.assertIn(msg, body["error"]["message"])

    def assertEnded(self, ev, status="ok"):
        self.assertEqual(ev[0]["type"], "start", ev)
        self.assertEqual(ev[-1]["type"], "end", ev)
        self.assertEqual(ev[-1]["status"], status, ev)
        self.assertEqual([e for e in ev if e["type"] in ("start", "end")], [ev[0], ev[-1]])

    def text(self, ev, kind="stdout"):
        return "".join(e["text"] for e in ev if e["type"] == kind)

    def results(self, ev):
        return [e for e in ev if e["type"] == "result"]


# ---------------------------------------------------------------------------------------------
# The real daemon


@skip_unless_pg
@skip_unless_agent
@skip_unless_daemon
class ContextsTest(unittest.TestCase, Assertions):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="sp-code-")
        os.chmod(cls.tmp, 0o755)
        cls.code_port = free_port()
        cls.daemon_log = open(os.path.join(cls.tmp, "daemon.log"), "w")
        user = pwd.getpwuid(os.geteuid()).pw_name
        cls.daemon = subprocess.Popen(
            [kernel_python(), DAEMON, "serve", "--port", str(cls.code_port),
             "--kernel-user", user],
            stdout=cls.daemon_log, stderr=subprocess.STDOUT, cwd=cls.tmp,
            start_new_session=True)
        if not wait_port(cls.code_port, 60):
            cls.stop_daemon()
            raise AssertionError("space-code did not listen:\n" + cls.daemon_output())
        cls.p = Platform(teams=("alpha", "beta"), runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20", "SPACE_CODE_PORT": str(cls.code_port),
                              "SPACE_CODE_DAEMON": os.path.join(cls.tmp, "no-such-daemon")})
        cls.s = cls.p.s
        cls.other_key = cls.p.keys["beta"]
        cls.sid, _ = cls.s.create()
        cls.cl = Client(cls.s)

    @classmethod
    def stop_daemon(cls):
        if cls.daemon.poll() is None:
            os.killpg(cls.daemon.pid, signal.SIGTERM)
            try:
                cls.daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(cls.daemon.pid, signal.SIGKILL)
                cls.daemon.wait()
        cls.daemon_log.close()

    @classmethod
    def daemon_output(cls):
        with open(os.path.join(cls.tmp, "daemon.log")) as f:
            return f.read()[-4000:]

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()
        cls.stop_daemon()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    # ---- helpers ----

    def req(self, *a, **kw):
        return self.cl.req(*a, **kw)

    def base(self, sid=None):
        return self.cl.base(sid or self.sid)

    def create(self, body=None, sid=None):
        st, ctx = self.req("POST", self.base(sid) + "/contexts", body, timeout=120)
        self.assertEqual(st, 201, ctx)
        return ctx

    def run_in(self, ctx_id, code, **extra):
        st, ev, ctype = self.cl.stream(self.base() + "/contexts/%s/execute" % ctx_id,
                                       dict(code=code, **extra))
        self.assertEqual(st, 200, ev)
        self.assertEqual(ctype, "application/x-ndjson")
        return ev

    def run_top(self, body, sid=None, key=None):
        return self.cl.stream(self.base(sid) + "/execute", body, key=key)

    # ---- contexts ----

    def test_context_lifecycle(self):
        ctx = self.create({"language": "python", "cwd": self.tmp})
        self.assertEqual((ctx["language"], ctx["cwd"], ctx["default"]),
                         ("python", self.tmp, False))
        self.assertIsInstance(ctx["id"], str)
        st, lst = self.req("GET", self.base() + "/contexts")
        self.assertEqual(st, 200, lst)
        ids = {c["id"]: c for c in lst["contexts"]}
        self.assertIn(ctx["id"], ids)
        self.assertFalse(ids[ctx["id"]]["default"])
        ev = self.run_in(ctx["id"], "import os; os.getcwd()")
        self.assertEnded(ev)
        self.assertEqual(self.results(ev)[0]["data"]["text/plain"], repr(self.tmp))
        # restart keeps the context and its cwd, clears its state
        self.assertEnded(self.run_in(ctx["id"], "kept = 1"))
        st, r = self.req("POST", self.base() + "/contexts/%s/restart" % ctx["id"], timeout=120)
        self.assertEqual(st, 200, r)
        self.assertEqual((r["id"], r["cwd"], r["default"]), (ctx["id"], self.tmp, False))
        ev = self.run_in(ctx["id"], "kept")
        self.assertEnded(ev, "error")
        self.assertEqual([e["name"] for e in ev if e["type"] == "error"], ["NameError"])
        # interrupt with nothing running is fine
        st, r = self.req("POST", self.base() + "/contexts/%s/interrupt" % ctx["id"])
        self.assertEqual((st, r), (204, None))
        st, r = self.req("DELETE", self.base() + "/contexts/" + ctx["id"])
        self.assertEqual((st, r), (204, None))
        self.assertError(self.req("DELETE", self.base() + "/contexts/" + ctx["id"]), 404,
                         "not_found")
        self.assertError(self.req("POST", self.base() + "/contexts/%s/restart" % ctx["id"]),
                         404)
        self.assertError(self.req("POST", self.base() + "/contexts/%s/interrupt" % ctx["id"]),
                         404)
        st, ev, _ = self.cl.stream(self.base() + "/contexts/%s/execute" % ctx["id"],
                                   {"code": "1"})
        self.assertError((st, ev), 404, "not_found")
        st, lst = self.req("GET", self.base() + "/contexts")
        self.assertNotIn(ctx["id"], [c["id"] for c in lst["contexts"]])

    def test_defaults_listed_and_used_by_execute(self):
        st, ev, _ = self.run_top({"code": "default_marker = 7"})
        self.assertEqual(st, 200, ev)
        self.assertEnded(ev)
        self.assertTrue(ev[0]["context"]["default"], ev[0])
        self.assertEqual(ev[0]["context"]["language"], "python")
        st, ev, _ = self.run_top({"code": "default_marker * 6", "language": "py"})
        self.assertEqual(self.results(ev)[0]["data"]["text/plain"], "42")
        st, lst = self.req("GET", self.base() + "/contexts")
        defaults = [c for c in lst["contexts"] if c["default"]]
        self.assertIn("python", [c["language"] for c in defaults])
        # by ID through the top-level route too
        pid = [c["id"] for c in defaults if c["language"] == "python"][0]
        st, ev, _ = self.run_top({"code": "default_marker", "context_id": pid})
        self.assertEqual(self.results(ev)[0]["data"]["text/plain"], "7")

    def test_state_and_execution_count(self):
        ctx = self.create()
        self.assertEqual(ctx["language"], "python")
        e1 = self.run_in(ctx["id"], "x = 41")
        self.assertEnded(e1)
        self.assertEqual(self.results(e1), [])
        e2 = self.run_in(ctx["id"], "x + 1")
        self.assertEnded(e2)
        res = self.results(e2)
        self.assertEqual(len(res), 1, e2)
        self.assertTrue(res[0]["is_main_result"])
        self.assertEqual(res[0]["data"]["text/plain"], "42")
        self.assertIsInstance(e1[-1]["execution_count"], int)
        self.assertEqual(e2[-1]["execution_count"], e1[-1]["execution_count"] + 1)

    def test_stream_order_and_timestamps(self):
        ctx = self.create()
        code = ("import sys, time\n"
                "print('a', flush=True); time.sleep(0.3)\n"
                "print('b', file=sys.stderr, flush=True); time.sleep(0.3)\n"
                "print('c', flush=True); time.sleep(0.3)\n"
                "'r'\n")
        ev = self.run_in(ctx["id"], code)
        self.assertEnded(ev)
        kinds = [e["type"] for e in ev if e["type"] != "keepalive"]
        self.assertEqual(kinds, ["start", "stdout", "stderr", "stdout", "result", "end"], ev)
        self.assertEqual(self.text(ev), "a\nc\n")
        self.assertEqual(self.text(ev, "stderr"), "b\n")
        for e in ev:
            if e["type"] in ("stdout", "stderr"):
                self.assertRegex(e["timestamp"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")

    def test_result_mime_data(self):
        ctx = self.create()
        code = ("from IPython.display import display, HTML, JSON\n"
                "display(HTML('<b>hi</b>'))\n"
                "display(JSON({'k': [1, 2]}))\n"
                "{'a': 1}\n")
        ev = self.run_in(ctx["id"], code)
        self.assertEnded(ev)
        res = self.results(ev)
        self.assertEqual(len(res), 3, ev)
        self.assertFalse(res[0]["is_main_result"])
        self.assertEqual(res[0]["data"]["text/html"], "<b>hi</b>")
        self.assertEqual(res[1]["data"]["application/json"], {"k": [1, 2]})
        self.assertTrue(res[2]["is_main_result"])
        self.assertEqual(res[2]["data"]["text/plain"], "{'a': 1}")

    def test_error_event(self):
        ctx = self.create()
        ev = self.run_in(ctx["id"], "print('before')\n1/0")
        self.assertEnded(ev, "error")
        self.assertEqual(self.text(ev), "before\n")
        err = [e for e in ev if e["type"] == "error"]
        self.assertEqual(len(err), 1, ev)
        self.assertEqual(err[0]["name"], "ZeroDivisionError")
        self.assertIn("division by zero", err[0]["value"])
        self.assertIsInstance(err[0]["traceback"], list)
        self.assertTrue(all(isinstance(t, str) for t in err[0]["traceback"]))
        # the context carries on
        self.assertEnded(self.run_in(ctx["id"], "1"))

    def test_env_is_per_execution(self):
        ctx = self.create()
        ev = self.run_in(ctx["id"], "import os; os.environ.get('SP_CTX_FOO')",
                         env={"SP_CTX_FOO": "bar baz"})
        self.assertEqual(self.results(ev)[0]["data"]["text/plain"], "'bar baz'")
        ev = self.run_in(ctx["id"], "import os; os.environ.get('SP_CTX_FOO')")
        self.assertEqual(self.results(ev), [], ev)  # None has no result
        bash = self.create({"language": "bash"})
        ev = self.run_in(bash["id"], 'echo "[$SP_CTX_FOO]"', env={"SP_CTX_FOO": "b"})
        self.assertEqual(self.text(ev), "[b]\n")
        ev = self.run_in(bash["id"], 'echo "[$SP_CTX_FOO]"')
        self.assertEqual(self.text(ev), "[]\n")

    def test_timeout_keeps_the_context(self):
        ctx = self.create()
        self.assertEnded(self.run_in(ctx["id"], "survivor = 'yes'"))
        t0 = time.time()
        ev = self.run_in(ctx["id"], "import time\ntime.sleep(60)", timeout_s=1.5)
        self.assertLess(time.time() - t0, 30 * MULT)
        self.assertEnded(ev, "timeout")
        ev = self.run_in(ctx["id"], "survivor")
        self.assertEnded(ev)
        self.assertEqual(self.results(ev)[0]["data"]["text/plain"], "'yes'")

    def test_keepalive_while_quiet(self):
        ctx = self.create()
        ev = self.run_in(ctx["id"], "import time\ntime.sleep(6.5)\n'late'")
        self.assertEnded(ev)
        self.assertIn("keepalive", [e["type"] for e in ev])
        self.assertEqual(self.results(ev)[0]["data"]["text/plain"], "'late'")

    def test_bash_context_keeps_state(self):
        ctx = self.create({"language": "sh", "cwd": self.tmp})
        self.assertEqual(ctx["language"], "bash")
        self.assertEnded(self.run_in(ctx["id"], "cd /; SP_X=5"))
        ev = self.run_in(ctx["id"], "echo $SP_X; pwd")
        self.assertEnded(ev)
        self.assertEqual(self.text(ev), "5\n/\n")
        ev = self.run_in(ctx["id"], "false")
        self.assertEqual(ev[-1]["type"], "end")

    def test_client_disconnect_interrupts(self):
        ctx = self.create()
        c, r = self.cl.open_stream(self.base() + "/contexts/%s/execute" % ctx["id"],
                                   {"code": "import time\nfor i in range(1200):\n"
                                            "    time.sleep(0.1)\nfinished = True"})
        self.assertEqual(r.status, 200)
        self.assertEqual(json.loads(r.readline())["type"], "start")
        time.sleep(0.5)
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        # executions in a context run one at a time: this one only starts once the
        # disconnected one was interrupted
        t0 = time.time()
        ev = self.run_in(ctx["id"], "'finished' in globals()")
        self.assertLess(time.time() - t0, 30 * MULT)
        self.assertEnded(ev)
        self.assertEqual(self.results(ev)[0]["data"]["text/plain"], "False")

    def test_interrupt_route(self):
        ctx = self.create()
        out = {}

        def run():
            out["ev"] = self.run_in(ctx["id"], "import time\ntime.sleep(120)")
        t = threading.Thread(target=run)
        t.start()
        time.sleep(2)
        st, r = self.req("POST", self.base() + "/contexts/%s/interrupt" % ctx["id"], {})
        self.assertEqual(st, 204, r)
        t.join(60 * MULT)
        self.assertFalse(t.is_alive())
        self.assertEnded(out["ev"], "interrupted")

    # ---- bad input ----

    def test_bad_input(self):
        b = self.base()
        ctx = self.create()
        xp = b + "/contexts/%s/execute" % ctx["id"]
        for body in ({}, {"code": 5}, {"code": None}, {"code": "1", "env": {"A": 1}},
                     {"code": "1", "env": "A=1"}, {"code": "1", "timeout_s": 0},
                     {"code": "1", "timeout_s": -1}, {"code": "1", "timeout_s": "1"},
                     {"code": "1", "timeout_s": 1e9}, {"code": "1", "language": "python"},
                     {"code": "1", "extra": True}):
            st, r, _ = self.cl.stream(xp, body)
            self.assertError((st, r), 400, "invalid_argument")
        for body in ({"code": "1", "language": "cobol"}, {"code": "1", "language": 3},
                     {"code": "1", "language": "python", "context_id": ctx["id"]},
                     {"language": "python"}, {"code": ["1"]}):
            st, r, _ = self.cl.stream(b + "/execute", body)
            self.assertError((st, r), 400)
        st, r, _ = self.cl.stream(b + "/execute", {"code": "1", "language": "cobol"})
        self.assertIn("python, bash", r["error"]["message"])
        self.assertError(self.req("POST", b + "/contexts", {"language": "cobol"}), 400,
                         msg="python, bash")
        self.assertError(self.req("POST", b + "/contexts", {"cwd": 5}), 400)
        self.assertError(self.req("POST", b + "/contexts", {"cwd": ""}), 400)
        self.assertError(self.req("POST", b + "/contexts", {"nope": 1}), 400)
        self.assertError(self.req("POST", b + "/contexts/%s/restart" % ctx["id"], {"x": 1}),
                         400)
        # malformed JSON, not an object, too large
        for raw in (b"{", b"[1]", b'"code"', b"\xff\xfe"):
            st, r = self.req("POST", xp, raw=raw, headers={"Content-Type": "application/json"})
            self.assertError((st, r), 400)
        big = json.dumps({"code": "x" * (2 * 1024 * 1024)}).encode()
        st, r = self.req("POST", xp, raw=big, headers={"Content-Type": "application/json"})
        self.assertError((st, r), 413)
        # unknown contexts
        st, r, _ = self.cl.stream(b + "/contexts/nosuchcontext/execute", {"code": "1"})
        self.assertError((st, r), 404)
        st, r, _ = self.cl.stream(b + "/execute", {"code": "1", "context_id": "nosuchcontext"})
        self.assertError((st, r), 404)
        self.assertError(self.req("DELETE", b + "/contexts/nosuchcontext"), 404)
        # a cwd that does not exist is the daemon's to refuse
        st, r = self.req("POST", b + "/contexts", {"cwd": "/nonexistent/dir/x"}, timeout=120)
        self.assertIn(st, (400, 404), r)
        # the sandbox still works
        self.assertEnded(self.run_in(ctx["id"], "1"))

    # ---- tenancy and state ----

    def test_other_team_and_unknown_sandbox_get_404(self):
        k = self.other_key
        ctx = self.create()
        b = self.base()
        self.assertError(self.req("GET", b + "/contexts", key=k), 404)
        self.assertError(self.req("POST", b + "/contexts", {}, key=k), 404)
        self.assertError(self.req("DELETE", b + "/contexts/" + ctx["id"], key=k), 404)
        self.assertError(self.req("POST", b + "/contexts/%s/restart" % ctx["id"], key=k), 404)
        self.assertError(self.req("POST", b + "/contexts/%s/interrupt" % ctx["id"], key=k), 404)
        st, r, _ = self.cl.stream(b + "/contexts/%s/execute" % ctx["id"], {"code": "1"}, key=k)
        self.assertError((st, r), 404)
        st, r, _ = self.run_top({"code": "1"}, key=k)
        self.assertError((st, r), 404)
        st, r, _ = self.run_top({"code": "1"}, sid="nosuchsandbox")
        self.assertError((st, r), 404)
        self.assertError(self.req("GET", "/v1/sandboxes/nosuchsandbox/contexts"), 404)
        # the context was not touched
        self.assertEnded(self.run_in(ctx["id"], "1"))

    def test_paused_sandbox_is_409_and_activity_recorded(self):
        sid, _ = self.s.create()
        st, sb0 = self.req("GET", "/v1/sandboxes/" + sid)
        time.sleep(1.2)
        st, ev, _ = self.run_top({"code": "1"}, sid=sid)
        self.assertEqual(st, 200, ev)
        sb1 = self.s.wait_activity(sid, sb0)
        self.assertGreater(sb1["last_activity_at"], sb0["last_activity_at"])
        st, r = self.req("POST", "/v1/sandboxes/%s/pause?wait=30" % sid, timeout=40)
        self.assertEqual((st, r["operation"]["status"]), (200, "succeeded"), r)
        st, r, _ = self.run_top({"code": "1"}, sid=sid)
        self.assertError((st, r), 409, "conflict")
        self.assertError(self.req("GET", self.base(sid) + "/contexts"), 409)
        self.assertError(self.req("POST", self.base(sid) + "/contexts", {}), 409)
        st, r = self.req("POST", "/v1/sandboxes/%s/wake?wait=30" % sid, timeout=40)
        self.assertEqual((st, r["operation"]["status"]), (200, "succeeded"), r)
        st, ev, _ = self.run_top({"code": "40 + 2"}, sid=sid)
        self.assertEqual(self.results(ev)[0]["data"]["text/plain"], "42")
        self.req("DELETE", "/v1/sandboxes/%s?wait=30" % sid, timeout=40)


# ---------------------------------------------------------------------------------------------
# No daemon, a daemon started on demand, and a hostile one


def send(conn, obj):
    conn.sendall((json.dumps(obj) + "\n").encode())


CTX = {"id": "c1", "language": "python", "cwd": "/home/user", "default": False}


class FakeDaemon:
    """A stand-in that speaks the daemon protocol (core/channel/code.h) the way a test wants, including
    ways the real one never would. behavior(req, conn, rfile) answers one connection."""

    def __init__(self, port):
        self.port = port
        self.sock = None
        self.behavior = None
        self.requests = []
        self.sent = 0          # bytes written by behaviors that count
        self.closed = threading.Event()  # a behavior saw the client close its connection
        self.lock = threading.Lock()

    def listen(self, behavior):
        self.behavior = behavior
        self.requests = []
        self.sent = 0
        self.closed.clear()
        if self.sock is None:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", self.port))
            s.listen(64)
            self.sock = s
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def stop(self):
        if self.sock is not None:
            s, self.sock = self.sock, None
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, s):
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            rfile = conn.makefile("rb")
            line = rfile.readline()
            if not line:
                return
            req = json.loads(line)
            with self.lock:
                self.requests.append(req)
            self.behavior(req, conn, rfile)
        except OSError:
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass


def answer(status):
    def b(req, conn, rfile):
        send(conn, status)
    return b


@skip_unless_pg
@skip_unless_agent
class DaemonEdgeTest(unittest.TestCase, Assertions):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="sp-code-edge-")
        os.chmod(cls.tmp, 0o755)
        cls.script = os.path.join(cls.tmp, "space-code")
        cls.code_port = free_port()
        cls.fake = FakeDaemon(cls.code_port)
        cls.p = Platform(teams=("alpha",), runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20", "SPACE_CODE_PORT": str(cls.code_port),
                              "SPACE_CODE_DAEMON": cls.script})
        cls.s = cls.p.s
        cls.sid, _ = cls.s.create()
        cls.cl = Client(cls.s)

    @classmethod
    def tearDownClass(cls):
        cls.fake.stop()
        cls.p.destroy()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.fake.stop()
        if os.path.exists(self.script):
            os.unlink(self.script)

    def write_script(self, body):
        with open(self.script, "w") as f:
            f.write("#!/bin/sh\n" + body)
        os.chmod(self.script, 0o755)

    def req(self, *a, **kw):
        return self.cl.req(*a, **kw)

    def base(self):
        return self.cl.base(self.sid)

    def execute(self, body=None):
        return self.cl.stream(self.base() + "/execute", body or {"code": "1"})

    def alive(self):
        st, _ = self.req("GET", "/v1/sandboxes/" + self.sid)
        self.assertEqual(st, 200)
        self.assertIsNone(self.s.proc.poll())

    # ---- starting the daemon ----

    def test_template_without_daemon_is_409(self):
        msg = "no code interpreter"
        self.assertError(self.req("POST", self.base() + "/contexts", {}), 409, "conflict", msg)
        self.assertError(self.req("GET", self.base() + "/contexts"), 409, "conflict", msg)
        st, r, ctype = self.execute()
        self.assertError((st, r), 409, "conflict", msg)
        self.assertEqual(ctype, "application/json")
        # a start command that exists but is not found by the shell the same way
        self.write_script("exit 127\n")
        self.assertError(self.req("GET", self.base() + "/contexts"), 409, "conflict", msg)

    def test_start_failure_is_503_with_its_reason(self):
        self.write_script("echo 'starting...'\necho 'kernel spec missing' >&2\nexit 3\n")
        r = self.req("GET", self.base() + "/contexts")
        self.assertError(r, 503, "unavailable", "kernel spec missing")
        self.assertIn("exit 3", r[1]["error"]["message"])
        # it started but nothing listens
        self.write_script("exit 0\n")
        self.assertError(self.req("GET", self.base() + "/contexts"), 503, "unavailable",
                         "not answering")

    def test_concurrent_requests_share_one_start(self):
        starts = os.path.join(self.tmp, "starts")
        go = os.path.join(self.tmp, "go")
        ready = os.path.join(self.tmp, "listening")
        for p in (starts, go, ready):
            if os.path.exists(p):
                os.unlink(p)
        self.write_script(
            "echo \"$1\" >> %s\ntouch %s\ni=0\n"
            "while [ ! -e %s ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n"
            % (starts, go, ready))

        def when_started():
            deadline = time.time() + 60 * MULT
            while not os.path.exists(go) and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(1)  # every request is waiting by now
            self.fake.listen(answer({"ok": True, "contexts": [dict(CTX, default=True)]}))
            open(ready, "w").close()
        threading.Thread(target=when_started, daemon=True).start()
        results = [None] * 5

        def one(i):
            results[i] = self.req("GET", self.base() + "/contexts", timeout=120)
        ts = [threading.Thread(target=one, args=(i,)) for i in range(5)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120 * MULT)
        for st, r in results:
            self.assertEqual(st, 200, r)
            self.assertEqual(r["contexts"], [dict(CTX, default=True)])
        with open(starts) as f:
            self.assertEqual(f.read(), "start\n")  # one start, with the argument "start"
        # once up, no more starts
        self.assertEqual(self.req("GET", self.base() + "/contexts")[0], 200)
        with open(starts) as f:
            self.assertEqual(f.read(), "start\n")

    # ---- what the daemon is sent ----

    def test_requests_as_sent(self):
        self.fake.listen(answer({"ok": True}))
        self.assertEqual(self.req("DELETE", self.base() + "/contexts/c1")[0], 204)
        self.assertEqual(self.req("POST", self.base() + "/contexts/c1/interrupt")[0], 204)
        self.assertEqual(self.fake.requests, [
            {"op": "delete", "sandbox_id": self.sid, "context_id": "c1"},
            {"op": "interrupt", "sandbox_id": self.sid, "context_id": "c1"}])
        self.fake.listen(answer({"ok": True, "contexts": []}))
        self.assertEqual(self.req("GET", self.base() + "/contexts"),
                         (200, {"contexts": [], "truncated": False}))
        self.assertEqual(self.fake.requests, [{"op": "list", "sandbox_id": self.sid}])
        # execute: fields, language normalised, timeout in ms, env as given
        self.fake.listen(self.exec_events([{"type": "end", "status": "ok",
                                            "execution_count": 3}]))
        st, ev, _ = self.execute({"code": "print('é')\n", "language": "SH", "timeout_s": 1.5,
                                  "env": {"A": "1", "B": ""}})
        self.assertEqual(st, 200, ev)
        self.assertEqual(self.fake.requests, [{
            "op": "execute", "sandbox_id": self.sid, "context_id": None, "language": "bash",
            "code": "print('é')\n", "env": {"A": "1", "B": ""}, "timeout_ms": 1500}])
        self.assertEqual(ev, [{"type": "start", "context": CTX},
                              {"type": "end", "status": "ok", "execution_count": 3}])
        self.fake.listen(self.exec_events([{"type": "end", "status": "ok"}]))
        st, ev, _ = self.cl.stream(self.base() + "/contexts/c1/execute", {"code": ""})
        self.assertEqual(self.fake.requests[0]["context_id"], "c1")
        self.assertEqual(self.fake.requests[0]["language"], None)
        self.assertEqual(self.fake.requests[0]["env"], None)
        self.assertEqual(self.fake.requests[0]["timeout_ms"], 0)
        self.assertEqual(ev[-1], {"type": "end", "status": "ok", "execution_count": None})

    def test_create_and_restart_requests(self):
        self.fake.listen(answer({"ok": True, "context": CTX}))
        self.req("POST", self.base() + "/contexts", {"language": " Python3 ", "cwd": "/tmp"})
        self.req("POST", self.base() + "/contexts", {})
        self.req("POST", self.base() + "/contexts/c%2F1/restart")
        self.assertEqual(self.fake.requests, [
            {"op": "create", "sandbox_id": self.sid, "language": "python", "cwd": "/tmp"},
            {"op": "create", "sandbox_id": self.sid, "language": None, "cwd": None},
            {"op": "restart", "sandbox_id": self.sid, "context_id": "c/1"}])

    # ---- the daemon's errors ----

    def test_daemon_error_codes(self):
        cases = [("invalid", 400, "invalid_argument"), ("not_found", 404, "not_found"),
                 ("unsupported_language", 400, "invalid_argument"),
                 ("unavailable", 503, "unavailable"), ("something_new", 500, "internal")]
        for code, status, name in cases:
            self.fake.listen(answer({"ok": False, "error": {"code": code, "message": "m-" + code}}))
            r = self.req("POST", self.base() + "/contexts", {})
            self.assertError(r, status, name, "m-" + code)
            st, body, _ = self.execute()
            self.assertError((st, body), status, None, "m-" + code)
        self.fake.listen(answer({"ok": False, "error": {"code": "unsupported_language",
                                                        "message": "no ruby here"}}))
        self.assertError(self.req("POST", self.base() + "/contexts", {}), 400, None,
                         "python, bash")
        self.fake.listen(answer({"ok": False, "error": {"code": "not_found"}}))
        self.assertError(self.req("DELETE", self.base() + "/contexts/x"), 404)

    # ---- a hostile daemon ----

    def test_garbage_answers(self):
        bad = [b"hello\n", b"[1,2]\n", b"{\"ok\": 1}\n", b"{\"ok\": true}\n",
               b"{\"ok\": true, \"context\": {\"id\": 5, \"language\": \"python\", "
               b"\"cwd\": \"/\"}}\n",
               b"{\"ok\": true, \"context\": {\"id\": \"\", \"language\": \"python\", "
               b"\"cwd\": \"/\"}}\n",
               b"{\"ok\": true, \"context\": {\"id\": \"a\", \"language\": \"python\", "
               b"\"cwd\": \"/\", \"default\": \"yes\"}}\n",
               b"{\"ok\": false, \"error\": \"bad\"}\n", b"{\"ok\": false}\n",
               b"\xff\xfe\n", b"{\"ok\": true, \"context\": {\"id\": \"a\\u0000b\"}}\n",
               b"", b"{\"ok\": true, \"con"]
        for raw in bad:
            def b(req, conn, rfile, raw=raw):
                conn.sendall(raw)
            self.fake.listen(b)
            r = self.req("POST", self.base() + "/contexts", {})
            self.assertError(r, 503, "unavailable")
            st, body, _ = self.execute()
            self.assertError((st, body), 503, "unavailable")
        # list entries are checked one by one
        self.fake.listen(answer({"ok": True, "contexts": [CTX, {"id": "x"}]}))
        self.assertError(self.req("GET", self.base() + "/contexts"), 503)
        self.fake.listen(answer({"ok": True, "contexts": {}}))
        self.assertError(self.req("GET", self.base() + "/contexts"), 503)
        self.alive()

    def test_huge_and_complex_lines(self):
        rss0 = self.s.rss_kb()

        def huge(req, conn, rfile):
            chunk = b"a" * (1024 * 1024)
            for _ in range(17):
                conn.sendall(chunk)
            time.sleep(5)
        self.fake.listen(huge)
        t0 = time.time()
        self.assertError(self.req("POST", self.base() + "/contexts", {}, timeout=60), 503,
                         "unavailable", "malformed")
        self.assertLess(time.time() - t0, 30 * MULT)
        # A list's line stops at 4 MiB (core/channel/listcap.h), before any line's 16 MiB.
        self.fake.listen(huge)
        self.assertError(self.req("GET", self.base() + "/contexts", timeout=60), 503,
                         "unavailable", "larger than 4 MiB")

        def complex_(req, conn, rfile):
            conn.sendall(b'{"ok": true, "contexts": [' + b"[]," * 400000 + b"[]]}\n")
        self.fake.listen(complex_)
        self.assertError(self.req("GET", self.base() + "/contexts", timeout=60), 503)

        def deep(req, conn, rfile):
            conn.sendall(b"[" * 200000 + b"]" * 200000 + b"\n")
        self.fake.listen(deep)
        self.assertError(self.req("GET", self.base() + "/contexts", timeout=60), 503)
        # a line just under the cap is fine (a large result)
        big = "x" * (15 * 1024 * 1024)
        self.fake.listen(self.exec_events([
            {"type": "result", "is_main_result": True, "data": {"text/plain": big}},
            {"type": "end", "status": "ok", "execution_count": 1}]))
        st, ev, _ = self.execute()
        self.assertEqual(st, 200)
        self.assertEqual(len(ev[1]["data"]["text/plain"]), len(big))
        self.alive()
        self.assertLess(self.s.rss_kb() - rss0, 400 * 1024)

    def exec_events(self, events, then=None):
        def b(req, conn, rfile):
            send(conn, {"ok": True, "context": CTX})
            for e in events:
                if isinstance(e, bytes):
                    conn.sendall(e)
                else:
                    send(conn, e)
            if then:
                then(req, conn, rfile)
        return b

    def test_bad_events_end_the_stream_with_failed(self):
        out = {"type": "stdout", "text": "hi", "timestamp": "2024-01-01T00:00:00Z"}
        cases = [
            [out, b"garbage\n"],
            [out, {"type": "stdout", "text": 5}],
            [out, {"type": "stdout", "text": "x", "timestamp": 1}],
            [out, {"type": "result", "data": "x"}],
            [out, {"type": "result", "is_main_result": 1, "data": {}}],
            [out, {"type": "error", "name": "E", "value": "v", "traceback": [1]}],
            [out, {"type": "error", "name": "E", "value": "v"}],
            [out, {"type": "end", "status": "weird"}],
            [out, {"type": "end", "status": "ok", "execution_count": "1"}],
            [out, {"type": "end", "status": "ok", "execution_count": -1}],
            [out, {"notype": 1}],
            [out],  # closes without an end
        ]
        for events in cases:
            self.fake.listen(self.exec_events(events))
            st, ev, _ = self.execute()
            self.assertEqual(st, 200, ev)
            self.assertEqual(ev[0], {"type": "start", "context": CTX})
            self.assertEqual(ev[1], out)
            self.assertEqual(ev[-1]["type"], "end", ev)
            self.assertEqual(ev[-1]["status"], "failed", ev)
            self.assertEqual(ev[-1]["error"]["code"], "unavailable", ev)
            self.assertEqual(len(ev), 3, ev)
        self.alive()

    def test_events_rendered_and_unknown_ones_skipped(self):
        events = [
            {"type": "stdout", "text": "a\u00e9\n", "timestamp": "t1"},
            {"type": "future-thing", "x": 1},
            "",
            {"type": "stderr", "text": ""},
            {"type": "result", "is_main_result": False,
             "data": {"text/plain": "1", "application/json": {"k": [1]}, "image/png": "iVBO"}},
            {"type": "error", "name": "E", "value": "v", "traceback": ["l1", "l2"]},
            {"type": "end", "status": "error", "execution_count": 9},
            {"type": "stdout", "text": "after the end"},
        ]

        def b(req, conn, rfile):
            send(conn, {"ok": True, "context": CTX})
            for e in events:
                if e == "":
                    conn.sendall(b"\n  \r\n")
                else:
                    send(conn, e)
        self.fake.listen(b)
        st, ev, _ = self.execute()
        self.assertEqual(st, 200, ev)
        self.assertEqual(ev[1], {"type": "stdout", "text": "a\u00e9\n", "timestamp": "t1"})
        self.assertEqual(ev[2]["type"], "stderr")
        self.assertRegex(ev[2]["timestamp"], r"^\d{4}-\d\d-\d\dT")  # ours when it sent none
        self.assertEqual(ev[3], events[4])
        self.assertEqual(ev[4], events[5])
        self.assertEqual(ev[5], {"type": "end", "status": "error", "execution_count": 9})
        self.assertEqual(len(ev), 6, ev)

    def test_keepalive_and_daemon_going_away(self):
        def quiet(req, conn, rfile):
            time.sleep(6)
            send(conn, {"type": "end", "status": "ok", "execution_count": 1})
        self.fake.listen(self.exec_events([], then=quiet))
        st, ev, _ = self.execute()
        self.assertEqual([e["type"] for e in ev], ["start", "keepalive", "end"])

        def vanish(req, conn, rfile):
            time.sleep(0.5)
            conn.shutdown(socket.SHUT_RDWR)
        self.fake.listen(self.exec_events([{"type": "stdout", "text": "x"}], then=vanish))
        st, ev, _ = self.execute()
        self.assertEqual(ev[-1]["status"], "failed")
        self.assertIn("went away", ev[-1]["error"]["message"])

    def test_client_disconnect_closes_the_daemon_connection(self):
        def wait_close(req, conn, rfile):
            if rfile.read(1) == b"":  # the client of the daemon (spaced, via the agent) left
                self.fake.closed.set()
        self.fake.listen(self.exec_events([{"type": "stdout", "text": "x"}], then=wait_close))
        c, r = self.cl.open_stream(self.base() + "/execute", {"code": "1"})
        self.assertEqual(json.loads(r.readline())["type"], "start")
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        self.assertTrue(self.fake.closed.wait(20 * MULT))
        # also when the client leaves while the daemon is still being connected to
        self.fake.listen(self.exec_events([], then=wait_close))
        c, r = self.cl.open_stream(self.base() + "/execute", {"code": "1"})
        r.readline()
        c.close()
        self.assertTrue(self.fake.closed.wait(20 * MULT))

    def test_slow_client_holds_output_in_the_guest(self):
        # 40 MiB, of which a daemon held back gets out only what the buffers in between hold:
        # the agent's window (256 KiB), the socket buffers from the daemon to the agent and
        # from spaced to the client (the kernel sizes these; 8 to 11 MiB seen here), so less
        # than half. The client's receive buffer is fixed, or the kernel could grow it to tcp_rmem's
        # 32 MiB for a reader that stopped.
        chunk = "y" * 65536
        total = 640

        def flood(req, conn, rfile):
            send(conn, {"ok": True, "context": CTX})
            for i in range(total):
                send(conn, {"type": "stdout", "text": chunk, "timestamp": str(i)})
                with self.fake.lock:
                    self.fake.sent += 1
            send(conn, {"type": "end", "status": "ok", "execution_count": 1})
        self.fake.listen(flood)
        rss0 = self.s.rss_kb()
        c, r = self.cl.open_stream(self.base() + "/execute", {"code": "1"}, rcvbuf=128 * 1024)
        self.assertEqual(r.status, 200)
        # nobody reads: the daemon must come to a stop well before the end
        stuck_at, deadline = -1, time.time() + 20 * MULT
        while time.time() < deadline:
            time.sleep(1)
            with self.fake.lock:
                now = self.fake.sent
            if now == stuck_at or now == total:
                break
            stuck_at = now
        self.assertLess(now, total // 2, "the daemon was not held back")
        self.assertEqual(now, stuck_at, "the daemon did not stop")
        sys.stderr.write("(daemon stuck after %d KiB; spaced grew %d KiB) " % (stuck_at * 64,
                                                                            self.s.rss_kb() - rss0))
        grown = self.s.rss_kb() - rss0
        got, n, last = 0, 0, None
        for line in r:
            e = json.loads(line)
            if e["type"] == "stdout":
                self.assertEqual(e["timestamp"], str(n))
                n += 1
                got += len(e["text"])
            last = e
        c.close()
        self.assertEqual(got, total * len(chunk))
        self.assertEqual(last["type"], "end")
        # ASan keeps freed memory in quarantine: be generous, as test_commands is
        self.assertLess(grown, 150 * 1024, "spaced held the output")

    def test_agent_dying_mid_execution(self):
        sid, _ = self.s.create()

        def hang(req, conn, rfile):
            rfile.read(1)
        self.fake.listen(self.exec_events([{"type": "stdout", "text": "x"}], then=hang))
        c, r = self.cl.open_stream(self.cl.base(sid) + "/execute", {"code": "1"})
        self.assertEqual(json.loads(r.readline())["type"], "start")
        self.assertEqual(json.loads(r.readline())["type"], "stdout")
        with open(os.path.join(self.s.data_dir, "fake", sid + ".pid")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        t0 = time.time()
        ev = [json.loads(line) for line in r]
        c.close()
        self.assertLess(time.time() - t0, 10 * MULT)
        self.assertEqual(ev[-1]["status"], "failed", ev)
        self.assertEqual(ev[-1]["error"]["code"], "unavailable")
        self.req("DELETE", "/v1/sandboxes/%s?wait=30" % sid, timeout=40)
        self.alive()


if __name__ == "__main__":
    unittest.main(verbosity=2)
