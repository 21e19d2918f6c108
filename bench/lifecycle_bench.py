#!/usr/bin/env python3
"""Sandbox lifecycle figures through the native API, each next to a baseline from the same run.

  bench/lifecycle_bench.py BUILD_DIR [DATA_DIR]

BUILD_DIR holds server/spaced (a release build). DATA_DIR (default BUILD_DIR/bench-data) gets the
base template if it has none. Prints medians and p99 of:
  - create -> first command from the template snapshot: with a spare clone ready (creates
    BENCH_GAP seconds apart, so the pool refills), and back to back (spares run out), against
      * the same create without spares (spaced with SPACE_POOL_SIZE=0: QEMU restores the template
        snapshot for each create),
      * a cold boot of the same template (spaced with SPACE_COLD_BOOT=1), and
      * QEMU alone restoring the same template snapshot with no control plane (the command line of
        a live clone started by hand, device state on an inherited fd, the same QMP steps; timed
        to the agent's HELLO and to a first `true` straight on the agent socket: the floor)
  - 20 concurrent creates (total wall time) against 20 x the single-create median
  - bursts (the adaptive spare pool): BENCH_BURST concurrent creates, each to a first command
    answered (total and per-create median), on the pool the earlier cases left, then again once
    the pool has refilled; then creates at BENCH_RATE per second for BENCH_RATE_S seconds
    (median, p99), on the pool as the bursts left it and again once it has refilled to what the
    rate asked for; the spare clones' count and memory (PSS) before each. Each of these creates
    waits until its sandbox runs (?wait=, as an SDK's create does), then sends one command:
    twenty clients each polling with a command every 3 ms (BENCH_POLL=1, the single creates'
    way) load the 2 cores here enough to make a burst 2.6x slower than what they measure
  - pause and wake (API round trips)
  - suspend and wake of a 256 MiB and a 1 GiB clone (device state + the RAM pages that differ from
    the template's); snapshot bytes
  - host memory per idle sandbox: RSS and PSS of N idle clones' QEMU (and of a few cold-booted ones),
    MemAvailable before/after, and how many idle clones would fit in what is available
Needs root, QEMU and PostgreSQL. Machines here are shared and noisy: read ratios, not absolutes.
Environment: BENCH_CREATES (20), BENCH_GAP (1.0 s), BENCH_COLD (5), BENCH_FLOOR (10), BENCH_CONC (20),
BENCH_PAUSE (20), BENCH_SUSPEND (3 rounds per size), BENCH_DENSITY (20), BENCH_DENSITY_COLD (3),
BENCH_BURST (20), BENCH_RATE (10 per s), BENCH_RATE_S (10), BENCH_POLL=1, BENCH_ONLY=burst (the warm-up create,
then the burst cases only: to compare two builds' pools), BENCH_ONLY=steady (pause and wake,
suspend and wake, and idle memory only: the figures a change elsewhere must not move),
BENCH_ONLY=sizes (the first create of
a new size only, below), BENCH_SIZES (3 sizes per case), BENCH_BASE=BUILD_DIR (sizes: the same
case on that build too, first, in the same run: a baseline such as main's release build).

The first create of a new size (BENCH_ONLY=sizes, also at the end of a full run): sizes that no
template snapshot exists for, 1 vCPU and an odd memory size each, on a fresh database per build:
  - "seen": a sandbox of that size was created in the last day (a deleted row, as another
    worker or an earlier template version would have left it), spaced restarted; the bench
    waits until the snapshot exists (at most 60 s: a build without snapshots made ahead never
    makes it) and the host is quiet, then times create -> first command;
  - "never seen": the same without the row: the create builds its snapshot (today's first
    create of any new size).
"""
import glob
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from benchlib import Platform, line, ratio  # noqa: E402
from harness import Spaced  # noqa: E402
from agentwire import AgentWire  # noqa: E402

