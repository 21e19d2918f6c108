"""Metrics and logs of a running spaced (test driver, host-side agent): /metrics on the operator
listener only, valid Prometheus text (promtool check metrics), each counter moving when its
event happens (requests by surface and route, lifecycle operations, sandboxes by state, the
database pool, egress connections and denials, agent channels), the process figures, and
--log-format json.

promtool (Debian package `prometheus`, installed by scripts/test) is required: without it the
test fails rather than pass unchecked."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, free_port, skip_unless_pg  # noqa: E402

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text):
    """{(name, frozenset(labels)): value} of every sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, "not a sample line: %r" % line
        labels = frozenset(LABEL.findall(m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def val(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


@skip_unless_pg
class MetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.mport = free_port()
        cls.pport = free_port()
        env = {"SPACE_FAKE_DELAY_MS": "20", "SPACE_TEST_EGRESS_PORT": str(cls.pport),
               "SPACE_TEST_EGRESS_NO_DNS": "1"}
        cls.agent = os.environ.get("SPACE_FAKE_AGENT")
        if cls.agent:
            env["SPACE_FAKE_AGENT"] = cls.agent
        cls.p = Platform(teams=(None,), runtime="test", env=env,
                         args=["--metrics-listen", "127.0.0.1:%d" % cls.mport,
                               "--log-format", "json"])
        cls.s = cls.p.s

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    def scrape(self):
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.mport,
                                    timeout=30 * MULT) as r:
            self.assertEqual(r.status, 200)
            self.assertTrue(r.headers["Content-Type"].startswith("text/plain; version=0.0.4"))
            return r.read().decode()

    def wait_for(self, what, pred, timeout=15):
        deadline = time.time() + timeout * MULT
        while True:
            m = parse(self.scrape())
            if pred(m):
                return m
            if time.time() > deadline:
                self.fail("%s: not within %d s" % (what, timeout))
            time.sleep(0.2)

    def test_promtool_accepts_the_exposition(self):
        promtool = shutil.which("promtool")
        self.assertIsNotNone(promtool, "promtool is not installed (Debian package prometheus; "
                                       "scripts/test installs it)")
        self.s.create()  # some series of every kind
        text = self.scrape()
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # and the check can fail: a counter without _total
        r = subprocess.run([promtool, "check", "metrics"], capture_output=True, text=True,
                           input="# HELP x_bytes X.\n# TYPE x_bytes counter\nx_bytes 1\n",
                           timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stdout)
        for name in ("process_resident_memory_bytes", "process_open_fds",
                     "process_cpu_seconds_total", "process_start_time_seconds"):
            self.assertIn("\n# TYPE %s " % name, text)
        m = parse(text)
        self.assertGreater(val(m, "process_resident_memory_bytes"), 1 << 20)
        self.assertGreater(val(m, "process_open_fds"), 3)
        self.assertLess(abs(val(m, "process_start_time_seconds") - time.time()), 3600)

    def test_not_on_the_public_listener(self):
        st, body = self.s.request("GET", "/metrics")
        self.assertEqual(st, 404, body)
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.mport) as r:
            self.assertEqual(r.status, 200)
        try:
            urllib.request.urlopen("http://127.0.0.1:%d/v1/sandboxes" % self.mport)
            self.fail("the operator listener answered an API path")
        except urllib.error.HTTPError as e:
            self.assertEqual(e.code, 404)

    def test_requests_by_surface_route_and_code(self):
        before = parse(self.scrape())
        self.assertEqual(self.s.request("GET", "/v1/sandboxes")[0], 200)
        self.assertEqual(self.s.request("GET", "/v1/sandboxes/sbnosuchsandbox1")[0], 404)
        st, _ = self.s.request("GET", "/sandboxes", key="", headers={"X-API-KEY": self.s.key})
        self.assertEqual(st, 200)
        st, _ = self.s.request("GET", "/envs", key="")  # envd on the API address, no selector
        self.assertEqual(self.s.request("GET", "/nowhere/" + "x" * 40)[0], 404)
        after = parse(self.scrape())

        def moved(surface, route, code, by=1):
            k = dict(surface=surface, route=route, code=str(code))
            self.assertEqual(val(after, "space_http_requests_total", **k)
                             - val(before, "space_http_requests_total", **k), by, k)

        moved("native", "sandboxes", 200)
        moved("native", "sandbox", 404)
        moved("e2b", "sandboxes", 200)
        moved("envd", "envd_info", st)
        moved("other", "other", 404)
        k = dict(surface="native", route="sandboxes")
        self.assertEqual(val(after, "space_http_request_duration_seconds_count", **k)
                         - val(before, "space_http_request_duration_seconds_count", **k), 1)
        # no raw paths or ids in any label
        for (name, labels) in after:
            for _, v in labels:
                self.assertNotIn("/", v, (name, labels))
                self.assertNotIn("sbnosuch", v, (name, labels))
                self.assertNotIn("xxxx", v, (name, labels))

    def test_lifecycle_operations_and_states(self):
        def ops(m, op, outcome="success"):
            return val(m, "space_lifecycle_operations_total", op=op, outcome=outcome)

        def running():  # what the API says (every sandbox here is the one team's)
            st, body = self.s.request("GET", "/v1/sandboxes?limit=100")
            self.assertEqual(st, 200, body)
            return sum(1 for sb in body["sandboxes"] if sb["state"] == "running")

        before = parse(self.scrape())
        sid, _ = self.s.create()
        base = "/v1/sandboxes/" + sid
        n = running()
        self.assertGreaterEqual(n, 1)
        # sampled every 5 s (core/control/sampler.h)
        m = self.wait_for("space_sandboxes counts the new sandbox",
                          lambda m: val(m, "space_sandboxes", state="running") == n)
        self.assertEqual(ops(m, "create") - ops(before, "create"), 1)
        self.assertEqual(val(m, "space_lifecycle_operation_duration_seconds_count", op="create",
                             outcome="success")
                         - val(before, "space_lifecycle_operation_duration_seconds_count",
                               op="create", outcome="success"), 1)
        for action, op in (("pause", "pause"), ("wake", "wake"), ("suspend", "suspend"),
                           ("wake", "wake")):
            b = parse(self.scrape())
            st, r = self.s.request("POST", "%s/%s?wait=30" % (base, action))
            self.assertEqual(st, 200, r)
            a = parse(self.scrape())
            self.assertEqual(ops(a, op) - ops(b, op), 1, action)
        b = parse(self.scrape())
        st, r = self.s.request("DELETE", base + "?wait=30")
        self.assertEqual(st, 200, r)
        a = parse(self.scrape())
        self.assertEqual(ops(a, "delete") - ops(b, "delete"), 1)
        self.assertEqual(running(), n - 1)
        self.wait_for("space_sandboxes forgets the deleted sandbox",
                      lambda m: val(m, "space_sandboxes", state="running") == n - 1)
        # the database pool: every statement waited (a little) for a connection
        self.assertGreater(val(a, "space_pg_pool_wait_seconds_count"),
                           val(before, "space_pg_pool_wait_seconds_count"))
        self.assertIn("\n# TYPE space_pg_errors_total counter\n", self.scrape())

    def test_egress_and_agent_channel(self):
        if not self.agent:
            self.skipTest("SPACE_FAKE_AGENT (space-agent-host) is not built")
        before = parse(self.scrape())
        st, r = self.s.request("POST", "/v1/sandboxes?wait=30",
                               {"template": "base", "egress": {"allow": ["127.0.0.1"]}})
        self.assertEqual(st, 200, r)
        m = self.wait_for("an agent channel came up",
                          lambda m: val(m, "space_agent_channel_connects_total")
                          > val(before, "space_agent_channel_connects_total"))
        deadline = time.time() + 10 * MULT
        while True:  # the agent listens once EGRESS_CONFIG arrived
            try:
                c = socket.create_connection(("127.0.0.1", self.pport), timeout=10 * MULT)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        # A destination the policy does not allow (private addresses are denied unless a rule
        # names them): 403 from the proxy, one denial.
        c.sendall(b"CONNECT 10.255.255.1:443 HTTP/1.1\r\nHost: 10.255.255.1:443\r\n\r\n")
        reply = c.recv(4096)
        c.close()
        self.assertTrue(reply.startswith(b"HTTP/1.1 403"), reply)
        m = self.wait_for("the denial is counted",
                          lambda m: val(m, "space_egress_decisions_total", decision="denied")
                          > val(before, "space_egress_decisions_total", decision="denied"))
        self.assertGreater(val(m, "space_egress_connections_total"),
                           val(before, "space_egress_connections_total"))
        self.assertIn("\n# TYPE space_egress_bytes_total counter\n", self.scrape())
        self.assertIn("\n# TYPE space_agent_channel_reconnects_total counter\n", self.scrape())
        self.s.delete_quietly(r["sandbox"]["id"])

    def test_json_logs(self):
        self.s.request("GET", "/v1/sandboxes")
        with open(self.s.log_path) as f:
            lines = [l for l in f.read().splitlines() if l.startswith("{")]
        self.assertTrue(lines, "no JSON log lines")
        seen = False
        for l in lines:
            o = json.loads(l)  # every line one object
            self.assertEqual(list(o)[:4], ["ts", "level", "component", "msg"], o)
            self.assertRegex(o["ts"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
            self.assertIn(o["level"], ("debug", "info", "warn", "error"))
            if o["component"] == "server" and o["msg"].startswith("serving "):
                self.assertEqual(o["listen"], "127.0.0.1:%d" % self.s.port)
                self.assertEqual(o["runtime"], "test")
                seen = True
        self.assertTrue(seen, lines[:5])


if __name__ == "__main__":
    unittest.main()
