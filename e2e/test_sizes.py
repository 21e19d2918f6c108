"""Template snapshots built ahead for the sizes users ask for (core/control/sizes.h, the QEMU
driver's prepare in core/runtime/qemu/ahead.c), on real VMs.

A create of a size nobody asked for before builds its template snapshot and says so in its
operation's progress while it waits (and keeps it once done). The sandbox is deleted; spaced
stops, and that size's snapshot goes (as a new template version or QEMU binary would make it
go); spaced starts again on the same database. The sizes of the last day's creates, read from
the sandboxes' rows, drive a build of the missing snapshot in the background, with nothing
else booting; the next create of that size then builds nothing (the build counter of the new
process stays where the ahead build left it) and its operation tells of no wait. Needs root
and SP_TEST_DATA_DIR (the e2e data dir with `base` built).
"""
import glob
import os
import re
import shutil
import sys
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, VmSuite, free_port, wait_s, wait_until  # noqa: E402
from test_vm_api import skip_reason  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
MEM = 320  # MiB: a size no other suite creates (its snapshot is removed at the end)


def snapshot_dirs():
    """The committed snapshots of base at the test's size (templates/base/current is a link to
    one of the builds: each counted once)."""
    return sorted({os.path.realpath(d) for d in glob.glob(
        os.path.join(DATA, "templates", "base", "*", "snapshot-*-%dM-1c-*" % MEM))})


def remove_snapshots():
    for d in snapshot_dirs():
        shutil.rmtree(d)


@unittest.skipIf(skip_reason(), skip_reason())
class SizesTest(VmSuite):
    @classmethod
    def setUpClass(cls):
        remove_snapshots()  # an earlier run's, unused
        cls.mport = free_port()
        cls.ARGS = ("--metrics-listen", "127.0.0.1:%d" % cls.mport)
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        remove_snapshots()

    def metric(self, family, labels):
        """One sample of /metrics (0 when absent)."""
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.mport, timeout=30) as r:
            text = r.read().decode()
        m = re.search(r"^%s\{%s\} (\S+)$" % (re.escape(family), re.escape(labels)), text, re.M)
        return float(m.group(1)) if m else 0.0

    def builds(self):
        return self.metric("space_template_snapshot_builds_total", 'outcome="success"')

    def create_watched(self):
        """Creates a sandbox of the test's size and polls its operation until it ends: (its
        id, the operation as it ended, the progress seen while it was still running)."""
        st, r = self.s.request("POST", "/v1/sandboxes", {"template": "base", "memory_mb": MEM,
                                                          "cpu_count": 1})
        self.assertEqual(st, 202, r)
        sid, op_id = r["sandbox"]["id"], r["operation"]["id"]
        self.sids.append(sid)
        seen = set()
        deadline = time.time() + 240 * MULT
        while time.time() < deadline:
            st, op = self.s.request("GET", "/v1/operations/" + op_id)
            self.assertEqual(st, 200, op)
            if op["status"] in ("succeeded", "failed"):
                break
            if op.get("progress"):
                seen.add(op["progress"])
            time.sleep(0.05)
        self.assertEqual(op["status"], "succeeded", (op, self.s.read_log()))
        return sid, op, seen

    def delete(self, sid):
        st, r = self.s.request("DELETE", "/v1/sandboxes/%s?wait=%d" % (sid, wait_s(60)),
                               timeout=90 * MULT)
        self.assertEqual(st, 200, r)
        self.sids.remove(sid)

    def test_size_built_ahead_after_restart(self):
        s = self.s
        want = "building template snapshot for 1 vCPU / %d MiB" % MEM
        b0 = self.builds()
        sid, op, seen = self.create_watched()
        self.assertEqual(seen, {want}, op)  # said while it waited
        self.assertEqual(op["progress"], want, op)  # and kept
        self.assertEqual(self.builds(), b0 + 1)
        self.assertEqual(len(snapshot_dirs()), 1)
        self.assertEqual(s.command(sid, "echo up")["stdout"], "up\n")
        self.delete(sid)

        # The size's snapshot goes while spaced is down; the sizes in the database bring it back.
        s.stop()
        remove_snapshots()
        s.start()
        wait_until(lambda: self.metric("space_template_snapshots_ahead_total",
                                       'outcome="built"') >= 1,
                   "the snapshot of %d MiB built ahead" % MEM, timeout=240, step=0.5)
        self.assertEqual(len(snapshot_dirs()), 1)
        b1 = self.builds()
        self.assertEqual(b1, 1)  # this process built that one, ahead
        with open(s.log_path) as f:
            self.assertIn("template snapshot built ahead template=base cpus=1 memory_mb=%d" % MEM,
                          f.read())

        sid, op, seen = self.create_watched()
        self.assertEqual(seen, set(), op)  # nothing to wait for
        self.assertIsNone(op["progress"], op)
        self.assertEqual(self.builds(), b1)  # and nothing built
        self.assertEqual(s.command(sid, "echo up")["stdout"], "up\n")
        self.delete(sid)


if __name__ == "__main__":
    unittest.main(verbosity=2)
