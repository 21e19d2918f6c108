"""The build cache's uploaded files (core/control/tmplfiles.h), without VMs: files a team
uploaded for COPY steps are kept for --build-cache-s after their last upload, lookup or use,
then removed (and an empty team directory with them); both APIs then say they are missing and
the next upload stores them again. Another team's files are its own."""
import hashlib
import io
import os
import sys
import tarfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import MULT, Platform, skip_unless_pg  # noqa: E402

CACHE_S = 6  # --build-cache-s: looked over every 3 s


def tar_with(text):
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w") as tf:
        data = text.encode()
        ti = tarfile.TarInfo("app/file.txt")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    body = b.getvalue()
    return body, hashlib.sha256(body).hexdigest()


@skip_unless_pg
class BuildCacheFilesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.p = Platform(teams=("alpha", "beta"), runtime="test",
                         env={"SPACE_FAKE_DELAY_MS": "20"},
                         args=["--build-cache-s", str(CACHE_S)])
        cls.s = cls.p.s
        cls.other_key = cls.p.keys["beta"]
        cls.files = os.path.join(cls.s.data_dir, "template-files")

    @classmethod
    def tearDownClass(cls):
        cls.p.destroy()

    def put(self, body, key, api_key=None):
        st, r = self.s.request("PUT", "/v1/template-files/" + key, raw=body, key=api_key)
        self.assertIn(st, (200, 201), r)
        return st

    def present(self, key, api_key=None):
        st, r = self.s.request("GET", "/v1/template-files/" + key, key=api_key)
        self.assertIn(st, (200, 404), r)
        return st == 200

    def path_of(self, key, api_key=None):
        """The file as stored: <data>/template-files/<team id>/<key>."""
        for team in os.listdir(self.files):
            p = os.path.join(self.files, team, key)
            if os.path.exists(p):
                return p
        return None

    def age(self, path, secs):
        t = time.time() - secs
        os.utime(path, (t, t))

    def wait_gone(self, path, what):
        deadline = time.time() + (CACHE_S + 10) * MULT
        while os.path.exists(path) and time.time() < deadline:
            time.sleep(0.3)
        self.assertFalse(os.path.exists(path), what)

    def test_unused_files_go_and_come_back(self):
        s = self.s
        old, old_key = tar_with("old-%d" % os.getpid())
        fresh, fresh_key = tar_with("fresh-%d" % os.getpid())
        theirs, theirs_key = tar_with("theirs-%d" % os.getpid())
        self.assertEqual(self.put(old, old_key), 201)
        self.put(fresh, fresh_key)
        self.put(theirs, theirs_key, api_key=self.other_key)
        p_old, p_fresh, p_theirs = (self.path_of(k) for k in (old_key, fresh_key, theirs_key))
        self.assertTrue(p_old and p_fresh and p_theirs)
        self.assertNotEqual(os.path.dirname(p_old), os.path.dirname(p_theirs))

        # an upload of what is there, and a lookup, count as uses
        self.age(p_old, 3600)
        self.assertEqual(self.put(old, old_key), 200)  # existed
        self.assertGreater(os.stat(p_old).st_mtime, time.time() - 60)
        self.age(p_old, 3600)
        self.assertTrue(self.present(old_key))
        self.assertGreater(os.stat(p_old).st_mtime, time.time() - 60)

        # unused past the time: removed; the fresh one stays while its time runs
        self.age(p_old, 3600)
        self.age(p_theirs, 3600)
        t_fresh = time.time()
        os.utime(p_fresh)
        self.wait_gone(p_old, "files unused for an hour kept")
        self.wait_gone(p_theirs, "another team's unused files kept")
        self.assertFalse(os.path.exists(os.path.dirname(p_theirs)), "empty team dir kept")
        if time.time() - t_fresh < CACHE_S - 1:  # a loaded machine may have taken longer
            self.assertTrue(os.path.exists(p_fresh), "files used a moment ago removed")

        # both APIs say they are missing
        self.assertFalse(self.present(old_key))
        st, r = s.request("GET", "/templates/base/files/" + old_key, key="",
                          headers={"X-API-KEY": s.key})  # E2B's question before an upload
        self.assertEqual((st, r["present"]), (201, False), r)
        # uploaded again: stored anew
        self.assertEqual(self.put(old, old_key), 201)
        self.assertTrue(self.present(old_key))
        # and the fresh one goes once its own time is up
        self.wait_gone(p_fresh, "files kept past their time")


if __name__ == "__main__":
    unittest.main(verbosity=2)
