"""Command sessions (native API): create on the control plane, attach with the session token.

Runs against spaced-test with a real space-agent-host per sandbox (SPACE_FAKE_AGENT), like
test_commands.py. The WebSocket client is tests/wsclient.py.
"""
import hashlib
import json
import os
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, PlatformTest, skip_unless_agent, skip_unless_pg  # noqa: E402
from wsclient import WebSocket  # noqa: E402

@skip_unless_pg
@skip_unless_agent
class SessionsTest(PlatformTest):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.sid, _ = cls.s.create()

    # ---- helpers ----

    def create(self, body, key=None, status=201):
        st, r = self.s.request("POST", "/v1/sandboxes/%s/sessions" % self.sid, body, key=key)
        self.assertEqual(st, status, r)
        return r

    def attach(self, sess, token=None, headers=None, timeout=30):
        """Starts an NDJSON attach; returns (conn, response)."""
        key = False if token is False else (token or sess["attach_token"])
        return self.s.open_stream("GET", sess["attach_url"], key=key, headers=headers,
                                  timeout=timeout)

    def attach_status(self, sess, **kw):
        conn, r = self.attach(sess, **kw)
        body = r.read()
        conn.close()
        if r.status == 200:  # NDJSON events
            return r.status, [json.loads(x) for x in body.splitlines() if x.strip()]
        return r.status, (json.loads(body) if body else None)

    def ws(self, sess, token=None):
        return WebSocket(self.s.port, "%s?token=%s" % (sess["attach_url"],
                                                       token or sess["attach_token"]))

    def lines(self, resp):
        return [json.loads(x) for x in resp.read().splitlines() if x.strip()]

    # ---- tests ----

    def test_create_shape(self):
        r = self.create({"cmd": "true"})
        self.assertTrue(r["id"].startswith("se"), r)
        # The path names the sandbox: any node can forward the attach to its worker.
        self.assertEqual(r["attach_url"], "/v1/attach/%s/%s" % (self.sid, r["id"]))
        self.assertTrue(r["attach_token"].startswith("sat_"))
        self.assertNotIn(r["attach_token"], json.dumps(self.list_sessions()))
        self.assertEqual(r["state"], "created")
        self.assertRegex(r["expires_at"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        for bad in ({}, {"cmd": "x", "argv": ["x"]}, {"argv": []}, {"cmd": "x", "bogus": 1},
                    {"cmd": "x", "rows": 10}, {"cmd": "x", "attach_timeout_s": 0},
                    {"cmd": "x", "env": {"A": 1}}):
            self.create(bad, status=400)

    def test_attach_paths(self):
        # The older /v1/attach/{session} still works on the node that holds the session.
        sess = self.create({"cmd": "echo old-path"})
        conn, r = self.s.open_stream("GET", "/v1/attach/" + sess["id"],
                                     key=sess["attach_token"])
        events = self.lines(r)
        conn.close()
        self.assertEqual(r.status, 200)
        self.assertEqual(events[-1]["type"], "exit", events)
        # Another sandbox's path is not this session's, whatever the token.
        sess = self.create({"cmd": "true"})
        other, _ = self.s.create()
        st, body = self.attach_status(dict(sess, attach_url="/v1/attach/%s/%s"
                                           % (other, sess["id"])))
        self.assertEqual(st, 404, body)
        st, body = self.attach_status(dict(sess, attach_url="/v1/attach/%s/se%s"
                                           % (self.sid, "0" * 22)))
        self.assertEqual(st, 404, body)
        self.assertEqual(self.attach_status(sess)[0], 200)

    def list_sessions(self, key=None):
        st, r = self.s.request("GET", "/v1/sandboxes/%s/sessions" % self.sid, key=key)
        self.assertEqual(st, 200, r)
        return r["sessions"]

    def test_ndjson_attach(self):
        sess = self.create({"cmd": "echo hi; echo oops >&2; exit 3"})
        conn, r = self.attach(sess)
        self.assertEqual(r.status, 200)
        self.assertEqual(r.getheader("Content-Type"), "application/x-ndjson")
        ev = self.lines(r)
        conn.close()
        self.assertEqual(ev[0]["type"], "start", ev)
        self.assertEqual(ev[0]["session"], sess["id"])
        self.assertIsInstance(ev[0]["pid"], int)
        self.assertEqual("".join(e["data"] for e in ev if e["type"] == "stdout"), "hi\n")
        self.assertEqual("".join(e["data"] for e in ev if e["type"] == "stderr"), "oops\n")
        self.assertEqual(ev[-1], {"type": "exit", "exit_code": 3, "signal": None,
                                  "timed_out": False})
        mine = [x for x in self.list_sessions() if x["id"] == sess["id"]]
        self.assertEqual(len(mine), 1)
        self.assertEqual(mine[0]["state"], "exited")
        self.assertEqual(mine[0]["exit_code"], 3)
        self.assertNotIn("attach_token", mine[0])

    def test_argv_env_cwd(self):
        sess = self.create({"argv": ["/bin/sh", "-c", "echo $FOO; pwd"], "env": {"FOO": "bar"},
                            "cwd": "/tmp"})
        conn, r = self.attach(sess)
        ev = self.lines(r)
        conn.close()
        self.assertEqual("".join(e["data"] for e in ev if e["type"] == "stdout"), "bar\n/tmp\n")
        self.assertEqual(ev[-1]["exit_code"], 0)

    def test_token_checks(self):
        a = self.create({"cmd": "echo ready; sleep 30"})
        b = self.create({"cmd": "true"})
        # An API key is not an attach token; nor is another session's token, nor garbage.
        self.assertEqual(self.attach_status(a, token=self.s.key)[0], 401)
        self.assertEqual(self.attach_status(a, token=b["attach_token"])[0], 401)
        self.assertEqual(self.attach_status(a, token="sat_" + "x" * 43)[0], 401)
        self.assertEqual(self.attach_status(a, token="garbage")[0], 401)
        st, body = self.attach_status(a, token=False)
        self.assertEqual(st, 401)
        self.assertEqual(body["error"]["code"], "unauthenticated", body)
        # None of those started the process.
        self.assertEqual([x["state"] for x in self.list_sessions() if x["id"] == a["id"]],
                         ["created"])
        # One attach at a time: the second one, while the first streams, is 409.
        conn, r = self.attach(a)
        self.assertEqual(r.status, 200)
        self.assertEqual(json.loads(r.readline())["type"], "start")
        self.assertEqual(json.loads(r.readline())["data"], "ready\n")
        st, body = self.attach_status(a)
        self.assertEqual(st, 409, body)
        ws = self.ws(a)
        self.assertEqual(ws.status, 409)
        ws.close()
        # DELETE kills the process: the attached stream ends with SIGKILL.
        st, body = self.s.request("DELETE", "/v1/sandboxes/%s/sessions/%s" % (self.sid, a["id"]))
        self.assertEqual(st, 200, body)
        rest = self.lines(r)
        conn.close()
        self.assertEqual(rest[-1]["type"], "exit", rest)
        self.assertEqual(rest[-1]["signal"], 9, rest)
        self.assertEqual(self.attach_status(a)[0], 404)
        st, _ = self.s.request("DELETE", "/v1/sandboxes/%s/sessions/%s" % (self.sid, a["id"]))
        self.assertEqual(st, 404)

    def test_ws_cat(self):
        sess = self.create({"cmd": "cat"})
        ws = self.ws(sess)
        self.assertEqual(ws.status, 101)
        op, p = ws.recv()
        self.assertEqual(op, 1)
        self.assertEqual(json.loads(p)["type"], "start")
        ws.send_binary(b"hello\n")
        out = b""
        while b"hello\n" not in out:
            op, p = ws.recv()
            self.assertEqual(op, 2, p)
            self.assertEqual(p[0], 1)
            out += p[1:]
        ws.send_json({"type": "stdin", "data": "text too\n"})
        ws.send_json({"type": "bogus"})
        ws.send_json({"type": "eof"})
        events, more, err = ws.collect()
        ws.close()
        self.assertEqual(out + more, b"hello\ntext too\n")
        self.assertEqual(err, b"")
        self.assertEqual(events[0]["type"], "error", events)  # the bogus message
        self.assertEqual(events[-1]["type"], "exit", events)
        self.assertEqual(events[-1]["exit_code"], 0, events)

    def test_ws_pty_resize(self):
        sess = self.create({"cmd": "read line; stty size", "pty": True})
        ws = self.ws(sess)
        self.assertEqual(ws.status, 101)
        ws.send_json({"type": "resize", "rows": 33, "cols": 101})
        ws.send_binary(b"go\n")
        events, out, _ = ws.collect()
        ws.close()
        self.assertIn(b"33 101", out, (events, out))
        self.assertEqual(events[-1]["type"], "exit", events)
        self.assertEqual(events[-1]["exit_code"], 0, events)

    def test_ws_signal(self):
        sess = self.create({"cmd": "echo up; sleep 30"})
        ws = self.ws(sess)
        out = b""
        while b"up" not in out:
            op, p = ws.recv()
            if op == 2:
                out += p[1:]
        ws.send_json({"type": "signal", "signal": "SIGTERM"})
        events, _, _ = ws.collect()
        ws.close()
        self.assertEqual(events[-1]["type"], "exit", events)
        self.assertEqual(events[-1]["signal"], 15, events)

    def test_ws_large_output_and_stdin(self):
        # Several agent windows each way: credit must come back as the client takes bytes.
        sess = self.create({"cmd": "seq 1 300000"})
        ws = self.ws(sess)
        events, out, _ = ws.collect()
        ws.close()
        self.assertEqual(events[-1]["exit_code"], 0, events)
        self.assertEqual(out, "".join("%d\n" % i for i in range(1, 300001)).encode())

        sess = self.create({"cmd": "cat"})
        ws = self.ws(sess)
        data = os.urandom(3 * 1024 * 1024)

        def writer():
            for i in range(0, len(data), 65536):
                ws.send_binary(data[i:i + 65536])
            ws.send_json({"type": "eof"})

        t = threading.Thread(target=writer)
        t.start()
        events, out, _ = ws.collect()
        t.join()
        ws.close()
        self.assertEqual(events[-1]["exit_code"], 0, events)
        self.assertEqual(hashlib.sha256(out).hexdigest(), hashlib.sha256(data).hexdigest())

    def test_ws_stdin_before_reading(self):
        # All of stdin (more than one agent window) and its EOF arrive before the process took
        # any: the agent's credit coming back must move the rest on its own, with no later
        # client message to prompt it (spacectl exec < file sends everything at once).
        # The frames are made first and written at once: made one by one (masking in Python
        # is slow), they would trickle in and each would prompt the server anew.
        sess = self.create({"cmd": "sha256sum"})
        data = os.urandom(900 * 1024)
        frames = [WebSocket.frame(0x2, data[i:i + 65536]) for i in range(0, len(data), 65536)]
        frames.append(WebSocket.frame(0x1, b'{"type":"eof"}'))
        ws = self.ws(sess)
        ws.sock.sendall(b"".join(frames))
        events, out, _ = ws.collect()
        ws.close()
        self.assertEqual(events[-1]["exit_code"], 0, events)
        self.assertEqual(out.split()[0].decode(), hashlib.sha256(data).hexdigest())

    def test_reattach_replays(self):
        sess = self.create({"cmd": "i=0; while true; do echo tick$i; i=$((i+1)); sleep 0.1; done"})
        conn, r = self.attach(sess)
        self.assertEqual(json.loads(r.readline())["type"], "start")
        self.assertEqual(json.loads(r.readline())["data"], "tick0\n")
        conn.close()  # the client goes away: the process keeps running
        time.sleep(0.5)
        deadline = time.time() + 10 * MULT
        while True:  # the server notices the disconnect asynchronously
            conn, r = self.attach(sess)
            if r.status != 409 or time.time() > deadline:
                break
            r.read()
            conn.close()
            time.sleep(0.1)
        self.assertEqual(r.status, 200)
        start = json.loads(r.readline())
        self.assertEqual(start["type"], "start")
        seen = ""
        while "tick5" not in seen:
            ev = json.loads(r.readline())
            self.assertEqual(ev["type"], "stdout", ev)
            seen += ev["data"]
        self.assertTrue(seen.startswith("tick0\n"), seen)  # replayed from the start
        conn.close()
        st, body = self.s.request("DELETE", "/v1/sandboxes/%s/sessions/%s" % (self.sid, sess["id"]))
        self.assertEqual(st, 200, body)
        self.assertEqual(self.attach_status(sess)[0], 404)

    def test_expired_and_unknown(self):
        sess = self.create({"cmd": "true", "attach_timeout_s": 1})
        time.sleep(2.5)
        st, body = self.attach_status(sess)
        self.assertEqual(st, 404, body)
        self.assertNotIn(sess["id"], [x["id"] for x in self.list_sessions()])
        fake = dict(sess, attach_url="/v1/attach/se" + "0" * 22)
        self.assertEqual(self.attach_status(fake)[0], 404)
        st, _ = self.s.request("GET", "/v1/sandboxes/%s/sessions/%s" % (self.sid, sess["id"]))
        self.assertEqual(st, 404)

    def test_other_team(self):
        self.create({"cmd": "true"}, key=self.other_key, status=404)
        st, _ = self.s.request("GET", "/v1/sandboxes/%s/sessions" % self.sid, key=self.other_key)
        self.assertEqual(st, 404)
        mine = self.create({"cmd": "true"})
        for method in ("GET", "DELETE"):
            st, _ = self.s.request(method, "/v1/sandboxes/%s/sessions/%s" % (self.sid, mine["id"]),
                                   key=self.other_key)
            self.assertEqual(st, 404)
        st, _ = self.s.request("POST", "/v1/sandboxes/nosuchsandbox/sessions", {"cmd": "true"})
        self.assertEqual(st, 404)
        # The session still works for its owner.
        self.assertEqual(self.attach_status(mine)[0], 200)

    def test_attach_method(self):
        sess = self.create({"cmd": "true"})
        st, _ = self.s.request("POST", sess["attach_url"], {}, key="")
        self.assertEqual(st, 405)


if __name__ == "__main__":
    unittest.main(verbosity=2)
