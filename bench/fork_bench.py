#!/usr/bin/env python3
"""Sandbox snapshots ("forks") through the native API, next to baselines from the same run.

  bench/fork_bench.py BUILD_DIR [DATA_DIR]

BUILD_DIR holds server/spaced (a release build); DATA_DIR (default BUILD_DIR/bench-data) gets the
base template if it has none. A 256 MiB sandbox of `base` runs a Python process that keeps
writing a counter (its memory moves on while it is snapshotted). Prints medians of:
  - a snapshot of it (POST .../snapshots?wait -> ready), and the time its vCPUs were stopped
    (the driver's own figure, snapshots/<id>/vm.json "pause_ms"); the baseline is a pause and
    resume of the same sandbox through the API (the least a stop-the-world snapshot could cost);
    the same once spaced has been killed and started again (the sandbox's QEMU adopted);
  - create from the snapshot -> first command answered, and the same from a snapshot of an idle
    sandbox (no counter running in it), against create from `base` -> first command (a
    template snapshot clone); all from spares when one is ready (the first create from a
    snapshot has none: it makes the pool keep some), as users get them, the three in turn;
  - a command's round trip in a running fork of the counter's snapshot, against one in a
    running sandbox of `base`: what the counter costs any command in its sandbox.
Needs root, QEMU and PostgreSQL. Machines here are shared and noisy: read ratios, not absolutes.
Environment: BENCH_SNAPS (7 rounds), BENCH_CREATES (7), BENCH_GAP (1.0 s between creates),
BENCH_ROUND_TRIPS (21);
SPACE_SNAPSHOT_LIVE=0 (passed on to spaced) gives the stop-first snapshot as a baseline: run the
script with and without it, one after the other.
"""
import json
import os
import signal
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import Platform, line, ratio  # noqa: E402

SNAPS = int(os.environ.get("BENCH_SNAPS", "7"))
CREATES = int(os.environ.get("BENCH_CREATES", "7"))
GAP = float(os.environ.get("BENCH_GAP", "1.0"))
ROUND_TRIPS = int(os.environ.get("BENCH_ROUND_TRIPS", "21"))
COUNTER = ("nohup python3 -c 'import time\ni = 0\nb = bytearray(32 << 20)\nwhile True:\n"
           "    i += 1\n    b[(i * 4096) % len(b)] = i & 255\n"
           "    open(\"/tmp/count\", \"w\").write(str(i))\n    time.sleep(0.01)' "
           ">/dev/null 2>&1 &")


def cmd(s, sid, c):
    st, r = s.request("POST", "/v1/sandboxes/%s/commands" % sid, {"cmd": c}, timeout=60)
    assert st == 200 and r["exit_code"] == 0, (st, r)
    return r


def create_first_cmd(s, body):
    t0 = time.time()
    st, r = s.request("POST", "/v1/sandboxes?wait=120", body, timeout=150)
    assert st == 200 and r["sandbox"]["state"] == "running", (st, r)
    sid = r["sandbox"]["id"]
    cmd(s, sid, "true")
    ms = (time.time() - t0) * 1000
    s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
    time.sleep(GAP)  # the pool refills between creates: each create finds what users find
    return ms


def snapshot(p, src, take, window, modes):
    """A snapshot of src: its time to ready into take, its vCPUs' stop into window, how its RAM
    was copied counted in modes. Returns its id."""
    t0 = time.time()
    st, r = p.s.request("POST", "/v1/sandboxes/%s/snapshots?wait=120" % src, {}, timeout=150)
    assert st == 201, (st, r)
    take.append((time.time() - t0) * 1000)
    sn = r["snapshot"]["id"]
    with open(os.path.join(p.data, "snapshots", sn, "vm.json")) as f:
        vmj = json.load(f)
    window.append(float(vmj["pause_ms"]))
    mode = vmj.get("ram_copy", "?")
    modes[mode] = modes.get(mode, 0) + 1
    return sn


