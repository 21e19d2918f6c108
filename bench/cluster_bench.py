#!/usr/bin/env python3
"""The data-plane forwarder's cost (issue 20): a command's round trip, a 100 MiB download and a
100 MiB upload through an API node to the worker that owns the sandbox, against the same
directly at the worker, in the same run; and, with a second build, the one-node path before
and after, and the same through an API node of that build.

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
  - 100 MiB upload (PUT /v1/sandboxes/{id}/files) MiB/s: at B, through A, ratio, and A's
    resident memory at its highest during the uploads through it (an upload streams through
    an API node: http/bodygate.h); and the same over HTTP/2 (curl with prior knowledge)
With BASELINE_BUILD_DIR (e.g. a build of the commit before forwarding, or before uploads
streamed): an API node A0 of that build beside A, the same figures through it; and the same
command round trip, download and upload on one node (B alone) for each build, alternating, so
that the local path's cost of the "is this sandbox here" check and of reading an upload's body
after its key is checked shows. Machines here are shared
and noisy: read ratios, not absolutes.
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
from harness import PeakRss, PgCluster, Spaced, pg_bindir, tmpdir  # noqa: E402

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


def upload(s, sid, src, watch=None):
    """MiB/s of one PUT of the file src; watch's resident memory at its highest meanwhile."""
    with PeakRss(watch, 0.02) as peak:
        c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300, blocksize=1 << 20)
        t0 = time.perf_counter()
        with open(src, "rb") as f:
            c.request("PUT", "/v1/sandboxes/%s/files?path=%s.up" % (sid, src), body=f,
                      headers={"Authorization": "Bearer " + s.key, "Content-Length": str(BIG)})
            r = c.getresponse()
            r.read()
        dt = time.perf_counter() - t0
        c.close()
    assert r.status in (200, 201, 204), r.status
    return BIG / (1 << 20) / dt, peak.kib


def upload_h2(s, sid, src, watch=None):
    """The same over HTTP/2 (curl, prior knowledge: the frames the E2B Python SDK sends over
    TLS): MiB/s, and watch's resident memory at its highest meanwhile."""
    with PeakRss(watch, 0.02) as peak:
        r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{time_total}",
                            "--http2-prior-knowledge", "-T", src,
                            "-H", "Authorization: Bearer " + s.key,
                            "http://127.0.0.1:%d/v1/sandboxes/%s/files?path=%s.h2"
                            % (s.port, sid, src)],
                           capture_output=True, text=True, timeout=300)
    code, secs = r.stdout.split()
    assert code in ("200", "201", "204"), (r.stdout, r.stderr)
    return BIG / (1 << 20) / float(secs), peak.kib


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
    apis = {}
    try:
        with open(os.path.join(b.data_dir, "worker-id")) as f:
            sql(pg, "INSERT INTO workers (id, address) VALUES ('%s', '127.0.0.1:%d') "
                "ON CONFLICT (id) DO UPDATE SET address = EXCLUDED.address"
                % (f.read().strip(), b.port))
        for name, bd in (("A", build), ("A0", base)):
            if bd is not None:
                apis[name] = node(bd, pg, "none", keyfile)
                apis[name].key = b.key
                apis[name].start()
        nodes = [("B", b)] + list(apis.items())
        rtt = {n: [] for n, _ in nodes}
        mbs = {n: [] for n, _ in nodes}
        ups = {n: [] for n, _ in nodes}
        h2ups = {n: [] for n, _ in nodes}
        peak = {n: 0 for n, _ in nodes}
        h2peak = {n: 0 for n, _ in nodes}
        rss = {n: [s.rss_kb()] for n, s in apis.items()}
        for _ in range(ROUNDS):
            for name, s in nodes:
                rtt[name].append(cmd_rtt(s, sid))
                mbs[name].append(download(s, sid, big))
                mibs, p = upload(s, sid, big, s if name != "B" else None)
                ups[name].append(mibs)
                peak[name] = max(peak[name], p)
                mibs, p = upload_h2(s, sid, big, s if name != "B" else None)
                h2ups[name].append(mibs)
                h2peak[name] = max(h2peak[name], p)
            for n, s in apis.items():
                rss[n].append(s.rss_kb())
        med = {n: (statistics.median(rtt[n]), statistics.median(mbs[n]),
                   statistics.median(ups[n])) for n, _ in nodes}
        print("two nodes, %d rounds (medians)%s:"
              % (ROUNDS, "; A0 is an API node of the baseline build" if base else ""))
        mb, tb, ub = med["B"]
        for n in apis:
            ma, ta, ua = med[n]
            print("  %-2s command round trip: at B %.2f ms, through %s %.2f ms: %.2fx "
                  "(target <= 1.2x)" % (n, mb, n, ma, ma / mb))
            print("  %-2s 100 MiB download:   at B %.0f MiB/s, through %s %.0f MiB/s: %.2fx "
                  "(target >= 0.8x)" % (n, tb, n, ta, ta / tb))
            print("  %-2s 100 MiB upload:     at B %.0f MiB/s, through %s %.0f MiB/s: %.2fx"
                  % (n, ub, n, ua, ua / ub))
            print("  %-2s RSS: %d KiB at start, %d KiB at most during the uploads through it, "
                  "%d KiB after %d rounds" % (n, rss[n][0], peak[n], rss[n][-1], ROUNDS))
            hb, ha = statistics.median(h2ups["B"]), statistics.median(h2ups[n])
            print("  %-2s 100 MiB upload, HTTP/2: at B %.0f MiB/s, through %s %.0f MiB/s: %.2fx; "
                  "%s's RSS at most %d KiB" % (n, hb, n, ha, ha / hb, n, h2peak[n]))
    finally:
        for s in apis.values():
            s.destroy()
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
        res = {n: ([], [], []) for n in runs}
        for _ in range(ROUNDS):
            for n, (_, s, sd) in runs.items():
                res[n][0].append(cmd_rtt(s, sd))
                res[n][1].append(download(s, sd, big))
                res[n][2].append(upload(s, sd, big)[0])
        print("one node, %d rounds (medians):" % ROUNDS)
        med = {n: [statistics.median(x) for x in res[n]] for n in res}
        for n in res:
            print("  %-8s command round trip %.2f ms, 100 MiB download %.0f MiB/s, "
                  "100 MiB upload %.0f MiB/s" % (n, med[n][0], med[n][1], med[n][2]))
        t, bl = med["this"], med["baseline"]
        print("  this/baseline: round trip %.2fx, download %.2fx, upload %.2fx"
              % (t[0] / bl[0], t[1] / bl[1], t[2] / bl[2]))
    finally:
        for p, s, _ in runs.values():
            s.kill_fake_agents()
            s.destroy()
            p.destroy()
        os.unlink(big)


if __name__ == "__main__":
    main()
