#!/usr/bin/env python3
"""The data-plane forwarder's cost (issue 20): a command's round trip and a 100 MiB download
through an API node to the worker that owns the sandbox, against the same directly at the
worker, in the same run; and, with a second build, the one-node path before and after.

  bench/cluster_bench.py BUILD_DIR [BASELINE_BUILD_DIR]

BUILD_DIR holds server/spaced-test and agent/space-agent-host (a release build for figures).
No VM: worker B runs the test runtime with a real agent on the host per sandbox
(SPACE_FAKE_AGENT), API node A runs no runtime; both on one PostgreSQL, the same cluster key;
B's `workers` row is written here (worker registration is another part of issue 20). The
sandbox is created through B, then A starts. Prints, medians over BENCH_ROUNDS (5) rounds:
  - command round trip (POST /v1/sandboxes/{id}/commands `true`, one keep-alive connection,
    BENCH_CMDS (50) a round): at B, through A, ratio (target <= 1.2x)
  - 100 MiB download (GET /v1/sandboxes/{id}/files) MiB/s: at B, through A, ratio (>= 0.8x),
    and A's resident memory before and after
With BASELINE_BUILD_DIR (e.g. a build of the commit before forwarding): the same command
round trip and download on one node (B alone) for each build, alternating, so that the
local path's cost of the "is this sandbox here" check shows. Machines here are shared and
noisy: read ratios, not absolutes.
"""
import http.client
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from harness import PgCluster, Spaced, pg_bindir, tmpdir  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
CMDS = int(os.environ.get("BENCH_CMDS", "50"))
BIG = 100 << 20


def node(build, pg, runtime, keyfile, data_dir=None):
    env = {"SPACE_FAKE_AGENT": os.path.join(build, "agent", "space-agent-host"),
           "SPACE_FAKE_DELAY_MS": "0"}
    args = ["--cluster-key-file", keyfile] if keyfile else []
    return Spaced(binary=os.path.join(build, "server", "spaced-test"), database_url=pg.url,
                  runtime=runtime, env=env, args=args, data_dir=data_dir)


def cmd_rtt(s, sid):
    """Median ms of CMDS command round trips on one connection."""
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    body = json.dumps({"cmd": "true"})
    h = {"Authorization": "Bearer " + s.key, "Content-Type": "application/json"}
    times = []
    for _ in range(CMDS):
        t0 = time.perf_counter()
        c.request("POST", "/v1/sandboxes/%s/commands" % sid, body=body, headers=h)
        r = c.getresponse()
        r.read()
        times.append((time.perf_counter() - t0) * 1000)
        assert r.status == 200, r.status
    c.close()
    return statistics.median(times)


def download(s, sid, path):
    """MiB/s of one GET of path."""
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300)
    t0 = time.perf_counter()
    c.request("GET", "/v1/sandboxes/%s/files?path=%s" % (sid, path),
              headers={"Authorization": "Bearer " + s.key})
    r = c.getresponse()
    n = 0
    while True:
        b = r.read(1 << 20)
        if not b:
            break
        n += len(b)
    dt = time.perf_counter() - t0
    c.close()
    assert r.status == 200 and n == BIG, (r.status, n)
    return BIG / (1 << 20) / dt


def sql(pg, text):
    subprocess.run([os.path.join(pg_bindir(), "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1",
                    pg.url, "-c", text], check=True, capture_output=True)


def setup(build, keyfile, big=None):
    pg = PgCluster()
    b = node(build, pg, "test", keyfile)
    b.key = b.cli("keys", "create").stdout.strip()
    b.start()
    st, r = b.request("POST", "/v1/sandboxes?wait=60", {"template": "base"}, timeout=70)
    assert st == 200, (st, r)
    sid = r["sandbox"]["id"]
    if big is None:
        big = os.path.join(tmpdir("sp-bench-"), "big")
        with open(big, "wb") as f:
            f.write(os.urandom(BIG))
    return pg, b, sid, big


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    base = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else None
    kdir = tmpdir("sp-bench-key-")
    keyfile = os.path.join(kdir, "cluster.key")
    fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)

    pg, b, sid, big = setup(build, keyfile)
    a = None
    try:
        with open(os.path.join(b.data_dir, "worker-id")) as f:
            sql(pg, "INSERT INTO workers (id, address) VALUES ('%s', '127.0.0.1:%d')"
                % (f.read().strip(), b.port))
        a = node(build, pg, "none", keyfile)
        a.key = b.key
        a.start()
        rtt = {"B": [], "A": []}
        mbs = {"B": [], "A": []}
        rss = [a.rss_kb()]
        for _ in range(ROUNDS):
            for name, s in (("B", b), ("A", a)):
                rtt[name].append(cmd_rtt(s, sid))
                mbs[name].append(download(s, sid, big))
            rss.append(a.rss_kb())
        mb, ma = statistics.median(rtt["B"]), statistics.median(rtt["A"])
        tb, ta = statistics.median(mbs["B"]), statistics.median(mbs["A"])
        print("two nodes, %d rounds (medians):" % ROUNDS)
        print("  command round trip: at B %.2f ms, through A %.2f ms: %.2fx (target <= 1.2x)"
              % (mb, ma, ma / mb))
        print("  100 MiB download:   at B %.0f MiB/s, through A %.0f MiB/s: %.2fx (target >= 0.8x)"
              % (tb, ta, ta / tb))
        print("  A's RSS: %d KiB at start, %d KiB after %d downloads through it"
              % (rss[0], rss[-1], ROUNDS))
    finally:
        if a is not None:
            a.destroy()
        b.kill_fake_agents()
        b.destroy()
        pg.destroy()

    if base is None:
        os.unlink(big)
        return
    # One node, this build against the baseline, alternating round by round.
    runs = {}
    try:
        for name, bd in (("this", build), ("baseline", base)):
            p, s, sd, _ = setup(bd, None, big)
            runs[name] = (p, s, sd)
        res = {n: ([], []) for n in runs}
        for _ in range(ROUNDS):
            for n, (_, s, sd) in runs.items():
                res[n][0].append(cmd_rtt(s, sd))
                res[n][1].append(download(s, sd, big))
        print("one node, %d rounds (medians):" % ROUNDS)
        for n in res:
            print("  %-8s command round trip %.2f ms, 100 MiB download %.0f MiB/s"
                  % (n, statistics.median(res[n][0]), statistics.median(res[n][1])))
        t, bl = res["this"], res["baseline"]
        print("  this/baseline: round trip %.2fx, download %.2fx"
              % (statistics.median(t[0]) / statistics.median(bl[0]),
                 statistics.median(t[1]) / statistics.median(bl[1])))
    finally:
        for p, s, _ in runs.values():
            s.kill_fake_agents()
            s.destroy()
            p.destroy()
        os.unlink(big)


if __name__ == "__main__":
    main()