def main():
    p = Platform(sys.argv, templates=("base",)).start()
    s = p.s
    try:
        st, r = s.request("POST", "/v1/sandboxes?wait=120", {"template": "base", "memory_mb": 256},
                          timeout=150)
        src = r["sandbox"]["id"]
        cmd(s, src, COUNTER)
        cmd(s, src, "for i in $(seq 1 100); do [ -s /tmp/count ] && break; sleep 0.1; done")
        take, window, pr, snaps, modes = [], [], [], [], {}
        for _ in range(SNAPS):
            snaps.append(snapshot(p, src, take, window, modes))
            t0 = time.time()
            s.request("POST", "/v1/sandboxes/%s/pause?wait=60" % src, timeout=70)
            s.request("POST", "/v1/sandboxes/%s/wake?wait=60" % src, timeout=70)
            pr.append((time.time() - t0) * 1000)
            time.sleep(0.5)
        line("snapshot of a running 256 MiB sandbox (POST -> ready)", take)
        line("  its vCPUs stopped (driver's pause_ms)", window)
        print("  how its RAM was copied (vm.json ram_copy): %s" %
              ", ".join("%s x%d" % kv for kv in sorted(modes.items())), flush=True)
        line("baseline: pause + resume of it through the API", pr)
        # spaced killed and started again: the sandbox's QEMU is adopted, and its snapshots
        # are taken as before
        s.kill(signal.SIGKILL)
        s.start()
        take2, window2, modes2 = [], [], {}
        for _ in range(SNAPS):
            snaps.append(snapshot(p, src, take2, window2, modes2))
            time.sleep(0.5)
        line("after a restart of spaced: snapshot", take2)
        line("  its vCPUs stopped", window2)
        print("  how its RAM was copied: %s" %
              ", ".join("%s x%d" % kv for kv in sorted(modes2.items())), flush=True)
        # a snapshot of an idle sandbox too: the counter's snapshot brings a busy process
        st, r = s.request("POST", "/v1/sandboxes?wait=120", {"template": "base", "memory_mb": 256},
                          timeout=150)
        idle = r["sandbox"]["id"]
        st, r = s.request("POST", "/v1/sandboxes/%s/snapshots?wait=120" % idle, {}, timeout=150)
        assert st == 201, (st, r)
        idle_snap = r["snapshot"]["id"]
        s.request("DELETE", "/v1/sandboxes/%s?wait=60" % idle, timeout=70)
        # in turn, so that what the shared machine does meanwhile falls on all three alike
        forks, idles, tpl = [], [], []
        for _ in range(CREATES):
            forks.append(create_first_cmd(s, {"snapshot": snaps[-1]}))
            idles.append(create_first_cmd(s, {"snapshot": idle_snap}))
            tpl.append(create_first_cmd(s, {"template": "base", "memory_mb": 256}))
        line("create from the snapshot -> first command", forks)
        line("create from an idle sandbox's snapshot -> first cmd", idles)
        line("create from base -> first command", tpl)
        ratio("snapshot / template", statistics.median(forks), statistics.median(tpl))
        ratio("idle sandbox's snapshot / template", statistics.median(idles),
              statistics.median(tpl))
        # What the snapshot's busy process costs any command, once created: a command's round
        # trip in a running fork of it against one in a running sandbox of base.
        st, r = s.request("POST", "/v1/sandboxes?wait=120", {"snapshot": snaps[-1]}, timeout=150)
        fork = r["sandbox"]["id"]
        st, r = s.request("POST", "/v1/sandboxes?wait=120", {"template": "base", "memory_mb": 256},
                          timeout=150)
        plain = r["sandbox"]["id"]
        in_fork, in_plain = [], []
        for _ in range(ROUND_TRIPS):
            for sid, xs in ((fork, in_fork), (plain, in_plain)):
                t0 = time.time()
                cmd(s, sid, "true")
                xs.append((time.time() - t0) * 1000)
        line("a command in a running fork of it", in_fork)
        line("a command in a running sandbox of base", in_plain)
        ratio("fork / base (the busy process's share)", statistics.median(in_fork),
              statistics.median(in_plain))
        for sid in (fork, plain):
            s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
        s.request("DELETE", "/v1/snapshots/" + idle_snap, timeout=30)
        for sn in snaps:
            s.request("DELETE", "/v1/snapshots/" + sn, timeout=30)
        s.request("DELETE", "/v1/sandboxes/%s?wait=60" % src, timeout=70)
    finally:
        p.stop()


if __name__ == "__main__":
    main()
