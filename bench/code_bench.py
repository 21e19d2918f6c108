#!/usr/bin/env python3
"""Code interpreter figures, each next to its baseline from the same run.

  bench/code_bench.py BUILD_DIR [DATA_DIR]

BUILD_DIR holds server/spaced (a release build: cmake -DCMAKE_BUILD_TYPE=RelWithDebInfo).
DATA_DIR (default BUILD_DIR/bench-data) gets the code-interpreter-v1 template if it has none
(minutes the first time). Prints medians and p99 of:
  - create -> first run_code for code-interpreter-v1 through the E2B surface (POST /sandboxes,
    then POST /execute `1+1` until it answers), as an SDK user sees it
  - `1+1` round trip through the E2B surface (POST /execute on the listener, routed by the
    E2b-Sandbox-Id header and the access token, NDJSON back), through the native API
    (POST /v1/sandboxes/{id}/execute), and the floor: the same request sent straight to the
    code daemon inside the guest (a small client run in the guest connects to
    127.0.0.1:49999 and times N executions there)
Needs root, QEMU and PostgreSQL. Machines here are shared and noisy: read ratios, not absolutes.
Environment: BENCH_CREATES (5), BENCH_RTT (100, at least 50).
"""
import http.client
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from benchlib import Platform, line  # noqa: E402

TEMPLATE = "code-interpreter-v1"
N_CREATE = int(os.environ.get("BENCH_CREATES", "5"))
N_RTT = max(50, int(os.environ.get("BENCH_RTT", "100")))

# Runs inside the guest: N executions of `1+1` straight to the code daemon (core/channel/code.h's
# protocol: one request line, a status line, event lines up to "end", then the daemon closes).
GUEST_CLIENT = r"""
import json, socket, sys, time
sid, n = sys.argv[1], int(sys.argv[2])
req = (json.dumps({"op": "execute", "sandbox_id": sid, "context_id": None, "language": None,
                   "code": "1+1", "env": None, "timeout_ms": 0}) + "\n").encode()
out = []
for _ in range(n):
    t0 = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", 49999))
    s.sendall(req)
    f = s.makefile("rb")
    status = json.loads(f.readline())
    assert status.get("ok"), status
    seen = False
    for line in f:
        ev = json.loads(line)
        if ev.get("type") == "result" and ev.get("data", {}).get("text/plain") == "2":
            seen = True
        if ev.get("type") == "end":
            break
    s.close()
    assert seen, "no result 2"
    out.append((time.perf_counter() - t0) * 1000)
print(json.dumps(out))
"""


def accelerator(log_path):
    """What spaced's probe picked (its log says accelerator=kvm|tcg)."""
    with open(log_path, errors="replace") as f:
        m = re.search(r"accelerator=(\w+)", f.read())
    return m.group(1) if m else "unknown"


def ndjson(body):
    return [json.loads(x) for x in body.decode().split("\n") if x]


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    p = Platform(sys.argv, templates=(TEMPLATE,), drop_env=()).start()
    s, pg = p.s, p.pg
    made = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300)

        def call(method, path, body=None, headers=None):
            h = {"Content-Type": "application/json"}
            h.update(headers or {})
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers=h)
            r = conn.getresponse()
            return r.status, r.read()

        native_h = {"Authorization": "Bearer " + s.key}
        e2b_h = {"X-API-Key": s.key}

        def e2b_create():
            st, b = call("POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 3600}, e2b_h)
            assert st == 201, (st, b)
            sb = json.loads(b)
            made.append(sb["sandboxID"])
            return sb["sandboxID"], sb["envdAccessToken"]

        def e2b_execute(sid, token, code="1+1"):
            st, b = call("POST", "/execute", {"code": code, "context_id": None, "language": None,
                                              "env_vars": None},
                         {"X-Access-Token": token, "E2b-Sandbox-Id": sid})
            return st, b

        def e2b_ok(st, b):
            if st != 200:
                return False
            return any(e.get("type") == "result" and e.get("text") == "2" for e in ndjson(b))

        # Warm-up sandbox: the first create of a data dir also probes the accelerator.
        warm, token = e2b_create()
        st, b = e2b_execute(warm, token)
        assert e2b_ok(st, b), (st, b)

        creates = []
        for _ in range(N_CREATE):
            t0 = time.perf_counter()
            sid, tok = e2b_create()
            while True:
                st, b = e2b_execute(sid, tok)
                if e2b_ok(st, b):
                    break
                assert st in (502, 503), (st, b)  # not up yet; anything else is a bug
                time.sleep(0.005)
            creates.append((time.perf_counter() - t0) * 1000)
        print("space code interpreter benchmarks (accelerator: %s)" % accelerator(s.log_path))
        line("create -> first run_code `1+1`, E2B surface", creates)

        e2b = []
        for _ in range(N_RTT):
            t0 = time.perf_counter()
            st, b = e2b_execute(warm, token)
            e2b.append((time.perf_counter() - t0) * 1000)
            assert e2b_ok(st, b), (st, b)

        native = []
        for _ in range(N_RTT):
            t0 = time.perf_counter()
            st, b = call("POST", "/v1/sandboxes/%s/execute" % warm, {"code": "1+1"}, native_h)
            native.append((time.perf_counter() - t0) * 1000)
            assert st == 200 and any(e.get("type") == "result" and
                                     e.get("data", {}).get("text/plain") == "2"
                                     for e in ndjson(b)), (st, b)

        st, b = call("POST", "/v1/sandboxes/%s/commands" % warm,
                     {"argv": ["python3", "-c", GUEST_CLIENT, warm, str(N_RTT)],
                      "timeout_s": 600},
                     native_h)
        r = json.loads(b)
        assert st == 200 and r["exit_code"] == 0, (st, r)
        floor = json.loads(r["stdout"])

        line("run_code `1+1` round trip, E2B surface", e2b)
        line("execute `1+1` round trip, native API", native)
        line("`1+1` straight to the daemon in the guest (floor)", floor)
        fm = statistics.median(floor)
        print("%-50s E2B %.2fx   native %.2fx   (medians)" % (
            "over the floor", statistics.median(e2b) / fm, statistics.median(native) / fm))
        print("%-50s %.2f ms E2B, %.2f ms native" % (
            "added per execution (median - floor median)", statistics.median(e2b) - fm,
            statistics.median(native) - fm))
    finally:
        try:
            for sid in made:  # non-empty only once call() exists
                call("DELETE", "/v1/sandboxes/%s?wait=60" % sid, None, native_h)
        except Exception as e:  # noqa: BLE001 - report and go on stopping spaced
            print("cleanup: %s" % e, file=sys.stderr)
        s.destroy()
        pg.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
