"""Code contexts end to end on real microVMs through the native HTTP API (shipped spaced, QEMU
driver, the code-interpreter-v1 template with its warm kernel in the template snapshot).

Python state, results as MIME bundles (a matplotlib PNG), a kernel killed from inside the
guest and brought back by restart, bash contexts, per-execution env and timeout, clones of
the template snapshot that must not share their PRNG state, a context that survives suspend
and wake, and a template without the interpreter answering 409.

Needs SP_TEST_DATA_DIR with built `base` and `code-interpreter-v1` templates (the
e2e.template and e2e.template-ci fixtures) and root. Runs its own PostgreSQL.
"""
import base64
import http.client
import json
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, pg_bindir, Platform, wait_s  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
CI = "code-interpreter-v1"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def built(name):
    return DATA is not None and os.path.exists(os.path.join(DATA, "templates", name, "current"))


def skip_reason():
    if not built("base"):
        return "SP_TEST_DATA_DIR has no built base template"
    if not built(CI):
        return "SP_TEST_DATA_DIR has no built %s template (e2e.template-ci)" % CI
    if os.geteuid() != 0:
        return "needs root"
    if pg_bindir() is None:
        return "PostgreSQL is not installed"
    return None


class Run:
    """One execution's NDJSON events, with the pieces tests look at."""

    def __init__(self, status, events, raw):
        self.http_status, self.events, self.raw = status, events, raw

    def of(self, kind):
        return [e for e in self.events if e.get("type") == kind]

    @property
    def end(self):
        ends = self.of("end")
        return ends[-1] if ends else None

    @property
    def status(self):
        return self.end["status"] if self.end else None

    @property
    def stdout(self):
        return "".join(e["text"] for e in self.of("stdout"))

    @property
    def stderr(self):
        return "".join(e["text"] for e in self.of("stderr"))

    @property
    def main(self):
        """text/plain of the main result, or None."""
        for e in self.of("result"):
            if e.get("is_main_result"):
                return e["data"].get("text/plain")
        return None

    @property
    def error(self):
        errs = self.of("error")
        return errs[-1] if errs else None

    def __repr__(self):
        return "Run(http %s, %s)" % (self.http_status, self.raw[:1500])


