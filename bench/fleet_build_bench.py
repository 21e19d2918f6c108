#!/usr/bin/env python3
"""Template build throughput on two workers against one (issue 20), in the same run.

  bench/fleet_build_bench.py BUILD_DIR [DATA_DIR]

BUILD_DIR holds server/spaced (a release build); DATA_DIR (default BUILD_DIR/bench-data) gets
the base template if it has none. Real VMs: an API node and workers w1 and w2 sharing a
snapshot dir (bench/fleet_fork_bench.py's set-up), each worker first running a sandbox of base
(a template snapshot of it at the builds' size, as a worker in service holds), and each round
starts BENCH_SETTLE (10) s after the one before (the spare pools refill meanwhile). The API node
sends each template's builds to its builder, the active worker whose md5(name/id) sorts first:
so each round's BENCH_BUILDS (4) template names are picked half for each worker, and every
build is new (a step writing a nonce: no cache hit). Rounds alternate between both workers
active and w2 drained (its templates then go to w1, as a drain moves them); each round sends
all its builds at once through the API node and waits for all. Prints, medians over
BENCH_ROUNDS (3) rounds: the round's wall time and builds per minute with one worker and with
two, their ratio, and the median build (POST -> succeeded). A worker runs SP_TMPL_BUILDS (2)
builds at once: with two, twice as many run. On one host the workers share its cores (2 here),
and a build under TCG is CPU-bound (its builder VM's boot, steps and snapshot): the ratio shows
what queueing on one worker costs, not what two hosts would give. Machines here are shared
and noisy: read ratios, not absolutes.
"""
import concurrent.futures
import hashlib
import os
import secrets
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from benchlib import Platform, build_template, ratio  # noqa: E402
from fleet_fork_bench import delete, source, start_fleet, stop_fleet  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
BUILDS = int(os.environ.get("BENCH_BUILDS", "4"))
SETTLE = float(os.environ.get("BENCH_SETTLE", "10"))


def builder(name, wids):
    """The worker id the API node sends name's builds to (sp_fleet_builder)."""
    return min(wids, key=lambda w: hashlib.md5(("%s/%s" % (name, w)).encode()).hexdigest())


def names(r, wids):
    """BUILDS new template names for round r, half of them built by each of wids."""
    want = {w: BUILDS // len(wids) + (1 if i < BUILDS % len(wids) else 0)
            for i, w in enumerate(wids)}
    out = []
    for i in range(10000):
        n = "bb-%d-%d-%d" % (os.getpid(), r, i)
        w = builder(n, wids)
        if want[w] > 0:
            want[w] -= 1
            out.append(n)
        if len(out) == BUILDS:
            return out
    raise SystemExit("no names for %s" % wids)


def one_round(api, r, wids):
    """All of a round's builds at once: (wall ms, [each build's ms])."""
    nonce = secrets.token_hex(8)
    bodies = [{"name": n, "from": "base", "memory_mb": 256,
               "steps": [{"run": "echo %s-%s > /home/user/nonce" % (nonce, n)}]}
              for n in names(r, wids)]
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        each = [ms for ms, _ in ex.map(lambda b: build_template(api, b), bodies)]
    wall = (time.time() - t0) * 1000
    for b in bodies:
        api.request("DELETE", "/v1/templates/" + b["name"], timeout=60)
    return wall, each


def main():
    p = Platform(sys.argv, templates=("base",)).start()
    root = os.path.join(os.path.dirname(p.data), "fleet-build-bench-%d" % os.getpid())
    os.makedirs(root)
    pg = nodes = None
    try:
        pg, nodes, api, (w1, w2) = start_fleet(p.spaced, p.data, root)
        admin = api.admin
        wid = {}
        for w in (w1, w2):
            with open(os.path.join(w.data_dir, "worker-id")) as f:
                wid[w] = f.read().strip()
        for n in ("w1", "w2"):  # each holds a template snapshot of base at 256 MiB
            delete(api, source(api, {"placement": {"labels": {"node": n}}}, counter=False))
        res = {1: [], 2: []}
        each = {1: [], 2: []}
        for r in range(2 * ROUNDS):
            k = 2 if r % 2 == 0 else 1
            path = "/v1/workers/%s/%s" % (wid[w2], "undrain" if k == 2 else "drain")
            st, out = api.request("POST", path, key=admin)
            assert st == 200, (st, out)
            time.sleep(SETTLE)  # the spare pools' refills after the last round (or warm-up)
            wall, ms = one_round(api, r, [wid[w1], wid[w2]] if k == 2 else [wid[w1]])
            res[k].append(wall)
            each[k].extend(ms)
            print("round %d, %d worker%s: %d builds in %.1f s (each %s s)"
                  % (r + 1, k, "s" if k == 2 else "", BUILDS, wall / 1000,
                     ", ".join("%.1f" % (x / 1000) for x in ms)), flush=True)
        med = {k: statistics.median(v) for k, v in res.items()}
        print("%d rounds each, medians:" % ROUNDS)
        for k in (1, 2):
            print("  %d worker%s: %d builds in %6.1f s, %5.1f builds/min, a build %5.1f s"
                  % (k, "s" if k == 2 else " ", BUILDS, med[k] / 1000,
                     BUILDS * 60000 / med[k], statistics.median(each[k]) / 1000))
        ratio("build throughput, two workers / one", med[1], med[2])
    finally:
        stop_fleet(pg, nodes, root)
        p.stop()


if __name__ == "__main__":
    main()
