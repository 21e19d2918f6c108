#!/usr/bin/env python3
"""How long spaced stops answering while it deletes a sandbox whose files are large.

  bench/delete_bench.py BUILD_DIR [DATA_DIR]

A cold-booted sandbox keeps its guest RAM in a file in its VM directory (mem.ram, shared with
QEMU), so deleting a 1 GiB one that has used its memory unlinks a GiB of file. Done on the
event loop, every client waits for it. This bench runs spaced with SPACE_COLD_BOOT=1 and, N
times: creates a sandbox of BENCH_MEM MiB (1024), has it write BENCH_FILL MiB (600) of its
memory, then deletes it while a client asks GET /healthz back to back on one connection.
Prints, each next to its baseline from the same run (the same client for as long with nothing
deleted): the slowest /healthz answer of each window (median and p99 over the rounds) and the
delete's own time. Compare two builds by running it on each (a change's build and main's).
Needs root, QEMU and PostgreSQL. Machines here are shared and noisy: read ratios, not absolutes.
Environment: BENCH_ROUNDS (5), BENCH_MEM (1024), BENCH_FILL (600).
"""
import http.client
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import Platform, line, ratio  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
MEM = int(os.environ.get("BENCH_MEM", "1024"))
FILL = int(os.environ.get("BENCH_FILL", "600"))


class Client:
    def __init__(self, s):
        self.conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300)
        self.hdr = {"Authorization": "Bearer " + s.key, "Content-Type": "application/json"}

    def call(self, method, path, body=None):
        self.conn.request(method, path, body=json.dumps(body) if body is not None else None,
                          headers=self.hdr)
        r = self.conn.getresponse()
        return r.status, r.read()


class Prober(threading.Thread):
    """GET /healthz back to back until stopped; keeps each answer's time (ms)."""

    def __init__(self, s):
        super().__init__(daemon=True)
        self.c = Client(s)
        self.stop = threading.Event()
        self.times = []

    def run(self):
        while not self.stop.is_set():
            t0 = time.perf_counter()
            st, _ = self.c.call("GET", "/healthz")
            self.times.append((time.perf_counter() - t0) * 1000)
            assert st == 200, st


def window(s, action, settle=1.0):
    """The slowest /healthz answer (ms) while action() runs and settle s after; action's ms."""
    p = Prober(s)
    p.start()
    time.sleep(0.3)
    n0 = len(p.times)
    t0 = time.perf_counter()
    action()
    took = (time.perf_counter() - t0) * 1000
    time.sleep(settle)
    p.stop.set()
    p.join()
    return max(p.times[n0:]), took


def main():
    p = Platform(sys.argv, templates=("base",), env={"SPACE_COLD_BOOT": "1"}).start()
    try:
        s = p.s
        c = Client(s)
        idle, busy, deletes = [], [], []
        for i in range(ROUNDS):
            st, b = c.call("POST", "/v1/sandboxes?wait=300", {"template": "base",
                                                               "memory_mb": MEM})
            assert st == 200, (st, b)
            sid = json.loads(b)["sandbox"]["id"]
            # write FILL MiB of guest memory (a process that touches it, then exits: the pages
            # stay in the RAM file)
            st, b = c.call("POST", "/v1/sandboxes/%s/commands" % sid,
                           {"cmd": "python3 -c 'b = bytearray(b\"x\") * (%d << 20)'" % FILL,
                            "timeout_s": 120})
            assert st == 200 and json.loads(b).get("exit_code") == 0, (st, b)
            ram = os.path.join(p.data, "vms", sid, "mem.ram")
            used = os.stat(ram).st_blocks * 512 >> 20 if os.path.exists(ram) else 0
            time.sleep(1)
            worst, _ = window(s, lambda: time.sleep(0.5))  # baseline: nothing deleted

            def delete():
                st, b = c.call("DELETE", "/v1/sandboxes/%s?wait=60" % sid)
                assert st in (200, 202, 204), (st, b)

            worst_del, took = window(s, delete)
            print("round %d: mem.ram %d MiB allocated; slowest /healthz %.1f ms idle, %.1f ms "
                  "around the delete (%.0f ms)" % (i + 1, used, worst, worst_del, took),
                  flush=True)
            idle.append(worst)
            busy.append(worst_del)
            deletes.append(took)
        print("space delete benchmarks (%d MiB cold-booted sandbox, %d MiB written)" % (MEM, FILL))
        line("slowest /healthz, nothing deleted (baseline)", idle)
        line("slowest /healthz around a delete", busy)
        line("delete (API, wait=finished)", deletes)
        ratio("around a delete / baseline (medians)", statistics.median(busy),
              statistics.median(idle))
    finally:
        p.stop()


if __name__ == "__main__":
    main()