@unittest.skipIf(skip_reason(), skip_reason())
class CodeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=(None,), binary=os.environ["SPACED"], data_dir=DATA,
                         env={"SPACE_ACCEL": os.environ.get("SPACE_ACCEL", "auto")})
        cls.s, cls.pg = cls.p.s, cls.p.pg
        cls.made = []

    @classmethod
    def tearDownClass(cls):
        for sid in cls.made:
            cls.s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
        cls.p.destroy()

    # ---- helpers ----

    def req(self, *a, **kw):
        return self.s.request(*a, **kw)

    def create(self, template=CI, **fields):
        t0 = time.time()
        st, r = self.req("POST", "/v1/sandboxes?wait=%d" % wait_s(120),
                         dict(template=template, **fields), timeout=130 * MULT)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["operation"]["status"], "succeeded", (r, self.s.read_log()))
        sid = r["sandbox"]["id"]
        self.made.append(sid)
        self.create_s = time.time() - t0
        return sid

    def execute(self, sid, code, timeout=120, **fields):
        """POST /execute; reads the NDJSON stream to its end."""
        body = dict(code=code, **fields)
        conn = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=timeout * MULT)
        try:
            conn.request("POST", "/v1/sandboxes/%s/execute" % sid, body=json.dumps(body),
                         headers={"Authorization": "Bearer " + self.s.key,
                                  "Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read().decode()
        finally:
            conn.close()
        events = []
        if r.status == 200:
            for line in raw.split("\n"):
                if line:
                    events.append(json.loads(line))  # every line is one JSON object
            self.assertTrue(raw.endswith("\n"), "the stream ends with a whole line: %r" % raw[-80:])
        run = Run(r.status, events, raw)
        if r.status == 200:
            self.assertEqual(events[0]["type"], "start", run)
            self.assertEqual(events[-1]["type"], "end", run)
            self.assertEqual(len(run.of("end")), 1, run)
        return run

    def ok(self, sid, code, **fields):
        run = self.execute(sid, code, **fields)
        self.assertEqual(run.http_status, 200, run)
        self.assertEqual(run.status, "ok", run)
        self.assertIsNone(run.error, run)
        return run

    def new_context(self, sid, **fields):
        st, ctx = self.req("POST", "/v1/sandboxes/%s/contexts" % sid, fields, timeout=120 * MULT)
        self.assertIn(st, (200, 201), ctx)
        self.assertTrue(ctx["id"], ctx)
        return ctx

    def contexts(self, sid):
        st, r = self.req("GET", "/v1/sandboxes/%s/contexts" % sid, timeout=60 * MULT)
        self.assertEqual(st, 200, r)
        return r["contexts"]

    def lifecycle(self, sid, verb, want):
        st, r = self.req("POST", "/v1/sandboxes/%s/%s?wait=%d" % (sid, verb, wait_s(120)),
                         timeout=130 * MULT)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["operation"]["status"], "succeeded", r)
        self.assertEqual(r["sandbox"]["state"], want)

    # ---- tests ----

    def test_python_state_results_and_errors(self):
        sid = self.create()
        first = self.ok(sid, "x = 20\nprint('hello', x)")
        self.assertEqual(first.stdout, "hello 20\n")
        ctx = first.events[0]["context"]
        self.assertEqual((ctx["language"], ctx["default"]), ("python", True), ctx)
        self.assertEqual(ctx["cwd"], "/home/user")
        two = self.ok(sid, "x * 2 + 2")
        self.assertEqual(two.main, "42")
        self.assertEqual(two.events[0]["context"]["id"], ctx["id"], "the same default context")
        self.assertIsInstance(two.end["execution_count"], int)
        self.assertGreater(two.end["execution_count"], first.end["execution_count"] or 0)
        for e in first.of("stdout"):
            self.assertRegex(e["timestamp"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")

        png = self.ok(sid, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\n"
                           "plt.title('e2e')\nplt.show()")
        images = [e["data"]["image/png"] for e in png.of("result") if "image/png" in e["data"]]
        self.assertEqual(len(images), 1, png)
        blob = base64.b64decode(images[0])
        self.assertEqual(blob[:8], PNG_SIGNATURE)
        self.assertGreater(len(blob), 2000)

        html = self.ok(sid, "import pandas as pd\npd.DataFrame({'a': [1, 2]})")
        main = [e for e in html.of("result") if e.get("is_main_result")]
        self.assertIn("<table", main[0]["data"].get("text/html", ""), html)

        err = self.execute(sid, "print('partial')\n1 / 0")
        self.assertEqual(err.http_status, 200, err)
        self.assertEqual(err.status, "error", err)
        self.assertEqual(err.stdout, "partial\n")
        self.assertEqual((err.error["name"], err.error["value"]),
                         ("ZeroDivisionError", "division by zero"), err)
        self.assertIsInstance(err.error["traceback"], list)
        self.assertTrue(any("ZeroDivisionError" in t for t in err.error["traceback"]), err)
        self.assertEqual(self.ok(sid, "x").main, "20", "state survives an error")

        # Per-execution env, then gone.
        r = self.ok(sid, "import os\nprint(os.environ.get('E2E_VAR'))", env={"E2E_VAR": "set"})
        self.assertEqual(r.stdout, "set\n")
        self.assertEqual(self.ok(sid, "print(os.environ.get('E2E_VAR'))").stdout, "None\n")

        # A timeout interrupts the code and keeps the context and its state.
        t0 = time.time()
        slow = self.execute(sid, "import time\ntime.sleep(30)", timeout_s=2)
        took = time.time() - t0
        self.assertEqual(slow.http_status, 200, slow)
        self.assertEqual(slow.status, "timeout", slow)
        self.assertLess(took, 15 * MULT, "the timeout took %.1f s" % took)
        t0 = time.time()
        self.assertEqual(self.ok(sid, "x + 1").main, "21")
        self.assertLess(time.time() - t0, 10 * MULT, "the interrupted sleep kept running")

        # Bad input: both a context and a language, an unknown context, an unknown language.
        st = self.execute(sid, "1", context_id=ctx["id"], language="python").http_status
        self.assertEqual(st, 400)
        self.assertEqual(self.execute(sid, "1", context_id="nosuchcontext").http_status, 404)
        self.assertEqual(self.execute(sid, "1", language="cobol").http_status, 400)
        st, body = self.req("POST", "/v1/sandboxes/%s/execute" % sid, raw=b"{not json")
        self.assertEqual(st, 400, body)
        st, body = self.req("POST", "/v1/sandboxes/%s/execute" % sid, {"code": 5})
        self.assertEqual(st, 400, body)

    def test_killed_kernel_then_restart(self):
        sid = self.create()
        ctx = self.new_context(sid)
        self.assertEqual((ctx["language"], ctx["cwd"]), ("python", "/home/user"), ctx)
        self.ok(sid, "y = 5", context_id=ctx["id"])
        dead = self.execute(sid, "import os\nos.kill(os.getpid(), 9)", context_id=ctx["id"])
        self.assertEqual(dead.http_status, 200, dead)
        self.assertEqual(dead.status, "crashed", dead)
        self.assertIsNotNone(dead.error, "a crash is reported as an error event: %r" % dead)
        # Other contexts are not affected.
        self.assertEqual(self.ok(sid, "6 * 7").main, "42")
        st, r = self.req("POST", "/v1/sandboxes/%s/contexts/%s/restart" % (sid, ctx["id"]),
                         timeout=120 * MULT)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["id"], ctx["id"], r)
        self.assertEqual(self.ok(sid, "1 + 1", context_id=ctx["id"]).main, "2")
        # The context's own execute route.
        conn = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=120 * MULT)
        conn.request("POST", "/v1/sandboxes/%s/contexts/%s/execute" % (sid, ctx["id"]),
                     body=json.dumps({"code": "3 * 3"}),
                     headers={"Authorization": "Bearer " + self.s.key})
        resp = conn.getresponse()
        lines = [json.loads(x) for x in resp.read().decode().splitlines()]
        conn.close()
        self.assertEqual(resp.status, 200)
        self.assertEqual(lines[0]["context"]["id"], ctx["id"], lines)
        self.assertIn({"text/plain": "9"}, [x.get("data") for x in lines if x["type"] == "result"])
        gone = self.execute(sid, "y", context_id=ctx["id"])
        self.assertEqual(gone.error["name"], "NameError", gone)
        # List, delete, then 404.
        self.assertIn(ctx["id"], [c["id"] for c in self.contexts(sid)])
        st, r = self.req("DELETE", "/v1/sandboxes/%s/contexts/%s" % (sid, ctx["id"]))
        self.assertIn(st, (200, 204), r)
        self.assertNotIn(ctx["id"], [c["id"] for c in self.contexts(sid)])
        self.assertEqual(self.execute(sid, "1", context_id=ctx["id"]).http_status, 404)
        st, r = self.req("POST", "/v1/sandboxes/%s/contexts/%s/restart" % (sid, ctx["id"]))
        self.assertEqual(st, 404, r)

    def test_bash_context(self):
        sid = self.create()
        b = self.new_context(sid, language="bash", cwd="/tmp")
        self.assertEqual((b["language"], b["cwd"]), ("bash", "/tmp"), b)
        r = self.ok(sid, "A=3\necho $((A * 2)) $PWD", context_id=b["id"])
        self.assertEqual(r.stdout, "6 /tmp\n")
        self.assertEqual(self.ok(sid, "echo $A", context_id=b["id"]).stdout, "3\n")
        r = self.ok(sid, "echo [$E2E_B]", context_id=b["id"], env={"E2E_B": "x"})
        self.assertEqual(r.stdout, "[x]\n")
        self.assertEqual(self.ok(sid, "echo [$E2E_B]", context_id=b["id"]).stdout, "[]\n")
        self.assertEqual(self.ok(sid, "echo by-language", language="bash").stdout,
                         "by-language\n")
        listed = {c["id"]: c for c in self.contexts(sid)}
        self.assertEqual(listed[b["id"]]["language"], "bash")

    def test_clones_do_not_share_random_state(self):
        a, b = self.create(), self.create()
        code = ("import random, os\nimport numpy\n"
                "print(random.random(), numpy.random.random(), os.urandom(8).hex())")
        ra = self.ok(a, code).stdout.split()
        rb = self.ok(b, code).stdout.split()
        self.assertEqual((len(ra), len(rb)), (3, 3), (ra, rb))
        self.assertNotEqual(ra[0], rb[0], "random.random() equal in two clones")
        self.assertNotEqual(ra[1], rb[1], "numpy.random.random() equal in two clones")
        self.assertNotEqual(ra[2], rb[2], "os.urandom() equal in two clones")

    def test_suspend_and_wake_keep_context_state(self):
        sid = self.create()
        ctx = self.new_context(sid)
        self.ok(sid, "kept = 'before-suspend'", context_id=ctx["id"])
        self.ok(sid, "default_kept = 99")
        self.lifecycle(sid, "suspend", "suspended")
        st, r = self.req("POST", "/v1/sandboxes/%s/execute" % sid, {"code": "1"})
        self.assertEqual(st, 409, r)
        self.lifecycle(sid, "wake", "running")
        self.assertEqual(self.ok(sid, "kept", context_id=ctx["id"]).main, "'before-suspend'")
        self.assertEqual(self.ok(sid, "default_kept + 1").main, "100")
        self.assertIn(ctx["id"], [c["id"] for c in self.contexts(sid)])

    def test_base_template_has_no_interpreter(self):
        sid = self.create(template="base")
        t0 = time.time()
        st, r = self.req("POST", "/v1/sandboxes/%s/execute" % sid, {"code": "1 + 1"},
                         timeout=60 * MULT)
        self.assertEqual(st, 409, r)
        self.assertIn("code interpreter", r["error"]["message"])
        self.assertLess(time.time() - t0, 30 * MULT)
        st, r = self.req("GET", "/v1/sandboxes/%s/contexts" % sid)
        self.assertEqual(st, 409, r)
        st, r = self.req("POST", "/v1/sandboxes/nosuchsandbox/execute", {"code": "1"})
        self.assertEqual(st, 404, r)


if __name__ == "__main__":
    unittest.main()
