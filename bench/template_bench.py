#!/usr/bin/env python3
"""Template builds through the native API, next to baselines from the same run.

  bench/template_bench.py BUILD_DIR [DATA_DIR]

BUILD_DIR holds server/spaced (a release build); DATA_DIR (default BUILD_DIR/bench-data) gets the
base template if it has none. Prints medians of:
  - a 3-step build on `base` (a file written, a small package-free script run, a directory tree
    made), fresh each round (a nonce step), from POST to succeeded, against the same commands
    run in a running sandbox;
  - the same build with a start_cmd HTTP server and its ready_cmd (the first round's time per
    stage from its log), against the same
    commands run in a running sandbox, alone and then with start_cmd run until ready_cmd
    passes: the differences are what a build adds (builder VM, disk export, version commit,
    template snapshot) over the commands and over the commands with the server's start-up;
  - the same build again, fully cached (its inputs made a version before);
  - the steps-alone build with disk_mb 1 GiB above base's (the builder's disk and filesystem
    grown before the first step), and built from a snapshot of a running sandbox of base
    (the builder starts from the snapshot), each against the steps-alone build;
  - create -> first command from the built template, against create -> first command from
    `base` (both from template snapshots; the built one has its server already up), a second
    apart so the spare pool refills between creates, as fork_bench.py does; the first create
    from the new template finds no spare (its pool starts with it).
Needs root, QEMU and PostgreSQL. Machines here are shared and noisy: read ratios, not absolutes.
Environment: BENCH_BUILDS (5 rounds), BENCH_CREATES (5).
"""
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import Platform, build_template, line, ratio  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_BUILDS", "5"))
CREATES = int(os.environ.get("BENCH_CREATES", "5"))
CMDS = ["mkdir -p /srv/site && for i in $(seq 1 200); do echo line-$i; done > /srv/site/index.html",
        "python3 -c 'import json; print(json.dumps({\"ok\": 1}))' > /srv/site/ok.json",
        "mkdir -p /opt/tree/a/b/c && touch /opt/tree/a/b/c/f1 /opt/tree/a/f2"]


START = "cd /srv/site && python3 -m http.server 8000"
READY = "curl -sf http://127.0.0.1:8000/index.html"


def create_first_cmd(s, template):
    t0 = time.time()
    st, r = s.request("POST", "/v1/sandboxes?wait=120", {"template": template}, timeout=150)
    sid = r["sandbox"]["id"]
    st, c = s.request("POST", "/v1/sandboxes/%s/commands" % sid, {"cmd": "true"}, timeout=60)
    ms = (time.time() - t0) * 1000
    s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
    time.sleep(1.0)  # the pool refills between creates (as fork_bench.py): what users find
    return ms


def stages(s, b):
    """Where a build's time went, from its log: {stage: ms}, a stage being the time from one
    info line to the next (the steps' own output lines fall inside the step's stage)."""
    r, text = s.exchange("GET", "/v1/templates/%s/builds/%s/logs" % (b["template"], b["id"]),
                         None, None, {"Authorization": "Bearer " + s.key}, 30)
    marks = []
    for ln in text.decode().splitlines():
        e = json.loads(ln)
        if e.get("level") == "info" or e.get("stream") == "info":
            t = e["ts"]
            ms = ((int(t[11:13]) * 60 + int(t[14:16])) * 60 + float(t[17:23])) * 1000
            marks.append((ms, e["line"][:40]))
    return [(marks[i][1], marks[i + 1][0] - marks[i][0]) for i in range(len(marks) - 1)]


