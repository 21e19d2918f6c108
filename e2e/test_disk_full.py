"""A snapshot that cannot be written (disk full) leaves the sandbox running and says why;
once there is room again the same sandbox suspends and wakes with its files.

The snapshot directory of one VM is covered by a 4 KiB tmpfs, so writing the device state
fails with ENOSPC exactly as a full disk would. Needs root and SP_TEST_DATA_DIR.
"""
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, Platform, wait_s  # noqa: E402
from test_vm_api import skip_reason  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")


@unittest.skipIf(skip_reason(), skip_reason())
class DiskFullTest(unittest.TestCase):
    def test_failed_snapshot_keeps_the_sandbox(self):
        p = Platform(teams=(None,), start=False, binary=os.environ["SPACED"], data_dir=DATA)
        s = p.s
        mnt = None
        try:
            s.start()
            st, r = s.request("POST", "/v1/sandboxes?wait=%d" % wait_s(120), {"template": "base"},
                              timeout=130 * MULT)
            self.assertEqual(r["operation"]["status"], "succeeded", r)
            sid = r["sandbox"]["id"]
            st, c = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                              {"cmd": "echo precious > /home/user/f"}, timeout=60)
            self.assertEqual(c["exit_code"], 0, c)

            mnt = os.path.join(DATA, "vms", sid, "snapshot")
            os.makedirs(mnt, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", mnt], check=True)

            st, r = s.request("POST", "/v1/sandboxes/%s/suspend?wait=%d" % (sid, wait_s(60)),
                              timeout=70 * MULT)
            self.assertEqual(st, 200, r)
            self.assertEqual(r["operation"]["status"], "failed", r)
            self.assertIn("suspend", r["operation"]["error"]["message"])
            self.assertEqual(r["sandbox"]["state"], "running", r)
            self.assertEqual(r["sandbox"]["desired_state"], "running", r)
            st, c = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                              {"cmd": "cat /home/user/f"}, timeout=60)
            self.assertEqual((st, c["stdout"]), (200, "precious\n"), c)

            subprocess.run(["umount", mnt], check=True)
            mnt = None
            for verb, want in (("suspend", "suspended"), ("wake", "running")):
                st, r = s.request("POST", "/v1/sandboxes/%s/%s?wait=%d" % (sid, verb, wait_s(60)),
                                  timeout=70 * MULT)
                self.assertEqual(r["operation"]["status"], "succeeded", r)
                self.assertEqual(r["sandbox"]["state"], want)
            st, c = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                              {"cmd": "cat /home/user/f"}, timeout=60)
            self.assertEqual(c["stdout"], "precious\n", c)
            s.request("DELETE", "/v1/sandboxes/%s?wait=60" % sid, timeout=70)
        finally:
            if mnt is not None:
                subprocess.run(["umount", mnt])
            p.destroy()


if __name__ == "__main__":
    unittest.main()