N_CREATES = int(os.environ.get("BENCH_CREATES", "20"))
GAP = float(os.environ.get("BENCH_GAP", "1.0"))
N_COLD = int(os.environ.get("BENCH_COLD", "5"))
N_FLOOR = int(os.environ.get("BENCH_FLOOR", "10"))
N_CONC = int(os.environ.get("BENCH_CONC", "20"))
N_PAUSE = int(os.environ.get("BENCH_PAUSE", "20"))
N_SUSPEND = int(os.environ.get("BENCH_SUSPEND", "3"))
N_DENSITY = int(os.environ.get("BENCH_DENSITY", "20"))
N_DENSITY_COLD = int(os.environ.get("BENCH_DENSITY_COLD", "3"))
N_BURST = int(os.environ.get("BENCH_BURST", "20"))
RATE = float(os.environ.get("BENCH_RATE", "10"))
RATE_S = float(os.environ.get("BENCH_RATE_S", "10"))
POLL = os.environ.get("BENCH_POLL") == "1"
ONLY = os.environ.get("BENCH_ONLY", "")


class Api:
    def __init__(self, spaced):
        self.s = spaced
        self.conn = None
        self.hdr = {"Authorization": "Bearer " + spaced.key, "Content-Type": "application/json"}

    def call(self, method, path, body=None, timeout=300):
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.s.port, timeout=timeout)
            try:
                self.conn.request(method, path,
                                  body=json.dumps(body) if body is not None else None,
                                  headers=self.hdr)
                r = self.conn.getresponse()
                return r.status, r.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise

    def create_first_cmd(self, limit=180.0, wait=False, **fields):
        """create, then `true` until it answers (at most limit seconds): (ms, id). wait: the
        create itself waits until the sandbox runs (?wait=, as the E2B SDKs' create does), so
        `true` is sent once; else it is sent every 3 ms until it runs."""
        t0 = time.perf_counter()
        st, b = self.call("POST", "/v1/sandboxes" + ("?wait=%d" % limit if wait else ""),
                          dict(template="base", **fields))
        assert st in (200, 202), (st, b)
        sid = json.loads(b)["sandbox"]["id"]
        while True:
            st, b = self.call("POST", "/v1/sandboxes/%s/commands" % sid, {"argv": ["true"]})
            if st == 200:
                break
            if st not in (404, 409, 503):
                raise AssertionError("first command: %d %r" % (st, b))
            if time.perf_counter() - t0 > limit:
                raise AssertionError("no first command within %.0f s: %d %r" % (limit, st, b))
            time.sleep(0.003)
        return (time.perf_counter() - t0) * 1000, sid

    def creates(self, n, gap=0.0):
        """n x (create -> first command, delete), gap seconds before each: the ms list."""
        out = []
        for _ in range(n):
            time.sleep(gap)
            ms, sid = self.create_first_cmd()
            out.append(ms)
            self.delete(sid)
        return out

    def create(self, **fields):
        st, b = self.call("POST", "/v1/sandboxes?wait=120", dict(template="base", **fields))
        assert st == 200, (st, b)
        return json.loads(b)["sandbox"]["id"]

    def verb(self, sid, verb):
        t0 = time.perf_counter()
        st, b = self.call("POST", "/v1/sandboxes/%s/%s?wait=120" % (sid, verb))
        assert st == 200, (verb, st, b)
        return (time.perf_counter() - t0) * 1000

    def run(self, sid, cmd):
        st, b = self.call("POST", "/v1/sandboxes/%s/commands" % sid, {"cmd": cmd})
        assert st == 200, (st, b)
        return json.loads(b)

    def delete(self, sid):
        self.call("DELETE", "/v1/sandboxes/%s?wait=60" % sid)


def qemu_pid(data, sid):
    with open(os.path.join(data, "vms", sid, "qemu.pid")) as f:
        return int(f.read().strip())


