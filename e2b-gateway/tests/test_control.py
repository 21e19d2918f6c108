"""E2B control plane (/sandboxes, /v2/sandboxes) against a real PostgreSQL and spaced-test
(test-only driver), checked against what the E2B SDKs require (spec e2b-wire.md section 2)."""
import datetime
import json
import os
import subprocess
import sys
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, PlatformTest, pg_bindir, skip_unless_pg  # noqa: E402

SANDBOX_KEYS = ("sandboxID", "templateID", "clientID", "envdVersion")
LISTED_KEYS = ("clientID", "cpuCount", "diskSizeMB", "endAt", "envdVersion", "memoryMB",
               "sandboxID", "startedAt", "state", "templateID")
METRIC_KEYS = {"cpuCount": int, "cpuUsedPct": float, "diskTotal": int, "diskUsed": int,
               "memTotal": int, "memUsed": int, "timestamp": str, "timestampUnix": int}
DOMAIN = "sbx.test:3443"


def parse_time(s):
    """RFC 3339 as the SDK's ISO parser takes it (Z or offset, optional fraction)."""
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))


def sdk_metadata_query(md):
    """The Python SDK's double encoding of the metadata filter (spec 2.5)."""
    inner = urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v)
                                    for k, v in md.items()})
    return urllib.parse.urlencode({"metadata": inner})


