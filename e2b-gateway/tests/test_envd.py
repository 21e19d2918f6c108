"""envd (E2B port 49983) over the gateway, against a real space-agent.

The test driver (spaced-test --runtime test) starts space-agent-host per sandbox when
SPACE_FAKE_AGENT names it (ctest sets it). The agent runs on this host as this user, so every
path here is under a scratch directory; `nobody` plays the template's default user (the host
has no `user` account: SPACE_E2B_DEFAULT_USER=nobody).

envd is reached on the API address with E2b-Sandbox-Id / X-Access-Token headers (the
E2B_SANDBOX_URL mode, spec 1.6); the token comes from the native sandbox JSON.

Path traversal: a path like ../../etc/passwd is a *guest* path. It resolves inside the guest,
as the request's user, relative to that user's home; it never touches the gateway's host. With
the test driver the "guest" is this host, so the test only checks it behaves as a guest path
would (relative to the user's home, the user's permissions apply).
"""
import base64
import gzip
import hashlib
import http.client
import json
import os
import shutil
import struct
import sys
import tempfile
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, skip_unless_agent, skip_unless_pg  # noqa: E402


def env(flags, payload):
    return struct.pack(">BI", flags, len(payload)) + payload


def parse_envs(data):
    out, off = [], 0
    while off < len(data):
        flags, n = struct.unpack(">BI", data[off:off + 5])
        out.append((flags, data[off + 5:off + 5 + n]))
        off += 5 + n
    return out


# ---- a few protobuf helpers (enough for StartRequest / StartResponse) ----

def pb_varint(v):
    out = b""
    while True:
        b = v & 0x7f
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def pb_len(num, data):
    if isinstance(data, str):
        data = data.encode()
    return pb_varint(num << 3 | 2) + pb_varint(len(data)) + data


def pb_uint(num, v):
    return pb_varint(num << 3) + pb_varint(v)


def pb_parse(data):
    """{field: [values]}; length-delimited values stay bytes."""
    out, off = {}, 0
    while off < len(data):
        key, off = _rd(data, off)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, off = _rd(data, off)
        elif wt == 2:
            n, off = _rd(data, off)
            v, off = data[off:off + n], off + n
        else:
            raise ValueError("wire type %d" % wt)
        out.setdefault(num, []).append(v)
    return out


def _rd(data, off):
    v = shift = 0
    while True:
        b = data[off]
        off += 1
        v |= (b & 0x7f) << shift
        shift += 7
        if not b & 0x80:
            return v, off


