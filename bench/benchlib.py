"""What the bench scripts share: percentiles and result lines, the platform they measure (a
built template, a private PostgreSQL and one spaced of the given build on a data dir), and a
template build waited for.

    p = Platform(sys.argv, templates=("base",)).start()  # p.s: harness.Spaced, p.data
    try:
        ...
    finally:
        p.stop()
"""
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import harness  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def line(name, xs, unit="ms", width=52):
    print("%-*s median %8.2f %s   p99 %8.2f %s   (n=%d)" % (
        width, name, statistics.median(xs), unit, pct(xs, 99), unit, len(xs)), flush=True)


def ratio(name, a, b, width=52):
    print("%-*s %.2fx" % (width, name, a / b), flush=True)


def build_template(s, body):
    """POST /v1/templates with body and waits for the build to end (5 minutes a wait): (ms it
    took, the build). Stops the bench when the build is refused or fails."""
    t0 = time.time()
    st, r = s.request("POST", "/v1/templates?wait=300", body, timeout=330)
    if "build" not in r:
        raise SystemExit("build refused: %s %s" % (st, r))
    b = r["build"]
    while b["status"] in ("queued", "building"):
        st, r = s.request("GET", "/v1/templates/%s/builds/%s?wait=300" % (b["template"], b["id"]),
                          timeout=330)
        b = r["build"]
    if b["status"] != "succeeded":
        raise SystemExit("build failed: %s" % b)
    return (time.time() - t0) * 1000, b


def clear_leftovers(data):
    """Removes what earlier runs left in DATA_DIR that no database knows any more (each run has
    a PostgreSQL of its own): sandboxes' VM directories whose QEMU is gone, and sandbox
    snapshots. They would skew this run: spaced re-reads them at start, and a suspended one's
    files stay in its scans. Templates stay (cached builds). Returns how many went."""
    n = 0
    vms = os.path.join(data, "vms")
    for d in sorted(os.listdir(vms)) if os.path.isdir(vms) else []:
        p = os.path.join(vms, d)
        if d == "accel" or os.path.islink(p) or not os.path.isdir(p):
            continue
        try:
            with open(os.path.join(p, "qemu.pid")) as f:
                pid = int(f.read().strip())
            os.kill(pid, 0)
            continue  # a QEMU still runs in it: not ours to remove
        except (OSError, ValueError):
            pass
        shutil.rmtree(p, ignore_errors=True)
        n += 1
    snaps = os.path.join(data, "snapshots")
    for d in os.listdir(snaps) if os.path.isdir(snaps) else []:
        shutil.rmtree(os.path.join(snaps, d), ignore_errors=True)
        n += 1
    return n


class Platform:
    """argv: [script, BUILD_DIR, DATA_DIR?]. Builds the templates (cached when unchanged),
    clears what earlier runs left (clear_leftovers), starts PostgreSQL and BUILD_DIR's spaced
    with one key; stops both on exit."""

    def __init__(self, argv, templates=("base",), env=None, drop_env=()):
        if len(argv) < 2:
            raise SystemExit("usage: %s BUILD_DIR [DATA_DIR]" % os.path.basename(argv[0]))
        self.build = os.path.abspath(argv[1])
        self.data = os.path.abspath(argv[2] if len(argv) > 2 else
                                    os.path.join(self.build, "bench-data"))
        self.spaced = os.path.join(self.build, "server", "spaced")
        self.templates, self.env, self.drop_env = templates, env, drop_env
        self.p = self.pg = self.s = None

    def start(self):
        os.makedirs(self.data, exist_ok=True)
        for t in self.templates:
            t0 = time.time()
            subprocess.run([self.spaced, "template", "build", t, "--data-dir", self.data],
                           check=True, stdout=subprocess.DEVNULL)
            print("template %s ready in %.1f s (cached when unchanged)" % (t, time.time() - t0),
                  flush=True)
        n = clear_leftovers(self.data)
        if n:
            print("removed %d VM and snapshot directories earlier runs left" % n, flush=True)
        # PostgreSQL, spaced and a key of the default team (harness.Platform), started once
        # the environment is as asked
        self.p = harness.Platform(teams=(None,), start=False, binary=self.spaced,
                                  data_dir=self.data, env=self.env)
        self.pg, self.s = self.p.pg, self.p.s
        try:
            for k in self.drop_env:
                self.s.env.pop(k, None)
            # more `serve` options for a look inside, e.g. BENCH_SPACED_ARGS="--log-level debug"
            self.s.args += os.environ.get("BENCH_SPACED_ARGS", "").split()
            self.s.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        if self.p is not None:
            self.p.destroy()
