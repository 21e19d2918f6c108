#!/usr/bin/env python3
"""Microvm figures through the native API, each next to its baseline from the same run.

  bench/vm_bench.py BUILD_DIR [DATA_DIR]

BUILD_DIR holds server/spaced (a release build: cmake -DCMAKE_BUILD_TYPE=RelWithDebInfo).
DATA_DIR (default BUILD_DIR/bench-data) gets the base template if it has none. Prints:
  - create-to-first-command for `base` by cold boot (median, p99 of N)
  - command round trip (`true`) through the API, and straight to the agent socket (floor)
  - output throughput of `cat` of a 100 MiB text file (base64 lines) through the API (NDJSON
    stream), and straight to the agent
Needs root, QEMU and PostgreSQL. Machines here are shared and noisy: read ratios, not absolutes.
"""
import http.client
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from benchlib import Platform, line  # noqa: E402
from agentwire import AgentWire  # noqa: E402

N_CREATE = int(os.environ.get("BENCH_CREATES", "5"))
N_RTT = int(os.environ.get("BENCH_RTT", "200"))


def main():
    p = Platform(sys.argv, templates=("base",), drop_env=()).start()
    data, s, pg = p.data, p.s, p.pg
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300)
        hdr = {"Authorization": "Bearer " + s.key, "Content-Type": "application/json"}

        def call(method, path, body=None):
            nonlocal conn
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers=hdr)
            r = conn.getresponse()
            return r.status, r.read()

        # Warm-up create: the first boot of a data dir also runs the accelerator probe.
        st, b = call("POST", "/v1/sandboxes?wait=120", {"template": "base"})
        warm = json.loads(b)["sandbox"]["id"]

        creates = []
        ids = []
        for _ in range(N_CREATE):
            t0 = time.perf_counter()
            st, b = call("POST", "/v1/sandboxes", {"template": "base"})
            sid = json.loads(b)["sandbox"]["id"]
            while True:
                st, b = call("POST", "/v1/sandboxes/%s/commands" % sid, {"argv": ["true"]})
                if st == 200:
                    break
                time.sleep(0.005)
            creates.append((time.perf_counter() - t0) * 1000)
            ids.append(sid)
        print("space microVM benchmarks (TCG: %s)" % ("yes" if not os.path.exists("/dev/kvm") else
                                                      "auto-probed"))
        line("create -> first command, cold boot", creates)

        api = []
        for _ in range(N_RTT):
            t0 = time.perf_counter()
            st, b = call("POST", "/v1/sandboxes/%s/commands" % warm, {"argv": ["true"]})
            api.append((time.perf_counter() - t0) * 1000)
            assert st == 200, b
        call("POST", "/v1/sandboxes/%s/commands" % warm,
             {"cmd": "head -c 80000000 /dev/urandom | base64 -w 76 | head -c 104857600 > /tmp/big"})
        t0 = time.perf_counter()
        conn.request("POST", "/v1/sandboxes/%s/commands" % warm,
                     body=json.dumps({"cmd": "cat /tmp/big", "stream": True}), headers=hdr)
        r = conn.getresponse()
        got = 0
        for raw in r:
            ev = json.loads(raw)
            if ev["type"] == "stdout":
                got += len(ev["data"])
        api_tp = got / (time.perf_counter() - t0) / 1e6
        assert got == 100 << 20, got

        # The floor: the same requests straight to the agent, spaced out of the way (SIGKILL
        # leaves the VM running and frees its socket; spaced re-adopts it afterwards).
        s.kill()
        w = AgentWire(os.path.join(data, "vms", warm, "agent.sock"))
        floor = []
        for _ in range(N_RTT):
            t0 = time.perf_counter()
            w.run("true")
            floor.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        _, out = w.run("cat /tmp/big")
        floor_tp = len(out) / (time.perf_counter() - t0) / 1e6
        w.close()
        line("command round trip `true`, native API", api)
        line("command round trip `true`, agent socket (floor)", floor)
        print("%-46s %.2fx the floor (medians)" % ("API overhead", statistics.median(api) /
                                                   statistics.median(floor)))
        print("%-46s API %.1f MB/s   agent socket %.1f MB/s   ratio %.2f" % (
            "cat 100 MiB output throughput", api_tp, floor_tp, api_tp / floor_tp))
        s.start()
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300)
        for sid in ids + [warm]:
            call("DELETE", "/v1/sandboxes/%s?wait=60" % sid)
    finally:
        s.destroy()
        pg.destroy()


if __name__ == "__main__":
    main()
