"""Command sessions (native API): create on the control plane, attach with the session token.

Runs against spaced-test with a real space-agent-host per sandbox (SPACE_FAKE_AGENT), like
test_commands.py. The WebSocket client below is the standard library only (RFC 6455 framing,
client frames masked).
"""
import base64
import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, PlatformTest, skip_unless_agent, skip_unless_pg  # noqa: E402

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class WsError(Exception):
    pass


class WebSocket:
    """A minimal RFC 6455 client: handshake, masked frames out, whole messages in."""

    def __init__(self, port, path, headers=None, timeout=30):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout * MULT)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = ["GET %s HTTP/1.1" % path, "Host: 127.0.0.1:%d" % port, "Upgrade: websocket",
                 "Connection: Upgrade", "Sec-WebSocket-Key: " + key,
                 "Sec-WebSocket-Version: 13"]
        for k, v in (headers or {}).items():
            lines.append("%s: %s" % (k, v))
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise WsError("connection closed during the handshake: %r" % buf)
            buf += chunk
        head, self.buf = buf.split(b"\r\n\r\n", 1)
        status_line, *hdrs = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {h.split(":", 1)[0].strip().lower(): h.split(":", 1)[1].strip()
                        for h in hdrs if ":" in h}
        self.body = self.buf if self.status != 101 else b""
        if self.status == 101:
            want = base64.b64encode(hashlib.sha1(key.encode() + WS_GUID).digest()).decode()
            if self.headers.get("sec-websocket-accept") != want:
                raise WsError("bad Sec-WebSocket-Accept")
        self.closed = False

    @staticmethod
    def frame(opcode, payload):
        """One masked client frame, as bytes (send_frame sends it)."""
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        return head + mask + masked

    def send_frame(self, opcode, payload):
        self.sock.sendall(self.frame(opcode, payload))

    def send_binary(self, data):
        self.send_frame(0x2, data)

    def send_json(self, obj):
        self.send_frame(0x1, json.dumps(obj).encode())

    def _read(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise WsError("connection closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self):
        """One message: (opcode, payload); answers pings; (8, payload) for close."""
        data, first_op = b"", None
        while True:
            b0, b1 = self._read(2)
            op, fin, n = b0 & 0x0F, b0 & 0x80, b1 & 0x7F
            if b1 & 0x80:
                raise WsError("server frames must not be masked")
            if n == 126:
                n = struct.unpack("!H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._read(8))[0]
            payload = self._read(n)
            if op == 0x9:
                self.send_frame(0xA, payload)
                continue
            if op == 0x8:
                if not self.closed:
                    self.send_frame(0x8, payload[:2])
                    self.closed = True
                return 8, payload
            if op != 0:
                first_op = op
            data += payload
            if fin:
                return first_op, data

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def collect(self, until_exit=True):
        """Reads until the exit (or error) event and the close: (events, stdout, stderr)."""
        events, out, err = [], b"", b""
        while True:
            op, p = self.recv()
            if op == 8:
                return events, out, err
            if op == 2:
                if p[0] == 1:
                    out += p[1:]
                elif p[0] == 2:
                    err += p[1:]
                else:
                    raise WsError("unknown channel byte %d" % p[0])
            elif op == 1:
                events.append(json.loads(p))


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
        self.assertEqual(r["attach_url"], "/v1/attach/" + r["id"])
        self.assertTrue(r["attach_token"].startswith("sat_"))
        self.assertNotIn(r["attach_token"], json.dumps(self.list_sessions()))
        self.assertEqual(r["state"], "created")
        self.assertRegex(r["expires_at"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        for bad in ({}, {"cmd": "x", "argv": ["x"]}, {"argv": []}, {"cmd": "x", "bogus": 1},
                    {"cmd": "x", "rows": 10}, {"cmd": "x", "attach_timeout_s": 0},
                    {"cmd": "x", "env": {"A": 1}}):
            self.create(bad, status=400)

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
