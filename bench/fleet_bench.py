#!/usr/bin/env python3
"""Create throughput of a fleet of three workers against one (issue 20), in the same run.

  bench/fleet_bench.py BUILD_DIR

BUILD_DIR holds server/spaced-test (a release build for figures). No VM: every worker runs the
test runtime, whose boot takes SPACE_FAKE_DELAY_MS (BENCH_BOOT_MS, 200) and costs no CPU, so
what is measured is the control plane a create goes through: the API node's insert and
placement (space_place, under the workers' row locks), the owning worker's controller picking
the row up, booting, recording it running, and the API node seeing that. One PostgreSQL, one
API node (--role api), then 1 or 3 workers (--role worker, room for all), a fresh set per
round, the two set-ups alternating (team quotas lifted on the API node). Each round sends BENCH_CREATES (60) creates through the API
node, BENCH_CONCURRENCY (12) at a time, each with ?wait= (answered once running), and deletes
them after. Prints, medians over BENCH_ROUNDS (5) rounds: creates per second with 1 worker and
with 3, the ratio, and each setting's median create latency. On one host the workers share its
cores (2 here): the ratio shows how much of a create's cost is the worker's and spreads, not
what three hosts would give. BENCH_BOOT_MS=0 with a higher concurrency finds the control
plane's own limit. Machines here are shared and noisy: read ratios, not absolutes.
"""
import concurrent.futures
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from harness import PgCluster, Spaced, wait_until  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
CREATES = int(os.environ.get("BENCH_CREATES", "60"))
CONC = int(os.environ.get("BENCH_CONCURRENCY", "12"))
BOOT_MS = os.environ.get("BENCH_BOOT_MS", "200")


def fleet(build, pg, n):
    """An API node and n workers on pg, started; the API node's key set."""
    binary = os.path.join(build, "server", "spaced-test")
    env = {"SPACE_FAKE_DELAY_MS": BOOT_MS}
    api = Spaced(binary=binary, database_url=pg.url, runtime="test", env=env,
                 args=["--role", "api", "--team-max-sandboxes", "100000",
                       "--team-max-vcpus", "100000", "--team-max-memory-mb", "100000000"])
    api.key = api.cli("keys", "create", "--team", "bench").stdout.strip()
    api.start()
    nodes = [api]
    for _ in range(n):
        w = Spaced(binary=binary, database_url=pg.url, runtime="test", env=env,
                   args=["--role", "worker", "--worker-vcpus", "1000",
                         "--worker-memory-mb", "1000000"])
        nodes.append(w.start())
    admin = open(os.path.join(api.data_dir, "admin-key")).read().strip()

    def active():
        st, r = api.request("GET", "/v1/workers", key=admin)
        return st == 200 and len([w for w in r["workers"] if w["state"] == "active"]) == n
    wait_until(active, "%d workers active" % n, 60)
    return api, nodes


def one_create(api):
    t0 = time.perf_counter()
    st, r = api.request("POST", "/v1/sandboxes?wait=60",
                        {"template": "base", "cpu_count": 1, "memory_mb": 256}, timeout=90)
    assert st == 200 and r["sandbox"]["state"] == "running", (st, r)
    return r["sandbox"]["id"], (time.perf_counter() - t0) * 1000


def round_(build, n):
    """(creates per second, median create ms) of one round with n workers."""
    pg = PgCluster()
    nodes = []
    try:
        api, nodes = fleet(build, pg, n)
        with concurrent.futures.ThreadPoolExecutor(CONC) as ex:
            t0 = time.perf_counter()
            done = list(ex.map(lambda _: one_create(api), range(CREATES)))
            wall = time.perf_counter() - t0
            ex.map(lambda x: api.request("DELETE", "/v1/sandboxes/" + x[0]), done)
        return CREATES / wall, statistics.median(ms for _, ms in done)
    finally:
        for s in nodes:
            s.destroy()
        pg.destroy()


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    res = {1: [], 3: []}
    for i in range(ROUNDS):
        for n in ((1, 3) if i % 2 == 0 else (3, 1)):
            rate, ms = round_(build, n)
            res[n].append((rate, ms))
            print("round %d: %d worker(s): %.1f creates/s, median %.0f ms" % (i + 1, n, rate, ms),
                  flush=True)
    med = {n: (statistics.median(r for r, _ in v), statistics.median(m for _, m in v))
           for n, v in res.items()}
    print("creates/s (median of %d rounds, %d creates, %d at a time, boot %s ms):"
          % (ROUNDS, CREATES, CONC, BOOT_MS))
    print("  1 worker:  %.1f/s (create median %.0f ms)" % med[1])
    print("  3 workers: %.1f/s (create median %.0f ms)" % med[3])
    print("  ratio 3/1: %.2fx" % (med[3][0] / med[1][0]))


if __name__ == "__main__":
    main()
