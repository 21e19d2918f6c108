#!/usr/bin/env python3
"""Sandbox snapshots on many workers (issue 20), next to one node's in the same run.

  bench/fleet_fork_bench.py BUILD_DIR [DATA_DIR]

BUILD_DIR holds server/spaced (a release build); DATA_DIR (default BUILD_DIR/bench-data) gets
the base template if it has none. Two set-ups run side by side on real VMs:
  - one node (role all, no snapshot dir): a snapshot's RAM is a delta over the template
    snapshot's and stays on the node;
  - a fleet on its own PostgreSQL: an API node and workers w1 and w2 sharing a snapshot dir
    (each worker's data dir holds DATA_DIR's base build, linked): a snapshot is taken as on
    one node, then copied to the snapshot dir as it is (its RAM the same delta, over the
    template RAM published there once) before it is ready; a fork on the other worker copies
    it in first, its RAM made whole over that published RAM, then a delta over its own
    template snapshot's RAM.
Each worker first runs a sandbox of base (so it holds a template snapshot of it, as a worker in
service does). Each round, in both: a 256 MiB sandbox of `base` with a Python process writing
a counter is snapshotted (POST .../snapshots?wait -> ready; its vCPUs' stop from the driver's
vm.json "pause_ms"), then the snapshot's first fork -> first command answered (no spare of a
new snapshot exists): on the node; in the fleet on w1 (the taker) and on w2 (which copies it
in), which of the two first alternating; then, BENCH_GAP (6) s later, the next fork in each
place (from a spare the pool made of the snapshot meanwhile, when it did); and, as the
baseline of the fleet's own path, a create of base -> first command in each (a template
clone, from a spare when one is ready). Prints medians over BENCH_ROUNDS (5) and the ratios.
Needs root, QEMU and PostgreSQL. Machines here are shared and noisy: read ratios, not
absolutes.
"""
import json
import os
import secrets
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from benchlib import Platform, ratio  # noqa: E402
from fork_bench import COUNTER, cmd  # noqa: E402 (the same counting process)
from harness import PgCluster, Spaced, wait_until  # noqa: E402
import fleet  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
GAP = float(os.environ.get("BENCH_GAP", "6"))


def source(s, body, counter=True):
    st, r = s.request("POST", "/v1/sandboxes?wait=120", dict(body, template="base",
                                                             memory_mb=256), timeout=150)
    assert st == 200 and r["sandbox"]["state"] == "running", (st, r)
    sid = r["sandbox"]["id"]
    if not counter:
        cmd(s, sid, "true")
        return sid
    cmd(s, sid, COUNTER)
    time.sleep(1)
    return sid


def take(s, sid):
    t0 = time.time()
    st, r = s.request("POST", "/v1/sandboxes/%s/snapshots?wait=120" % sid, {}, timeout=150)
    assert st == 201 and r["snapshot"]["state"] == "ready", (st, r)
    return r["snapshot"]["id"], (time.time() - t0) * 1000


def pause_ms(data_dir, snap):
    with open(os.path.join(data_dir, "snapshots", snap, "vm.json")) as f:
        return json.load(f)["pause_ms"]


def fork(s, snap, placement=None):
    body = {"snapshot": snap}
    if placement:
        body["placement"] = {"labels": {"node": placement}}
    t0 = time.time()
    st, r = s.request("POST", "/v1/sandboxes?wait=120", body, timeout=150)
    assert st == 200 and r["sandbox"]["state"] == "running", (st, r)
    sid = r["sandbox"]["id"]
    cmd(s, sid, "true")
    return sid, (time.time() - t0) * 1000


def delete(s, sid):
    s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)


