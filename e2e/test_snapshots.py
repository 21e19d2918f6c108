"""Sandbox snapshots ("forks") through the native API (core/control/snap.h), on real VMs.

A sandbox runs a Python process that counts in memory and has a file on its disk. A snapshot is
taken while it runs (it keeps running and answering); three sandboxes created from the snapshot
each have the file as it was at the snapshot, the counter going on from the snapshot's count on
its own (stopping one leaves the others counting), different /dev/urandom bytes and their own
ids and hostnames, and the create's env merged over the source's. Snapshots survive a restart
of spaced (listed, and a fork made after it works). Deleting the snapshot refuses new forks
(404) while the forks already made keep running and can be suspended and woken (their disk
backs onto the deleted snapshot's, kept until the last of them is gone, then removed from the
data dir). Another team neither sees nor uses it. A snapshot of a sandbox whose process writes
every page of 32 MiB as fast as it can is copied live ("exact") and its forks find every page
as one pass of the writer left it; so is it after a restart of spaced (its QEMU adopted).
Needs root and SP_TEST_DATA_DIR (the e2e data dir with `base` built).
"""
import json
import os
import signal
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, VmSuite, wait_s  # noqa: E402
from test_vm_api import skip_reason  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")

COUNTER = ("nohup python3 -c 'import os, time\nopen(\"/tmp/count.pid\", \"w\").write(str(os.getpid()))"
           "\ni = 0\nwhile True:\n    i += 1\n"
           "    open(\"/tmp/count.tmp\", \"w\").write(str(i))\n"
           "    os.rename(\"/tmp/count.tmp\", \"/tmp/count\")\n"
           "    time.sleep(0.1)' >/dev/null 2>&1 &")

# Writes every page of 32 MiB in turn, as fast as it can, checking first that each holds
# what its last pass wrote: a snapshot that kept a page older (or newer) than the rest shows
# as errors in its forks. /tmp/w: passes done, errors seen.
WRITER = ("nohup python3 -c 'import os, struct\nn = 8192\nb = bytearray(n * 4096)\n"
          "i = err = 0\nwhile True:\n"
          "    for k in range(0, n * 4096, 4096):\n"
          "        if struct.unpack_from(\"Q\", b, k)[0] != i:\n            err += 1\n"
          "        struct.pack_into(\"Q\", b, k, i + 1)\n"
          "    i += 1\n"
          "    open(\"/tmp/w.tmp\", \"w\").write(\"%d %d\" % (i, err))\n"
          "    os.rename(\"/tmp/w.tmp\", \"/tmp/w\")' >/dev/null 2>&1 &")


def passes(s, sid):
    c = s.command(sid, "for i in $(seq 1 100); do [ -s /tmp/w ] && break; sleep 0.2; done;"
                       " cat /tmp/w")
    done, err = c["stdout"].split()
    return int(done), int(err)


def count(s, sid):
    c = s.command(sid, "for i in $(seq 1 100); do [ -s /tmp/count ] && break; sleep 0.2; done;"
                       " cat /tmp/count")
    return int(c["stdout"].strip())


def rising(s, sid):
    a = count(s, sid)
    deadline = time.time() + 20 * MULT
    while time.time() < deadline:
        time.sleep(0.5)
        b = count(s, sid)
        if b > a:
            return a, b
    raise AssertionError("counter stuck at %d in %s" % (a, sid))


