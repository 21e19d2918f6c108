"""The E2B code interpreter (port 49999, spec e2b-wire.md section 4) over the gateway, against
the real code daemon (guest/code/space-code) and a real space-agent.

The test driver (spaced-test --runtime test) starts space-agent-host per sandbox on this host
(SPACE_FAKE_AGENT), so the "guest" is this host: the code daemon runs here, started by the
test on a free port (SPACE_CODE_PORT tells core where to connect), with IPython kernels from
a Python that has ipykernel and jupyter_client.

Requests use Host routing (<port>-<id>.<domain> over plain HTTP on the one listener), as the
SDK does; one test uses the API address with only X-Access-Token (E2B_DEBUG-style routing).
Every streamed body is checked the way the SDKs read it: split with str.splitlines() (httpx),
one JSON object per line, no blank lines.
"""
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, free_port, kernel_python, skip_unless_pg  # noqa: E402

DAEMON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "guest", "code",
                      "space-code")


def has_module(py, mod):
    return subprocess.run([py, "-c", "import " + mod], capture_output=True,
                          timeout=60).returncode == 0


def skip_unless_ready(cls):
    if not os.environ.get("SPACE_FAKE_AGENT"):
        return unittest.skip("SPACE_FAKE_AGENT (space-agent-host) is not set")(cls)
    if os.geteuid() != 0:
        return unittest.skip("needs root: the agent switches users")(cls)
    if not os.path.exists(DAEMON):
        return unittest.skip("guest/code/space-code is not there")(cls)
    if kernel_python() is None:
        return unittest.skip("no python3 with ipykernel and jupyter_client")(cls)
    return cls


