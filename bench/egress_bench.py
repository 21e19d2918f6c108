#!/usr/bin/env python3
"""Egress proxy figures: a guest's outbound connections through the host's proxy, each next to
the same thing done directly from the host to the same loopback server.

  bench/egress_bench.py BUILD_DIR [DATA_DIR]

BUILD_DIR holds server/spaced (a release build: cmake -DCMAKE_BUILD_TYPE=RelWithDebInfo).
DATA_DIR (default BUILD_DIR/bench-data) gets the base template if it has none. Prints:
  - connection setup + one small request (plain HTTP, absolute form, one connection each):
    median and p99 in the guest through the proxy, and on the host directly
  - CONNECT setup (until "200 Connection established") in the guest
  - download and upload throughput of BENCH_EGRESS_MIB (default 256) MiB, guest through the
    proxy vs host direct, and the ratio
Needs root, QEMU and PostgreSQL. Machines here are shared and noisy: read ratios, not absolutes.
"""
import http.client
import http.server
import json
import os
import socketserver
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from benchlib import Platform, line  # noqa: E402

N_CONN = int(os.environ.get("BENCH_EGRESS_CONNS", "200"))
MIB = int(os.environ.get("BENCH_EGRESS_MIB", "256"))


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        n = int(self.path.split("/")[2]) if self.path.startswith("/bytes/") else 3
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.send_header("Connection", "close")
        self.end_headers()
        chunk = b"\0" * (1 << 20)
        while n > 0:
            k = min(n, len(chunk))
            self.wfile.write(chunk[:k])
            n -= k
        self.close_connection = True

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        while n > 0:
            d = self.rfile.read(min(n, 1 << 20))
            if not d:
                break
            n -= len(d)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    do_PUT = do_POST

    def log_message(self, *a):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 1024


# Runs in the guest (and, with direct=1, on the host): N sequential connections, each one
# request and its whole answer; prints the durations in ms as JSON.
SETUP = r"""
import json, socket, sys, time
host, port, n, direct = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
mode = sys.argv[5] if len(sys.argv) > 5 else "get"
out = []
for i in range(n):
    t0 = time.perf_counter()
    s = socket.create_connection((host, port) if direct else ("127.0.0.1", 3128))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if mode == "connect":
        s.sendall(b"CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host.encode(), port, host.encode(), port))
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = s.recv(4096)
            if not d:
                break
            buf += d
    else:
        target = "/x" if direct else "http://%s:%d/x" % (host, port)
        s.sendall(b"GET %s HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (target.encode(), host.encode(), port))
        while s.recv(65536):
            pass
    out.append((time.perf_counter() - t0) * 1000)
    s.close()
print(json.dumps(out))
"""

# A minimal server inside the guest: the floor for a guest connection with no proxy at all.
FLOOR = r"""
import socket
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", 7999))
l.listen(64)
while True:
    c, _ = l.accept()
    c.recv(4096)
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc")
    c.close()
"""


def main():
    p = Platform(sys.argv, templates=("base",), drop_env=()).start()
    data, s, pg = p.data, p.s, p.pg
    srv = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    sid = None
    try:
        st, r = s.request("POST", "/v1/sandboxes?wait=120",
                          {"template": "base", "egress": {"allow": ["127.0.0.1"]}}, timeout=130)
        assert st == 200 and r["operation"]["status"] == "succeeded", r
        sid = r["sandbox"]["id"]

        def run(cmd, timeout=1800):
            st, r = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                              {"cmd": cmd, "env": {"NO_PROXY": "", "no_proxy": ""},
                               "timeout_s": timeout}, timeout=timeout + 30)
            assert st == 200 and r["exit_code"] == 0, (st, r)
            return r["stdout"]

        run("cat > /tmp/setup.py <<'EOF'\n%sEOF" % SETUP)
        run("python3 /tmp/setup.py 127.0.0.1 %d 20 0" % port)  # warm-up
        guest = json.loads(run("python3 /tmp/setup.py 127.0.0.1 %d %d 0" % (port, N_CONN)))
        guest_c = json.loads(run("python3 /tmp/setup.py 127.0.0.1 %d %d 0 connect"
                                 % (port, N_CONN)))
        # The host direct, with the same script.
        host = json.loads(subprocess.run([sys.executable, "-c", SETUP, "127.0.0.1", str(port),
                                          str(N_CONN), "1"], capture_output=True, text=True,
                                         check=True).stdout)
        # Guest floor: a connection to a listener inside the guest (no proxy, no host).
        run("cat > /tmp/floor.py <<'EOF'\n%sEOF" % FLOOR)
        run("setsid python3 /tmp/floor.py >/dev/null 2>&1 </dev/null &")
        time.sleep(1)
        floor = json.loads(run("python3 /tmp/setup.py 127.0.0.1 7999 %d 1" % N_CONN))

        print("egress bench: %d connections, %d MiB transfers, sandbox %s" % (N_CONN, MIB, sid))
        line("setup + small GET, guest via egress proxy", guest)
        line("setup + small GET, host direct (same server)", host)
        line("setup + small GET, guest to a guest listener (floor)", floor)
        line("CONNECT until 200, guest via egress proxy", guest_c)
        print("%-52s %.1fx" % ("setup latency ratio (guest proxy / host direct)",
                               statistics.median(guest) / statistics.median(host)))

        n = MIB << 20
        out = run("curl -sS -o /dev/null -w '%%{size_download} %%{time_total}'"
                  " http://127.0.0.1:%d/bytes/%d" % (port, n)).split()
        assert int(out[0]) == n, out
        g_down = n / float(out[1]) / 1e6
        out = subprocess.run(["curl", "-sS", "--noproxy", "*", "-o", "/dev/null", "-w",
                              "%{size_download} %{time_total}",
                              "http://127.0.0.1:%d/bytes/%d" % (port, n)],
                             capture_output=True, text=True, check=True).stdout.split()
        h_down = n / float(out[1]) / 1e6
        # Uploads stream a file on disk (PUT with Content-Length): the guest's RAM is small.
        run("head -c %d /dev/zero > /root/up.bin" % n)
        out = run("curl -sS -o /dev/null -w '%%{size_upload} %%{time_total}' -T /root/up.bin"
                  " http://127.0.0.1:%d/sink" % port).split()
        run("rm -f /root/up.bin")
        assert int(float(out[0])) == n, out
        g_up = n / float(out[1]) / 1e6
        up = os.path.join(data, "bench-up.bin")
        with open(up, "wb") as f:
            f.truncate(n)
        hp = subprocess.run(["curl", "-sS", "--noproxy", "*", "-o", "/dev/null", "-w",
                             "%{size_upload} %{time_total}", "-T", up,
                             "http://127.0.0.1:%d/sink" % port],
                            capture_output=True, text=True, check=True).stdout.split()
        os.unlink(up)
        h_up = n / float(hp[1]) / 1e6
        print("%-52s %8.1f MB/s" % ("download, guest via egress proxy", g_down))
        print("%-52s %8.1f MB/s" % ("download, host direct", h_down))
        print("%-52s %8.3f" % ("download ratio (guest proxy / host direct)", g_down / h_down))
        print("%-52s %8.1f MB/s" % ("upload, guest via egress proxy", g_up))
        print("%-52s %8.1f MB/s" % ("upload, host direct", h_up))
        print("%-52s %8.3f" % ("upload ratio (guest proxy / host direct)", g_up / h_up))
    finally:
        if sid is not None:
            try:
                s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
            except OSError:
                pass
        s.destroy()
        pg.destroy()
        srv.shutdown()


if __name__ == "__main__":
    main()