def mem_of(pid):
    """(RSS, PSS) in bytes from smaps_rollup."""
    rss = pss = 0
    with open("/proc/%d/smaps_rollup" % pid) as f:
        for ln in f:
            if ln.startswith("Rss:"):
                rss = int(ln.split()[1]) << 10
            elif ln.startswith("Pss:"):
                pss = int(ln.split()[1]) << 10
    return rss, pss


def spares(data):
    """The spare clones there are now: (count, PSS bytes of their QEMUs together)."""
    vms = os.path.join(data, "vms")
    n = pss = 0
    for d in os.listdir(vms):
        p = os.path.join(vms, d)
        if not d.startswith(".pool-") or os.path.islink(p) or not os.path.isdir(p):
            continue
        try:
            pss += mem_of(qemu_pid(data, d))[1]
            n += 1
        except (OSError, ValueError):
            pass  # being made (no QEMU yet) or going
    return n, pss


def settle(data, quiet=10.0, limit=180.0):
    """Waits until the spare clones' count has not changed for quiet seconds (the pool made
    what it wanted), at most limit seconds."""
    end = time.monotonic() + limit
    last, since = None, time.monotonic()
    while time.monotonic() < end:
        n = spares(data)[0]
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        time.sleep(0.5)


def print_spares(data, when):
    n, pss = spares(data)
    print("%-52s %d, PSS %.0f MB together" % ("spare clones " + when, n, pss / 1e6), flush=True)


def concurrent(s, starts):
    """One create -> first command per start time (seconds from now), each on its own
    connection: (wall ms until all answered, [(ms, id)]); failures are printed."""
    res, errs = [], []
    t0 = time.perf_counter()

    def one(at):
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        try:
            res.append(Api(s).create_first_cmd(wait=not POLL))
        except Exception as e:  # noqa: BLE001 - report, do not hang the bench
            errs.append(repr(e))

    ths = [threading.Thread(target=one, args=(at,)) for at in starts]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if errs:
        print("%-52s %d of %d: %s" % ("creates that failed", len(errs), len(starts), errs[0][:200]),
              flush=True)
    assert res, errs
    return (time.perf_counter() - t0) * 1000, res


def burst_cases(api, s, data):
    """A burst on the pool as it is, again once the pool has grown, then a steady rate."""
    for label in ("burst (pool as left)", "burst (pool refilled after a burst)"):
        settle(data)
        print_spares(data, "before " + label)
        total, res = concurrent(s, [0.0] * N_BURST)
        ms = [r[0] for r in res]
        line("%s: each create -> first command" % label, ms)
        print("%-52s %8.0f ms total, per-create median %.0f ms" % (
            "%s: %d concurrent, all answered" % (label, N_BURST), total, statistics.median(ms)),
            flush=True)
        for _, sid in res:
            api.delete(sid)
    n = int(RATE * RATE_S)
    # the rate case's sandboxes all run at once: the default team's quota (100 running) must
    # leave room for them beside the warm-up sandbox
    s.cli("teams", "set-quota", "default", "--sandboxes", str(n + 10))
    for label in ("pool as left", "pool refilled after the rate"):
        settle(data)
        print_spares(data, "before the steady rate (%s)" % label)
        total, res = concurrent(s, [i / RATE for i in range(n)])
        line("%.0f/s for %.0f s (%s): each create -> first command" % (RATE, RATE_S, label),
             [r[0] for r in res])
        print_spares(data, "after the steady rate (%s)" % label)
        for _, sid in res:
            api.delete(sid)


def mem_available():
    with open("/proc/meminfo") as f:
        for ln in f:
            if ln.startswith("MemAvailable:"):
                return int(ln.split()[1]) << 10
    return 0


def snapshot_bytes(data, sid):
    d = os.path.join(data, "vms", sid)
    n = os.path.getsize(os.path.join(d, "snapshot", "devstate"))
    ram = os.path.join(d, "mem.ram")
    alloc = os.stat(ram).st_blocks * 512 if os.path.exists(ram) else 0
    return n, alloc


def cmdline(pid):
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


