#!/usr/bin/env python3
"""What the jailer costs a create: create -> first command with every QEMU jailed (the default)
and with `--no-jail`, in alternating rounds on the same data dir and database.

  bench/jail_bench.py BUILD_DIR [DATA_DIR]

Two paths, each A/B:
  - no spare (SPACE_POOL_SIZE=0): each create starts a QEMU restoring the template snapshot, so
    the jail (plan, clone into namespaces, mounts, pivot_root, dropping privileges) is on the
    path of every create;
  - spare clone ready (the default pool): the spare's QEMU was started (jailed) before the
    create; the create renames and starts it.
Also the spawn itself from spaced's debug log (`qemu spawned ... spawn_us=`): jailed, up to
QEMU's exec; unjailed, the fork; and, in the spare rounds, a sandbox's suspend and its wake
(a new QEMU, jailed or not), BENCH_SUSPENDS times each. Medians; machines here are shared and
noisy.
Environment: BENCH_CREATES (15 per mode and round), BENCH_ROUNDS (2), BENCH_GAP (1.0 s),
BENCH_SUSPENDS (5 per round).
"""
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from benchlib import Platform, line  # noqa: E402
from harness import Spaced  # noqa: E402
from lifecycle_bench import Api  # noqa: E402

N = int(os.environ.get("BENCH_CREATES", "15"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
GAP = float(os.environ.get("BENCH_GAP", "1.0"))
SUSPENDS = int(os.environ.get("BENCH_SUSPENDS", "5"))


def run(p, jail, pool):
    env = {} if pool else {"SPACE_POOL_SIZE": "0"}
    args = ["--log-level", "debug"] + ([] if jail else ["--no-jail"])
    s = Spaced(binary=p.spaced, data_dir=p.data, database_url=p.pg.url, env=env, args=args)
    s.key = p.s.key
    s.start()
    try:
        api = Api(s)
        api.delete(api.create())  # warm: snapshot verdicts, the sealed template RAM, spares
        time.sleep(GAP)
        ms = api.creates(N, GAP if pool else 0.0)
        sus, wake = [], []
        if pool:  # suspend and wake of one sandbox: the wake starts a new QEMU (jailed or not)
            sid = api.create()
            api.run(sid, "true")
            for _ in range(SUSPENDS):
                sus.append(api.verb(sid, "suspend"))
                wake.append(api.verb(sid, "wake"))
                api.run(sid, "true")
            api.delete(sid)
    finally:
        s.stop()
    with open(s.log_path) as f:
        us = [int(x) for x in re.findall(r"qemu spawned .* spawn_us=(\d+)", f.read())]
    return ms, us, sus, wake


def main():
    p = Platform(sys.argv, templates=("base",), drop_env=("SPACE_COLD_BOOT",)).start()
    p.s.stop()
    res = {}
    try:
        for pool in (False, True):
            for _ in range(ROUNDS):
                for jail in (True, False):
                    got = run(p, jail, pool)
                    k = (pool, jail)
                    had = res.get(k, ([], [], [], []))
                    res[k] = tuple(a + b for a, b in zip(had, got))
        for pool in (False, True):
            name = "spare clone ready" if pool else "no spare"
            on, off = res[(pool, True)], res[(pool, False)]
            line("create -> first command, %s, jailed" % name, on[0])
            line("create -> first command, %s, --no-jail" % name, off[0])
            print("%-52s %+8.1f ms" % ("  jailed - unjailed (medians)",
                                        statistics.median(on[0]) - statistics.median(off[0])),
                  flush=True)
            if on[1] and off[1]:
                line("  QEMU spawn, jailed (up to exec)", [u / 1000 for u in on[1]])
                line("  QEMU spawn, --no-jail (fork)", [u / 1000 for u in off[1]])
            for i, verb in ((2, "suspend"), (3, "wake from suspend")):
                if on[i] and off[i]:
                    line("%s, jailed" % verb, on[i])
                    line("%s, --no-jail" % verb, off[i])
                    print("%-52s %.2fx" % ("  jailed / unjailed (medians)",
                                           statistics.median(on[i]) / statistics.median(off[i])),
                          flush=True)
    finally:
        p.stop()


if __name__ == "__main__":
    main()
