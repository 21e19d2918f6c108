"""Lists a hostile guest answers (core/channel/listcap.h), through spaced's real routes on both
APIs, with spaced's memory watched.

The test driver runs core/channel/tests/hostile_agent.c per sandbox (SPACE_FAKE_AGENT): it
answers a process list and a directory listing with 1 MiB entries and a million tiny ones,
each watch with thousands of 4000-byte event names, and the code daemon's context list with
5000 contexts, or with 15 MiB of them. Each answer must come back capped and flagged
("truncated": true on the native API, the x-space-truncated header on E2B's) or as a clear
error, spaced must stay up, and its resident memory must stay within RSS_BOUND_MIB of what it
was before the floods. A thread reads /proc/<pid>/status every 20 ms while a flood runs and
kills spaced once the bound is passed, so an uncapped list fails the test at the bound instead
of taking the machine's memory.

The bound: one answer reads at most SP_LIST_BYTES_MAX (4 MiB) of the guest's bytes, which make
at most 6x that in JSON (an escaped control byte) plus jansson's objects for 10,000 entries
(about 1.5 KiB each): about 40 MiB while it is built, about as much again while E2B's copy is
encoded; the watchers hold at most 1 MiB each (12 here). Measured under ASan, each kind of
flood alone takes spaced 25-66 MiB above its start, all four about 130 MiB (the allocator keeps
what each size class used; ASan's quarantine is held to 16 MiB here so freed memory is not
counted as held). RSS_BOUND_MIB, 256, leaves room for that; a second round of the floods
(test_zy) must not grow the peak by more than REPEAT_GROWTH_MIB: memory is reused, not piling
up. Without the caps one flood alone takes gigabytes (each of the first three passes the bound
within seconds on a build without them).
"""
import json
import os
import sys
import threading
import time
import unittest
import http.client

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
from harness import MULT, Platform, skip_unless_pg, wait_until  # noqa: E402

RSS_BOUND_MIB = 256
REPEAT_GROWTH_MIB = 32
ENTRIES_MAX = 10000     # SP_LIST_ENTRIES_MAX
STR_MAX = 4096          # SP_LIST_STR_MAX
CONTEXTS_MAX = 1000     # SP_LIST_CONTEXTS_MAX
WATCH_BYTES_MAX = 1 << 20  # SP_WATCH_BYTES_MAX
WATCHERS = 12
TRUNC = "x-space-truncated"


def skip_unless_hostile(cls):
    agent = os.environ.get("SPACE_FAKE_AGENT", "")
    if not agent.endswith("hostile-agent"):
        return unittest.skip("SPACE_FAKE_AGENT is not the hostile agent")(cls)
    return cls


