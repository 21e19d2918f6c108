"""The guest code-interpreter daemon (guest/code/space-code) on the host, over its socket.

Starts `space-code serve` on a free port as the current user and speaks the protocol of
core/channel/code.h to it: contexts (create/list/delete/restart), Python through a real IPython
kernel (state, stream order, rich results, errors, env, timeout, interrupt, disconnect,
kernel death, reseeding), bash (state, exit status, timeout), bad requests, concurrency
and a client that does not read. Also `space-code start` (detached, idempotent).

Needs the daemon's interpreter (its #! line) with jupyter_client and ipykernel; numpy,
pandas and matplotlib for the rich-result cases. Exits 77 (skip) without jupyter_client
or ipykernel. SP_TEST_KEEP=1 keeps the daemon log; SP_TEST_TIMEOUT_MULT stretches waits.
"""
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import KEEP, MULT, free_port  # noqa: E402

SCRIPT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "code", "space-code"))
SID = "sbx-test-1"


def interpreter():
    with open(SCRIPT) as f:
        first = f.readline()
    return first[2:].strip().split()[0] if first.startswith("#!") else sys.executable


def skip_reason():
    py = interpreter()
    if not os.path.exists(py):
        return "%s (the daemon's interpreter) is missing" % py
    r = subprocess.run([py, "-c", "import jupyter_client, ipykernel"], capture_output=True)
    if r.returncode != 0:
        return "%s has no jupyter_client/ipykernel (python3-jupyter-client, " \
               "python3-ipykernel)" % py
    return None


def has_modules(*names):
    r = subprocess.run([interpreter(), "-c", "import " + ", ".join(names)],
                       capture_output=True)
    return r.returncode == 0


class Daemon:
    def __init__(self, user=None):
        self.dir = tempfile.mkdtemp(prefix="space-code-test-")
        self.log = os.path.join(self.dir, "space-code.log")
        self.port = free_port()
        self.user = user or pwd.getpwuid(os.geteuid()).pw_name
        # The sandbox env file the agent writes at IDENTITY (agent/agent.h), here a temp file.
        self.env_file = os.path.join(self.dir, "sandbox.env")
        self.proc = subprocess.Popen(
            [interpreter(), SCRIPT, "serve", "--port", str(self.port), "--log", self.log,
             "--kernel-user", self.user],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(os.environ, SPACE_ENV_FILE=self.env_file))
        end = time.monotonic() + 30 * MULT
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        raise RuntimeError("space-code did not listen: %s" % self.log_text())

    def log_text(self):
        try:
            with open(self.log) as f:
                return f.read()[-4000:]
        except OSError:
            return "(no log)"

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        out = self.proc.stdout.read() + self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
        if not KEEP:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print("daemon log kept in", self.log, file=sys.stderr)
        return out


D = None


def setUpModule():
    global D
    D = Daemon()


def tearDownModule():
    out = D.stop()
    # Logging goes to the log file, never to stdout/stderr.
    assert out == b"", out


def connect(timeout=120, port=None):
    return socket.create_connection(("127.0.0.1", port or D.port), timeout=timeout * MULT)


def rpc(req, timeout=120, port=None):
    """One request: (status, [events]) after the daemon closes the connection."""
    s = connect(timeout, port)
    try:
        s.sendall(json.dumps(req).encode() + b"\n")
        f = s.makefile("rb")
        lines = [json.loads(line) for line in f]
    finally:
        s.close()
    return lines[0], lines[1:]


def op(name, **fields):
    req = {"op": name, "sandbox_id": fields.pop("sandbox_id", SID)}
    req.update(fields)
    return rpc(req)[0]


def run(code, ctx=None, timeout=120, **fields):
    req = {"op": "execute", "sandbox_id": fields.pop("sandbox_id", SID), "context_id": ctx,
           "code": code}
    req.update(fields)
    st, evs = rpc(req, timeout)
    return st, evs


def text(evs, stream="stdout"):
    return "".join(e["text"] for e in evs if e["type"] == stream)


def end(evs):
    assert evs and evs[-1]["type"] == "end", evs
    return evs[-1]


def results(evs):
    return [e for e in evs if e["type"] == "result"]


def errors(evs):
    return [e for e in evs if e["type"] == "error"]


