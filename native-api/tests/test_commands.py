"""Commands and files (native API) against a real space-agent.

The test driver (spaced-test --runtime test) starts space-agent-host per sandbox when
SPACE_FAKE_AGENT names it (ctest sets it). The agent runs on this host as this user, so
every path here is under a scratch directory.
"""
import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, PlatformTest, q, skip_unless_agent, skip_unless_pg  # noqa: E402


@skip_unless_pg
@skip_unless_agent
class CommandsTest(PlatformTest):
    # Under ASan freed memory waits in a quarantine (256 MiB by default) that counts in the
    # RSS the flood tests bound: a small one, so the figure is what spaced holds, whichever
    # tests ran before.
    ENV = {"ASAN_OPTIONS": ":".join(filter(None, [os.environ.get("ASAN_OPTIONS"),
                                                  "quarantine_size_mb=16"]))}

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.sid, _ = cls.s.create()
        cls.scratch = tempfile.mkdtemp(prefix="sp-cmd-")
        os.chmod(cls.scratch, 0o777)

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        shutil.rmtree(cls.scratch, ignore_errors=True)

    # ---- helpers ----

    def req(self, *a, **kw):
        return self.s.request(*a, **kw)

    def base(self, sid=None):
        return "/v1/sandboxes/%s" % (sid or self.sid)

    def run_cmd(self, body, sid=None, key=None, timeout=60):
        return self.req("POST", self.base(sid) + "/commands", body, key=key, timeout=timeout)

    def ok(self, body, **kw):
        st, r = self.run_cmd(body, **kw)
        self.assertEqual(st, 200, r)
        return r

    def assertError(self, resp, status, code=None):
        st, body = resp
        self.assertEqual(st, status, body)
        self.assertIsInstance(body, dict, body)
        self.assertIsInstance(body["error"]["message"], str)
        if code:
            self.assertEqual(body["error"]["code"], code)

    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=timeout * MULT)

    def hdrs(self, extra=None):
        h = {"Authorization": "Bearer " + self.s.key}
        h.update(extra or {})
        return h

    def open_stream(self, method, path, body=None):
        return self.s.open_stream(method, path, body, timeout=60)

    def events(self, r):
        out = []
        for line in r:
            out.append(json.loads(line))
        return out

    def path(self, name):
        return os.path.join(self.scratch, name)

    def wait_not_running(self, cid, timeout=15):
        deadline = time.time() + timeout * MULT
        while time.time() < deadline:
            st, r = self.req("GET", self.base() + "/commands")
            self.assertEqual(st, 200, r)
            mine = [c for c in r["commands"] if c["id"] == cid]
            self.assertEqual(len(mine), 1, r)
            if not mine[0]["running"]:
                return mine[0]
            time.sleep(0.1)
        self.fail("command %s still running" % cid)

    # ---- commands ----

    def test_echo_and_exit_codes(self):
        r = self.ok({"cmd": "echo hello; echo oops >&2; exit 3"})
        self.assertEqual((r["exit_code"], r["stdout"], r["stderr"]), (3, "hello\n", "oops\n"))
        self.assertFalse(r["timed_out"])
        self.assertRegex(r["id"], r"^[1-9][0-9]*$")
        self.assertEqual(self.ok({"argv": ["true"]})["exit_code"], 0)
        self.assertEqual(self.ok({"argv": ["false"]})["exit_code"], 1)
        r = self.ok({"cmd": "kill -9 $$"})
        self.assertEqual((r["exit_code"], r["signal"]), (None, 9))

    def test_argv_vs_cmd(self):
        r = self.ok({"argv": ["echo", "$HOME", "a  b"]})
        self.assertEqual(r["stdout"], "$HOME a  b\n")
        r = self.ok({"cmd": "echo $HOME"})
        self.assertEqual(r["stdout"], "/root\n")
        self.assertError(self.run_cmd({"cmd": "x", "argv": ["x"]}), 400)
        self.assertError(self.run_cmd({"argv": []}), 400)
        st, r = self.run_cmd({"argv": ["/nonexistent/binary"]})
        self.assertIn(st, (400, 404), r)

    def test_env_and_cwd(self):
        r = self.ok({"cmd": 'printf "%s|%s" "$FOO" "$(pwd)"', "env": {"FOO": "bar baz"},
                     "cwd": self.scratch})
        self.assertEqual(r["stdout"], "bar baz|" + self.scratch)
        self.assertError(self.run_cmd({"cmd": "true", "env": {"A": 1}}), 400)

    def test_user_root_and_nobody(self):
        self.assertEqual(self.ok({"cmd": "id -un", "user": "root"})["stdout"], "root\n")
        self.assertEqual(self.ok({"cmd": "id -un", "user": "nobody"})["stdout"], "nobody\n")
        # nobody cannot write where only root may
        own = self.path("rootonly")
        os.makedirs(own, exist_ok=True)
        os.chmod(own, 0o755)
        r = self.ok({"cmd": "touch %s/x" % own, "user": "nobody"})
        self.assertNotEqual(r["exit_code"], 0)
        self.assertError(self.run_cmd({"cmd": "true", "user": "no-such-user-x"}), 404)

    def test_stdin_round_trip(self):
        self.assertEqual(self.ok({"cmd": "cat", "stdin": "line1\nline2\n"})["stdout"],
                         "line1\nline2\n")
        big = "x" * 300000  # more than one agent window
        self.assertEqual(self.ok({"cmd": "wc -c", "stdin": big})["stdout"].strip(), "300000")
        # without stdin, it is /dev/null: cat ends at once
        self.assertEqual(self.ok({"cmd": "cat", "timeout_s": 10})["stdout"], "")

    def test_stream_event_order(self):
        c, r = self.open_stream("POST", self.base() + "/commands",
                                {"cmd": "echo a; sleep 0.2; echo b >&2; echo c; exit 5",
                                 "stream": True})
        self.assertEqual(r.status, 200)
        self.assertEqual(r.getheader("Content-Type"), "application/x-ndjson")
        ev = self.events(r)
        c.close()
        self.assertEqual(ev[0]["type"], "start")
        self.assertEqual(ev[-1]["type"], "exit")
        self.assertEqual(ev[-1]["exit_code"], 5)
        self.assertTrue(all(e["type"] in ("stdout", "stderr") for e in ev[1:-1]), ev)
        self.assertEqual("".join(e["data"] for e in ev if e["type"] == "stdout"), "a\nc\n")
        self.assertEqual("".join(e["data"] for e in ev if e["type"] == "stderr"), "b\n")
        # stdout "a" came before stderr "b" (the sleep orders them)
        kinds = [e["type"] for e in ev[1:-1]]
        self.assertLess(kinds.index("stdout"), kinds.index("stderr"))
        # ?stream=true works too
        c, r = self.open_stream("POST", self.base() + "/commands?stream=true", {"argv": ["true"]})
        ev = self.events(r)
        c.close()
        self.assertEqual([e["type"] for e in ev], ["start", "exit"])

    def test_background_list_and_reattach_after_disconnect(self):
        marker = self.path("bg-done")
        st, r = self.run_cmd({"cmd": "for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.3; done;"
                                     " touch %s" % marker, "background": True, "tag": "ticker"})
        self.assertEqual(st, 200, r)
        cid = r["id"]
        # follow it, then drop the connection mid-stream
        c, resp = self.open_stream("GET", self.base() + "/commands/%s/output" % cid)
        self.assertEqual(resp.status, 200)
        first = json.loads(resp.readline())
        self.assertEqual(first["type"], "start")
        json.loads(resp.readline())
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        st, lst = self.req("GET", self.base() + "/commands")
        mine = [x for x in lst["commands"] if x["id"] == cid]
        self.assertEqual(len(mine), 1, lst)
        self.assertTrue(mine[0]["running"])
        self.assertEqual(mine[0]["tag"], "ticker")
        # re-attach: the buffered output is replayed, then it runs to its end
        c, resp = self.open_stream("GET", self.base() + "/commands/%s/output" % cid)
        ev = self.events(resp)
        c.close()
        out = "".join(e["data"] for e in ev if e["type"] == "stdout")
        self.assertIn("tick1\n", out)
        self.assertIn("tick6\n", out)
        self.assertEqual(ev[-1]["type"], "exit")
        self.assertEqual(ev[-1]["exit_code"], 0)
        self.assertTrue(os.path.exists(marker))
        self.assertEqual(self.wait_not_running(cid)["exit_code"], 0)
        self.assertError(self.req("GET", self.base() + "/commands/999999999/output"), 404)
        self.assertError(self.req("GET", self.base() + "/commands/abc/output"), 404)

    def test_signal(self):
        st, r = self.run_cmd({"cmd": "sleep 30", "background": True})
        self.assertEqual(st, 200, r)
        cid = r["id"]
        self.assertError(self.req("POST", self.base() + "/commands/%s/signal" % cid,
                                  {"signal": "SIGNOPE"}), 400)
        self.assertError(self.req("POST", self.base() + "/commands/%s/signal" % cid,
                                  {"signal": "TERM", "x": 1}), 400)
        st, r = self.req("POST", self.base() + "/commands/%s/signal" % cid, {"signal": "SIGTERM"})
        self.assertEqual(st, 200, r)
        info = self.wait_not_running(cid)
        self.assertEqual((info["signal"], info["exit_code"]), (15, None))
        self.assertError(self.req("POST", self.base() + "/commands/%s/signal" % cid,
                                  {"signal": 9}), 409)
        self.assertError(self.req("POST", self.base() + "/commands/2147483000/signal",
                                  {"signal": 9}), 404)

    def test_stdin_to_background_command(self):
        st, r = self.run_cmd({"cmd": "read a; echo got:$a; cat; echo end", "background": True})
        self.assertEqual(st, 200, r)
        cid = r["id"]
        p = self.base() + "/commands/%s/stdin" % cid
        self.assertError(self.req("POST", p, {"data": 5}), 400)
        self.assertError(self.req("POST", p, {}), 400)
        self.assertEqual(self.req("POST", p, {"data": "hi\n"})[0], 200)
        self.assertEqual(self.req("POST", p, {"data": "more\n", "eof": True})[0], 200)
        c, resp = self.open_stream("GET", self.base() + "/commands/%s/output" % cid)
        ev = self.events(resp)
        c.close()
        self.assertEqual("".join(e["data"] for e in ev if e["type"] == "stdout"),
                         "got:hi\nmore\nend\n")
        self.assertEqual(ev[-1]["exit_code"], 0)
        self.assertError(self.req("POST", p, {"data": "late"}), 409)

    def test_timeout(self):
        t0 = time.time()
        r = self.ok({"cmd": "echo before; sleep 30; echo after", "timeout_s": 1})
        self.assertLess(time.time() - t0, 10 * MULT)
        self.assertTrue(r["timed_out"])
        self.assertIsNone(r["exit_code"])
        self.assertEqual(r["signal"], 9)
        self.assertEqual(r["stdout"], "before\n")
        self.assertFalse(self.ok({"cmd": "true", "timeout_s": 5})["timed_out"])
        self.assertError(self.run_cmd({"cmd": "true", "timeout_s": 0}), 400)

    def test_collected_output_is_capped(self):
        r = self.ok({"cmd": "head -c 20000000 /dev/zero | tr '\\0' a"}, timeout=120)
        self.assertEqual(r["exit_code"], 0)
        self.assertTrue(r["truncated"])
        self.assertEqual(len(r["stdout"]), 16 * 1024 * 1024)

    def test_non_utf8_output(self):
        r = self.ok({"cmd": "printf 'a\\377b\\303\\251'"})
        self.assertEqual(r["stdout"], "a\ufffdb\u00e9")

    def test_collected_output_rendered_in_pieces(self):
        # The answer is rendered 64 KiB of output at a time: characters cut by a piece's end,
        # NUL bytes (six as JSON) and an invalid byte come out whole, with a Content-Length
        # that holds, on both streams.
        prog = ("import sys; b = sys.stdout.buffer; e = sys.stderr.buffer; "
                "d = b'\\0' * 65535 + 'é'.encode() * 40000 + b'\\xff' + '€'.encode() * 3; "
                "b.write(d); e.write(d[::-1][:70001])")
        want = "\0" * 65535 + "é" * 40000 + "\ufffd" + "€" * 3
        r, raw = self.s.exchange("POST", self.base() + "/commands",
                                 {"argv": ["python3", "-c", prog]},
                                 headers={"Authorization": "Bearer " + self.s.key}, timeout=60)
        self.assertEqual(r.status, 200, raw[:200])
        self.assertEqual(int(r.getheader("Content-Length")), len(raw))
        body = json.loads(raw)
        self.assertEqual(body["stdout"], want)
        rev = (b"\0" * 65535 + "é".encode() * 40000 + b"\xff" + "€".encode() * 3)[::-1][:70001]
        self.assertEqual(body["stderr"], rev.decode("utf-8", "replace"))
        self.assertEqual((body["exit_code"], body["truncated"]), (0, False))
        self.assertEqual(list(body), ["exit_code", "signal", "timed_out", "id", "pid", "stdout",
                                      "stderr", "truncated"])

    # ---- files ----

    def test_file_50mib_put_get_sha256(self):
        data = os.urandom(50 * 1024 * 1024)
        want = hashlib.sha256(data).hexdigest()
        p = self.path("big.bin")
        t0 = time.time()
        st, e = self.req("PUT", self.base() + "/files?path=" + q(p), raw=data,
                         headers={"Content-Type": "application/octet-stream"}, timeout=300)
        t_put = time.time() - t0
        self.assertEqual(st, 200, e)
        self.assertEqual((e["type"], e["size"]), ("file", len(data)))
        with open(p, "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), want)
        c = self.conn(timeout=300)
        t0 = time.time()
        c.request("GET", self.base() + "/files?path=" + q(p), headers=self.hdrs())
        r = c.getresponse()
        self.assertEqual(r.status, 200)
        self.assertEqual(r.getheader("Content-Length"), str(len(data)))
        h = hashlib.sha256()
        n = 0
        while True:
            chunk = r.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
        t_get = time.time() - t0
        c.close()
        self.assertEqual((n, h.hexdigest()), (len(data), want))
        sys.stderr.write("\n50 MiB via fake agent: PUT %.2fs GET %.2fs\n" % (t_put, t_get))

    def test_download_disconnect_midway(self):
        p = self.path("dl.bin")
        with open(p, "wb") as f:
            f.write(os.urandom(20 * 1024 * 1024))
        for _ in range(3):
            c = self.conn()
            c.request("GET", self.base() + "/files?path=" + q(p), headers=self.hdrs())
            r = c.getresponse()
            self.assertEqual(r.status, 200)
            self.assertEqual(len(r.read(1 << 20)), 1 << 20)
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
        # the server and the agent carry on
        st, body = self.req("GET", self.base() + "/files?path=" + q(p), timeout=120)
        self.assertEqual((st, len(body)), (200, 20 * 1024 * 1024))
        self.assertEqual(self.ok({"cmd": "echo alive"})["stdout"], "alive\n")

    def test_fs_operations(self):
        d = self.path("tree")
        st, e = self.req("POST", self.base() + "/files/mkdir", {"path": d + "/a/b", "mode": "0750"})
        self.assertEqual(st, 200, e)
        self.assertEqual((e["type"], e["mode"]), ("dir", 0o750))
        st, e = self.req("PUT", self.base() + "/files?path=" + q(d + "/a/b/f.txt"), raw=b"hello",
                         headers={"Content-Type": "application/octet-stream"})
        self.assertEqual((st, e["size"]), (200, 5), e)
        st, e = self.req("PUT", self.base() + "/files?path=" + q(d + "/new/dir/g.txt")
                         + "&mode=600", raw=b"x")
        self.assertEqual((st, e["mode"]), (200, 0o600), e)
        self.assertError(self.req("PUT", self.base() + "/files?path=" + q(d + "/nodir/h")
                                  + "&mkdirs=false", raw=b"x"), 404)
        st, e = self.req("GET", self.base() + "/files/stat?path=" + q(d + "/a/b/f.txt"))
        self.assertEqual((st, e["type"], e["size"], e["name"]), (200, "file", 5, "f.txt"), e)
        self.assertEqual(self.req("GET", self.base() + "/files?path=" + q(d + "/a/b/f.txt")),
                         (200, b"hello"))
        st, lst = self.req("GET", self.base() + "/files/list?path=" + q(d))
        self.assertEqual(sorted(x["name"] for x in lst["entries"]), ["a", "new"])
        self.assertFalse(lst["truncated"])
        st, lst = self.req("GET", self.base() + "/files/list?path=" + q(d) + "&depth=3")
        names = sorted(x["name"] for x in lst["entries"])
        self.assertIn("f.txt", names)
        self.assertIn("b", names)
        st, e = self.req("POST", self.base() + "/files/move",
                         {"from": d + "/a/b/f.txt", "to": d + "/moved.txt"})
        self.assertEqual((st, e["name"]), (200, "moved.txt"), e)
        self.assertError(self.req("GET", self.base() + "/files/stat?path=" + q(d + "/a/b/f.txt")),
                         404)
        self.assertEqual(self.req("GET", self.base() + "/files?path=" + q(d + "/moved.txt"))[1],
                         b"hello")
        self.assertError(self.req("GET", self.base() + "/files?path=" + q(d)), 400)
        st, r = self.req("DELETE", self.base() + "/files?path=" + q(d + "/a"))
        self.assertIn(st, (400, 409), r)  # not empty, not recursive
        self.assertEqual(self.req("DELETE", self.base() + "/files?path=" + q(d + "/a")
                                  + "&recursive=true")[0], 200)
        self.assertFalse(os.path.exists(d + "/a"))
        # nobody may not read root's 0600 file
        os.chmod(d + "/moved.txt", 0o600)
        self.assertError(self.req("GET", self.base() + "/files?path=" + q(d + "/moved.txt")
                                  + "&user=nobody"), 403)

    def test_path_validation(self):
        b = self.base()
        self.assertError(self.req("GET", b + "/files"), 400)
        self.assertError(self.req("GET", b + "/files?path="), 400)
        self.assertError(self.req("GET", b + "/files/stat?path=" + "a" * 5000), 400)
        self.assertError(self.req("GET", b + "/files/stat?path=a%00b"), 400)
        self.assertError(self.req("GET", b + "/files/list?path=/tmp&depth=0"), 400)
        self.assertError(self.req("PUT", b + "/files?path=/tmp/x&mode=999", raw=b""), 400)
        self.assertError(self.req("POST", b + "/files/mkdir", {"path": "/tmp/x", "extra": 1}), 400)
        self.assertError(self.req("POST", b + "/files/mkdir", {"path": "a\u0000b"}), 400)
        self.assertError(self.req("POST", b + "/files/mkdir", {}), 400)
        self.assertError(self.req("POST", b + "/files/move", {"from": "/tmp/x"}), 400)
        self.assertError(self.req("POST", b + "/commands", {"cmd": "true", "bogus": 1}), 400)
        self.assertError(self.req("POST", b + "/commands", {"cmd": "true", "background": True,
                                                            "stdin": "x"}), 400)
        self.assertError(self.req("GET", b + "/files/stat?path=" + q(self.path("nope"))), 404)

    # ---- tenancy and state ----

    def test_other_team_gets_404(self):
        k = self.other_key
        self.assertError(self.run_cmd({"cmd": "true"}, key=k), 404)
        self.assertError(self.req("GET", self.base() + "/commands", key=k), 404)
        self.assertError(self.req("GET", self.base() + "/files/stat?path=/tmp", key=k), 404)
        self.assertError(self.req("GET", "/v1/sandboxes/nosuchsandbox/commands"), 404)

    def test_paused_sandbox_is_409_and_activity_recorded(self):
        sid, _ = self.s.create()
        st, sb0 = self.req("GET", "/v1/sandboxes/" + sid)
        time.sleep(1.2)
        self.assertEqual(self.ok({"cmd": "true"}, sid=sid)["exit_code"], 0)
        sb1 = self.s.wait_activity(sid, sb0)
        self.assertGreater(sb1["last_activity_at"], sb0["last_activity_at"])
        st, r = self.req("POST", "/v1/sandboxes/%s/pause?wait=30" % sid, timeout=40)
        self.assertEqual((st, r["operation"]["status"]), (200, "succeeded"), r)
        self.assertError(self.run_cmd({"cmd": "true"}, sid=sid), 409, "conflict")
        self.assertError(self.req("GET", self.base(sid) + "/files/stat?path=/"), 409)
        st, r = self.req("POST", "/v1/sandboxes/%s/wake?wait=30" % sid, timeout=40)
        self.assertEqual((st, r["operation"]["status"]), (200, "succeeded"), r)
        self.assertEqual(self.ok({"cmd": "echo back"}, sid=sid)["stdout"], "back\n")
        self.req("DELETE", "/v1/sandboxes/%s?wait=30" % sid, timeout=40)

    # ---- hostile load ----

    def quick_requests(self, n=10, limit=2.0):
        for _ in range(n):
            t0 = time.time()
            st, _ = self.req("GET", self.base(), timeout=10)
            self.assertEqual(st, 200)
            r = self.ok({"cmd": "echo ok"})
            self.assertEqual(r["stdout"], "ok\n")
            self.assertLess(time.time() - t0, limit * MULT)

    def test_flood_slow_reader(self):
        total = 200000000
        rss0 = self.s.rss_kb()
        c, r = self.open_stream("POST", self.base() + "/commands",
                                {"cmd": "yes | head -c %d" % total, "stream": True})
        self.assertEqual(r.status, 200)
        got = 0
        kinds = []
        slow_until = time.time() + 2
        for line in r:
            e = json.loads(line)
            kinds.append(e["type"]) if e["type"] != "stdout" else None
            if e["type"] == "stdout":
                got += len(e["data"])
            if time.time() < slow_until:
                time.sleep(0.05)  # a slow reader first: the guest must wait, not us buffer
                if got > 0 and len(kinds) == 1:
                    self.quick_requests(n=2)
        c.close()
        self.assertEqual(kinds, ["start", "exit"])
        self.assertEqual(got, total)
        # bounded memory: far less than what went through (ASan inflates RSS; be generous)
        self.assertLess(self.s.rss_kb() - rss0, 150 * 1024)

    def test_flood_unread_does_not_stall_others(self):
        c, r = self.open_stream("POST", self.base() + "/commands", {"cmd": "yes", "stream": True})
        start = json.loads(r.readline())
        self.assertEqual(start["type"], "start")
        # nobody reads this response; everyone else is still answered quickly
        time.sleep(1)
        self.quick_requests(n=10, limit=2.0)
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        # the command outlived its client; end it
        st, _ = self.req("POST", self.base() + "/commands/%s/signal" % start["id"],
                         {"signal": "KILL"})
        self.assertEqual(st, 200)
        self.assertEqual(self.wait_not_running(start["id"])["signal"], 9)

    def test_agent_dying_mid_stream(self):
        sid, _ = self.s.create()
        c, r = self.open_stream("POST", self.base(sid) + "/commands",
                                {"cmd": "while true; do echo x; sleep 0.05; done", "stream": True})
        self.assertEqual(json.loads(r.readline())["type"], "start")
        with open(os.path.join(self.s.data_dir, "fake", sid + ".pid")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        t0 = time.time()
        ev = self.events(r)
        c.close()
        self.assertLess(time.time() - t0, 5 * MULT)
        self.assertEqual(ev[-1]["type"], "error", ev[-3:])
        self.assertEqual(ev[-1]["error"]["code"], "unavailable")
        self.assertError(self.run_cmd({"cmd": "true"}, sid=sid), 503, "unavailable")
        # the other sandbox is unaffected
        self.quick_requests(n=3)
        self.req("DELETE", "/v1/sandboxes/%s?wait=30" % sid, timeout=40)


if __name__ == "__main__":
    unittest.main(verbosity=2)