def start_fleet(binary, data, root):
    pg = PgCluster()
    nodes = []
    key = os.path.join(root, "cluster.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(24))
    snap = os.path.join(root, "snapshots")
    os.makedirs(snap)
    common = ["--cluster-key-file", key]
    api = Spaced(binary=binary, database_url=pg.url, args=["--role", "api"] + common)
    nodes.append(api)
    api.key = api.cli("keys", "create", "--team", "bench").stdout.strip()
    api.start()
    with open(os.path.join(api.data_dir, "admin-key")) as f:
        admin = api.admin = f.read().strip()
    workers = []
    for n in ("w1", "w2"):
        d = os.path.join(root, n)
        fleet.worker_data_dir(data, d)
        w = Spaced(binary=binary, database_url=pg.url, data_dir=d,
                   args=["--role", "worker", "--snapshot-dir", snap, "--worker-labels",
                         "node=" + n] + common)
        w.key = api.key
        nodes.append(w)
        w.start(timeout=120)
        workers.append(w)

    def active():
        st, r = api.request("GET", "/v1/workers", key=admin)
        return st == 200 and len([x for x in r["workers"] if x["state"] == "active"]) == 2

    wait_until(active, "2 workers active", 60, 0.2)
    return pg, nodes, api, workers  # api.admin: the admin key


def stop_fleet(pg, nodes, root):
    """Stops what start_fleet started (either may be None) and removes root (BENCH_KEEP=1:
    kept)."""
    for n in nodes or []:
        n.destroy()
    if pg is not None:
        pg.destroy()
    if os.environ.get("BENCH_KEEP") != "1":
        shutil.rmtree(root, ignore_errors=True)


def main():
    p = Platform(sys.argv, templates=("base",)).start()
    root = os.path.join(os.path.dirname(p.data), "fleet-fork-bench-%d" % os.getpid())
    os.makedirs(root)
    pg = nodes = None
    try:
        pg, nodes, api, (w1, w2) = start_fleet(p.spaced, p.data, root)
        one, fl = p.s, api
        # each worker holds a template snapshot of base at 256 MiB, as a worker in service
        # does (made by its first sandbox of it): the copies are made deltas over it
        for w in ("w1", "w2"):
            delete(fl, source(fl, {"placement": {"labels": {"node": w}}}))
        res = {k: [] for k in ("take1", "takeF", "pause1", "pauseF", "fork1", "forkT",
                               "forkO", "again1", "againT", "againO", "tmpl1", "tmplF")}
        for r in range(ROUNDS):
            a = source(one, {})
            b = source(fl, {"placement": {"labels": {"node": "w1"}}})
            s1, ms = take(one, a)
            res["take1"].append(ms)
            res["pause1"].append(pause_ms(p.data, s1))
            sf, ms = take(fl, b)
            res["takeF"].append(ms)
            res["pauseF"].append(pause_ms(w1.data_dir, sf))
            made = []
            sid, ms = fork(one, s1)
            made.append((one, sid))
            res["fork1"].append(ms)
            # each the first fork of it there; which goes first alternates
            order = [("forkO", "w2"), ("forkT", "w1")]
            for key, where in order if r % 2 == 0 else order[::-1]:
                sid, ms = fork(fl, sf, where)
                made.append((fl, sid))
                res[key].append(ms)
            time.sleep(GAP)  # the pools make spares of the snapshot meanwhile
            for key, s, where in (("again1", one, None), ("againO", fl, "w2"),
                                  ("againT", fl, "w1")):
                sid, ms = fork(s, s1 if s is one else sf, where)
                made.append((s, sid))
                res[key].append(ms)
            # baseline: a create of base -> first command in each (a template clone)
            for key, s, body in (("tmpl1", one, {}),
                                 ("tmplF", fl, {"placement": {"labels": {"node": "w1"}}})):
                t0 = time.time()
                sid = source(s, body, counter=False)
                res[key].append((time.time() - t0) * 1000)
                made.append((s, sid))
            for s, sid in made + [(one, a), (fl, b)]:
                delete(s, sid)
            one.request("DELETE", "/v1/snapshots/" + s1)
            fl.request("DELETE", "/v1/snapshots/" + sf)
            print("round %d: take %.0f / %.0f ms, first fork %.0f / taker %.0f / other %.0f ms"
                  % (r + 1, res["take1"][-1], res["takeF"][-1], res["fork1"][-1],
                     res["forkT"][-1], res["forkO"][-1]), flush=True)
        med = {k: statistics.median(v) for k, v in res.items()}
        print("%d rounds, medians (one node | fleet with a shared snapshot dir):" % ROUNDS)
        print("  snapshot -> ready:        %7.0f ms | %7.0f ms" % (med["take1"], med["takeF"]))
        print("  vCPUs stopped (pause_ms): %7.0f ms | %7.0f ms" % (med["pause1"], med["pauseF"]))
        print("  first fork -> command:    %7.0f ms | taker %.0f ms, other worker %.0f ms"
              % (med["fork1"], med["forkT"], med["forkO"]))
        print("  next fork -> command:     %7.0f ms | taker %.0f ms, other worker %.0f ms"
              % (med["again1"], med["againT"], med["againO"]))
        print("  base -> command (clone):  %7.0f ms | %7.0f ms (baseline: the fleet's own path)"
              % (med["tmpl1"], med["tmplF"]))
        ratio("snapshot, fleet / one node", med["takeF"], med["take1"])
        ratio("create of base, fleet / one node", med["tmplF"], med["tmpl1"])
        ratio("first fork, fleet taker / one node", med["forkT"], med["fork1"])
        ratio("first fork, other worker / taker", med["forkO"], med["forkT"])
        ratio("next fork, fleet taker / one node", med["againT"], med["again1"])
        ratio("next fork, other worker / taker", med["againO"], med["againT"])
    finally:
        stop_fleet(pg, nodes, root)
        p.stop()


if __name__ == "__main__":
    main()