@unittest.skipIf(skip_reason(), skip_reason())
class SnapshotTest(VmSuite):
    TEAMS = ("alpha", "beta")

    def delete(self, sid):
        st, r = self.s.request("DELETE", "/v1/sandboxes/%s?wait=%d" % (sid, wait_s(60)),
                               timeout=90 * MULT)
        self.assertEqual(st, 200, r)

    def test_forks(self):
        s = self.s
        src = self.create(template="base", env={"WHO": "source", "KEEP": "yes"})
        s.command(src, COUNTER)
        s.command(src, "echo at-snapshot > /home/user/state.txt")
        rising(s, src)
        st, r = s.request("POST", "/v1/sandboxes/%s/snapshots?wait=%d" % (src, wait_s(120)),
                          {"name": "agent-ready"}, timeout=150 * MULT)
        self.assertEqual(st, 201, r)
        snap = r["snapshot"]
        self.assertEqual((snap["state"], snap["sandbox_id"], snap["name"]),
                         ("ready", src, "agent-ready"), snap)
        self.assertEqual(r["operation"]["status"], "succeeded", r)
        self.assertTrue(os.path.isdir(os.path.join(DATA, "snapshots", snap["id"])))
        at_snap = count(s, src)
        # the source goes on: running, answering, changing its file
        s.command(src, "echo after > /home/user/state.txt")
        st, sb = s.request("GET", "/v1/sandboxes/" + src)
        self.assertEqual(sb["state"], "running", sb)

        forks = [self.create(snapshot=snap["id"], env={"WHO": "fork-%d" % i}) for i in range(3)]
        rnd = set()
        for i, f in enumerate(forks):
            c = s.command(f, "cat /home/user/state.txt; hostname; echo $WHO $KEEP")
            self.assertEqual(c["stdout"], "at-snapshot\n%s\nfork-%d yes\n" % (f, i), c)
            a, _ = rising(s, f)
            self.assertGreaterEqual(a, at_snap - 50)  # from the snapshot's count, not from 0
            rnd.add(s.command(f, "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")["stdout"])
        self.assertEqual(len(rnd), 3, rnd)
        self.assertEqual(len(set(forks) | {src}), 4)
        s.command(forks[0], "kill $(cat /tmp/count.pid)")
        time.sleep(0.5)
        stopped = count(s, forks[0])
        rising(s, forks[1])
        self.assertEqual(count(s, forks[0]), stopped)

        # another team: nothing
        other = self.p.keys["beta"]
        self.assertEqual(s.request("GET", "/v1/snapshots/" + snap["id"], key=other)[0], 404)
        st, r = s.request("POST", "/v1/sandboxes", {"snapshot": snap["id"]}, key=other)
        self.assertEqual(st, 404, r)

        # a restart of spaced: the snapshot is still there and forks
        s.kill(signal.SIGKILL)
        s.start()
        st, lst = s.request("GET", "/v1/snapshots?sandbox_id=" + src)
        self.assertEqual([x["id"] for x in lst["snapshots"]], [snap["id"]], lst)
        late = self.create(snapshot=snap["id"])
        self.assertEqual(s.command(late, "cat /home/user/state.txt")["stdout"], "at-snapshot\n")
        self.delete(late)

        # delete: no new forks; the made ones run on, suspend and wake
        st, r = s.request("DELETE", "/v1/snapshots/" + snap["id"])
        self.assertEqual(st, 200, r)
        st, r = s.request("POST", "/v1/sandboxes", {"snapshot": snap["id"]})
        self.assertEqual(st, 404, r)
        f = forks[1]
        st, r = s.request("POST", "/v1/sandboxes/%s/suspend?wait=%d" % (f, wait_s(120)),
                          timeout=150 * MULT)
        self.assertEqual((st, r["sandbox"]["state"]), (200, "suspended"), r)
        st, r = s.request("POST", "/v1/sandboxes/%s/wake?wait=%d" % (f, wait_s(120)),
                          timeout=150 * MULT)
        self.assertEqual((st, r["sandbox"]["state"]), (200, "running"), r)
        rising(s, f)
        self.assertEqual(s.command(f, "cat /home/user/state.txt")["stdout"], "at-snapshot\n")
        self.assertTrue(os.path.isdir(os.path.join(DATA, "snapshots", snap["id"])))
        for x in forks:
            self.delete(x)
        deadline = time.time() + 10 * MULT
        while os.path.isdir(os.path.join(DATA, "snapshots", snap["id"])) and \
                time.time() < deadline:
            time.sleep(0.2)
        self.assertFalse(os.path.isdir(os.path.join(DATA, "snapshots", snap["id"])))
        self.delete(src)

    def test_snapshot_of_a_busy_writer(self):
        # The snapshot is taken while the writer dirties pages as fast as it can: its RAM
        # is copied while the vCPUs run, the last pages read from QEMU's own memory once
        # they stop ("exact"). Each fork must go on from one consistent instant.
        s = self.s
        src = self.create(template="base")
        s.command(src, WRITER)
        deadline = time.time() + 60 * MULT
        while passes(s, src)[0] < 3:
            self.assertLess(time.time(), deadline, "the writer does not get going")
            time.sleep(0.3)
        sid = self.exact_snapshot(src)
        forks = [self.create(snapshot=sid) for _ in range(2)]
        self.writers_intact(forks + [src])
        for x in forks:
            self.delete(x)
        # spaced killed and started again: the sandbox's QEMU, adopted, maps the copy of the
        # template's memory the last spaced made, and its snapshot is still exact
        s.kill(signal.SIGKILL)
        s.start()
        again = self.exact_snapshot(src)
        late = self.create(snapshot=again)
        self.writers_intact([late, src])
        for x in (late, src):
            self.delete(x)
        for x in (sid, again):
            st, r = s.request("DELETE", "/v1/snapshots/" + x)
            self.assertEqual(st, 200, r)

    def exact_snapshot(self, src):
        st, r = self.s.request("POST", "/v1/sandboxes/%s/snapshots?wait=%d" % (src, wait_s(120)),
                               {}, timeout=150 * MULT)
        self.assertEqual(st, 201, r)
        sid = r["snapshot"]["id"]
        with open(os.path.join(DATA, "snapshots", sid, "vm.json")) as f:
            vmj = json.load(f)
        self.assertEqual(vmj["ram_copy"], "exact", vmj)
        return sid

    def writers_intact(self, sids):
        for x in sids:
            start = passes(self.s, x)[0]
            deadline = time.time() + 90 * MULT
            while True:
                done, err = passes(self.s, x)
                self.assertEqual(err, 0, "%s: %d pages not as the writer left them" % (x, err))
                if done >= start + 2:  # every page checked at least once since
                    break
                self.assertLess(time.time(), deadline, "%s: the writer stopped at %d" % (x, done))
                time.sleep(0.3)


if __name__ == "__main__":
    unittest.main(verbosity=2)