@skip_unless_pg
@skip_unless_hostile
class ListFloodTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        asan = os.environ.get("ASAN_OPTIONS", "")
        cls.p = Platform(teams=("alpha",), runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20", "HOSTILE_EVENTS": "12000",
                              "ASAN_OPTIONS": (asan + ":" if asan else "") +
                              "quarantine_size_mb=16"})
        cls.s = cls.p.s
        cls.sid, _ = cls.s.create()
        st, sb = cls.s.request("GET", "/v1/sandboxes/" + cls.sid)
        assert st == 200, (st, sb)
        cls.token = sb["access_token"]
        cls.rss0 = cls.s.rss_kb()
        cls.peak = cls.rss0
        cls.over = None
        cls.repeat_growth = None

    @classmethod
    def tearDownClass(cls):
        print("listflood: spaced RSS before the floods %d MiB, peak %d MiB (+%d MiB, bound +%d)"
              % (cls.rss0 // 1024, cls.peak // 1024, (cls.peak - cls.rss0) // 1024,
                 RSS_BOUND_MIB), file=sys.stderr)
        if cls.repeat_growth is not None:
            print("listflood: a second round of floods grew the peak by %d KiB (bound %d MiB)"
                  % (cls.repeat_growth, REPEAT_GROWTH_MIB), file=sys.stderr)
        cls.p.destroy()

    # ---- helpers ----

    def guarded(self, fn):
        """fn() while spaced's RSS is read every 20 ms; spaced is killed past the bound."""
        self.check_bound()  # an earlier flood may have killed it
        stop = threading.Event()
        cls = type(self)

        def watch():
            while not stop.is_set():
                try:
                    rss = self.s.rss_kb()
                except OSError:
                    return
                cls.peak = max(cls.peak, rss)
                if rss - cls.rss0 > RSS_BOUND_MIB * 1024:
                    cls.over = rss
                    self.s.proc.kill()
                    return
                time.sleep(0.02)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            return fn()
        except OSError as e:
            if cls.over is None:
                raise
            return e
        finally:
            stop.set()
            t.join()
            self.check_bound()

    def check_bound(self):
        over = type(self).over
        self.assertIsNone(over, "spaced's RSS passed the bound: %s KiB over %s KiB before"
                          % (over, self.rss0))
        self.assertIsNone(self.s.proc.poll(), "spaced exited")
        st, _ = self.s.request("GET", "/healthz")
        self.assertEqual(st, 200)

    def settle(self):
        """Waits until spaced's CPU time stops moving (the agent's flood is read)."""
        def ticks():
            with open("/proc/%d/stat" % self.s.proc.pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])
        last = [ticks(), time.time()]

        def flat():
            now = ticks()
            if now != last[0]:
                last[0], last[1] = now, time.time()
                return False
            return time.time() - last[1] > 0.5
        wait_until(flat, "spaced idle", timeout=120)

    def native(self, path):
        return self.s.request("GET", "/v1/sandboxes/%s%s" % (self.sid, path), timeout=120)

    def envd(self, method, body, path=None):
        """A Connect JSON call (or a plain GET of path) to the sandbox's envd on the API
        address: (status, headers, body)."""
        c = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=120 * MULT)
        h = {"E2b-Sandbox-Id": self.sid, "X-Access-Token": self.token}
        try:
            if path is None:
                h.update({"Content-Type": "application/json", "connect-protocol-version": "1"})
                c.request("POST", "/" + method, body=json.dumps(body).encode(), headers=h)
            else:
                c.request("GET", path, headers=h)
            r = c.getresponse()
            raw = r.read()
            return r.status, r.headers, (json.loads(raw) if raw else None)
        finally:
            c.close()

    # ---- the lists ----

    # The stand-in's first list of a kind passes the cap on bytes (10 tiny entries, then 256
    # of 1 MiB, then a million tiny ones), its second the cap on entries (10 tiny, 2 of 1 MiB, a
    # million tiny).

    def test_processes(self):
        st, r = self.guarded(lambda: self.native("/commands"))
        self.assertEqual(st, 200, r)
        self.assertIs(r.get("truncated"), True)
        procs = r["commands"]
        self.assertGreater(len(procs), 10)  # the tiny ones and the huge ones that fit, cut
        self.assertLess(len(procs), 20)
        for p in procs:
            for k in ("tag", "cmd", "cwd", "user"):
                self.assertLessEqual(len(p[k] or ""), STR_MAX)
        self.assertIn(STR_MAX, [len(p["cmd"]) for p in procs])

        st, h, r = self.guarded(lambda: self.envd("process.Process/List", {}))
        self.assertEqual(st, 200, r)
        self.assertEqual(h.get(TRUNC), "true")
        self.assertEqual(len(r.get("processes", [])), ENTRIES_MAX)

    def test_directory(self):
        st, r = self.guarded(lambda: self.native("/files/list?path=/flood&depth=1"))
        self.assertEqual(st, 200, r)
        self.assertIs(r.get("truncated"), True)
        # The huge entries are left out (a cut path would name another file).
        self.assertEqual(sorted(e["name"] for e in r["entries"]),
                         sorted("f%d" % i for i in range(10)))

        st, h, r = self.guarded(lambda: self.envd("filesystem.Filesystem/ListDir",
                                                  {"path": "/flood", "depth": 1}))
        self.assertEqual(st, 200, r)
        self.assertEqual(h.get(TRUNC), "true")
        entries = r.get("entries", [])
        self.assertEqual(len(entries), ENTRIES_MAX)
        self.assertTrue(all(len(e["name"]) <= STR_MAX for e in entries))

    def test_watch_events(self):
        def flood():
            ids = []
            for i in range(WATCHERS):
                st, _, r = self.envd("filesystem.Filesystem/CreateWatcher",
                                     {"path": "/flood/w%d" % i, "recursive": False})
                self.assertEqual(st, 200, r)
                ids.append(r["watcherId"])
            self.settle()
            return ids
        ids = self.guarded(flood)
        self.assertIsInstance(ids, list, ids)
        for wid in ids:
            st, _, r = self.guarded(lambda: self.envd("filesystem.Filesystem/GetWatcherEvents",
                                                      {"watcherId": wid}))
            self.assertEqual(st, 200, r)
            evs = r.get("events", [])
            self.assertGreater(len(evs), 0)
            self.assertLessEqual(sum(len(e["name"]) + 1 for e in evs), WATCH_BYTES_MAX)
            st, _, r = self.envd("filesystem.Filesystem/RemoveWatcher", {"watcherId": wid})
            self.assertEqual(st, 200, r)

    def test_contexts(self):
        # The stand-in alternates: 5000 small contexts (capped, flagged), then 15 MiB of them
        # (refused with a clear error), on each API in turn.
        st, r = self.guarded(lambda: self.native("/contexts"))
        self.assertEqual(st, 200, r)
        self.assertIs(r.get("truncated"), True)
        self.assertEqual(len(r["contexts"]), CONTEXTS_MAX)
        st, r = self.guarded(lambda: self.native("/contexts"))
        self.assertEqual(st, 503, r)
        self.assertIn("code interpreter", r["error"]["message"])

        st, h, r = self.guarded(lambda: self.envd(None, None, path="/contexts"))
        self.assertEqual(st, 200, r)
        self.assertEqual(h.get(TRUNC), "true")
        self.assertEqual(len(r), CONTEXTS_MAX)
        st, h, r = self.guarded(lambda: self.envd(None, None, path="/contexts"))
        self.assertGreaterEqual(st, 500, r)

    def test_zy_floods_again_reuse_memory(self):
        before = type(self).peak
        for path in ("/commands", "/commands", "/files/list?path=/flood&depth=1",
                     "/files/list?path=/flood&depth=1", "/contexts", "/contexts"):
            st, r = self.guarded(lambda: self.native(path))
            self.assertIn(st, (200, 503), r)
        grown = type(self).peak - before
        type(self).repeat_growth = grown
        self.assertLess(grown, REPEAT_GROWTH_MIB * 1024,
                        "a second round of floods grew spaced's peak RSS by %d KiB" % grown)

    def test_zz_still_serves(self):
        self.check_bound()
        st, r = self.s.request("GET", "/v1/sandboxes/" + self.sid)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["state"], "running")


if __name__ == "__main__":
    unittest.main(verbosity=2)
