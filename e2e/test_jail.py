"""Every QEMU runs jailed (core/runtime/jail.h), checked from the host through /proc/<pid>:
its own non-zero uid from the jail range (distinct per VM), no capabilities, no_new_privs,
seccomp filter mode, mount/pid/ipc/uts/net namespaces not spaced's, a root holding only what
it needs (its own VM directory, its template's files, QEMU and its libraries, a few devices),
only lo, an empty environment; and the VM still works through all of it: commands and files,
pause, suspend and wake (a new QEMU, jailed again), a spare clone, spaced's restart
(re-adoption keeps each VM's uid taken). spaced as a user that is not root jails each QEMU in
user namespaces of its own (UnprivilegedJailTest). Needs root and SP_TEST_DATA_DIR.
"""
import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import MULT, Platform, wait_s, wait_until  # noqa: E402
from test_vm_api import skip_reason  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
UID_START, UID_COUNT = 900000, 65536  # the default --jail-uid-range
SECRET = "jail-test-master-key-must-not-leak"


def status(pid):
    with open("/proc/%d/status" % pid) as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def ns(pid, name):
    return os.readlink("/proc/%d/ns/%s" % (pid, name))


def jail_files(root, limit=20000):
    """Every non-directory path (as seen inside) under a jail's root, /usr/lib* aside."""
    out = []
    for top, dirs, files in os.walk(root):
        inside = top[len(root):] or "/"
        if inside.startswith(("/usr/lib", "/usr/share/qemu", "/usr/share/seabios", "/proc")):
            dirs[:] = []
            continue
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            out.append(os.path.join(inside, name))
        if len(out) > limit:
            break
    return out


