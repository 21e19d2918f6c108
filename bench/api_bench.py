#!/usr/bin/env python3
"""Control-plane read path: requests per second of the API's reads, next to what the
PostgreSQL under it does alone in the same run.

  bench/api_bench.py BUILD_DIR [BUILD_DIR ...]

Each BUILD_DIR holds server/spaced-test (any build; a release one for figures). With several,
the builds take turns round by round (BENCH_ROUNDS, default 3) on one PostgreSQL cluster, so an
A/B sees the same machine noise; each figure is the median over rounds. No VM: spaced runs the
test runtime (sandboxes exist as rows and a fake agent). Prints, per build:
  - POST /v1/sandboxes, request to 202 as a client sees it (BENCH_CREATES, 50, one at a time on
    one keep-alive connection; each deleted after), median and p99 in ms; and the handler's own
    time (request's first byte to response's last, spaced's space_http_request_duration_seconds
    on its --metrics-listen): the mean, and the share under 5 ms (over half: median <= 5 ms)
  - GET /v1/sandboxes/{id} (native), GET /sandboxes/{id} and GET /v2/sandboxes (E2B),
    GET /v1/sandboxes?limit=10, GET /healthz: wrk, BENCH_CONNS (32) connections, 2 threads,
    BENCH_SECONDS (5) s each
and once per round, the baseline: `pgbench -S` on the same cluster with as many clients as
spaced's pool (4), simple and prepared protocol; each read's ratio to the simple figure, and the E2B reads' to the native ones (the issue's
targets: GET by id >= 0.50x, list of 10 >= 0.30x pgbench -S simple; E2B within 1.3x).
Needs wrk and pgbench (Debian: wrk, postgresql-contrib; scripts/lib.sh installs both). Machines here are shared and noisy:
read ratios, not absolutes.
"""
import http.client
import json
import os
import re
import time
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from harness import PgCluster, Spaced, free_port, pg_bindir  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
CONNS = int(os.environ.get("BENCH_CONNS", "32"))
SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
POOL = 4  # spaced's PostgreSQL pool (server/server.c)
CREATES = int(os.environ.get("BENCH_CREATES", "50"))