@skip_unless_pg
class E2BControlTest(PlatformTest):
    ENV = {"SPACE_E2B_DOMAIN": DOMAIN}

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.key = cls.p.keys["alpha"]

    # ---- helpers ----

    @classmethod
    def sql(cls, text):
        subprocess.run([os.path.join(pg_bindir(), "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1",
                        cls.p.pg.url, "-c", text], check=True, capture_output=True)

    def req(self, method, path, body=None, key=None, raw=None, headers=None):
        h = {"X-API-KEY": self.key if key is None else key}
        if key == "":
            del h["X-API-KEY"]
        h.update(headers or {})
        # the harness sends Authorization only when given a key: give none
        return self.s.request(method, path, body=body, key="", raw=raw, headers=h,
                              timeout=120)

    def raw_req(self, method, path, body=None):
        """Like req, but also returns the response headers."""
        r, text = self.s.exchange(method, path, body, headers={"X-API-KEY": self.key},
                                  timeout=60)
        return r.status, (json.loads(text) if text else None), r

    def assertError(self, resp, status):
        st, body = resp
        self.assertEqual(st, status, body)
        self.assertIsInstance(body, dict, body)
        self.assertEqual(set(body), {"code", "message"}, body)
        self.assertIs(type(body["code"]), int, body)
        self.assertEqual(body["code"], status, body)
        self.assertIsInstance(body["message"], str, body)

    def create(self, **fields):
        body = {"templateID": "base", "allow_internet_access": True, "autoPause": False,
                "envVars": {}, "metadata": {}, "secure": True, "timeout": 300}
        body.update(fields)
        st, sb = self.req("POST", "/sandboxes", body)
        self.assertEqual(st, 201, sb)
        return sb

    def info(self, sid):
        st, d = self.req("GET", "/sandboxes/" + sid)
        self.assertEqual(st, 200, d)
        return d

    def wait_state(self, sid, want, timeout=20):
        deadline = time.time() + timeout * MULT
        st, d = None, None
        while time.time() < deadline:
            st, d = self.req("GET", "/sandboxes/" + sid)
            if (want == 404 and st == 404) or (st == 200 and d["state"] == want):
                return d
            time.sleep(0.1)
        self.fail("sandbox %s never became %s: %s %s" % (sid, want, st, d))

    def check_listed(self, d):
        for k in LISTED_KEYS:
            self.assertIn(k, d)
        for k in ("cpuCount", "diskSizeMB", "memoryMB"):
            self.assertIs(type(d[k]), int, (k, d))
        for k in ("clientID", "envdVersion", "sandboxID", "templateID"):
            self.assertIsInstance(d[k], str, (k, d))
        self.assertIn(d["state"], ("running", "paused"))
        parse_time(d["startedAt"])
        parse_time(d["endAt"])

    # ---- create and info ----

    def test_create_returns_sandbox_model(self):
        sb = self.create(metadata={"who": "create"}, envVars={"A": "1"})
        for k in SANDBOX_KEYS:
            self.assertIsInstance(sb[k], str, (k, sb))
        self.assertEqual(sb["templateID"], "base")
        self.assertEqual(sb["envdVersion"], "0.5.7")
        self.assertEqual(sb["domain"], DOMAIN)
        self.assertIsInstance(sb["envdAccessToken"], str)
        self.assertGreater(len(sb["envdAccessToken"]), 16)
        # a traffic token for every sandbox (the code interpreter's SDKs send it; README
        # "Data-plane authorization"), not the envd one
        self.assertRegex(sb["trafficAccessToken"], r"^[A-Za-z0-9]{43}$")
        self.assertNotEqual(sb["trafficAccessToken"], sb["envdAccessToken"])
        self.assertRegex(sb["sandboxID"], r"^[a-z0-9]+$")
        # 201 only once it runs
        d = self.info(sb["sandboxID"])
        self.check_listed(d)
        self.assertEqual(d["state"], "running")
        self.assertEqual(d["metadata"], {"who": "create"})
        self.assertEqual(d["lifecycle"], {"autoResume": False, "onTimeout": "kill"})
        self.assertIs(d["allowInternetAccess"], True)
        self.assertEqual(d["envdAccessToken"], sb["envdAccessToken"])
        end = parse_time(d["endAt"]) - parse_time(d["startedAt"])
        self.assertTrue(290 <= end.total_seconds() <= 310, d)

    def test_secure_false_still_gets_a_unique_token(self):
        a = self.create(secure=False)
        b = self.create(secure=False)
        self.assertTrue(a["envdAccessToken"] and b["envdAccessToken"])
        self.assertNotEqual(a["envdAccessToken"], b["envdAccessToken"])

    def test_create_stores_lifecycle_network_and_internet(self):
        sb = self.create(autoPause=True, autoResume={"enabled": True},
                         allow_internet_access=False,
                         network={"allowOut": ["example.com"], "denyOut": ["0.0.0.0/0"]},
                         mcp={"x": {}})
        d = self.info(sb["sandboxID"])
        self.assertEqual(d["lifecycle"], {"autoResume": True, "onTimeout": "pause"})
        self.assertIs(d["allowInternetAccess"], False)
        self.assertEqual(d["network"], {"allowOut": ["example.com"], "denyOut": ["0.0.0.0/0"]})

    def test_create_timeout_zero_means_300(self):
        sb = self.create(timeout=0)
        d = self.info(sb["sandboxID"])
        end = parse_time(d["endAt"]) - parse_time(d["startedAt"])
        self.assertTrue(290 <= end.total_seconds() <= 310, d)

    def test_create_that_fails_is_500_json_and_leaves_nothing(self):
        st, body = self.req("POST", "/sandboxes", {"templateID": "base", "timeout": 60,
                                                   "envVars": {"SPACE_FAKE_FAIL": "boot"},
                                                   "metadata": {"run": "failboot"}})
        self.assertError((st, body), 500)
        self.assertIn("injected", body["message"])
        st, listed = self.req("GET", "/v2/sandboxes?" + sdk_metadata_query({"run": "failboot"}))
        self.assertEqual((st, listed), (200, []))

    # ---- listing ----

    def test_disk_size_is_the_rows(self):
        # The disk size a worker recorded on the row (migration 16) is what every answer shows,
        # whichever node reads it: here the row's figure is written by hand, since the test
        # driver has no disk. A row without one shows this node's driver's (0 here).
        tag = "disk%d" % int(time.time() * 1000)
        a, b = (self.create(metadata={"run": tag})["sandboxID"] for _ in range(2))
        self.sql("UPDATE sandboxes SET disk_mb = 4321 WHERE id = '%s'" % a)
        q = sdk_metadata_query({"run": tag})
        for path in ("/sandboxes?" + q, "/v2/sandboxes?" + q, "/sandboxes/" + a,
                     "/sandboxes/" + b):
            st, r = self.req("GET", path)
            self.assertEqual(st, 200, r)
            got = {it["sandboxID"]: it["diskSizeMB"] for it in (r if isinstance(r, list) else [r])}
            want = {a: 4321, b: 0}
            self.assertEqual(got, {k: want[k] for k in got}, path)
            self.assertEqual(len(got), 2 if isinstance(r, list) else 1, path)
        # Kept while it sleeps: the disk goes with the sandbox.
        st, _ = self.req("POST", "/sandboxes/%s/pause" % a)
        self.assertEqual(st, 204)
        st, items = self.req("GET", "/v2/sandboxes?state=paused&" + q)
        self.assertEqual([(it["sandboxID"], it["diskSizeMB"]) for it in items], [(a, 4321)])

    def test_list_v2_filters_and_pages(self):
        tag = "list%d" % int(time.time() * 1000)
        ids = [self.create(metadata={"run": tag, "i": str(i), "sp ace": "a b&c=d"})["sandboxID"]
               for i in range(5)]
        st, _ = self.req("POST", "/sandboxes/%s/pause" % ids[0])
        self.assertEqual(st, 204)
        q = sdk_metadata_query({"run": tag, "sp ace": "a b&c=d"})
        # all, in pages of 2
        seen, token, pages = [], None, 0
        while True:
            path = "/v2/sandboxes?limit=2&" + q
            if token:
                path += "&" + urllib.parse.urlencode({"nextToken": token})
            st, items, r = self.raw_req("GET", path)
            self.assertEqual(st, 200, items)
            self.assertLessEqual(len(items), 2)
            for it in items:
                self.check_listed(it)
                self.assertEqual(it["metadata"]["run"], tag)
            seen += [it["sandboxID"] for it in items]
            pages += 1
            token = r.getheader("x-next-token")
            if not token:
                break
        self.assertEqual(sorted(seen), sorted(ids))
        self.assertEqual(len(seen), len(set(seen)))
        self.assertGreaterEqual(pages, 3)
        # state filters
        st, items = self.req("GET", "/v2/sandboxes?state=paused&" + q)
        self.assertEqual([it["sandboxID"] for it in items], [ids[0]])
        self.assertEqual(items[0]["state"], "paused")
        st, items = self.req("GET", "/v2/sandboxes?state=running&" + q)
        self.assertEqual(sorted(it["sandboxID"] for it in items), sorted(ids[1:]))
        st, items = self.req("GET", "/v2/sandboxes?state=running,paused&" + q)
        self.assertEqual(len(items), 5)
        # narrower metadata
        st, items = self.req("GET", "/v2/sandboxes?" + sdk_metadata_query({"run": tag, "i": "3"}))
        self.assertEqual([it["sandboxID"] for it in items], [ids[3]])
        st, items = self.req("GET", "/v2/sandboxes?" + sdk_metadata_query({"run": tag, "i": "9"}))
        self.assertEqual(items, [])
        # v1: running ones, no pagination
        st, items = self.req("GET", "/sandboxes?" + q)
        self.assertEqual(st, 200, items)
        self.assertEqual(sorted(it["sandboxID"] for it in items), sorted(ids[1:]))
        for it in items:
            self.check_listed(it)
        # bad input
        self.assertError(self.req("GET", "/v2/sandboxes?limit=0"), 400)
        self.assertError(self.req("GET", "/v2/sandboxes?limit=101"), 400)
        self.assertError(self.req("GET", "/v2/sandboxes?state=sleeping"), 400)
        self.assertError(self.req("GET", "/v2/sandboxes?nextToken=garbage"), 400)
        self.assertError(self.req("GET", "/v2/sandboxes?metadata=novalue"), 400)

    # ---- timeouts ----

    def test_set_timeout_and_expiry_kills(self):
        sid = self.create()["sandboxID"]
        st, body = self.req("POST", "/sandboxes/%s/timeout" % sid, {"timeout": 1000})
        self.assertEqual(st, 204, body)
        d = self.info(sid)
        left = (parse_time(d["endAt"]) - datetime.datetime.now(datetime.timezone.utc))
        self.assertTrue(990 <= left.total_seconds() <= 1001, d)
        # may shorten; at the deadline it is killed
        st, _ = self.req("POST", "/sandboxes/%s/timeout" % sid, {"timeout": 1})
        self.assertEqual(st, 204)
        self.wait_state(sid, 404)
        self.assertError(self.req("POST", "/sandboxes/%s/timeout" % sid, {"timeout": 5}), 404)

    def test_create_timeout_expiry_kills(self):
        sid = self.create(timeout=2)["sandboxID"]
        self.wait_state(sid, 404)

    def test_expiry_with_autopause_pauses(self):
        sb = self.create(timeout=2, autoPause=True)
        sid = sb["sandboxID"]
        d = self.wait_state(sid, "paused")
        self.assertEqual(d["lifecycle"]["onTimeout"], "pause")
        time.sleep(1.5)  # stays paused: no deadline runs while paused
        self.assertEqual(self.info(sid)["state"], "paused")
        st, r = self.req("POST", "/sandboxes/%s/connect" % sid, {"timeout": 300})
        self.assertEqual(st, 201, r)
        self.assertEqual(r["envdAccessToken"], sb["envdAccessToken"])
        self.assertEqual(self.info(sid)["state"], "running")

    def test_refreshes_extend_only(self):
        sid = self.create(timeout=600)["sandboxID"]
        before = parse_time(self.info(sid)["endAt"])
        st, _ = self.req("POST", "/sandboxes/%s/refreshes" % sid, {"duration": 10})
        self.assertEqual(st, 204)
        self.assertEqual(parse_time(self.info(sid)["endAt"]), before)
        st, _ = self.req("POST", "/sandboxes/%s/refreshes" % sid, {})
        self.assertEqual(st, 204)
        st, _ = self.req("POST", "/sandboxes/%s/refreshes" % sid, raw=b"")
        self.assertEqual(st, 204)
        self.assertError(self.req("POST", "/sandboxes/%s/refreshes" % sid, {"duration": "x"}), 400)
        self.assertError(self.req("POST", "/sandboxes/%s/refreshes" % sid, {"duration": 9999}),
                         400)

    # ---- connect, pause, resume ----

    def test_connect_running_extends_never_shortens(self):
        sb = self.create(timeout=600)
        sid = sb["sandboxID"]
        end0 = parse_time(self.info(sid)["endAt"])
        st, r = self.req("POST", "/sandboxes/%s/connect" % sid, {"timeout": 10},
                         headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})
        self.assertEqual(st, 200, r)
        for k in SANDBOX_KEYS:
            self.assertIn(k, r)
        self.assertEqual(r["domain"], DOMAIN)
        self.assertEqual(r["envdAccessToken"], sb["envdAccessToken"])
        self.assertEqual(parse_time(self.info(sid)["endAt"]), end0)
        st, r = self.req("POST", "/sandboxes/%s/connect" % sid, {"timeout": 1200})
        self.assertEqual(st, 200, r)
        self.assertGreater(parse_time(self.info(sid)["endAt"]), end0)
        self.assertError(self.req("POST", "/sandboxes/%s/connect" % sid, {}), 400)
        self.assertError(self.req("POST", "/sandboxes/%s/connect" % sid, {"timeout": "x"}), 400)

    def test_pause_connect_resume_cycle(self):
        sb = self.create(timeout=300)
        sid, token = sb["sandboxID"], sb["envdAccessToken"]
        st, body = self.req("POST", "/sandboxes/%s/pause" % sid)
        self.assertEqual((st, body), (204, None))
        d = self.info(sid)
        self.assertEqual(d["state"], "paused")
        self.check_listed(d)
        self.assertError(self.req("POST", "/sandboxes/%s/pause" % sid), 409)
        # metrics of a paused one: an empty series
        st, m = self.req("GET", "/sandboxes/%s/metrics" % sid)
        self.assertEqual((st, m), (200, []))
        # connect resumes: 201, same token
        st, r = self.req("POST", "/sandboxes/%s/connect" % sid, {"timeout": 120})
        self.assertEqual(st, 201, r)
        self.assertEqual(r["envdAccessToken"], token)
        self.assertEqual(r["domain"], DOMAIN)
        d = self.info(sid)
        self.assertEqual(d["state"], "running")
        left = parse_time(d["endAt"]) - datetime.datetime.now(datetime.timezone.utc)
        self.assertTrue(100 <= left.total_seconds() <= 121, d)
        # the deprecated resume: 409 while running, 201 from paused
        self.assertError(self.req("POST", "/sandboxes/%s/resume" % sid, {"timeout": 60}), 409)
        st, _ = self.req("POST", "/sandboxes/%s/pause" % sid)
        self.assertEqual(st, 204)
        st, r = self.req("POST", "/sandboxes/%s/resume" % sid, {"timeout": 60, "autoPause": True})
        self.assertEqual(st, 201, r)
        self.assertEqual(r["envdAccessToken"], token)
        d = self.info(sid)
        self.assertEqual((d["state"], d["lifecycle"]["onTimeout"]), ("running", "pause"))

    def test_failed_pause_is_500_and_keeps_a_deadline(self):
        sid = self.create(timeout=600, envVars={"SPACE_FAKE_FAIL": "snapshot"})["sandboxID"]
        st, body = self.req("POST", "/sandboxes/%s/pause" % sid)
        self.assertError((st, body), 500)
        self.assertIn("injected", body["message"])
        d = self.info(sid)
        self.assertEqual(d["state"], "running")
        left = parse_time(d["endAt"]) - datetime.datetime.now(datetime.timezone.utc)
        self.assertTrue(590 <= left.total_seconds() <= 601, d)

    def test_native_pause_shows_running_and_connect_resumes(self):
        sid = self.create()["sandboxID"]
        st, r = self.s.request("POST", "/v1/sandboxes/%s/pause?wait=30" % sid, key=self.key)
        self.assertEqual(r["sandbox"]["state"], "paused", r)
        self.assertEqual(self.info(sid)["state"], "running")
        st, r = self.req("POST", "/sandboxes/%s/connect" % sid, {"timeout": 60})
        self.assertEqual(st, 200, r)
        st, r = self.s.request("GET", "/v1/sandboxes/" + sid, key=self.key)
        self.assertEqual(r["state"], "running")

    def test_auto_resume_on_sandbox_traffic(self):
        sb = self.create(autoPause=True, autoResume={"enabled": True}, timeout=300)
        sid = sb["sandboxID"]
        st, _ = self.req("POST", "/sandboxes/%s/pause" % sid)
        self.assertEqual(st, 204)
        self.assertEqual(self.info(sid)["state"], "paused")
        # envd traffic for it (what the SDK sends for sandbox.is_running()) wakes it first
        self.s.request("GET", "/health", key="",
                       headers={"E2b-Sandbox-Id": sid, "X-Access-Token": sb["envdAccessToken"]})
        d = self.info(sid)
        self.assertEqual(d["state"], "running")
        left = parse_time(d["endAt"]) - datetime.datetime.now(datetime.timezone.utc)
        self.assertTrue(250 <= left.total_seconds() <= 301, d)
        # without autoResume, traffic does not wake it
        sb2 = self.create(autoPause=True)
        st, _ = self.req("POST", "/sandboxes/%s/pause" % sb2["sandboxID"])
        self.assertEqual(st, 204)
        st, body = self.s.request("GET", "/health", key="",
                                  headers={"E2b-Sandbox-Id": sb2["sandboxID"],
                                           "X-Access-Token": sb2["envdAccessToken"]})
        self.assertEqual(st, 502, body)
        self.assertEqual(self.info(sb2["sandboxID"])["state"], "paused")

    # ---- kill ----

    def test_kill(self):
        sid = self.create()["sandboxID"]
        st, body = self.req("DELETE", "/sandboxes/" + sid)
        self.assertEqual((st, body), (204, None))
        self.assertError(self.req("GET", "/sandboxes/" + sid), 404)
        self.assertError(self.req("DELETE", "/sandboxes/" + sid), 404)
        self.assertError(self.req("POST", "/sandboxes/%s/pause" % sid), 404)
        self.assertError(self.req("POST", "/sandboxes/%s/connect" % sid, {"timeout": 5}), 404)
        self.assertError(self.req("DELETE", "/sandboxes/nosuchsandbox0"), 404)

    # ---- metrics and logs ----

    def check_metric(self, m):
        self.assertEqual(set(m), set(METRIC_KEYS), m)
        for k, t in METRIC_KEYS.items():
            self.assertIs(type(m[k]), t, (k, m))
        parse_time(m["timestamp"])
        self.assertLess(abs(m["timestampUnix"] - time.time()), 60)

    def test_metrics(self):
        sid = self.create()["sandboxID"]
        st, ms = self.req("GET", "/sandboxes/%s/metrics" % sid)
        self.assertEqual(st, 200, ms)
        self.assertEqual(len(ms), 1, ms)
        self.check_metric(ms[0])
        self.assertGreaterEqual(ms[0]["cpuCount"], 1)
        now = int(time.time())
        st, ms = self.req("GET", "/sandboxes/%s/metrics?start=%d&end=%d" % (sid, now - 60, now))
        self.assertEqual(st, 200, ms)
        self.assertError(self.req("GET", "/sandboxes/%s/metrics?start=abc" % sid), 400)
        st, all_ = self.req("GET", "/sandboxes/metrics?sandbox_ids=" + sid)
        self.assertEqual(st, 200, all_)
        self.assertEqual(list(all_["sandboxes"]), [sid])
        self.check_metric(all_["sandboxes"][sid])
        st, all_ = self.req("GET", "/sandboxes/metrics")
        self.assertEqual(st, 200, all_)
        self.assertIn(sid, all_["sandboxes"])
        st, none = self.req("GET", "/sandboxes/metrics?sandbox_ids=nosuch1,nosuch2")
        self.assertEqual((st, none), (200, {"sandboxes": {}}))
        st, other = self.req("GET", "/sandboxes/metrics?sandbox_ids=" + sid, key=self.other_key)
        self.assertEqual((st, other), (200, {"sandboxes": {}}))

    def test_metrics_series(self):
        """A running sandbox's metrics are a series sampled every 5 s, not a single sample;
        start/end (unix seconds) select from it."""
        sid = self.create(timeout=300)["sandboxID"]
        first = time.time()
        deadline = first + 15 * MULT
        while True:
            st, ms = self.req("GET", "/sandboxes/%s/metrics" % sid)
            self.assertEqual(st, 200, ms)
            if len(ms) >= 2 or time.time() > deadline:
                break
            time.sleep(1)
        self.assertGreaterEqual(len(ms), 2, "no second sample after %.0f s" % (time.time() - first))
        for m in ms:
            self.check_metric(m)
        ts = [m["timestampUnix"] for m in ms]
        self.assertEqual(ts, sorted(ts))
        st, later = self.req("GET", "/sandboxes/%s/metrics?start=%d" % (sid, ts[-1] + 3600))
        self.assertEqual((st, later), (200, []))
        st, early = self.req("GET", "/sandboxes/%s/metrics?end=%d" % (sid, ts[0]))
        self.assertEqual(st, 200, early)
        self.assertGreaterEqual(len(early), 1, early)
        self.assertTrue(all(m["timestampUnix"] <= ts[0] for m in early), early)
        st, last = self.req("GET", "/sandboxes/%s/metrics?start=%d" % (sid, ts[-1]))
        self.assertEqual(st, 200, last)
        self.assertTrue(last and all(m["timestampUnix"] >= ts[-1] for m in last), last)

    def test_logs(self):
        sid = self.create()["sandboxID"]
        st, _ = self.req("POST", "/sandboxes/%s/pause" % sid)
        self.assertEqual(st, 204)
        st, logs = self.req("GET", "/sandboxes/%s/logs" % sid)
        self.assertEqual(st, 200, logs)
        self.assertEqual(set(logs), {"logs", "logEntries"})
        self.assertGreaterEqual(len(logs["logs"]), 2)
        self.assertEqual(len(logs["logs"]), len(logs["logEntries"]))
        for line in logs["logs"]:
            self.assertEqual(set(line), {"timestamp", "line"})
            parse_time(line["timestamp"])
            self.assertIsInstance(line["line"], str)
        for e in logs["logEntries"]:
            self.assertEqual(set(e), {"timestamp", "message", "level", "fields"})
            self.assertIn(e["level"], ("debug", "info", "warn", "error"))
            self.assertTrue(all(isinstance(v, str) for v in e["fields"].values()))
        self.assertIn("created", logs["logs"][0]["line"])
        self.assertTrue(any("suspend" in l["line"] for l in logs["logs"]), logs)
        st, limited = self.req("GET", "/sandboxes/%s/logs?limit=1" % sid)
        self.assertEqual(len(limited["logs"]), 1)
        future = int(time.time() * 1000) + 3600 * 1000
        st, later = self.req("GET", "/sandboxes/%s/logs?start=%d" % (sid, future))
        self.assertEqual(later, {"logs": [], "logEntries": []})
        st, v2 = self.req("GET", "/v2/sandboxes/%s/logs" % sid)
        self.assertEqual(st, 200, v2)
        self.assertEqual(len(v2["logs"]), len(logs["logEntries"]))
        self.assertError(self.req("GET", "/sandboxes/%s/logs" % sid, key=self.other_key), 404)

    # ---- errors ----

    def test_volumes_unsupported(self):
        # E2B's Volume API, control and content, answers a clear 501 (not a bare 404)
        for method, path in (("POST", "/volumes"), ("GET", "/volumes"),
                             ("GET", "/volumes/vol-1"), ("DELETE", "/volumes/vol-1"),
                             ("GET", "/volumecontent/vol-1/file?path=/a.txt")):
            st, body = self.req(method, path, {} if method == "POST" else None)
            self.assertEqual(st, 501, (method, path, body))
            self.assertIn("volumes are not supported", body["message"])

    def test_auth_errors(self):
        self.assertError(self.req("GET", "/v2/sandboxes", key=""), 401)
        self.assertError(self.req("GET", "/v2/sandboxes", key="e2b_not_a_key"), 401)
        self.assertError(self.req("POST", "/sandboxes", {"templateID": "base"}, key="bad"), 401)
        # a native Bearer key is not an E2B key header
        st, body = self.s.request("GET", "/v2/sandboxes", key=self.key)
        self.assertError((st, body), 401)
        # ... but on template routes E2B also takes an access token (Authorization: Bearer),
        # all the CLI sends for `template list`/`delete` without an API key: the team's key
        st, body = self.s.request("GET", "/templates", key=self.key)
        self.assertEqual(st, 200, body)
        self.assertIn("base", [t["templateID"] for t in body])
        self.assertError(self.s.request("GET", "/templates", key="e2b_not_a_key"), 401)
        self.assertError(self.req("GET", "/templates", key=""), 401)
        # X-API-Key first when both are sent (the CLI sends both when both are set)
        st, body = self.req("GET", "/templates", headers={"Authorization": "Bearer nonsense"})
        self.assertEqual(st, 200, body)

    def test_bad_bodies(self):
        self.assertError(self.req("POST", "/sandboxes", raw=b"{not json",
                                  headers={"Content-Type": "application/json"}), 400)
        self.assertError(self.req("POST", "/sandboxes", raw=b"[1,2]",
                                  headers={"Content-Type": "application/json"}), 400)
        self.assertError(self.req("POST", "/sandboxes", raw=b""), 400)
        self.assertError(self.req("POST", "/sandboxes", {}), 400)
        self.assertError(self.req("POST", "/sandboxes", {"templateID": 5}), 400)
        self.assertError(self.req("POST", "/sandboxes", {"templateID": "base", "timeout": "5"}),
                         400)
        self.assertError(self.req("POST", "/sandboxes", {"templateID": "base", "timeout": -1}),
                         400)
        self.assertError(self.req("POST", "/sandboxes",
                                  {"templateID": "base", "metadata": {"a": 1}}), 400)
        self.assertError(self.req("POST", "/sandboxes",
                                  {"templateID": "base", "envVars": ["A=1"]}), 400)
        self.assertError(self.req("POST", "/sandboxes", {"templateID": "base", "secure": "yes"}),
                         400)
        self.assertError(self.req("POST", "/sandboxes",
                                  {"templateID": "base", "autoPause": 1}), 400)
        self.assertError(self.req("POST", "/sandboxes",
                                  {"templateID": "base", "autoResume": {"enabled": "x"}}), 400)
        self.assertError(self.req("POST", "/sandboxes",
                                  {"templateID": "base", "network": "open"}), 400)
        sid = self.create()["sandboxID"]
        self.assertError(self.req("POST", "/sandboxes/%s/timeout" % sid, {}), 400)
        self.assertError(self.req("POST", "/sandboxes/%s/timeout" % sid, {"timeout": 1.5}), 400)
        self.assertError(self.req("POST", "/sandboxes/%s/timeout" % sid, raw=b"{",
                                  headers={"Content-Type": "application/json"}), 400)

    def test_unknown_template_is_404(self):
        self.assertError(self.req("POST", "/sandboxes", {"templateID": "no-such-template"}), 404)

    def test_other_team_sees_404(self):
        sid = self.create()["sandboxID"]
        k = self.other_key
        self.assertError(self.req("GET", "/sandboxes/" + sid, key=k), 404)
        self.assertError(self.req("DELETE", "/sandboxes/" + sid, key=k), 404)
        self.assertError(self.req("POST", "/sandboxes/%s/pause" % sid, key=k), 404)
        self.assertError(self.req("POST", "/sandboxes/%s/connect" % sid, {"timeout": 5}, key=k),
                         404)
        self.assertError(self.req("POST", "/sandboxes/%s/timeout" % sid, {"timeout": 5}, key=k),
                         404)
        self.assertError(self.req("POST", "/sandboxes/%s/refreshes" % sid, {}, key=k), 404)
        self.assertError(self.req("GET", "/sandboxes/%s/metrics" % sid, key=k), 404)
        st, items = self.req("GET", "/v2/sandboxes", key=k)
        self.assertEqual(st, 200)
        self.assertNotIn(sid, [it["sandboxID"] for it in items])
        self.assertEqual(self.info(sid)["state"], "running")

    def test_unknown_paths_and_methods(self):
        self.assertError(self.req("GET", "/sandboxes/abc/nothing"), 404)
        self.assertError(self.req("PUT", "/sandboxes", {"templateID": "base"}), 405)
        self.assertError(self.req("GET", "/sandboxes/abc/pause"), 405)
        self.assertError(self.req("GET", "/sandboxes/NOT-AN-ID"), 404)
        self.assertError(self.req("PUT", "/snapshots"), 405)


if __name__ == "__main__":
    unittest.main(verbosity=2)