class Qmp:
    """Just enough QMP for the floor: one command at a time, events skipped."""

    def __init__(self, path, proc):
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.sock.close()
                if proc.poll() is not None:
                    raise AssertionError("qemu exited %d" % proc.returncode)
                time.sleep(0.001)
        self.f = self.sock.makefile("rb")
        self.f.readline()  # greeting
        self.cmd("qmp_capabilities")

    def cmd(self, name, **args):
        self.sock.sendall(json.dumps({"execute": name, "arguments": args}).encode() + b"\n")
        while True:
            r = json.loads(self.f.readline())
            if "return" in r:
                return r["return"]
            if "error" in r:
                raise AssertionError("%s: %s" % (name, r["error"]))

    def close(self):
        self.f.close()
        self.sock.close()


def floor_restore(data, sid, n):
    """QEMU alone: a live clone's command line with its per-VM paths moved to a temp dir, the
    template's device state on an inherited fd; the same QMP steps the driver takes (capability,
    migrate-incoming, wait, cont), no IDENTITY. Returns (ms to agent HELLO, ms to first `true`)
    lists, both from QEMU's start; the overlay is made before the clock starts."""
    argv = cmdline(qemu_pid(data, sid))
    vdir = os.path.join(data, "vms", sid)
    origin = os.path.join(vdir, "pool.origin")  # a taken spare's QEMU names its old dir
    if os.path.exists(origin):
        with open(origin) as f:
            old = f.read().strip()
        argv = [x.replace(old + "/", vdir + "/") for x in argv]
    with open(os.path.join(vdir, "vm.json")) as f:
        src = json.load(f)["ram_src"]
    hello, first = [], []
    for i in range(n):
        tmp = tempfile.mkdtemp(prefix="sp-floor-", dir="/tmp")
        try:
            disk = os.path.join(tmp, "disk.qcow2")
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b",
                            os.path.join(src, "disk.qcow2"), disk], check=True)
            a = [x.replace(vdir + "/", tmp + "/") for x in argv]
            # a jailed QEMU got its sockets as listening fds (core/runtime/qemu/confine.c);
            # alone it binds them itself
            a = ["socket,id=qmp0,path=%s/qmp.sock,server=on,wait=off" % tmp
                 if x.startswith("socket,id=qmp0,fd=") else
                 "socket,id=agent,path=%s/agent.sock,server=on,wait=off" % tmp
                 if x.startswith("socket,id=agent,fd=") else x for x in a]
            # and the template's RAM as a sealed memfd through its /proc: alone, the file
            a = [re.sub(r"mem-path=/proc/self/fd/\d+", "mem-path=%s/mem.ram" % src, x)
                 for x in a]
            sock = os.path.join(tmp, "agent.sock")
            dev = os.open(os.path.join(src, "snapshot", "devstate"), os.O_RDONLY)
            t0 = time.perf_counter()
            p = subprocess.Popen(a, pass_fds=(dev,), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            os.close(dev)
            try:
                q = Qmp(os.path.join(tmp, "qmp.sock"), p)
                q.cmd("migrate-set-capabilities",
                      capabilities=[{"capability": "x-ignore-shared", "state": True}])
                q.cmd("migrate-incoming", uri="fd:%d" % dev)
                while q.cmd("query-status")["status"] == "inmigrate":
                    time.sleep(0.001)
                q.cmd("cont")
                w = AgentWire(sock)
                hello.append((time.perf_counter() - t0) * 1000)
                w.run("true")
                first.append((time.perf_counter() - t0) * 1000)
                w.close()
                q.close()
            finally:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return hello, first


def psql(pg, db, sql):
    subprocess.run([os.path.join(pg.bindir, "psql"), "-q", "-v", "ON_ERROR_STOP=1", "-d",
                    pg.db_url(db), "-c", sql], check=True, stdout=subprocess.DEVNULL)


def size_dirs(data, mem):
    """The template snapshots of base at 1 vCPU and mem MiB (any build, any accelerator)."""
    return sorted({os.path.realpath(d) for d in glob.glob(
        os.path.join(data, "templates", "base", "*", "snapshot-*-%dM-1c-*" % mem))})


def sizes_case(binary, data, pg, db, seen, unseen):
    """The first create of each size of seen (a row of it in the last day) and of unseen (none),
    on binary's spaced with a database of its own: (seen ms list, unseen ms list, whether the
    seen ones' snapshots were there before their creates)."""
    for mem in seen + unseen:
        for d in size_dirs(data, mem):
            shutil.rmtree(d)
    subprocess.run([binary, "template", "build", "base", "--data-dir", data], check=True,
                   stdout=subprocess.DEVNULL)
    pg.createdb(db)
    sp = Spaced(binary=binary, data_dir=data, database_url=pg.db_url(db))
    try:
        sp.key = sp.cli("keys", "create").stdout.strip()
        sp.start()  # the schema and the built-in templates' rows
        sp.stop()
        for i, mem in enumerate(seen):
            psql(pg, db, "INSERT INTO sandboxes (id, team_id, template, cpu_count, memory_mb,"
                 " access_token, observed_state, desired_state, created_at) SELECT"
                 " 'seen%d', id, 'base', 1, %d, 'tokseen%d', 'deleted', 'deleted',"
                 " now() - interval '1 hour' FROM teams LIMIT 1" % (i, mem, i))
        sp.start()
        end = time.monotonic() + 60
        while time.monotonic() < end and not all(size_dirs(data, m) for m in seen):
            time.sleep(0.5)
        ahead = all(size_dirs(data, m) for m in seen)
        settle(data, quiet=3.0, limit=30.0)
        time.sleep(2)
        api = Api(sp)
        out = []
        for mems in (seen, unseen):
            ms = []
            for mem in mems:
                t, sid = api.create_first_cmd(memory_mb=mem, cpu_count=1)
                ms.append(t)
                api.delete(sid)
                settle(data, quiet=2.0, limit=30.0)
            out.append(ms)
        return out[0], out[1], ahead
    finally:
        sp.destroy()
        for mem in seen + unseen:
            for d in size_dirs(data, mem):
                shutil.rmtree(d, ignore_errors=True)


def sizes_cases(p):
    """The first create of a new size, on BENCH_BASE's build (if given) and on this one."""
    n = int(os.environ.get("BENCH_SIZES", "3"))
    seen = [352 + 32 * i for i in range(n)]
    unseen = [352 + 32 * (n + i) for i in range(n)]
    runs = []
    base = os.environ.get("BENCH_BASE")
    if base:
        runs.append(("base", os.path.join(os.path.abspath(base), "server", "spaced")))
    runs.append(("this", p.spaced))
    res = {}
    for label, binary in runs:
        s_ms, u_ms, ahead = sizes_case(binary, p.data, p.pg, "sizes_%s" % label, seen, unseen)
        res[label] = (s_ms, u_ms)
        line("%s: first create, size seen (snapshot %s)" % (
            label, "built ahead" if ahead else "not built ahead"), s_ms)
        line("%s: first create, size never seen (builds)" % label, u_ms)
    s_ms, u_ms = res["this"]
    ratio("this: seen / never seen (medians)", statistics.median(s_ms), statistics.median(u_ms))
    if base:
        ratio("size seen: this / base (medians)", statistics.median(s_ms),
              statistics.median(res["base"][0]))
        ratio("size never seen: this / base (medians)", statistics.median(u_ms),
              statistics.median(res["base"][1]))


def main():
    p = Platform(sys.argv, templates=("base",), drop_env=("SPACE_COLD_BOOT",)).start()
    data, spaced, s, pg = p.data, p.spaced, p.s, p.pg
    cold = nop = None
    try:
        api = Api(s)
        print("space lifecycle benchmarks (accelerator: %s)" % open(
            os.path.join(data, "vms", "accel")).readline().strip()
            if os.path.exists(os.path.join(data, "vms", "accel")) else "", flush=True)

        # Warm-up: the first create of a data dir probes the accelerator and, with no template
        # snapshot yet, cold-boots the builder and snapshots it.
        t0 = time.perf_counter()
        warm = api.create()
        print("%-52s %8.0f ms" % ("first create (probe + template snapshot if none)",
                                  (time.perf_counter() - t0) * 1000), flush=True)
        if ONLY == "burst":
            burst_cases(api, s, data)
            return
        if ONLY == "sizes":
            api.delete(warm)
            s.stop()
            sizes_cases(p)
            return

        if ONLY != "steady":  # the steady figures only: 4 to 6 below
            # 1. create -> first command from the template snapshot: a spare clone ready, and back
            #    to back
            clone = api.creates(N_CREATES, GAP)
            line("create -> first command, spare clone ready", clone)
            time.sleep(GAP)
            b2b = api.creates(N_CREATES)
            line("create -> first command, back to back", b2b)

            # 2. QEMU alone restoring the same snapshot (the floor), argv of the warm clone
            hello, first = floor_restore(data, warm, N_FLOOR)
            line("QEMU alone: start -> agent HELLO (floor)", hello)
            line("QEMU alone: start -> first `true` (floor)", first)

            # 3. 20 concurrent creates
            res, errs = [], []

            def one():
                a = Api(s)
                try:
                    res.append(a.create_first_cmd())
                except Exception as e:  # noqa: BLE001 - report, do not hang the bench
                    errs.append(repr(e))

            ths = [threading.Thread(target=one) for _ in range(N_CONC)]
            t0 = time.perf_counter()
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            total = (time.perf_counter() - t0) * 1000
            assert not errs, errs
            line("concurrent creates: each create -> first command", [r[0] for r in res])
            print("%-52s %8.0f ms total   vs %d x single median = %.0f ms   (%.2fx)" % (
                "%d concurrent creates -> all answered" % N_CONC, total, N_CONC,
                N_CONC * statistics.median(clone), total / (N_CONC * statistics.median(clone))),
                flush=True)
            for _, sid in res:
                api.delete(sid)

            # 3b. bursts and a steady rate on the adaptive pool
            burst_cases(api, s, data)

        # 4. pause / wake
        pz, wk = [], []
        for _ in range(N_PAUSE):
            pz.append(api.verb(warm, "pause"))
            wk.append(api.verb(warm, "wake"))
        line("pause (API, wait=finished)", pz)
        line("wake from pause (API)", wk)

        # 5. suspend / wake, 256 MiB and 1 GiB clones
        for mem in (256, 1024):
            t0 = time.perf_counter()
            sid = api.create(memory_mb=mem)
            made = (time.perf_counter() - t0) * 1000
            api.run(sid, "echo hello > /root/mark")
            s1 = api.verb(sid, "suspend")
            b1 = snapshot_bytes(data, sid)
            w1 = api.verb(sid, "wake")
            later_s, later_w, later_b = [], [], None
            for _ in range(N_SUSPEND):
                later_s.append(api.verb(sid, "suspend"))
                later_b = snapshot_bytes(data, sid)
                later_w.append(api.verb(sid, "wake"))
            out = api.run(sid, "cat /root/mark")
            print("%d MiB clone: create %.0f ms; first suspend %.0f ms, snapshot %.1f MB; first "
                  "wake %.0f ms" % (mem, made, s1, (b1[0] + b1[1]) / 1e6, w1), flush=True)
            line("  %d MiB later suspend" % mem, later_s)
            line("  %d MiB later wake" % mem, later_w)
            print("  %d MiB later snapshot: device state + RAM delta %.1f MB, RAM file %.1f MB "
                  "allocated; marker=%s" % (mem, later_b[0] / 1e6, later_b[1] / 1e6,
                                           json.dumps(out.get("stdout", out))[:40]), flush=True)
            api.delete(sid)

        # 6. density: N idle clones
        api.delete(warm)
        time.sleep(1)
        avail0 = mem_available()
        ids = [api.create() for _ in range(N_DENSITY)]
        time.sleep(10)  # idle
        mems = [mem_of(qemu_pid(data, sid)) for sid in ids]
        avail1 = mem_available()
        rss = [m[0] / 1e6 for m in mems]
        pss = [m[1] / 1e6 for m in mems]
        per = (avail0 - avail1) / len(ids)
        line("idle clone QEMU RSS", rss, "MB")
        line("idle clone QEMU PSS", pss, "MB")
        print("%-52s %.1f MB per clone (MemAvailable %.1f -> %.1f GB for %d)" % (
            "host MemAvailable drop", per / 1e6, avail0 / 1e9, avail1 / 1e9, len(ids)), flush=True)
        print("%-52s about %d (by PSS), %d (by MemAvailable drop); CPU is the limit once they "
              "work" % ("idle clones that fit in MemAvailable", avail0 / (statistics.median(pss)
                                                                         * 1e6),
                        avail0 / per if per > 0 else 0), flush=True)
        for sid in ids:
            api.delete(sid)

        spares = [d for d in os.listdir(os.path.join(data, "vms")) if d.startswith(".pool-")
                  and os.path.isdir(os.path.join(data, "vms", d))
                  and not os.path.islink(os.path.join(data, "vms", d))]
        sm = [mem_of(qemu_pid(data, d)) for d in spares]
        print("%-52s %d kept, RSS %s MB, PSS %s MB" % (
            "spare clones (all sizes created from)", len(sm),
            "/".join("%.0f" % (m[0] / 1e6) for m in sm),
            "/".join("%.0f" % (m[1] / 1e6) for m in sm)), flush=True)

        if ONLY == "steady":
            return

        # 7. baseline: the same creates without spares (spaced with SPACE_POOL_SIZE=0)
        s.stop()
        nop = Spaced(binary=spaced, data_dir=data, database_url=pg.url,
                     env={"SPACE_POOL_SIZE": "0"})
        nop.key = s.key
        nop.start()
        napi = Api(nop)
        nopool = napi.creates(N_CREATES, GAP)
        line("create -> first command, no spare (baseline)", nopool)
        ratio("no spare / spare clone ready (medians)", statistics.median(nopool),
              statistics.median(clone))
        nop.stop()

        # 8. baselines: cold boots (spaced with SPACE_COLD_BOOT=1, same data dir and database)
        cold = Spaced(binary=spaced, data_dir=data, database_url=pg.url,
                      env={"SPACE_COLD_BOOT": "1"})
        cold.key = s.key
        cold.start()
        capi = Api(cold)
        cb = capi.creates(N_COLD)
        line("create -> first command, cold boot (baseline)", cb)
        ratio("cold boot / spare clone ready (medians)", statistics.median(cb),
              statistics.median(clone))
        ratio("spare clone ready / QEMU-alone floor (medians)", statistics.median(clone),
              statistics.median(first))
        ratio("no spare / QEMU-alone floor (medians)", statistics.median(nopool),
              statistics.median(first))
        cids = [capi.create() for _ in range(N_DENSITY_COLD)]
        time.sleep(10)
        cm = [mem_of(qemu_pid(data, sid)) for sid in cids]
        line("idle cold-booted QEMU RSS (baseline)", [m[0] / 1e6 for m in cm], "MB")
        line("idle cold-booted QEMU PSS (baseline)", [m[1] / 1e6 for m in cm], "MB")
        for sid in cids:
            capi.delete(sid)
        cold.stop()

        # 9. the first create of a new size: seen in the last day (built ahead) or never
        sizes_cases(p)
    finally:
        s.destroy()
        if nop is not None:
            nop.destroy()
        if cold is not None:
            cold.destroy()
        pg.destroy()


if __name__ == "__main__":
    main()
