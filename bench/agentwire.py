"""A minimal host-side client of the agent protocol (base/agentproto.h), for benchmarks that
need the floor: the same request sent straight to a VM's agent socket, with no spaced."""
import socket
import struct

HDR = struct.Struct("<IIHH")
T_HELLO, T_OK, T_ERROR, T_WINDOW, T_DATA = 0x0001, 0x0004, 0x0005, 0x0006, 0x0008
T_PROC_START, T_PROC_STARTED, T_PROC_STDOUT, T_PROC_STDERR, T_PROC_EXIT = (
    0x0101, 0x0102, 0x0103, 0x0104, 0x0105)
K_VERSION, K_CLIENT, K_WINDOW, K_CMD, K_STDIN = 1, 4, 13, 21, 32
F_END = 1


def field(tag, value):
    if isinstance(value, int):
        value = struct.pack("<I", value)
    elif isinstance(value, str):
        value = value.encode()
    return struct.pack("<HI", tag, len(value)) + value


class AgentWire:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buf = b""
        self.next_stream = 1
        self.send(0, T_HELLO, field(K_VERSION, 1) + field(K_CLIENT, "bench"))
        while True:
            stream, typ, flags, payload = self.recv()
            if stream == 0 and typ == T_HELLO:
                break

    def send(self, stream, typ, payload=b"", flags=0):
        self.sock.sendall(HDR.pack(len(payload), stream, typ, flags) + payload)

    def recv(self):
        while True:
            if len(self.buf) >= HDR.size:
                n, stream, typ, flags = HDR.unpack_from(self.buf)
                if len(self.buf) >= HDR.size + n:
                    payload = self.buf[HDR.size:HDR.size + n]
                    self.buf = self.buf[HDR.size + n:]
                    return stream, typ, flags, payload
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("agent closed the channel")
            self.buf += chunk

    def run(self, cmd):
        """Runs a shell command; returns (exit payload, stdout bytes). Grants credit as it reads."""
        sid = self.next_stream
        self.next_stream += 1
        self.send(sid, T_PROC_START, field(K_CMD, cmd) + field(K_STDIN, 0))
        out = bytearray()
        while True:
            stream, typ, flags, payload = self.recv()
            if stream != sid:
                continue
            if typ in (T_PROC_STDOUT, T_PROC_STDERR):
                if typ == T_PROC_STDOUT:
                    out += payload
                self.send(sid, T_WINDOW, field(K_WINDOW, len(payload)))
            if flags & F_END:
                if typ == T_ERROR:
                    raise RuntimeError("agent error: %r" % payload)
                return payload, bytes(out)

    def close(self):
        self.sock.close()