def wait_port(port, proc, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError("space-code exited with %d" % proc.returncode)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("space-code did not listen on %d" % port)


@skip_unless_pg
@skip_unless_ready
class CodeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.py = kernel_python()
        cls.scratch = tempfile.mkdtemp(prefix="sp-e2b-code-")
        os.chmod(cls.scratch, 0o777)
        cls.cport = free_port()
        cls.dlog = open(os.path.join(cls.scratch, "space-code.log"), "w")
        cls.start_daemon()
        cls.p = Platform(teams=("alpha",), start=False, runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20", "SPACE_CODE_PORT": str(cls.cport)})
        cls.s = cls.p.s
        cls.key = cls.p.keys["alpha"]
        cls.s.env.pop("SPACE_E2B_DOMAIN", None)
        cls.s.start()
        cls.domain = "space.localhost:%d" % cls.s.port
        sb = cls.create()
        cls.sid, cls.token = sb["sandboxID"], sb["envdAccessToken"]
        cls.traffic = sb["trafficAccessToken"]

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()
        cls.daemon.terminate()
        try:
            cls.daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cls.daemon.kill()
            cls.daemon.wait()
        cls.dlog.close()
        if os.environ.get("SP_TEST_KEEP") != "1":
            shutil.rmtree(cls.scratch, ignore_errors=True)

    @classmethod
    def start_daemon(cls):
        cls.daemon = subprocess.Popen(
            [cls.py, DAEMON, "serve", "--port", str(cls.cport), "--kernel-user",
             pwd_name()], stdout=cls.dlog, stderr=subprocess.STDOUT, cwd=cls.scratch)
        wait_port(cls.cport, cls.daemon, 60 * MULT)

    @classmethod
    def create(cls, **fields):
        body = {"templateID": "base", "timeout": 300, "metadata": {}, "envVars": {},
                "secure": True}
        body.update(fields)
        st, sb = cls.s.request("POST", "/sandboxes", body, key="",
                               headers={"X-API-KEY": cls.key}, timeout=120)
        assert st == 201, (st, sb)
        return sb

    # ---- helpers ----

    def conn(self, timeout=120):
        return http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=timeout * MULT)

    def hdrs(self, token=None, sid=None, host=True):
        h = {"Content-Type": "application/json"}
        if host:
            h["Host"] = "49999-%s.%s" % (sid or self.sid, self.domain)
        tok = self.token if token is None else token
        if tok:
            h["X-Access-Token"] = tok
        return h

    def call(self, method, path, body=None, raw=None, **kw):
        c = self.conn()
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                            else None)
        c.request(method, path, body=data, headers=self.hdrs(**kw))
        r = c.getresponse()
        text = r.read()
        c.close()
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = text
        return r.status, parsed, r

    def lines_of(self, data):
        """The body as the SDKs read it; checks the NDJSON framing."""
        self.assertTrue(data.endswith(b"\n"), data[-200:])
        text = data.decode("utf-8")
        by_nl = text[:-1].split("\n")
        # httpx's iter_lines uses str.splitlines(): it must see the very same lines.
        self.assertEqual(text.splitlines(), by_nl, "a line breaks under str.splitlines()")
        out = []
        for ln in by_nl:
            self.assertTrue(ln.strip(), "blank line in %r" % text[:500])
            self.assertTrue(ln.isascii(), ln[:200])
            msg = json.loads(ln)
            self.assertIsInstance(msg, dict)
            self.assertIn("type", msg)
            out.append(msg)
        return out

    def execute(self, code, context_id=None, language=None, env_vars=None, expect=200, **kw):
        body = {"code": code, "context_id": context_id, "language": language,
                "env_vars": env_vars}
        c = self.conn()
        c.request("POST", "/execute", body=json.dumps(body).encode(), headers=self.hdrs(**kw))
        r = c.getresponse()
        data = r.read()
        c.close()
        self.assertEqual(r.status, expect, data[:500])
        if expect != 200:
            return data
        self.assertEqual(r.getheader("Content-Type"), "application/x-ndjson")
        msgs = self.lines_of(data)
        self.assertEqual(msgs[-1], {"type": "end_of_execution"})
        self.assertEqual([m for m in msgs if m["type"] == "end_of_execution"], [msgs[-1]])
        return msgs

    def of(self, msgs, t):
        return [m for m in msgs if m["type"] == t]

    def stdout(self, msgs):
        return "".join(m["text"] for m in self.of(msgs, "stdout"))

    def main_text(self, msgs):
        main = [m for m in self.of(msgs, "result") if m.get("is_main_result")]
        return main[0].get("text") if main else None

    def new_context(self, **fields):
        fields.setdefault("cwd", self.scratch)
        st, ctx, _ = self.call("POST", "/contexts", fields)
        self.assertEqual(st, 200, ctx)
        return ctx

    # ---- execution ----

    def test_print_stdout_line(self):
        msgs = self.execute("print('hello')")
        out = self.of(msgs, "stdout")
        self.assertEqual(len(out), 1, msgs)
        self.assertEqual(set(out[0]), {"type", "text", "timestamp"})
        self.assertEqual(out[0]["text"], "hello\n")
        self.assertRegex(out[0]["timestamp"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
        self.assertEqual(self.of(msgs, "error"), [])

    def test_stderr_line(self):
        msgs = self.execute("import sys; print('oops', file=sys.stderr)")
        err = self.of(msgs, "stderr")
        self.assertEqual("".join(m["text"] for m in err), "oops\n")
        self.assertIn("timestamp", err[0])

    def test_expression_is_main_result(self):
        msgs = self.execute("x_expr = 20\nx_expr + 22")
        res = self.of(msgs, "result")
        self.assertEqual(len(res), 1, msgs)
        self.assertIs(res[0]["is_main_result"], True)
        self.assertEqual(res[0]["text"], "42")
        self.assertNotIn("extra", res[0])  # no other MIME types

    def test_string_result_loses_one_pair_of_quotes(self):
        self.assertEqual(self.main_text(self.execute("'abc'")), "abc")
        self.assertEqual(self.main_text(self.execute('"it\'s"')), "it's")  # repr: "it's"
        self.assertEqual(self.main_text(self.execute("\"'q'\"")), "'q'")  # only one pair

    def test_number_of_executions(self):
        ctx = self.new_context()
        counts = []
        for code in ("1", "print(2)", "1/0"):
            msgs = self.execute(code, context_id=ctx["id"])
            n = self.of(msgs, "number_of_executions")
            self.assertEqual(len(n), 1, msgs)
            self.assertIsInstance(n[0]["execution_count"], int)
            counts.append(n[0]["execution_count"])
        self.assertEqual(counts, [counts[0], counts[0] + 1, counts[0] + 2])

    def test_error_line(self):
        msgs = self.execute("print('before')\n1/0")
        errs = self.of(msgs, "error")
        self.assertEqual(len(errs), 1, msgs)
        e = errs[0]
        self.assertEqual(set(e), {"type", "name", "value", "traceback"})
        self.assertEqual(e["name"], "ZeroDivisionError")
        self.assertEqual(e["value"], "division by zero")
        self.assertIsInstance(e["traceback"], str)
        self.assertIn("ZeroDivisionError", e["traceback"])
        self.assertEqual(self.stdout(msgs), "before\n")
        # the context keeps working after an error
        self.assertEqual(self.main_text(self.execute("3 * 3")), "9")

    def test_display_html_and_markdown(self):
        msgs = self.execute("from IPython.display import display, HTML, Markdown\n"
                            "display(HTML('<b>bold</b>'))\n"
                            "display(Markdown('*md*'))\n"
                            "display({'k': 1}, raw=False)")
        res = self.of(msgs, "result")
        self.assertGreaterEqual(len(res), 3, msgs)
        self.assertEqual(res[0]["html"], "<b>bold</b>")
        self.assertIs(res[0]["is_main_result"], False)
        self.assertEqual(res[1]["markdown"], "*md*")
        self.assertTrue(all(r["is_main_result"] is False for r in res), res)

    def test_json_and_extra_mime(self):
        msgs = self.execute("from IPython.display import display\n"
                            "display({'application/json': {'a': [1, 2]},\n"
                            "         'application/x-custom': 'c',\n"
                            "         'text/plain': 'plain'}, raw=True)")
        res = self.of(msgs, "result")
        self.assertEqual(len(res), 1, msgs)
        self.assertEqual(res[0]["json"], {"a": [1, 2]})
        self.assertEqual(res[0]["extra"], {"application/x-custom": "c"})
        self.assertEqual(res[0]["text"], "plain")

    def test_matplotlib_png(self):
        if not has_module(self.py, "matplotlib"):
            self.skipTest("matplotlib is not installed for the kernel's Python")
        msgs = self.execute("import matplotlib.pyplot as plt\n"
                            "plt.plot([1, 2, 3], [3, 1, 2])\n"
                            "plt.show()")
        pngs = [r for r in self.of(msgs, "result") if "png" in r]
        self.assertEqual(len(pngs), 1, [{k: str(v)[:60] for k, v in r.items()}
                                        for r in self.of(msgs, "result")])
        import base64
        self.assertTrue(base64.b64decode(pngs[0]["png"]).startswith(b"\x89PNG"))
        self.assertIs(pngs[0]["is_main_result"], False)

    def test_pandas_html(self):
        if not has_module(self.py, "pandas"):
            self.skipTest("pandas is not installed for the kernel's Python")
        msgs = self.execute("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
        res = [r for r in self.of(msgs, "result") if r.get("is_main_result")]
        self.assertEqual(len(res), 1, msgs)
        self.assertIn("<table", res[0]["html"])
        self.assertIn("a", res[0]["text"])

    def test_kernel_dying_ends_with_an_error(self):
        ctx = self.new_context()
        # ipykernel sends output from a background thread: give it a moment before the
        # process ends, or the line may die with it (that is the kernel's, not ours).
        msgs = self.execute("import os, time\nprint('bye', flush=True)\ntime.sleep(0.5)\n"
                            "os._exit(3)", context_id=ctx["id"])
        self.assertEqual(self.stdout(msgs), "bye\n")
        self.assertEqual(len(self.of(msgs, "error")), 1, msgs)
        st, body, _ = self.call("POST", "/contexts/%s/restart" % ctx["id"])
        self.assertTrue(200 <= st < 300, (st, body))
        self.assertEqual(self.main_text(self.execute("6 * 7", context_id=ctx["id"])), "42")
        self.call("DELETE", "/contexts/%s" % ctx["id"])

    def test_daemon_going_away_mid_execution(self):
        ctx = self.new_context()
        code = ("import os, time\nprint('x', flush=True)\ntime.sleep(0.5)\n"
                "os.kill(%d, 9)\ntime.sleep(30)" % self.daemon.pid)
        try:
            msgs = self.execute(code, context_id=ctx["id"])
        finally:
            self.daemon.wait(timeout=30)
            type(self).start_daemon()
        self.assertEqual(self.stdout(msgs), "x\n")
        errs = self.of(msgs, "error")
        self.assertEqual(len(errs), 1, msgs)
        self.assertEqual(errs[0]["name"], "UnexpectedEndOfExecution")
        self.assertEqual(errs[0]["traceback"], "")
        self.assertTrue(errs[0]["value"], errs)
        # a new daemon serves the sandbox again
        self.assertEqual(self.main_text(self.execute("1 + 1")), "2")

    def test_unicode_is_escaped_on_the_wire(self):
        # U+2028 and U+0085 would split a line under str.splitlines(): lines are ASCII.
        msgs = self.execute("print('a\\u2028b\\x85c \u00e9\u4e2d\U0001F600')")
        self.assertEqual(self.stdout(msgs), "a\u2028b\x85c \u00e9\u4e2d\U0001F600\n")

    def test_keepalive_during_silence(self):
        c = self.conn()
        body = {"code": "import time\ntime.sleep(12)\nprint('done')", "context_id": None,
                "language": None, "env_vars": None}
        t0 = time.monotonic()
        c.request("POST", "/execute", body=json.dumps(body).encode(), headers=self.hdrs())
        r = c.getresponse()
        self.assertEqual(r.status, 200)
        # The response starts once the execution does, not with the first output: the SDKs
        # start their execution timeout there.
        self.assertLess(time.monotonic() - t0, 2.5 * MULT)
        stamps, lines = [], []
        while True:
            ln = r.readline()  # chunked framing decoded
            if not ln:
                break
            stamps.append(time.monotonic())
            lines.append(ln)
        c.close()
        msgs = self.lines_of(b"".join(lines))
        ka = self.of(msgs, "keepalive")
        self.assertGreaterEqual(len(ka), 2, msgs)
        self.assertEqual(ka[0], {"type": "keepalive"})
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        self.assertLess(max(gaps), 7.5 * MULT, gaps)  # every 5 s of silence
        self.assertEqual(self.stdout(msgs), "done\n")
        self.assertEqual(msgs[-1], {"type": "end_of_execution"})

    def test_env_vars_per_execution(self):
        code = "import os\nprint(os.environ.get('SP_CODE_TEST_VAR'))"
        msgs = self.execute(code, env_vars={"SP_CODE_TEST_VAR": "val ue"})
        self.assertEqual(self.stdout(msgs), "val ue\n")
        self.assertEqual(self.stdout(self.execute(code)), "None\n")

    def test_language_bash(self):
        msgs = self.execute("echo from-bash", language="bash")
        self.assertEqual(self.stdout(msgs), "from-bash\n")

    def test_missing_keys_are_null(self):
        # the JS SDK leaves out what is undefined: {"code": ...} alone
        c = self.conn()
        c.request("POST", "/execute", body=b'{"code": "print(5)"}', headers=self.hdrs())
        r = c.getresponse()
        data = r.read()
        c.close()
        self.assertEqual(r.status, 200, data)
        self.assertEqual(self.stdout(self.lines_of(data)), "5\n")

    # ---- bad input ----

    def test_context_and_language_is_400(self):
        ctx = self.new_context()
        data = self.execute("1", context_id=ctx["id"], language="python", expect=400)
        self.assertIn("Only one of context_id or language", json.loads(data)["message"])

    def test_malformed_bodies_are_400(self):
        for raw in (b"{not json", b"[1]", b"", b'{"code": 5}', b'{"context_id": "x"}',
                    b'{"code": "1", "env_vars": {"A": 1}}', b'{"code": "1", "env_vars": []}',
                    b'{"code": "1", "language": 3}'):
            st, body, _ = self.call("POST", "/execute", raw=raw)
            self.assertEqual(st, 400, (raw, body))
            self.assertEqual(body["code"], 400)
            self.assertIsInstance(body["message"], str)

    def test_unknown_language_is_400(self):
        self.execute("1", language="cobol", expect=400)

    def test_unknown_context_is_404(self):
        data = self.execute("1", context_id="nosuchcontext", expect=404)
        self.assertEqual(json.loads(data)["code"], 404)

    def test_unknown_path_and_method(self):
        st, body, _ = self.call("GET", "/nothing")
        self.assertEqual(st, 404, body)
        st, body, _ = self.call("GET", "/execute")
        self.assertEqual(st, 405, body)
        st, body, _ = self.call("GET", "/health")
        self.assertEqual((st, body), (200, "OK"))

    # ---- auth ----

    def test_execute_needs_the_token(self):
        st, body, _ = self.call("POST", "/execute", {"code": "1"}, token="")
        self.assertEqual(st, 401, body)
        self.assertEqual(body["code"], 401)
        st, body, _ = self.call("POST", "/execute", {"code": "1"}, token="x" * 43)
        self.assertEqual(st, 401, body)

    def test_contexts_follow_the_execute_rule(self):
        # /execute's rule for the context calls too: X-Access-Token or the traffic token, which
        # the JS SDK sends them alone (create returns one for every sandbox).
        for path in ("/contexts", "/execute"):
            method = "GET" if path == "/contexts" else "POST"
            body = None if path == "/contexts" else {"code": "1"}
            st, resp, _ = self.call(method, path, body, token="")
            self.assertEqual((st, resp), (401, {"code": 401, "message": "missing X-Access-Token "
                                                "or E2B-Traffic-Access-Token"}))
            st, resp, _ = self.call(method, path, body, token="x" * 43)
            self.assertEqual((st, resp), (401, {"code": 401, "message": "invalid access token "
                                                "for this sandbox"}))
        c = self.conn()
        c.request("GET", "/contexts", headers=dict(self.hdrs(token=""), **{
            "E2B-Traffic-Access-Token": self.traffic}))
        r = c.getresponse()
        body = r.read()
        c.close()
        self.assertEqual(r.status, 200, body)

    def test_api_address_routing_by_token(self):
        # E2B_DEBUG: http://localhost:49999 with only X-Access-Token to route on.
        msgs = self.execute("print('debug')", host=False)
        self.assertEqual(self.stdout(msgs), "debug\n")
        st, body, _ = self.call("GET", "/contexts", host=False)
        self.assertEqual(st, 200, body)

    def test_not_running_is_502(self):
        sb = self.create()
        st, body = self.s.request("POST", "/sandboxes/%s/pause" % sb["sandboxID"], key="",
                                  headers={"X-API-KEY": self.key}, timeout=120)
        self.assertEqual(st, 204, body)
        st, body, _ = self.call("POST", "/execute", {"code": "1"}, sid=sb["sandboxID"],
                                token=sb["envdAccessToken"])
        self.assertEqual(st, 502, body)

    # ---- contexts ----

    def test_contexts_crud(self):
        ctx = self.new_context()
        self.assertEqual(set(ctx), {"id", "language", "cwd"})
        self.assertEqual(ctx["language"], "python")
        self.assertEqual(ctx["cwd"], self.scratch)
        self.execute("print(1)")  # makes sure the python default context exists
        self.execute("echo 1", language="bash")
        st, listed, _ = self.call("GET", "/contexts")
        self.assertEqual(st, 200, listed)
        self.assertIsInstance(listed, list)
        self.assertIn(ctx, listed)
        for c in listed:
            self.assertEqual(set(c), {"id", "language", "cwd"})
        st, listed2, _ = self.call("GET", "/contexts")
        self.assertEqual(listed, listed2)

        # state is per context; cwd is the context's
        self.execute("ctx_marker = 7", context_id=ctx["id"])
        self.assertEqual(self.main_text(self.execute("ctx_marker * 6", context_id=ctx["id"])),
                         "42")
        self.assertEqual(self.stdout(self.execute("import os; print(os.getcwd())",
                                                  context_id=ctx["id"])), self.scratch + "\n")
        self.assertEqual(self.of(self.execute("ctx_marker"), "error")[0]["name"], "NameError")

        st, body, _ = self.call("POST", "/contexts/%s/restart" % ctx["id"])
        self.assertTrue(200 <= st < 300, (st, body))
        self.assertEqual(self.of(self.execute("ctx_marker", context_id=ctx["id"]),
                                 "error")[0]["name"], "NameError")

        st, body, _ = self.call("DELETE", "/contexts/%s" % ctx["id"])
        self.assertTrue(200 <= st < 300, (st, body))
        st, listed, _ = self.call("GET", "/contexts")
        self.assertNotIn(ctx["id"], [c["id"] for c in listed])
        st, body, _ = self.call("DELETE", "/contexts/%s" % ctx["id"])
        self.assertEqual(st, 404, body)
        st, body, _ = self.call("POST", "/contexts/%s/restart" % ctx["id"])
        self.assertEqual(st, 404, body)
        self.execute("1", context_id=ctx["id"], expect=404)

    def test_list_includes_default_contexts(self):
        # E2B's server lists the kernels it holds, its default Python one included.
        self.execute("1")
        self.execute("echo 1", language="bash")
        st, listed, _ = self.call("GET", "/contexts")
        self.assertEqual(st, 200, listed)
        ids = {c["id"]: c["language"] for c in listed}
        self.assertEqual(ids.get("default-python"), "python", listed)
        self.assertEqual(ids.get("default-bash"), "bash", listed)
        mine = self.new_context()
        st, after, _ = self.call("GET", "/contexts")
        self.assertEqual(len(after), len(listed) + 1, (listed, after))
        self.assertIn(mine, after)
        self.call("DELETE", "/contexts/%s" % mine["id"])

    def test_bash_context(self):
        ctx = self.new_context(language="bash")
        self.assertEqual(ctx["language"], "bash")
        self.execute("export SP_B=kept", context_id=ctx["id"])
        self.assertEqual(self.stdout(self.execute("echo $SP_B", context_id=ctx["id"])),
                         "kept\n")
        self.call("DELETE", "/contexts/%s" % ctx["id"])

    def test_create_context_bad_input(self):
        for body in ({"language": 5}, {"cwd": ["x"]}, {"language": "cobol"}):
            st, r, _ = self.call("POST", "/contexts", body)
            self.assertEqual(st, 400, (body, r))
        st, r, _ = self.call("POST", "/contexts", raw=b"{nope")
        self.assertEqual(st, 400, r)

    # ---- the client leaving ----

    def leave_mid_execution(self, tls):
        """Starts a long execution over HTTP/1.1, reads its first output, closes the
        connection; returns how long the next execution in that context then took."""
        ctx = self.new_context()
        sock = socket.create_connection(("127.0.0.1", self.s.port), timeout=30 * MULT)
        host = self.hdrs()["Host"]
        if tls:
            c = ssl.create_default_context(
                cafile=os.path.join(self.s.data_dir, "tls", "ca.pem"))
            c.set_alpn_protocols(["http/1.1"])
            sock = c.wrap_socket(sock, server_hostname=host.rsplit(":", 1)[0])
        body = json.dumps({"code": "import time\nprint('go', flush=True)\ntime.sleep(120)",
                           "context_id": ctx["id"], "language": None,
                           "env_vars": None}).encode()
        req = ("POST /execute HTTP/1.1\r\nHost: %s\r\nX-Access-Token: %s\r\n"
               "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
               % (host, self.token, len(body))).encode() + body
        sock.sendall(req)
        got = b""
        while b"go" not in got:
            chunk = sock.recv(4096)
            self.assertTrue(chunk, got)
            got += chunk
        self.assertTrue(got.startswith(b"HTTP/1.1 200"), got[:200])
        if tls:
            # close_notify first: bytes the server never reads sit before the FIN
            sock.settimeout(0.5)
            try:
                sock.unwrap()
            except (OSError, ValueError):
                pass
        sock.close()
        t0 = time.monotonic()
        msgs = self.execute("print('after')", context_id=ctx["id"])
        took = time.monotonic() - t0
        self.assertEqual(self.stdout(msgs), "after\n")
        self.call("DELETE", "/contexts/%s" % ctx["id"])
        return took

    def test_disconnect_interrupts(self):
        took = self.leave_mid_execution(tls=False)
        # the gateway sees the close within a second or so, then the daemon interrupts
        self.assertLess(took, 8 * MULT)
        sys.stderr.write("[plain: next execution after %.1f s] " % took)

    def test_disconnect_interrupts_tls(self):
        took = self.leave_mid_execution(tls=True)
        self.assertLess(took, 8 * MULT)
        sys.stderr.write("[tls: next execution after %.1f s] " % took)


def pwd_name():
    import pwd
    return pwd.getpwuid(os.getuid()).pw_name


if __name__ == "__main__":
    unittest.main(verbosity=2)