def handler_times(s):
    """(count, sum in s, count <= 5 ms) of native "sandboxes" requests so far (spaced's
    request-duration histogram: POST /v1/sandboxes and the list share that route class)."""
    c = http.client.HTTPConnection("127.0.0.1", s.mport, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = [0.0, 0.0, 0.0]
    for line in text.splitlines():
        if 'surface="native"' not in line or 'route="sandboxes"' not in line:
            continue
        v = float(line.rsplit(" ", 1)[1])
        if line.startswith("space_http_request_duration_seconds_count"):
            out[0] = v
        elif line.startswith("space_http_request_duration_seconds_sum"):
            out[1] = v
        elif line.startswith("space_http_request_duration_seconds_bucket") and 'le="0.005"' in line:
            out[2] = v
    return out


def creates(s):
    """ms from sending POST /v1/sandboxes to its 202, one at a time; deletes them after. Also
    the handler's own figures over the creates: (mean ms, share <= 5 ms)."""
    before = handler_times(s)
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    h = {"Authorization": "Bearer " + s.key, "Content-Type": "application/json"}
    body = json.dumps({"template": "base"})
    ms, ids = [], []
    for _ in range(CREATES):
        t0 = time.perf_counter()
        c.request("POST", "/v1/sandboxes", body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        ms.append((time.perf_counter() - t0) * 1000)
        if r.status != 202:
            raise SystemExit("create: %d %s" % (r.status, data))
        ids.append(json.loads(data)["sandbox"]["id"])
    after = handler_times(s)
    n = after[0] - before[0]
    handler = ((after[1] - before[1]) / n * 1000, (after[2] - before[2]) / n) if n else (0, 0)
    for sid in ids:
        c.request("DELETE", "/v1/sandboxes/" + sid, headers=h)
        c.getresponse().read()
    c.close()
    return ms, handler


def wrk(port, path, headers):
    argv = ["wrk", "-t2", "-c%d" % CONNS, "-d%ds" % SECONDS]
    for k, v in headers.items():
        argv += ["-H", "%s: %s" % (k, v)]
    out = subprocess.run(argv + ["http://127.0.0.1:%d%s" % (port, path)], capture_output=True,
                         text=True, check=True).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m is None or bad is not None:
        raise SystemExit("wrk %s: %s" % (path, out))
    return float(m.group(1))


def pgbench(pg, mode):
    argv = [os.path.join(pg_bindir(), "pgbench"), "-h", pg.sock, "-U", "postgres", "-S", "-n",
            "-c%d" % POOL, "-j2", "-T%d" % SECONDS, "-M", mode, "bench"]
    if os.geteuid() == 0:
        argv = ["runuser", "-u", "postgres", "--"] + argv
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd="/").stdout
    return float(re.search(r"tps = ([\d.]+)", out).group(1))


def start(build, pg, n):
    binary = os.path.join(os.path.abspath(build), "server", "spaced-test")
    mport = free_port()
    s = Spaced(binary=binary, database_url=pg.createdb("space%d" % n), runtime="test",
               args=["--metrics-listen", "127.0.0.1:%d" % mport])
    s.mport = mport
    s.key = s.cli("keys", "create").stdout.strip()
    s.start()
    sid, _ = s.create()
    for _ in range(9):
        s.create()
    st, sb = s.request("GET", "/v1/sandboxes/" + sid)
    assert st == 200, sb
    return s, sid, sb.get("envd_access_token") or sb.get("access_token")


def main():
    builds = sys.argv[1:]
    if not builds:
        raise SystemExit(__doc__)
    pg = PgCluster()
    runs = []
    try:
        pg._run(["createdb", "-h", pg.sock, "-U", "postgres", "bench"])
        pg._run(["pgbench", "-h", pg.sock, "-U", "postgres", "-i", "-q", "-s", "10", "bench"])
        for i, b in enumerate(builds):
            runs.append(start(b, pg, i))
        figs = {b: {} for b in builds}
        base = {"simple": [], "prepared": []}
        reads = [("GET /v1/sandboxes/{id}", lambda sid: "/v1/sandboxes/" + sid, "native"),
                 ("E2B GET /sandboxes/{id}", lambda sid: "/sandboxes/" + sid, "e2b"),
                 ("E2B GET /v2/sandboxes", lambda sid: "/v2/sandboxes", "e2b"),
                 ("GET /v1/sandboxes?limit=10", lambda sid: "/v1/sandboxes?limit=10", "native"),
                 ("GET /healthz", lambda sid: "/healthz", "none")]
        for r in range(ROUNDS):
            for mode in ("simple", "prepared"):
                base[mode].append(pgbench(pg, mode))
            for b, (s, sid, _) in zip(builds, runs):
                ms, handler = creates(s)
                figs[b].setdefault("create", []).extend(ms)
                figs[b].setdefault("handler", []).append(handler)
            for name, path, auth in reads:  # builds side by side on each read: same noise
                for b, (s, sid, _) in zip(builds, runs):
                    h = {"Authorization": "Bearer " + s.key} if auth == "native" else \
                        {"X-API-Key": s.key} if auth == "e2b" else {}
                    figs[b].setdefault(name, []).append(wrk(s.port, path(sid), h))
            print("round %d done" % (r + 1), file=sys.stderr, flush=True)
        simple = statistics.median(base["simple"])
        print("%-44s %10.0f tps" % ("pgbench -S, %d clients, simple" % POOL, simple))
        print("%-44s %10.0f tps" % ("pgbench -S, %d clients, prepared" % POOL,
                                    statistics.median(base["prepared"])))
        for b in builds:
            print("build %s" % b)
            xs = sorted(figs[b]["create"])
            print("  %-42s %10.2f ms median  %8.2f ms p99  (n=%d)" % (
                "POST /v1/sandboxes to 202", statistics.median(xs),
                xs[min(len(xs) - 1, int(0.99 * (len(xs) - 1)))], len(xs)))
            hs = figs[b]["handler"]
            print("  %-42s %10.2f ms mean    %7.0f%% under 5 ms" % (
                "  handler (request in to 202 out)", statistics.median(h[0] for h in hs),
                100 * statistics.median(h[1] for h in hs)))
            for name, _, _ in reads:
                v = statistics.median(figs[b][name])
                print("  %-42s %10.0f req/s  %5.2fx pgbench -S simple" % (name, v, v / simple))
            native = statistics.median(figs[b]["GET /v1/sandboxes/{id}"])
            for name in ("E2B GET /sandboxes/{id}", "E2B GET /v2/sandboxes"):
                print("  %-42s %5.2fx native GET /v1/sandboxes/{id}" % (
                    name, statistics.median(figs[b][name]) / native))
        if len(builds) > 1:
            first = builds[0]
            for b in builds[1:]:
                print("ratio %s / %s" % (b, first))
                print("  %-42s %5.2fx (time)" % ("POST /v1/sandboxes to 202",
                                                 statistics.median(figs[b]["create"]) /
                                                 statistics.median(figs[first]["create"])))
                for name, _, _ in reads:
                    print("  %-42s %5.2fx" % (name, statistics.median(figs[b][name]) /
                                              statistics.median(figs[first][name])))
    finally:
        for s, _, _ in runs:
            s.destroy()
        pg.destroy()


if __name__ == "__main__":
    main()