@skip_unless_pg
@skip_unless_agent
class EnvdTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=("alpha",), runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20", "SPACE_E2B_DEFAULT_USER": "nobody"})
        cls.s = cls.p.s
        cls.sid, cls.token = cls.make_sandbox()
        cls.sid2, cls.token2 = cls.make_sandbox()
        cls.scratch = tempfile.mkdtemp(prefix="sp-envd-")
        os.chmod(cls.scratch, 0o777)

    @classmethod
    def make_sandbox(cls):
        sid, _ = cls.s.create()
        st, sb = cls.s.request("GET", "/v1/sandboxes/" + sid)
        assert st == 200, (st, sb)
        return sid, sb["access_token"]

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()
        shutil.rmtree(cls.scratch, ignore_errors=True)

    # ---- helpers ----

    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=timeout * MULT)

    def hdrs(self, extra=None, sid=None, token=None, user=None):
        h = {"E2b-Sandbox-Id": sid or self.sid, "X-Access-Token": token or self.token}
        if user is not None:
            h["Authorization"] = "Basic " + base64.b64encode((user + ":").encode()).decode()
        h.update(extra or {})
        return {k: v for k, v in h.items() if v is not None}

    def rpc(self, method, body, user=None, proto=False, **kw):
        c = self.conn()
        data = body if proto else json.dumps(body, indent=2).encode()
        h = self.hdrs({"Content-Type": "application/proto" if proto else "application/json",
                       "connect-protocol-version": "1"}, user=user, **kw)
        c.request("POST", "/" + method, body=data, headers=h)
        r = c.getresponse()
        raw = r.read()
        c.close()
        if proto and r.status == 200:
            return r.status, raw
        return r.status, (json.loads(raw) if raw else None)

    def open_stream(self, method, body, user=None, timeout_ms=None, keepalive=None, proto=False,
                    raw=None, **kw):
        c = self.conn()
        payload = body if proto else json.dumps(body, indent=2).encode()
        h = self.hdrs({"Content-Type": "application/connect+proto" if proto
                       else "application/connect+json",
                       "connect-protocol-version": "1", "connect-content-encoding": "identity"},
                      user=user, **kw)
        if timeout_ms is not None:
            h["connect-timeout-ms"] = str(timeout_ms)
        if keepalive is not None:
            h["Keepalive-Ping-Interval"] = str(keepalive)
        c.request("POST", "/" + method, body=raw if raw is not None else env(0, payload),
                  headers=h)
        return c, c.getresponse()

    def next_env(self, r):
        h = r.read(5)
        if len(h) < 5:
            return None
        flags, n = struct.unpack(">BI", h)
        return flags, r.read(n)

    def stream(self, method, body, **kw):
        """Whole stream: (messages, end) with messages decoded from JSON."""
        c, r = self.open_stream(method, body, **kw)
        if r.status != 200:
            self.fail("status %d: %r" % (r.status, r.read()))
        self.assertEqual(r.getheader("Content-Type"), "application/connect+json")
        msgs, end = [], None
        while True:
            e = self.next_env(r)
            if e is None:
                break
            if e[0] & 2:
                end = json.loads(e[1])
                self.assertIsNone(self.next_env(r), "nothing may follow the end-stream")
                break
            self.assertTrue(e[1], "data envelopes are never empty")
            msgs.append(json.loads(e[1]))
        c.close()
        return msgs, end

    def cmd(self, line, envs=None, cwd=None, user=None, **kw):
        p = {"cmd": "/bin/bash", "args": ["-c", line]}
        if envs:
            p["envs"] = envs
        if cwd:
            p["cwd"] = cwd
        msgs, end = self.stream("process.Process/Start", {"process": p, "stdin": False},
                                user=user, **kw)
        out = b"".join(base64.b64decode(m["event"]["data"].get("stdout", ""))
                       for m in msgs if "data" in m["event"])
        err = b"".join(base64.b64decode(m["event"]["data"].get("stderr", ""))
                       for m in msgs if "data" in m["event"])
        return msgs, end, out, err

    def path(self, name):
        return os.path.join(self.scratch, name)

    # ---- process.Process ----

    def test_start_echo_exit_code_stderr(self):
        msgs, end, out, err = self.cmd("echo hello; echo oops >&2; exit 3", user="root")
        self.assertEqual(end, {})
        self.assertIn("start", msgs[0]["event"])
        self.assertGreater(msgs[0]["event"]["start"]["pid"], 0)
        self.assertEqual((out, err), (b"hello\n", b"oops\n"))
        last = msgs[-1]["event"]["end"]
        self.assertEqual((last["exitCode"], last["exited"], last["status"]),
                         (3, True, "exit status 3"))
        msgs, end, out, _ = self.cmd("true", user="root")
        self.assertNotIn("exitCode", msgs[-1]["event"]["end"])  # 0 is omitted
        self.assertEqual(msgs[-1]["event"]["end"]["status"], "exit status 0")

    def test_start_env_cwd_and_users(self):
        _, _, out, _ = self.cmd('printf "%s|%s" "$FOO" "$(pwd)"', envs={"FOO": "bar baz"},
                                cwd=self.scratch, user="root")
        self.assertEqual(out.decode(), "bar baz|" + self.scratch)
        _, _, out, _ = self.cmd("id -un", user="root")
        self.assertEqual(out, b"root\n")
        _, _, out, _ = self.cmd("id -un")  # no Authorization: the default user
        self.assertEqual(out, b"nobody\n")
        c, r = self.open_stream("process.Process/Start",
                                {"process": {"cmd": "/bin/true"}}, user="no-such-user-x")
        body = r.read()
        c.close()
        if r.status == 200:
            end = json.loads(parse_envs(body)[-1][1])
            self.assertEqual(end["error"]["code"], "unauthenticated")
        else:
            self.assertEqual((r.status, json.loads(body)["code"]), (401, "unauthenticated"))

    def test_start_proto_codec(self):
        cfg = pb_len(1, "/bin/sh") + pb_len(2, "-c") + pb_len(2, "echo proto; exit 2") + \
            pb_len(3, pb_len(1, "K") + pb_len(2, "V"))
        req = pb_len(1, cfg) + pb_uint(4, 0)
        c, r = self.open_stream("process.Process/Start", req, proto=True, user="root")
        self.assertEqual(r.status, 200)
        self.assertEqual(r.getheader("Content-Type"), "application/connect+proto")
        envs = parse_envs(r.read())
        c.close()
        self.assertEqual(envs[-1], (2, b"{}"))
        events = [pb_parse(pb_parse(p)[1][0]) for f, p in envs[:-1]]
        self.assertIn(1, events[0])  # start
        pid = pb_parse(events[0][1][0])[1][0]
        self.assertGreater(pid, 0)
        out = b"".join(pb_parse(e[2][0]).get(1, [b""])[0] for e in events if 2 in e)
        self.assertEqual(out, b"proto\n")
        end = pb_parse(events[-1][3][0])
        self.assertEqual(end[1][0], 4)  # sint32 zigzag of 2
        self.assertEqual(end[2][0], 1)
        # Unary proto: List.
        st, raw = self.rpc("process.Process/List", b"", proto=True)
        self.assertEqual(st, 200)
        self.assertIsInstance(pb_parse(raw), dict)

    def test_keepalive_events(self):
        t0 = time.time()
        msgs, end, _, _ = self.cmd("sleep 2.5", keepalive=1, user="root")
        self.assertEqual(end, {})
        kinds = [list(m["event"])[0] for m in msgs]
        self.assertEqual(kinds[0], "start")
        self.assertEqual(kinds[-1], "end")
        self.assertGreaterEqual(kinds.count("keepalive"), 2, kinds)
        self.assertLess(time.time() - t0, 30)

    def test_connect_timeout_kills_even_after_detach(self):
        marker = self.path("ct-%d" % time.time())
        # Attached: the stream ends with deadline_exceeded and the process is gone.
        msgs, end, _, _ = self.cmd("sleep 30", timeout_ms=800, user="root")
        self.assertEqual(end["error"]["code"], "deadline_exceeded")
        self.assertIn("end", msgs[-1]["event"])
        # Detached right after start: still killed at the deadline.
        c, r = self.open_stream("process.Process/Start",
                                {"process": {"cmd": "/bin/bash", "args": [
                                    "-c", "sleep 1.5; touch %s; sleep 30" % marker]}},
                                timeout_ms=700, user="root")
        pid = json.loads(self.next_env(r)[1])["event"]["start"]["pid"]
        c.close()
        time.sleep(2.5)
        self.assertFalse(os.path.exists(marker), "the process outlived its connect-timeout")
        st, lst = self.rpc("process.Process/List", {})
        self.assertNotIn(pid, [p["pid"] for p in lst.get("processes", [])])

    def test_background_connect_list_input_signal(self):
        c, r = self.open_stream("process.Process/Start",
                                {"process": {"cmd": "/bin/bash", "args": [
                                    "-c", "echo first; while read l; do echo got:$l; done"]},
                                 "tag": "bg-tag", "stdin": True}, user="root")
        pid = json.loads(self.next_env(r)[1])["event"]["start"]["pid"]
        c.close()  # detach: the process must keep running
        time.sleep(0.3)
        st, lst = self.rpc("process.Process/List", {})
        self.assertEqual(st, 200, lst)
        mine = [p for p in lst["processes"] if p["pid"] == pid]
        self.assertEqual(len(mine), 1, lst)
        self.assertEqual(mine[0]["tag"], "bg-tag")
        self.assertEqual(mine[0]["config"]["cmd"], "/bin/bash")
        self.assertEqual(mine[0]["config"]["args"][0], "-c")
        st, r1 = self.rpc("process.Process/SendInput",
                          {"process": {"pid": pid},
                           "input": {"stdin": base64.b64encode(b"one\n").decode()}})
        self.assertEqual((st, r1), (200, {}))
        # StreamInput (client streaming): envelopes in one body, by tag.
        body = env(0, json.dumps({"start": {"process": {"tag": "bg-tag"}}}).encode()) + \
            env(0, json.dumps({"data": {"input": {"stdin": base64.b64encode(b"two\n").decode()}}}
                              ).encode()) + env(0, json.dumps({"keepalive": {}}).encode())
        c2, r2 = self.open_stream("process.Process/StreamInput", None, raw=body)
        envs = parse_envs(r2.read())
        c2.close()
        self.assertEqual(envs[-1], (2, b"{}"))
        # Re-attach by tag: start first, the replayed output, then follow.
        c, r = self.open_stream("process.Process/Connect", {"process": {"tag": "bg-tag"}})
        self.assertEqual(r.status, 200)
        first = json.loads(self.next_env(r)[1])
        self.assertEqual(first["event"]["start"]["pid"], pid)
        got = b""
        deadline = time.time() + 10
        while b"got:two" not in got and time.time() < deadline:
            f, p = self.next_env(r)
            ev = json.loads(p)["event"]
            if "data" in ev:
                got += base64.b64decode(ev["data"].get("stdout", ""))
        self.assertIn(b"first\ngot:one\ngot:two\n", got)
        st, r3 = self.rpc("process.Process/SendSignal",
                          {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
        self.assertEqual((st, r3), (200, {}))
        while True:
            f, p = self.next_env(r)
            if f & 2:
                self.assertEqual(json.loads(p), {})
                break
            ev = json.loads(p)["event"]
            if "end" in ev:
                self.assertEqual(ev["end"]["status"], "signal: killed")
                self.assertFalse(ev["end"].get("exited", False))
        c.close()
        st, r4 = self.rpc("process.Process/SendSignal",
                          {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
        self.assertEqual((st, r4["code"]), (404, "not_found"))
        st, r5 = self.rpc("process.Process/SendInput",
                          {"process": {"pid": 999999}, "input": {"stdin": "eA=="}})
        self.assertEqual((st, r5["code"]), (404, "not_found"))
        st, r6 = self.rpc("process.Process/SendSignal",
                          {"process": {"pid": 1}, "signal": "SIGNAL_UNSPECIFIED"})
        self.assertEqual((st, r6["code"]), (400, "invalid_argument"))

    def test_pty_update_and_input(self):
        c, r = self.open_stream("process.Process/Start",
                                {"process": {"cmd": "/bin/sh", "args": [
                                    "-c", "read x; stty size; read y"]},
                                 "pty": {"size": {"cols": 80, "rows": 24}}}, user="root")
        pid = json.loads(self.next_env(r)[1])["event"]["start"]["pid"]
        st, b = self.rpc("process.Process/Update",
                         {"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 40}}})
        self.assertEqual((st, b), (200, {}))
        st, b = self.rpc("process.Process/SendInput",
                         {"process": {"pid": pid},
                          "input": {"pty": base64.b64encode(b"go\n").decode()}})
        self.assertEqual(st, 200, b)
        got = b""
        deadline = time.time() + 10
        while b"40 100" not in got and time.time() < deadline:
            f, p = self.next_env(r)
            ev = json.loads(p)["event"]
            if "data" in ev:
                self.assertNotIn("stdout", ev["data"])
                got += base64.b64decode(ev["data"].get("pty", ""))
        self.assertIn(b"40 100", got)
        self.rpc("process.Process/SendSignal", {"process": {"pid": pid},
                                                "signal": "SIGNAL_SIGKILL"})
        c.close()

    def test_client_disconnect_does_not_kill(self):
        marker = self.path("dc-%d" % time.time())
        c, r = self.open_stream("process.Process/Start",
                                {"process": {"cmd": "/bin/bash", "args": [
                                    "-c", "sleep 1; touch %s" % marker]}}, user="root")
        self.next_env(r)
        c.close()
        deadline = time.time() + 10
        while not os.path.exists(marker) and time.time() < deadline:
            time.sleep(0.1)
        self.assertTrue(os.path.exists(marker))

    # ---- filesystem.Filesystem ----

    def test_filesystem_rpcs(self):
        d = self.path("fs-%d" % time.time())
        st, r = self.rpc("filesystem.Filesystem/MakeDir", {"path": d + "/sub"}, user="root")
        self.assertEqual(st, 200, r)
        self.assertEqual(r["entry"]["type"], "FILE_TYPE_DIRECTORY")
        self.assertEqual(r["entry"]["permissions"][0], "d")
        st, r = self.rpc("filesystem.Filesystem/MakeDir", {"path": d + "/sub"}, user="root")
        self.assertEqual((st, r["code"]), (409, "already_exists"))
        with open(d + "/sub/f.txt", "w") as f:
            f.write("12345")
        os.symlink(d + "/sub", d + "/link")
        st, r = self.rpc("filesystem.Filesystem/Stat", {"path": d + "/sub/f.txt"}, user="root")
        self.assertEqual(st, 200, r)
        e = r["entry"]
        self.assertEqual((e["name"], e["type"], e["size"], e["path"]),
                         ("f.txt", "FILE_TYPE_FILE", "5", d + "/sub/f.txt"))
        self.assertRegex(e["permissions"], r"^-[rwx-]{9}$")
        self.assertEqual((e["owner"], e["group"]), ("root", "root"))
        self.assertRegex(e["modifiedTime"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
        st, r = self.rpc("filesystem.Filesystem/Stat", {"path": d + "/link"}, user="root")
        self.assertEqual(r["entry"]["type"], "FILE_TYPE_DIRECTORY")
        self.assertEqual(r["entry"]["symlinkTarget"], d + "/sub")
        st, r = self.rpc("filesystem.Filesystem/ListDir", {"path": d, "depth": 2}, user="root")
        self.assertEqual(st, 200, r)
        names = sorted(x["path"][len(d) + 1:] for x in r["entries"])
        self.assertIn("sub", names)
        self.assertIn("sub/f.txt", names)
        self.assertTrue(all(x["type"] in ("FILE_TYPE_FILE", "FILE_TYPE_DIRECTORY")
                            for x in r["entries"]))
        st, r = self.rpc("filesystem.Filesystem/Move",
                         {"source": d + "/sub/f.txt", "destination": d + "/g.txt"}, user="root")
        self.assertEqual((st, r["entry"]["path"]), (200, d + "/g.txt"))
        st, r = self.rpc("filesystem.Filesystem/Remove", {"path": d + "/sub"}, user="root")
        self.assertEqual((st, r), (200, {}))
        st, r = self.rpc("filesystem.Filesystem/Stat", {"path": d + "/sub"}, user="root")
        self.assertEqual((st, r["code"]), (404, "not_found"))
        st, r = self.rpc("filesystem.Filesystem/ListDir", {"path": d + "/g.txt"}, user="root")
        self.assertEqual((st, r["code"]), (400, "invalid_argument"))
        st, r = self.rpc("filesystem.Filesystem/Stat", {"path": ""}, user="root")
        self.assertEqual((st, r["code"]), (400, "invalid_argument"))
        # The default user (nobody) cannot write into a root-only directory.
        os.mkdir(d + "/private", 0o700)
        st, r = self.rpc("filesystem.Filesystem/MakeDir", {"path": d + "/private/x"})
        self.assertEqual((st, r["code"]), (403, "permission_denied"))

    def test_watchers_poll_and_stream(self):
        d = self.path("w-%d" % time.time())
        os.mkdir(d)
        os.chmod(d, 0o777)
        st, r = self.rpc("filesystem.Filesystem/CreateWatcher", {"path": d}, user="root")
        self.assertEqual(st, 200, r)
        wid = r["watcherId"]
        with open(d + "/new.txt", "w") as f:
            f.write("x")
        time.sleep(0.3)
        st, r = self.rpc("filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        self.assertEqual(st, 200, r)
        kinds = {(e["name"], e["type"]) for e in r["events"]}
        self.assertIn(("new.txt", "EVENT_TYPE_CREATE"), kinds)
        st, r = self.rpc("filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        self.assertEqual(r, {})  # drained
        st, r = self.rpc("filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid},
                         sid=self.sid2, token=self.token2)
        self.assertEqual((st, r["code"]), (404, "not_found"))  # not that sandbox's watcher
        st, r = self.rpc("filesystem.Filesystem/RemoveWatcher", {"watcherId": wid})
        self.assertEqual((st, r), (200, {}))
        st, r = self.rpc("filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        self.assertEqual((st, r["code"]), (404, "not_found"))
        st, r = self.rpc("filesystem.Filesystem/CreateWatcher", {"path": d + "/nope"})
        self.assertEqual((st, r["code"]), (404, "not_found"))
        # WatchDir stream: start first, then events, keepalives; recursive names are relative.
        os.mkdir(d + "/s")
        c, resp = self.open_stream("filesystem.Filesystem/WatchDir",
                                   {"path": d, "recursive": True}, keepalive=1, user="root")
        self.assertEqual(resp.status, 200)
        self.assertEqual(json.loads(self.next_env(resp)[1]), {"start": {}})
        with open(d + "/s/deep.txt", "w") as f:
            f.write("y")
        seen, ka = set(), 0
        deadline = time.time() + 10
        while time.time() < deadline and (("s/deep.txt", "EVENT_TYPE_CREATE") not in seen
                                          or ka == 0):
            f, p = self.next_env(resp)
            m = json.loads(p)
            if "filesystem" in m:
                seen.add((m["filesystem"]["name"], m["filesystem"]["type"]))
            ka += "keepalive" in m
        self.assertIn(("s/deep.txt", "EVENT_TYPE_CREATE"), seen)
        self.assertGreater(ka, 0)
        c.close()

    # ---- /files ----

    def files(self, method, query, body=None, headers=None, auth=True, **kw):
        c = self.conn()
        h = self.hdrs(headers, **kw) if auth else dict(headers or {})
        c.request(method, "/files?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote),
                  body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data, r

    def multipart(self, parts, boundary="xYzb0und"):
        out = b""
        for name, filename, data in parts:
            disp = 'form-data; name="%s"' % name
            if filename is not None:
                disp += '; filename="%s"' % filename.replace('"', "%22")
            out += b"--" + boundary.encode() + b"\r\nContent-Disposition: " + disp.encode() + \
                b"\r\nContent-Type: application/octet-stream\r\n\r\n" + data + b"\r\n"
        return out + b"--" + boundary.encode() + b"--\r\n", \
            "multipart/form-data; boundary=" + boundary

    def test_files_multipart_one_and_several(self):
        p = self.path("mp-one.txt")
        body, ct = self.multipart([("file", p, b"x")])
        st, data, _ = self.files("POST", {"path": p, "username": "root"}, body,
                                 {"Content-Type": ct})
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data), [{"name": "mp-one.txt", "type": "file", "path": p}])
        st, data, r = self.files("GET", {"path": p, "username": "root"})
        self.assertEqual((st, data), (200, b"x"))
        self.assertEqual(r.getheader("Content-Type"), "application/octet-stream")
        self.assertEqual(r.getheader("Content-Length"), "1")
        a, b = self.path("several/a.txt"), self.path("several/deeper/b.bin")
        body, ct = self.multipart([("file", a, b"AAA"), ("other", None, b"ignored"),
                                   ("file", b, b"\r\n--xYzb0un\x00\xff")])
        st, data, _ = self.files("POST", {"username": "nobody"}, body, {"Content-Type": ct})
        self.assertEqual(st, 200, data)
        res = json.loads(data)
        self.assertEqual([x["path"] for x in res], [a, b])
        self.assertTrue(all(set(x) == {"name", "type", "path"} for x in res))
        with open(b, "rb") as f:
            self.assertEqual(f.read(), b"\r\n--xYzb0un\x00\xff")
        self.assertEqual(os.stat(b).st_uid, 65534)  # written and owned as the user
        self.assertEqual(os.stat(os.path.dirname(b)).st_uid, 65534)
        body, ct = self.multipart([("file", a, b"1"), ("file", a, b"2")])
        st, data, _ = self.files("POST", {"username": "root"}, body, {"Content-Type": ct})
        self.assertEqual(st, 400, data)
        st, data, _ = self.files("GET", {"path": self.scratch, "username": "root"})
        self.assertEqual(st, 400, data)
        st, data, _ = self.files("GET", {"path": self.path("missing"), "username": "root"})
        self.assertEqual(st, 404, data)
        self.assertIsInstance(json.loads(data), dict)

    def test_files_chunked_upload(self):
        p = self.path("chunked.txt")
        body, ct = self.multipart([("file", p, b"chunky" * 1000)])
        c = self.conn()
        c.putrequest("POST", "/files?" + urllib.parse.urlencode({"path": p, "username": "root"}))
        for k, v in self.hdrs({"Content-Type": ct, "Transfer-Encoding": "chunked"}).items():
            c.putheader(k, v)
        c.endheaders()
        for i in range(0, len(body), 1000):
            piece = body[i:i + 1000]
            c.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        c.send(b"0\r\n\r\n")
        r = c.getresponse()
        self.assertEqual(r.status, 200, r.read())
        r.read()
        c.close()
        with open(p, "rb") as f:
            self.assertEqual(f.read(), b"chunky" * 1000)

    def test_files_octet_stream_gzip(self):
        p = self.path("gz.txt")
        data = os.urandom(100000) + b"tail"
        st, out, _ = self.files("POST", {"path": p, "username": "root"}, gzip.compress(data),
                                {"Content-Type": "application/octet-stream",
                                 "Content-Encoding": "gzip"})
        self.assertEqual(st, 200, out)
        self.assertEqual(json.loads(out)[0]["path"], p)
        with open(p, "rb") as f:
            self.assertEqual(f.read(), data)
        st, out, _ = self.files("POST", {"path": p, "username": "root"}, b"plain",
                                {"Content-Type": "application/octet-stream"})
        self.assertEqual(st, 200, out)
        st, out, _ = self.files("POST", {"path": p, "username": "root"},
                                gzip.compress(data)[:500],
                                {"Content-Type": "application/octet-stream",
                                 "Content-Encoding": "gzip"})
        self.assertEqual(st, 400, out)

    def test_files_20mib_round_trip(self):
        p = self.path("big.bin")
        data = os.urandom(20 * 1024 * 1024)
        want = hashlib.sha256(data).hexdigest()
        body, ct = self.multipart([("file", p, data)])
        t0 = time.time()
        st, out, _ = self.files("POST", {"path": p, "username": "root"}, body,
                                {"Content-Type": ct})
        t1 = time.time()
        self.assertEqual(st, 200, out)
        st, got, _ = self.files("GET", {"path": p, "username": "root"})
        t2 = time.time()
        self.assertEqual(st, 200)
        self.assertEqual(hashlib.sha256(got).hexdigest(), want)
        sys.stderr.write("\n20 MiB: upload %.2fs (%.0f MiB/s), download %.2fs (%.0f MiB/s)\n"
                         % (t1 - t0, 20 / (t1 - t0), t2 - t1, 20 / (t2 - t1)))
        # A client that leaves mid-download stops the transfer; the server carries on.
        c = self.conn()
        c.request("GET", "/files?" + urllib.parse.urlencode({"path": p, "username": "root"}),
                  headers=self.hdrs())
        r = c.getresponse()
        self.assertEqual(len(r.read(1 << 20)), 1 << 20)
        c.close()
        st, got, _ = self.files("GET", {"path": p, "username": "root"})
        self.assertEqual((st, len(got)), (200, len(data)))

    def sign(self, path, op, user, token, exp=None):
        raw = "%s:%s:%s:%s" % (path, op, user, token)
        if exp is not None:
            raw += ":%d" % exp
        return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")

    def test_signed_urls(self):
        p = self.path("signed.txt")
        with open(p, "w") as f:
            f.write("signed")
        only_id = {"E2b-Sandbox-Id": self.sid}
        exp = int(time.time()) + 60
        q_ = {"path": p, "username": "root", "signature": self.sign(p, "read", "root", self.token,
                                                                   exp),
              "signature_expiration": exp}
        st, data, _ = self.files("GET", q_, headers=only_id, auth=False)
        self.assertEqual((st, data), (200, b"signed"))
        q_ = {"path": p, "username": "root",
              "signature": self.sign(p, "read", "root", self.token)}
        st, data, _ = self.files("GET", q_, headers=only_id, auth=False)
        self.assertEqual((st, data), (200, b"signed"))
        old = int(time.time()) - 10
        q_ = {"path": p, "username": "root", "signature": self.sign(p, "read", "root", self.token,
                                                                   old),
              "signature_expiration": old}
        st, data, _ = self.files("GET", q_, headers=only_id, auth=False)
        self.assertEqual(st, 401, data)
        q_ = {"path": p + "x", "username": "root",
              "signature": self.sign(p, "read", "root", self.token)}
        st, data, _ = self.files("GET", q_, headers=only_id, auth=False)
        self.assertEqual(st, 401, data)
        q_ = {"path": p, "username": "root", "signature": self.sign(p, "write", "root",
                                                                   self.token)}
        st, data, _ = self.files("GET", q_, headers=only_id, auth=False)  # wrong operation
        self.assertEqual(st, 401, data)
        w = self.path("signed-up.txt")
        q_ = {"path": w, "username": "root", "signature": self.sign(w, "write", "root",
                                                                   self.token)}
        st, data, _ = self.files("POST", q_, b"up", {"E2b-Sandbox-Id": self.sid,
                                                     "Content-Type": "application/octet-stream"},
                                 auth=False)
        self.assertEqual(st, 200, data)
        st, data, _ = self.files("GET", {"path": p}, headers=only_id, auth=False)
        self.assertEqual(st, 401, data)

    def test_auth_and_cross_sandbox(self):
        st, r = self.rpc("process.Process/List", {}, token="wrong-token")
        self.assertEqual(st, 401, r)
        st, r = self.rpc("process.Process/List", {}, sid=self.sid2)  # token of sandbox 1
        self.assertEqual(st, 401, r)
        # /health too needs the token (the SDKs send it there): without, it would tell who
        # asks which sandboxes exist and run.
        c = self.conn()
        c.request("GET", "/health", headers={"E2b-Sandbox-Id": self.sid})
        r = c.getresponse()
        self.assertEqual(r.status, 401)
        r.read()
        c.close()
        c = self.conn()
        c.request("GET", "/health", headers=self.hdrs())
        r = c.getresponse()
        self.assertEqual(r.status, 204)
        r.read()
        c.close()
        c = self.conn()
        c.request("GET", "/envs", headers=self.hdrs())
        r = c.getresponse()
        body = json.loads(r.read())
        c.close()
        self.assertEqual(r.status, 200)
        self.assertIsInstance(body, dict)
        # The sandbox's own variables (envd's defaults), not a process's whole environment;
        # this driver gives its agents no IDENTITY, so there are none (e2e covers real VMs).
        self.assertNotIn("PATH", body)

    def test_hostile_inputs(self):
        # Malformed envelopes: truncated header, a length past the body, compressed flag.
        for raw in (b"\x00\x00", env(0, b"{}")[:-1], b"\x00\xff\xff\xff\xff{}",
                    b"\x01\x00\x00\x00\x02{}"):
            c, r = self.open_stream("process.Process/Start", None, raw=raw, user="root")
            body = r.read()
            c.close()
            # Stream errors are 200 + an end-stream envelope (connect-web reads no error body).
            self.assertEqual(r.status, 200, body)
            self.assertEqual(parse_envs(body), [(2, parse_envs(body)[0][1])])
            self.assertEqual(json.loads(parse_envs(body)[0][1])["error"]["code"],
                             "invalid_argument")
        st, r = self.rpc("process.Process/SendInput", {"input": {"stdin": "!!!"}})
        self.assertEqual((st, r["code"]), (400, "invalid_argument"))
        st, r = self.rpc("process.Process/Nope", {})
        self.assertEqual((st, r["code"]), (501, "unimplemented"))
        c = self.conn()
        c.request("POST", "/process.Process/List", body=b"{}",
                  headers=self.hdrs({"Content-Type": "text/plain"}))
        r = c.getresponse()
        self.assertEqual(r.status, 400)
        r.read()
        c.close()
        # Truncated multipart and a missing final boundary.
        body, ct = self.multipart([("file", self.path("t.txt"), b"abc")])
        for cut in (body[:-10], body[:40], body.replace(b"--xYzb0und--", b"")):
            st, data, _ = self.files("POST", {"username": "root"}, cut, {"Content-Type": ct})
            self.assertEqual(st, 400, data)
        self.assertFalse(os.path.exists(self.path("t.txt")))
        # A guest path with ../: resolved in the guest, relative to the user's home, as that
        # user. Here nobody's home is / (or /nonexistent) and /etc/shadow is not readable.
        st, data, _ = self.files("GET", {"path": "../../etc/shadow"})
        self.assertIn(st, (403, 404), data)
        st, data, _ = self.files("GET", {"path": "../../../../etc/hostname", "username": "root"})
        self.assertIn(st, (200, 404), data)


if __name__ == "__main__":
    unittest.main(verbosity=2)