@unittest.skipIf(skip_reason(), skip_reason())
class JailTest(unittest.TestCase):
    def setUp(self):
        self.key_b64 = base64.b64encode(SECRET[:32].encode()).decode()
        env = {"SPACE_MASTER_KEY": self.key_b64}
        self.p = Platform(teams=(None,), start=False, binary=os.environ["SPACED"], data_dir=DATA,
                          env=env)
        self.s = self.p.s
        self.sids = []

    def tearDown(self):
        for sid in self.sids:
            self.s.delete_quietly(sid)
        self.p.destroy()

    def create(self):
        sid = self.s.create_ready(template="base")
        self.sids.append(sid)
        return sid

    def cmd(self, sid, cmd):
        st, c = self.s.request("POST", "/v1/sandboxes/%s/commands" % sid, {"cmd": cmd},
                               timeout=60 * MULT)
        self.assertEqual(st, 200, c)
        self.assertEqual(c["exit_code"], 0, c)
        return c["stdout"]

    def lifecycle(self, sid, verb, want):
        st, r = self.s.request("POST", "/v1/sandboxes/%s/%s?wait=%d" % (sid, verb, wait_s(60)),
                               timeout=70 * MULT)
        self.assertEqual(r["operation"]["status"], "succeeded", r)
        self.assertEqual(r["sandbox"]["state"], want, r)

    def qemu_pid(self, sid):
        with open(os.path.join(DATA, "vms", sid, "qemu.pid")) as f:
            return int(f.read().strip())

    def is_clone(self, sid):
        """Its QEMU maps the template's RAM (the sealed copy, through its jail's /proc)."""
        with open("/proc/%d/cmdline" % self.qemu_pid(sid), "rb") as f:
            return b"mem-path=/proc/self/fd/" in f.read()

    def check_jailed(self, sid):
        """The sandbox's QEMU, from outside; returns its uid."""
        pid = self.qemu_pid(sid)
        st = status(pid)
        uids = st["Uid"].split()
        self.assertEqual(len(set(uids)), 1, st["Uid"])
        uid = int(uids[0])
        self.assertTrue(UID_START <= uid < UID_START + UID_COUNT, uid)
        self.assertEqual(st["Gid"].split(), [str(uid)] * 4)
        self.assertEqual(st["Groups"].strip(), "")
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            self.assertEqual(int(st[cap], 16), 0, (cap, st[cap]))
        self.assertEqual(st["NoNewPrivs"], "1")
        self.assertEqual(st["Seccomp"], "2")  # QEMU's -sandbox filter
        self.assertEqual(st["NSpid"].split()[-1], "1")  # init of its own pid namespace
        spaced = self.s.proc.pid
        for name in ("mnt", "pid", "ipc", "uts", "net"):
            self.assertNotEqual(ns(pid, name), ns(spaced, name), name)
        with open("/proc/%d/net/dev" % pid) as f:
            ifs = [line.split(":")[0].strip() for line in f.readlines()[2:]]
        self.assertEqual(ifs, ["lo"])
        with open("/proc/%d/environ" % pid, "rb") as f:
            self.assertEqual(f.read(), b"")
        # the root: what it needs and nothing else
        root = "/proc/%d/root" % pid
        top = set(os.listdir(root))
        self.assertTrue(top <= {"usr", "lib", "lib64", "lib32", "libx32", "dev", "etc", "proc",
                                DATA.strip("/").split("/")[0]}, top)
        if "proc" in top:  # a clone's: its own pid namespace's processes, nothing else
            self.assertTrue(all(n.isdigit() or n in ("self", "thread-self")
                                for n in os.listdir(root + "/proc")), os.listdir(root + "/proc"))
        self.assertEqual(set(os.listdir(root + "/dev")) - {"kvm"}, {"null", "zero", "urandom"})
        self.assertEqual(os.listdir(root + "/etc"), ["ld.so.cache"])
        self.assertTrue(set(os.listdir(root + DATA)) <= {"vms", "templates", "images"},
                        os.listdir(root + DATA))
        own = os.listdir(root + DATA + "/vms")
        self.assertEqual(len(own), 1, own)  # its own directory (a spare's name if it was one)
        self.assertTrue(own[0] == sid or own[0].startswith(".pool-"), own)
        for path in jail_files(root):
            ok = (path.startswith(DATA + "/vms/" + own[0] + "/")
                  or path.startswith(DATA + "/templates/")
                  or path.startswith(DATA + "/images/")  # kernel, initramfs
                  or path.startswith("/dev/") or path == "/etc/ld.so.cache"
                  or path.startswith("/usr/bin/qemu-system-") or path in ("/lib", "/lib64",
                                                                         "/lib32", "/libx32"))
            self.assertTrue(ok, path)
        # nothing of the template is writable from inside; its own directory is
        self.assertTrue(os.statvfs(root + "/usr/lib").f_flag & os.ST_RDONLY)
        self.assertTrue(os.statvfs(root).f_flag & os.ST_RDONLY)
        for path in jail_files(root + DATA + "/templates"):
            self.assertTrue(os.statvfs(root + DATA + "/templates" + path).f_flag & os.ST_RDONLY,
                            path)
        self.assertFalse(os.statvfs(root + DATA + "/vms/" + own[0]).f_flag & os.ST_RDONLY)
        # spaced's own environment lost the master key at start
        with open("/proc/%d/environ" % spaced, "rb") as f:
            env = f.read()
        self.assertNotIn(b"SPACE_MASTER_KEY", env)
        self.assertNotIn(self.key_b64.encode(), env)
        return uid

    def template_memfds(self):
        """spaced's sealed template RAM memfds: (size, bytes allocated) each."""
        out, fds = [], "/proc/%d/fd" % self.s.proc.pid
        for fd in os.listdir(fds):
            try:
                if "memfd:space-template-ram" in os.readlink(os.path.join(fds, fd)):
                    st = os.stat(os.path.join(fds, fd))
                    out.append((st.st_size, st.st_blocks * 512))
            except OSError:
                pass  # closed meanwhile
        return out

    def test_jailed_vms_work(self):
        vms = os.path.join(DATA, "vms")
        self.s.start()
        st, h = self.s.request("GET", "/healthz")
        self.assertEqual(st, 200)
        self.assertNotIn("insecure", h)
        with open(self.s.log_path) as f:
            self.assertIn("jailer on", f.read())
        # the template's RAM, sealed at start, keeps the holes of the pages its guest never
        # touched until a clone uses it; then they are filled in the background, rather than
        # by the faults of that clone's first suspend (confine.c, ram_fill_start)
        # (a window at a time: spaced's RSS does not grow by the template's RAM meanwhile)
        wait_until(lambda: self.template_memfds(), "the template's RAM sealed", 30)
        before = self.template_memfds()
        self.assertTrue(any(alloc < size for size, alloc in before), before)
        rss0 = rss = self.s.rss_kb()
        a = self.create()
        self.assertEqual(os.stat(vms).st_mode & 0o777, 0o700)
        self.assertTrue(self.is_clone(a), "the create was not a clone of the template snapshot")

        def filled():  # the fill's own report: every byte of a memfd faulted in
            nonlocal rss
            rss = max(rss, self.s.rss_kb())
            with open(self.s.log_path) as f:
                return any(int(m) == size for m in re.findall(
                    r"template RAM holes filled .* bytes=(\d+)", f.read())
                    for size, _ in before)
        wait_until(filled, "the template's RAM filled once a clone uses it", 60, step=0.02)
        self.assertLess((rss - rss0) // 1024, 64, "spaced's RSS grew while the RAM was filled")
        print("template RAM memfds (size, allocated) before the first clone %s, after its fill %s"
              % (before, self.template_memfds()), flush=True)
        ua = self.check_jailed(a)
        self.assertEqual(self.cmd(a, "echo hi"), "hi\n")
        self.cmd(a, "echo kept > /home/user/f")
        st, _ = self.s.request("GET", "/v1/sandboxes/%s/files?path=/home/user/f" % a)
        self.assertEqual(st, 200)
        # pause, suspend and wake: the wake's QEMU is jailed again
        self.lifecycle(a, "pause", "paused")
        self.lifecycle(a, "wake", "running")
        old = self.qemu_pid(a)
        self.lifecycle(a, "suspend", "suspended")
        self.lifecycle(a, "wake", "running")
        self.assertNotEqual(self.qemu_pid(a), old)
        ua = self.check_jailed(a)
        self.assertEqual(self.cmd(a, "cat /home/user/f"), "kept\n")
        # a second sandbox (a spare clone once the pool refilled): another uid
        time.sleep(3 * MULT)
        b = self.create()
        self.assertTrue(self.is_clone(b))
        ub = self.check_jailed(b)
        self.assertNotEqual(ua, ub)
        self.assertEqual(self.cmd(b, "echo b"), "b\n")
        # restart: both re-adopted with their uids, which stay taken
        pa, pb = self.qemu_pid(a), self.qemu_pid(b)
        self.s.stop()
        self.s.start()
        self.assertEqual(self.cmd(a, "cat /home/user/f"), "kept\n")
        self.assertEqual(self.cmd(b, "echo again"), "again\n")
        self.assertEqual((self.qemu_pid(a), self.qemu_pid(b)), (pa, pb))
        self.assertEqual((self.check_jailed(a), self.check_jailed(b)), (ua, ub))
        c = self.create()
        self.assertNotIn(self.check_jailed(c), (ua, ub))
        self.assertEqual(self.cmd(c, "echo c"), "c\n")


NOBODY = 65534


@unittest.skipIf(skip_reason(), skip_reason())
class UnprivilegedJailTest(unittest.TestCase):
    """spaced as a user that is not root (nobody, through setpriv), on a data dir of its own
    whose templates are hard links to SP_TEST_DATA_DIR's (read-only to it): each QEMU is jailed
    in user namespaces of its own, as spaced's uid (the one thing root's jail does that this
    one cannot), and the VM works."""

    def setUp(self):
        self.data = tempfile.mkdtemp(prefix="sp-unpriv-", dir=os.path.dirname(DATA.rstrip("/")))
        for sub in ("templates", "images"):
            subprocess.run(["cp", "-al", os.path.join(DATA, sub), os.path.join(self.data, sub)],
                           check=True)
        for top, _, _ in os.walk(self.data):  # its directories (the files stay root's)
            os.chown(top, NOBODY, NOBODY)
        wrap = ["setpriv", "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY, "--clear-groups", "--"]
        self.p = Platform(teams=(None,), start=False, binary=os.environ["SPACED"],
                          data_dir=self.data, wrap=wrap, args=["--insecure-no-cgroups"])
        self.s = self.p.s

    def tearDown(self):
        vms = os.path.join(self.data, "vms")
        for sid in os.listdir(vms) if os.path.isdir(vms) else []:
            self.s.delete_quietly(sid)
        self.p.destroy()
        for sid in os.listdir(vms) if os.path.isdir(vms) else []:  # what a failure left
            try:
                with open(os.path.join(vms, sid, "qemu.pid")) as f:
                    os.kill(int(f.read().strip()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        shutil.rmtree(self.data, ignore_errors=True)

    def check(self, sid):
        with open(os.path.join(self.data, "vms", sid, "qemu.pid")) as f:
            pid = int(f.read().strip())
        st = status(pid)
        self.assertEqual(st["Uid"].split(), [str(NOBODY)] * 4)
        self.assertEqual(st["Gid"].split(), [str(NOBODY)] * 4)
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            self.assertEqual(int(st[cap], 16), 0, (cap, st[cap]))
        self.assertEqual(st["NoNewPrivs"], "1")
        self.assertEqual(st["Seccomp"], "2")
        for name in ("user", "mnt", "pid", "ipc", "uts", "net"):
            self.assertNotEqual(ns(pid, name), ns(self.s.proc.pid, name), name)
        with open("/proc/%d/uid_map" % pid) as f:
            self.assertEqual(f.read().split(), [str(NOBODY), str(NOBODY), "1"])
        root = "/proc/%d/root" % pid
        self.assertFalse(os.path.exists(root + "/etc/passwd"))
        self.assertTrue(os.path.isdir(root + os.path.join(self.data, "vms", sid)))
        self.assertEqual(os.listdir(root + os.path.join(self.data, "vms")), [sid])
        return pid

    def test_jailed_in_user_namespaces(self):
        s = self.s
        s.start()
        self.assertEqual(status(s.proc.pid)["Uid"].split()[0], str(NOBODY))
        st, h = s.request("GET", "/healthz")
        self.assertEqual(st, 200)
        self.assertIn("jail-one-uid", h.get("insecure", []), h)
        self.assertNotIn("no-jail", h.get("insecure", []), h)
        with open(s.log_path) as f:
            self.assertIn("jailer on, in user namespaces", f.read())
        sid = s.create_ready(template="base")
        pid = self.check(sid)
        st, c = s.request("POST", "/v1/sandboxes/%s/commands" % sid,
                          {"cmd": "echo kept > /home/user/f; cat /home/user/f"},
                          timeout=60 * MULT)
        self.assertEqual((st, c.get("stdout")), (200, "kept\n"), c)
        for verb, want in (("suspend", "suspended"), ("wake", "running")):
            st, r = s.request("POST", "/v1/sandboxes/%s/%s?wait=%d" % (sid, verb, wait_s(60)),
                              timeout=70 * MULT)
            self.assertEqual(r["sandbox"]["state"], want, r)
        self.assertNotEqual(self.check(sid), pid)  # a new QEMU, jailed again
        st, c = s.request("POST", "/v1/sandboxes/%s/commands" % sid, {"cmd": "cat /home/user/f"},
                          timeout=60 * MULT)
        self.assertEqual((st, c.get("stdout")), (200, "kept\n"), c)


if __name__ == "__main__":
    unittest.main()