class CodeDaemonTest(unittest.TestCase):
    def create(self, language="python", cwd=None):
        st = op("create", language=language, cwd=cwd)
        self.assertTrue(st["ok"], st)
        self.addCleanup(lambda: op("delete", context_id=st["context"]["id"]))
        return st["context"]

    def ok(self, code, ctx=None, **kw):
        st, evs = run(code, ctx, **kw)
        self.assertTrue(st["ok"], st)
        self.assertEqual(end(evs)["status"], "ok", evs)
        return evs

    def main_text(self, evs):
        main = [r for r in results(evs) if r["is_main_result"]]
        self.assertEqual(len(main), 1, evs)
        return main[0]["data"]["text/plain"]

    # -- contexts ----------------------------------------------------------------------

    def test_contexts_create_list_delete_restart(self):
        cwd = tempfile.mkdtemp(prefix="space-code-t-cwd-")
        self.addCleanup(shutil.rmtree, cwd, True)
        t0 = time.monotonic()
        ctx = self.create("Python3", cwd)
        print("\n  kernel start (create python context): %.2f s" % (time.monotonic() - t0),
              file=sys.stderr)
        self.assertEqual((ctx["language"], ctx["cwd"], ctx["default"]), ("python", cwd, False))
        ids = {c["id"]: c for c in op("list")["contexts"]}
        self.assertIn(ctx["id"], ids)
        self.assertTrue(ids["default-python"]["default"])
        self.assertEqual(self.main_text(self.ok("import os; os.getcwd()", ctx["id"])), repr(cwd))
        self.ok("kept = 41", ctx["id"])
        self.assertEqual(self.main_text(self.ok("kept + 1", ctx["id"])), "42")

        st = op("restart", context_id=ctx["id"])
        self.assertTrue(st["ok"], st)
        self.assertEqual(st["context"], ctx)
        st, evs = run("kept", ctx["id"])
        self.assertEqual(errors(evs)[0]["name"], "NameError", evs)
        self.assertEqual(self.main_text(self.ok("import os; os.getcwd()", ctx["id"])), repr(cwd))

        self.assertEqual(op("delete", context_id=ctx["id"]), {"ok": True})
        self.assertNotIn(ctx["id"], [c["id"] for c in op("list")["contexts"]])
        for name in ("delete", "restart", "interrupt"):
            self.assertEqual(op(name, context_id=ctx["id"])["error"]["code"], "not_found")
        st, _ = run("1", ctx["id"])
        self.assertEqual(st["error"]["code"], "not_found")

        b = self.create("  SH ")
        self.assertEqual(b["language"], "bash")
        st = op("create", language="cobol")
        self.assertEqual(st["error"]["code"], "unsupported_language", st)
        self.assertIn("python, bash", st["error"]["message"])
        self.assertEqual(op("create", cwd="/no/such/dir")["error"]["code"], "invalid")
        self.assertEqual(op("create", cwd="relative")["error"]["code"], "invalid")

    def test_restart_and_delete_during_execution(self):
        for lang, code, probe, cleared in (
                ("python", "import time\ntime.sleep(60)", "print(globals().get('marker'))",
                 "None\n"),
                ("bash", "sleep 60", "echo \"[$marker]\"", "[]\n")):
            ctx = self.create(lang)["id"]
            self.ok("marker=1", ctx)
            box = {}
            th = threading.Thread(target=lambda: box.update(r=run(code, ctx)))
            th.start()
            time.sleep(1)
            st = op("restart", context_id=ctx)
            self.assertTrue(st["ok"], st)
            th.join(30 * MULT)
            self.assertFalse(th.is_alive())
            evs = box["r"][1]
            self.assertEqual(end(evs)["status"], "interrupted", evs)
            self.assertEqual(errors(evs)[0]["name"], "ContextRestarted", evs)
            self.assertEqual(text(self.ok(probe, ctx)), cleared)

            box.clear()
            th = threading.Thread(target=lambda: box.update(r=run(code, ctx)))
            th.start()
            time.sleep(1)
            self.assertEqual(op("delete", context_id=ctx), {"ok": True})
            th.join(30 * MULT)
            self.assertFalse(th.is_alive())
            evs = box["r"][1]
            self.assertEqual(end(evs)["status"], "interrupted", evs)
            self.assertEqual(errors(evs)[0]["name"], "ContextDeleted", evs)

    def test_context_cap(self):
        made = []
        try:
            for _ in range(40):
                st = op("create", language="bash")
                if not st["ok"]:
                    self.assertEqual(st["error"]["code"], "unavailable", st)
                    break
                made.append(st["context"]["id"])
            else:
                self.fail("no cap on contexts")
            self.assertLessEqual(len(made), 32)
        finally:
            for cid in made:
                op("delete", context_id=cid)

    # -- python --------------------------------------------------------------------------

    def test_python_state_result_and_error(self):
        ctx = self.create()["id"]
        self.ok("x = 20\ndef f(a):\n    return a + x", ctx)
        evs = self.ok("f(22)", ctx)
        self.assertEqual(self.main_text(evs), "42")
        c1 = end(evs)["execution_count"]
        c2 = end(self.ok("f(1)", ctx))["execution_count"]
        self.assertIsInstance(c1, int)
        self.assertEqual(c2, c1 + 1)

        st, evs = run("def g():\n    raise ValueError('bad thing')\ng()", ctx)
        self.assertEqual(end(evs)["status"], "error")
        err = errors(evs)
        self.assertEqual(len(err), 1, evs)
        self.assertEqual((err[0]["name"], err[0]["value"]), ("ValueError", "bad thing"))
        plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in err[0]["traceback"]]
        self.assertTrue(any("----> 3 g()" in line for line in plain), plain)
        self.assertTrue(all(isinstance(line, str) for line in err[0]["traceback"]))
        st, evs = run("print(", ctx)
        self.assertEqual(errors(evs)[0]["name"], "SyntaxError", evs)

    def test_python_stream_order_and_timestamps(self):
        ctx = self.create()["id"]
        code = ("import sys\nfor i in range(3):\n    print('out', i)\n"
                "    print('err', i, file=sys.stderr)\nprint('last')")
        evs = self.ok(code, ctx)
        streams = [(e["type"], e["text"]) for e in evs if e["type"] in ("stdout", "stderr")]
        joined = [(t, line) for t, s in streams for line in s.splitlines()]
        self.assertEqual(joined, [("stdout", "out 0"), ("stderr", "err 0"), ("stdout", "out 1"),
                                  ("stderr", "err 1"), ("stdout", "out 2"), ("stderr", "err 2"),
                                  ("stdout", "last")], evs)
        for e in evs[:-1]:
            self.assertRegex(e["timestamp"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")

    @unittest.skipUnless(has_modules("matplotlib", "pandas"), "no matplotlib/pandas")
    def test_python_rich_results(self):
        ctx = self.create()["id"]
        evs = self.ok("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()", ctx)
        pngs = [r for r in results(evs) if "image/png" in r["data"]]
        self.assertEqual(len(pngs), 1, evs)
        self.assertFalse(pngs[0]["is_main_result"])
        import base64
        self.assertTrue(base64.b64decode(pngs[0]["data"]["image/png"]).startswith(b"\x89PNG"))

        evs = self.ok("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})", ctx)
        data = [r for r in results(evs) if r["is_main_result"]][0]["data"]
        self.assertIn("<table", data["text/html"])
        self.assertIn("text/plain", data)

        evs = self.ok("from IPython.display import display\n"
                      "display({'application/json': {'k': 1}}, raw=True)", ctx)
        self.assertEqual(results(evs)[0]["data"], {"application/json": {"k": 1}}, evs)

    def test_python_env_is_per_execution(self):
        ctx = self.create()["id"]
        self.ok("import os\nos.environ['KEEP_ME'] = 'before'", ctx)
        evs = self.ok("print(os.environ.get('SP_A'), os.environ['KEEP_ME'])", ctx,
                      env={"SP_A": "one", "KEEP_ME": "during"})
        self.assertEqual(text(evs), "one during\n")
        evs = self.ok("print(os.environ.get('SP_A'), os.environ['KEEP_ME'])", ctx)
        self.assertEqual(text(evs), "None before\n")
        # The silent set/restore executions do not count.
        c1 = end(self.ok("1", ctx, env={"X": "1"}))["execution_count"]
        c2 = end(self.ok("1", ctx))["execution_count"]
        self.assertEqual(c2, c1 + 1)
        st, _ = run("1", ctx, env={"A": 1})
        self.assertEqual(st["error"]["code"], "invalid")

    def write_sandbox_env(self, env):
        tmp = D.env_file + ".new"
        with open(tmp, "wb") as f:
            f.write(b"".join(("%s=%s" % kv).encode() + b"\0" for kv in env.items()))
        os.replace(tmp, D.env_file)

    def test_sandbox_env_reaches_every_context(self):
        # What Sandbox.create(envs=...) gave reaches interpreters that were running before the
        # sandbox existed (a template snapshot's), and follows the file when it changes.
        self.addCleanup(lambda: os.path.exists(D.env_file) and os.unlink(D.env_file))
        py, sh = self.create()["id"], self.create("bash")["id"]
        self.write_sandbox_env({"SBX_ONE": "1 one", "SBX_TWO": "two"})
        show = "import os\nprint(os.environ.get('SBX_ONE'), os.environ.get('SBX_TWO'))"
        self.assertEqual(text(self.ok(show, py)), "1 one two\n")
        self.assertEqual(text(self.ok('echo "$SBX_ONE|$SBX_TWO"', sh)), "1 one|two\n")
        self.assertEqual(text(self.ok(show)), "1 one two\n")  # the default context too
        # A per-call value wins for that call, then the sandbox's comes back.
        self.assertEqual(text(self.ok(show, py, env={"SBX_ONE": "call"})), "call two\n")
        self.assertEqual(text(self.ok(show, py)), "1 one two\n")
        self.assertEqual(text(self.ok('echo "$SBX_ONE"', sh, env={"SBX_ONE": "c"})), "c\n")
        self.assertEqual(text(self.ok('echo "$SBX_ONE"', sh)), "1 one\n")
        # Changed and removed variables follow the file.
        time.sleep(0.01)
        self.write_sandbox_env({"SBX_ONE": "changed"})
        self.assertEqual(text(self.ok(show, py)), "changed None\n")
        self.assertEqual(text(self.ok('echo "$SBX_ONE|${SBX_TWO-unset}"', sh)), "changed|unset\n")
        # A restarted context gets it again.
        self.assertTrue(op("restart", context_id=py)["ok"])
        self.assertEqual(text(self.ok(show, py)), "changed None\n")

    @unittest.skipUnless(has_modules("matplotlib", "pandas"), "no matplotlib/pandas")
    def test_kernels_register_the_e2b_formatters(self):
        # space_formatters.py (beside the daemon) gives dicts JSON, DataFrames e2b/data and
        # figures e2b/chart; guest/tests/test_formatters.py covers their content.
        ctx = self.create()["id"]
        data = results(self.ok("{'a': [1, 2]}", ctx))[0]["data"]
        self.assertEqual(data["application/json"], {"a": [1, 2]})
        data = results(self.ok("import pandas as pd\npd.DataFrame({'x': [1]})", ctx))[0]["data"]
        self.assertEqual(data["e2b/data"], {"x": [1]})
        evs = self.ok("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()", ctx)
        charts = [r["data"]["e2b/chart"] for r in results(evs) if "e2b/chart" in r["data"]]
        self.assertEqual([c["type"] for c in charts], ["line"], evs)
        self.assertEqual(set(results(self.ok("1 + 1", ctx))[0]["data"]), {"text/plain"})

    def test_python_timeout_keeps_context(self):
        ctx = self.create()["id"]
        self.ok("survivor = 'still here'", ctx)
        t0 = time.monotonic()
        st, evs = run("import time\nprint('sleeping', flush=True)\ntime.sleep(30)\nafter = 1",
                      ctx, timeout_ms=2000)
        took = time.monotonic() - t0
        self.assertEqual(end(evs)["status"], "timeout", evs)
        err = errors(evs)
        self.assertEqual([(e["name"], e["value"]) for e in err],
                         [("TimeoutError", "execution timed out after 2 s")], evs)
        self.assertIn("sleeping", text(evs))
        self.assertLess(took, 2 + 4 * MULT)
        self.assertGreaterEqual(took, 1.9)
        t0 = time.monotonic()
        evs = self.ok("(survivor, 'after' in dir())", ctx)
        self.assertEqual(self.main_text(evs), "('still here', False)")
        self.assertLess(time.monotonic() - t0, 3 * MULT)

    def test_python_interrupt_op(self):
        ctx = self.create()["id"]
        box = {}
        th = threading.Thread(target=lambda: box.update(r=run("import time\ntime.sleep(60)",
                                                               ctx)))
        th.start()
        time.sleep(1.5)
        self.assertEqual(op("interrupt", context_id=ctx), {"ok": True})
        th.join(10 * MULT)
        self.assertFalse(th.is_alive())
        st, evs = box["r"]
        self.assertEqual(end(evs)["status"], "interrupted", evs)
        self.assertEqual(errors(evs)[0]["name"], "KeyboardInterrupt", evs)
        self.ok("1", ctx)

    def test_python_client_disconnect_interrupts(self):
        ctx = self.create()["id"]
        s = connect()
        s.sendall(json.dumps({"op": "execute", "sandbox_id": SID, "context_id": ctx,
                              "code": "import time\nstarted = 1\ntime.sleep(60)\nfinished = 1"}
                             ).encode() + b"\n")
        f = s.makefile("rb")
        self.assertTrue(json.loads(f.readline())["ok"])
        time.sleep(1.5)
        f.close()
        s.close()
        t0 = time.monotonic()
        evs = self.ok("('started' in dir(), 'finished' in dir())", ctx)
        self.assertLess(time.monotonic() - t0, 5 * MULT)
        self.assertEqual(self.main_text(evs), "(True, False)")

    def test_python_kernel_death_and_restart(self):
        ctx = self.create()["id"]
        self.ok("state = 1", ctx)
        t0 = time.monotonic()
        st, evs = run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", ctx)
        self.assertLess(time.monotonic() - t0, 3 * MULT)
        self.assertEqual(end(evs)["status"], "crashed", evs)
        self.assertEqual(errors(evs)[0]["name"], "KernelDied", evs)
        st, evs = run("1", ctx)
        self.assertEqual(end(evs)["status"], "crashed", evs)
        self.assertTrue(op("restart", context_id=ctx)["ok"])
        st, evs = run("state", ctx)
        self.assertEqual(errors(evs)[0]["name"], "NameError", evs)
        self.ok("1", ctx)

    def test_default_context_revives_after_death(self):
        # A default context has no id its user knows: the next execution gets a fresh kernel.
        self.ok("doomed_marker = 1")
        st, evs = run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        self.assertEqual(end(evs)["status"], "crashed", evs)
        st, evs = run("doomed_marker")
        self.assertEqual(errors(evs)[0]["name"], "NameError", evs)
        self.assertEqual(self.main_text(self.ok("6 * 7")), "42")
        st, evs = run("kill -9 $$", language="bash")
        self.assertEqual(end(evs)["status"], "crashed", evs)
        self.assertEqual(text(self.ok("echo again", language="bash")), "again\n")

    def test_default_context(self):
        evs = self.ok("default_marker = 7")
        self.assertEqual(self.main_text(self.ok("default_marker", None, language="py")), "7")
        ctx = [c for c in op("list")["contexts"] if c["id"] == "default-python"][0]
        self.assertEqual(self.main_text(self.ok("default_marker", ctx["id"])), "7")

    @unittest.skipUnless(has_modules("numpy"), "no numpy")
    def test_reseed_on_new_sandbox_id(self):
        ctx = self.create()["id"]
        ref = random.Random(1234)
        expect = [ref.random() for _ in range(3)]
        self.ok("import random, numpy\nrandom.seed(1234)\nnumpy.random.seed(7)", ctx,
                sandbox_id="sbx-seed-a")
        # Same sandbox: the seeded sequence goes on.
        for want in expect[:2]:
            evs = self.ok("random.random()", ctx, sandbox_id="sbx-seed-a")
            self.assertEqual(float(self.main_text(evs)), want)
        # A new sandbox id (a clone): fresh entropy, not the seeded continuation.
        evs = self.ok("(random.random(), float(numpy.random.random()))", ctx,
                      sandbox_id="sbx-seed-b")
        got_r, got_np = eval(self.main_text(evs))
        self.assertNotEqual(got_r, expect[2])
        import_np = subprocess.run(
            [interpreter(), "-c", "import numpy; numpy.random.seed(7); print(repr(float("
             "numpy.random.random())))"], capture_output=True, text=True, check=True)
        self.assertNotEqual(got_np, float(import_np.stdout))

        # bash: $RANDOM after RANDOM=5 is a fixed sequence; a new sandbox id breaks it.
        b = self.create("bash")["id"]
        seq = subprocess.run(["bash", "-c", "RANDOM=5; echo $RANDOM $RANDOM"],
                             capture_output=True, text=True, check=True).stdout.split()
        self.ok("RANDOM=5", b, sandbox_id="sbx-seed-b")
        self.assertEqual(text(self.ok("echo $RANDOM", b, sandbox_id="sbx-seed-b")).strip(),
                         seq[0])
        self.ok("RANDOM=5", b, sandbox_id="sbx-seed-b")
        got = text(self.ok("echo $RANDOM", b, sandbox_id="sbx-seed-c")).strip()
        self.assertNotEqual(got, seq[0])
        op("list")  # back to the suite's sandbox id

    def test_concurrent_contexts(self):
        a = self.create()["id"]
        b = self.create()["id"]
        box = {}

        def go(name, ctx):
            box[name] = run("import time\ntime.sleep(3)\n'done'", ctx)

        t0 = time.monotonic()
        ths = [threading.Thread(target=go, args=(n, c)) for n, c in (("a", a), ("b", b))]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        took = time.monotonic() - t0
        for n in "ab":
            self.assertEqual(end(box[n][1])["status"], "ok", box[n])
        self.assertLess(took, 3 + 2 * MULT, "two contexts did not run at the same time")

        # One context runs its executions one after the other, in order.
        order = []

        def seq(i):
            order.append(("sent", i))
            st, evs = run("import time\ntime.sleep(1)\n%d" % i, a)
            order.append(("done", i, self.main_text(evs)))

        t0 = time.monotonic()
        t1 = threading.Thread(target=seq, args=(1,))
        t1.start()
        time.sleep(0.3)
        t2 = threading.Thread(target=seq, args=(2,))
        t2.start()
        t1.join(30)
        t2.join(30)
        self.assertGreaterEqual(time.monotonic() - t0, 2.0)
        self.assertEqual([o for o in order if o[0] == "done"],
                         [("done", 1, "1"), ("done", 2, "2")])

    def test_slow_client_does_not_block_others(self):
        b = self.create("bash")["id"]
        s = connect()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(json.dumps({"op": "execute", "sandbox_id": SID, "context_id": b,
                              "code": "yes 0123456789abcdef"}
                             ).encode() + b"\n")
        time.sleep(1)  # the daemon is now stuck writing to us
        t0 = time.monotonic()
        self.assertEqual(self.main_text(self.ok("1+1")), "2")
        self.assertLess(time.monotonic() - t0, 5 * MULT)
        s.close()  # gone: the endless command is interrupted, the context goes on
        t0 = time.monotonic()
        evs = self.ok("echo alive", b, timeout=60)
        self.assertEqual(text(evs), "alive\n")
        self.assertLess(time.monotonic() - t0, 15 * MULT)

    # -- bash ----------------------------------------------------------------------------

    def test_bash_state_status_env_timeout(self):
        b = self.create("bash")["id"]
        d = tempfile.mkdtemp(prefix="space-code-t-bash-")
        self.addCleanup(shutil.rmtree, d, True)
        self.ok("cd %s && V=17 && f() { echo \"f:$1:$V\"; }" % d, b)
        evs = self.ok("pwd; f x; echo to-err >&2", b)
        self.assertEqual(text(evs), "%s\nf:x:17\n" % d)
        self.assertEqual(text(evs, "stderr"), "to-err\n")
        self.assertIsNone(end(evs)["execution_count"])

        st, evs = run("echo partial; echo oops >&2; (exit 3)", b)
        self.assertEqual(end(evs)["status"], "error", evs)
        err = errors(evs)[0]
        self.assertEqual((err["name"], err["value"]), ("ExitCode", "3"))
        self.assertIn("oops", err["traceback"])
        self.assertEqual(text(evs), "partial\n")
        # A failing command that is not the last one does not make the execution fail.
        self.ok("false; true", b)
        # Quotes, backslashes, newlines, unicode and no trailing newline pass unchanged.
        evs = self.ok("printf '%s' \"a'b\\\\c\n\u00e9\u4e2d\"", b)
        self.assertEqual(text(evs), "a'b\\c\n\u00e9\u4e2d")

        evs = self.ok("echo \"[$SP_E] [$HOME_X]\"", b, env={"SP_E": "it's\nhere", "HOME_X": "1"})
        self.assertEqual(text(evs), "[it's\nhere] [1]\n")
        self.assertEqual(text(self.ok("echo \"[${SP_E-unset}] [$HOME_X]\"", b)), "[unset] []\n")
        st, _ = run("true", b, env={"bad-name": "x"})
        self.assertEqual(st["error"]["code"], "invalid")

        t0 = time.monotonic()
        st, evs = run("echo begin; sleep 100; echo never", b, timeout_ms=1500)
        self.assertEqual(end(evs)["status"], "timeout", evs)
        self.assertEqual(errors(evs)[0]["name"], "TimeoutError")
        self.assertLess(time.monotonic() - t0, 1.5 + 3 * MULT)
        self.assertNotIn("never", text(evs))
        self.assertEqual(text(self.ok("echo $V; pwd", b)), "17\n%s\n" % d)

        st, evs = run("kill -9 $$", b)
        self.assertEqual(end(evs)["status"], "crashed", evs)
        self.assertIn("SIGKILL", errors(evs)[0]["value"])
        st, evs = run("echo", b)
        self.assertEqual(end(evs)["status"], "crashed", evs)
        self.assertTrue(op("restart", context_id=b)["ok"])
        self.assertEqual(text(self.ok("echo \"[$V]\"; pwd", b)).split("\n")[0], "[]")

    def test_bash_interrupt_op(self):
        b = self.create("bash")["id"]
        box = {}
        th = threading.Thread(target=lambda: box.update(r=run("sleep 60; echo no", b)))
        th.start()
        time.sleep(1)
        self.assertEqual(op("interrupt", context_id=b), {"ok": True})
        th.join(10 * MULT)
        self.assertFalse(th.is_alive())
        self.assertEqual(end(box["r"][1])["status"], "interrupted", box["r"])
        self.assertEqual(text(self.ok("echo yes", b)), "yes\n")

    # -- protocol errors -----------------------------------------------------------------

    def test_bad_requests(self):
        def raw(data):
            s = connect()
            try:
                s.sendall(data)
                return json.loads(s.makefile("rb").readline())
            finally:
                s.close()

        for data in (b"not json\n", b"[1,2]\n", b'{"op": 5, "sandbox_id": "x"}\n',
                     b'{"op": "fly", "sandbox_id": "x"}\n', b'{"op": "list"}\n',
                     b'{"op": "execute", "sandbox_id": "x"}\n',
                     b'{"op": "execute", "sandbox_id": "x", "code": 1}\n',
                     b'{"op": "execute", "sandbox_id": "x", "code": "1", "timeout_ms": "5"}\n',
                     b'{"op": "execute", "sandbox_id": "x", "code": "1", "timeout_ms": -1}\n',
                     b'{"op": "execute", "sandbox_id": "x", "code": "1", "env": [1]}\n',
                     b'{"op": "execute", "sandbox_id": "x", "code": "1", "context_id": 3}\n',
                     b'{"op": "execute", "sandbox_id": "x", "code": "1",'
                     b' "context_id": "default-python", "language": "python"}\n',
                     b'{"op": "delete", "sandbox_id": "x"}\n',
                     b'{"op": "create", "sandbox_id": "x", "language": 7}\n',
                     b'\xff\xfe\n', b"[" * 100000 + b"\n"):
            st = raw(data)
            self.assertEqual(st["ok"], False, data)
            self.assertEqual(st["error"]["code"], "invalid", (data, st))
        st = raw(b'{"op": "execute", "sandbox_id": "x", "language": "perl", "code": "1"}\n')
        self.assertEqual(st["error"]["code"], "unsupported_language")
        st = raw(b'{"op": "execute", "sandbox_id": "x", "context_id": "nope", "code": "1"}\n')
        self.assertEqual(st["error"]["code"], "not_found")

        # 17 MiB on one line: refused, the connection closed, the daemon fine.
        s = connect()
        big = b'{"op": "execute", "sandbox_id": "x", "code": "' + b"a" * (17 << 20) + b'"}\n'
        sender = threading.Thread(target=lambda: _sendall_quiet(s, big))
        sender.start()
        st = json.loads(s.makefile("rb").readline())
        sender.join(60)
        s.close()
        self.assertEqual(st["error"]["code"], "invalid", st)
        self.assertIn("16 MiB", st["error"]["message"])
        # Just under the limit is fine.
        code = "x = '" + "b" * (15 << 20) + "'\nlen(x)"
        self.assertEqual(self.main_text(self.ok(code, None)), str(15 << 20))
        self.assertTrue(op("list")["ok"])

    # -- speed ---------------------------------------------------------------------------

    def test_round_trip_median(self):
        self.ok("1+1")
        times = []
        for _ in range(50):
            t0 = time.monotonic()
            st, evs = run("1+1")
            times.append(time.monotonic() - t0)
            self.assertEqual(self.main_text(evs), "2")
        med = statistics.median(times)
        print("\n  1+1 round trip over the daemon socket: median %.1f ms, max %.1f ms (n=50)"
              % (med * 1000, max(times) * 1000), file=sys.stderr)
        self.assertLess(med, 1.0 * MULT)


def _sendall_quiet(s, data):
    try:
        s.sendall(data)
    except OSError:
        pass


def _uid(name):
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


@unittest.skipUnless(os.geteuid() == 0 and _uid("nobody") is not None,
                     "needs root and a nobody account")
class KernelUserTest(unittest.TestCase):
    """A root daemon runs the interpreters as the kernel user (in the guest: "user")."""

    def test_interpreters_run_as_the_kernel_user(self):
        d = Daemon("nobody")
        cwd = tempfile.mkdtemp(prefix="space-code-t-cwd-")
        os.chmod(cwd, 0o755)
        try:
            st = rpc({"op": "create", "sandbox_id": "s", "cwd": cwd}, port=d.port)[0]
            self.assertTrue(st["ok"], (st, d.log_text()))
            st, evs = rpc({"op": "execute", "sandbox_id": "s", "context_id": st["context"]["id"],
                           "code": "import os\n(os.getuid(), os.environ['USER'], os.getcwd(),"
                                   " os.environ['HOME'])"}, port=d.port)
            main = [e for e in evs if e["type"] == "result"][0]["data"]["text/plain"]
            self.assertEqual(eval(main), (_uid("nobody"), "nobody", cwd,
                                          pwd.getpwnam("nobody").pw_dir), evs)
            st = rpc({"op": "create", "sandbox_id": "s", "cwd": cwd, "language": "bash"},
                     port=d.port)[0]
            st, evs = rpc({"op": "execute", "sandbox_id": "s", "context_id": st["context"]["id"],
                           "code": "id -un; pwd; echo $USER"}, port=d.port)
            self.assertEqual(text(evs), "nobody\n%s\nnobody\n" % cwd, evs)
        finally:
            d.stop()
            shutil.rmtree(cwd, ignore_errors=True)


class StartCommandTest(unittest.TestCase):
    """`space-code start`: detached, idempotent, outlives the group that ran it."""

    def test_start_detaches_and_is_idempotent(self):
        port = free_port()
        d = tempfile.mkdtemp(prefix="space-code-t-start-")
        log = os.path.join(d, "log")
        user = pwd.getpwuid(os.geteuid()).pw_name
        argv = [interpreter(), SCRIPT, "start", "--port", str(port), "--log", log,
                "--kernel-user", user]
        pid = None
        try:
            t0 = time.monotonic()
            starter = subprocess.Popen(argv + ["--warm"], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
            out, err = starter.communicate(timeout=300 * MULT)
            self.assertEqual(starter.returncode, 0, err)
            try:
                os.killpg(starter.pid, signal.SIGKILL)  # whatever is left of its group
            except OSError:
                pass
            print("\n  start --warm: %.2f s" % (time.monotonic() - t0), file=sys.stderr)
            st = json.loads(subprocess.run([interpreter(), SCRIPT, "status", "--port",
                                            str(port)], capture_output=True, text=True,
                                           check=True).stdout)
            pid = st["pid"]
            dp = [c for c in st["contexts"] if c["id"] == "default-python"][0]
            self.assertEqual((dp["state"], dp["warm"]), ("ready", True))
            # Its own session and group: what ends the starter's group leaves it alone.
            self.assertNotIn(os.getsid(pid), (os.getsid(0), starter.pid))
            self.assertNotIn(os.getpgid(pid), (os.getpgid(0), starter.pid))
            t0 = time.monotonic()
            p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertLess(time.monotonic() - t0, 5)
            st2 = json.loads(subprocess.run([interpreter(), SCRIPT, "status", "--port",
                                             str(port)], capture_output=True, text=True,
                                            check=True).stdout)
            self.assertEqual(st2["pid"], pid)
            # The pre-imports did not bind names in the user's namespace.
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.sendall(json.dumps({"op": "execute", "sandbox_id": "s", "code":
                                  "import sys\n(sorted(n for n in dir() if not n.startswith('_')"
                                  " and n not in ('In', 'Out', 'exit', 'quit', 'get_ipython',"
                                  " 'sys')), 'numpy' in sys.modules or not %r)"
                                  % has_modules("numpy")}).encode() + b"\n")
            lines = [json.loads(x) for x in s.makefile("rb")]
            s.close()
            main = [e for e in lines if e.get("type") == "result"][0]["data"]["text/plain"]
            self.assertEqual(main, "([], True)")
        finally:
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    try:
                        os.kill(pid, 0)
                    except OSError:
                        break
                    time.sleep(0.1)
            if KEEP:
                print("start log kept in", log, file=sys.stderr)
            else:
                shutil.rmtree(d, ignore_errors=True)

    def test_start_fails_clearly(self):
        port = free_port()
        holder = socket.socket()
        holder.bind(("127.0.0.1", port))  # taken, and nothing answers the protocol
        holder.listen(1)
        d = tempfile.mkdtemp(prefix="space-code-t-start-")
        try:
            p = subprocess.run([interpreter(), SCRIPT, "start", "--port", str(port), "--log",
                                os.path.join(d, "log")], capture_output=True, text=True,
                               timeout=200)
            self.assertEqual(p.returncode, 1, p)
            self.assertIn("did not come up", p.stderr)
        finally:
            holder.close()
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    why = skip_reason()
    if why:
        print("skip:", why)
        sys.exit(77)
    unittest.main()
