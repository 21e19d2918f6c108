"""An HTTP/2 client for the suites: one connection with prior knowledge on a plain port, driven
frame by frame with the h2 package (Debian's python3-h2), flow control respected."""
import socket
import sys
import time

from harness import MULT


def import_h2():
    """The h2 package (Debian's python3-h2), or None."""
    for extra in (None, "/usr/lib/python3/dist-packages"):
        if extra and extra not in sys.path:
            sys.path.append(extra)
        try:
            import h2.config  # noqa: F401
            import h2.connection  # noqa: F401
            import h2.events  # noqa: F401
            return sys.modules["h2"]
        except ImportError:
            continue
    return None


h2 = import_h2()


class H2Client:
    """One HTTP/2 connection to spaced's plain port with prior knowledge (the h2 package: its
    frames are sent as given, flow control respected). Per stream: status, body, whether it
    ended, and the error code of a reset."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10 * MULT)
        self.c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.c.initiate_connection()
        self.status, self.body, self.ended, self.reset = {}, {}, set(), {}
        self.terminated = None
        self.sent = {}
        self.flush()

    def close(self):
        self.sock.close()

    def flush(self):
        data = self.c.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(self, method, path, headers=(), key=None, end=False, flush=True):
        sid = self.c.get_next_available_stream_id()
        hs = [(":method", method), (":path", path), (":scheme", "http"),
              (":authority", "127.0.0.1")] + list(headers)
        if key:
            hs.append(("authorization", "Bearer " + key))
        self.c.send_headers(sid, hs, end_stream=end)
        self.sent[sid] = 0
        if flush:
            self.flush()
        return sid

    def pump(self, timeout=0.2):
        """Reads what came within timeout and handles it; False once the connection is gone."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except (socket.timeout, BlockingIOError):
            return True
        finally:
            self.sock.settimeout(10 * MULT)
        if not data:
            self.terminated = self.terminated or "closed"
            return False
        for ev in self.c.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived):
                self.status[ev.stream_id] = int(dict(ev.headers)[b":status"])
            elif isinstance(ev, h2.events.DataReceived):
                self.body[ev.stream_id] = self.body.get(ev.stream_id, b"") + ev.data
                self.c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                self.ended.add(ev.stream_id)
            elif isinstance(ev, h2.events.StreamReset):
                self.reset[ev.stream_id] = ev.error_code
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.terminated = ev
        self.flush()
        return True

    def send(self, sid, nbytes, end=False, until=None, flush=True, block=True):
        """Sends up to nbytes of body on sid as flow control lets it (stopping early when
        until() holds or the stream is reset; with block=False, also when the windows are
        shut, instead of waiting for them); returns the bytes sent."""
        sent, deadline = 0, time.time() + 30 * MULT
        while sent < nbytes and time.time() < deadline:
            if sid in self.reset or (until and until()) or self.terminated:
                break
            n = min(nbytes - sent, self.c.local_flow_control_window(sid),
                    self.c.max_outbound_frame_size)
            if n <= 0:
                if not block or not self.pump():
                    break
                continue
            self.c.send_data(sid, b"x" * n, end_stream=end and sent + n == nbytes)
            sent += n
            if flush:
                self.flush()
                self.pump(0)
        self.sent[sid] += sent
        return sent

    def answer(self, sid, what="an answer"):
        deadline = time.time() + 10 * MULT
        while sid not in self.ended and sid not in self.reset and time.time() < deadline:
            if not self.pump():
                break
        if sid not in self.ended:
            raise AssertionError("no whole answer on stream %d (%s): status %s, reset %s, "
                                 "connection %s" % (sid, what, self.status.get(sid),
                                                    self.reset.get(sid), self.terminated))
        return self.status.get(sid), self.body.get(sid, b"")
