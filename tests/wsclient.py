"""A minimal RFC 6455 WebSocket client for the suites (standard library only): the handshake,
masked client frames, whole messages in, and the session attach's framing (collect)."""
import base64
import hashlib
import json
import os
import socket
import struct

from harness import MULT

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