def main():
    p = Platform(sys.argv, templates=("base",)).start()
    s = p.s
    try:
        built, plain, cached, inplace, served, grown, fromsnap = [], [], [], [], [], [], []
        with open(os.path.join(HERE, "..", "templates", "base", "template.json")) as f:
            bigger = json.load(f)["disk_mb"] + 1024
        # a running sandbox of base, snapshotted: the parent of the from-snapshot builds
        st, r = s.request("POST", "/v1/sandboxes?wait=120", {"template": "base"}, timeout=150)
        src = r["sandbox"]["id"]
        st, r = s.request("POST", "/v1/sandboxes/%s/snapshots?wait=120" % src, {}, timeout=150)
        assert st == 201, r
        snap = r["snapshot"]["id"]
        for i in range(ROUNDS):
            nonce = "%d-%d" % (os.getpid(), i)
            steps = [{"run": "echo %s > /nonce" % nonce}] + [{"run": c} for c in CMDS]
            # the steps alone (no start_cmd): what the build adds is the builder, the disk,
            # the version and the template snapshot
            # (its own nonce: neither build may start from the other's step cache)
            plain_steps = [{"run": "echo plain-%s > /nonce" % nonce}] + steps[1:]
            ms, _ = build_template(s, {"name": "bench-plain", "from": "base",
                                       "steps": plain_steps})
            plain.append(ms)
            ms, _ = build_template(s, {"name": "bench-disk", "from": "base", "disk_mb": bigger,
                                       "steps": [{"run": "echo disk-%s > /nonce" % nonce}]
                                       + steps[1:]})
            grown.append(ms)
            ms, _ = build_template(s, {"name": "bench-snap", "from": {"snapshot": snap},
                                       "steps": [{"run": "echo snap-%s > /nonce" % nonce}]
                                       + steps[1:]})
            fromsnap.append(ms)
            body = {"name": "bench-tpl", "from": "base", "steps": steps,
                    "start_cmd": START, "ready_cmd": READY}
            ms, b = build_template(s, body)
            built.append(ms)
            if i == 0:
                for what, ms_ in stages(s, b):
                    print("  stage %-44s %8.0f ms" % (what, ms_), flush=True)
            ms, b2 = build_template(s, body)
            assert b2["cached"], b2
            cached.append(ms)
            # the baseline, in a new sandbox each round (page cache as cold as a builder's)
            st, r = s.request("POST", "/v1/sandboxes?wait=120", {"template": "base"}, timeout=150)
            sid = r["sandbox"]["id"]
            t0 = time.time()
            for c in ["echo %s > /tmp/nonce" % nonce] + CMDS:
                st, out = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                                    {"cmd": c, "user": "root"}, timeout=60)
                assert out["exit_code"] == 0, out
            inplace.append((time.time() - t0) * 1000)
            # start_cmd and ready_cmd as a build's warmup runs them: in the background, then
            # polled every 0.2 s, as the template's user
            st, out = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                                {"cmd": "(%s) </dev/null >/dev/null 2>&1 & until %s >/dev/null "
                                        "2>&1; do sleep 0.2; done" % (START, READY),
                                 "user": "user", "timeout_s": 120}, timeout=150)
            assert out["exit_code"] == 0, out
            served.append((time.time() - t0) * 1000)
            s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
        line("build of the 4 steps alone (POST -> succeeded)", plain)
        line("  ... with disk_mb +1024 (grown first)", grown)
        ratio("grown disk / steps alone", statistics.median(grown), statistics.median(plain))
        line("  ... from a snapshot of a running sandbox", fromsnap)
        ratio("from a snapshot / steps alone", statistics.median(fromsnap),
              statistics.median(plain))
        line("build of 4 steps + start/ready (POST -> succeeded)", built)
        line("the same 4 commands in a running sandbox", inplace)
        line("  ... then start_cmd until ready_cmd passes", served)
        med = statistics.median(plain) - statistics.median(inplace)
        print("%-52s %8.0f ms" % ("what a build of the steps adds over the commands", med),
              flush=True)
        med = statistics.median(built) - statistics.median(served)
        print("%-52s %8.0f ms" % ("what the build adds over commands + start/ready", med),
              flush=True)
        line("the same build, cached", cached)
        from_tpl, from_base = [], []
        for _ in range(CREATES):  # in turn: what the machine does meanwhile falls on both
            from_tpl.append(create_first_cmd(s, "bench-tpl"))
            from_base.append(create_first_cmd(s, "base"))
        line("create -> first command, built template", from_tpl)
        line("create -> first command, base", from_base)
        ratio("built template / base", statistics.median(from_tpl), statistics.median(from_base))
        for name in ("bench-tpl", "bench-plain", "bench-disk", "bench-snap"):
            s.request("DELETE", "/v1/templates/" + name, timeout=30)
        s.request("DELETE", "/v1/snapshots/" + snap, timeout=30)
        s.request("DELETE", "/v1/sandboxes/%s?wait=60" % src, timeout=70)
    finally:
        p.stop()


if __name__ == "__main__":
    main()
