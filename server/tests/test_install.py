"""The installed layout: `cmake --install` of this build into a temporary prefix, then the
installed spaced on a fresh data directory (embedded PostgreSQL, no microVM runtime) with the
installed config file: version, serve and /healthz, keys create beside it, the admin key."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from harness import KEEP, Spaced, skip_unless_pg, tmpdir  # noqa: E402


@skip_unless_pg
class InstallTest(unittest.TestCase):
    def test_install_and_run(self):
        build = os.environ["SP_BUILD_DIR"]
        prefix = tempfile.mkdtemp(prefix="sp-prefix-")
        os.chmod(prefix, 0o755)
        try:
            r = subprocess.run([os.environ.get("CMAKE", "cmake"), "--install", build,
                                "--prefix", prefix], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            spaced = os.path.join(prefix, "bin", "spaced")
            agent = os.path.join(prefix, "lib", "space", "space-agent")
            unit = os.path.join(prefix, "lib", "systemd", "system", "spaced.service")
            conf = os.path.join(prefix, "etc", "space", "spaced.conf")
            for p in (spaced, agent):
                self.assertTrue(os.access(p, os.X_OK), p)
            for p in (unit, conf, os.path.join(prefix, "share", "space", "openapi.json")):
                self.assertTrue(os.path.isfile(p), p)
            with open(unit) as f:
                text = f.read()
            self.assertIn("ExecStart=%s serve --config %s" % (spaced, conf), text)
            self.assertNotIn("@", text)
            # The fleet's units (deploy/systemd/) beside it, on the same spaced and config dir.
            for name, conf_name in (("space-api", "api.conf"), ("space-worker", "worker.conf")):
                with open(os.path.join(os.path.dirname(unit), name + ".service")) as f:
                    fleet = f.read()
                self.assertIn("ExecStart=%s serve --config %s" % (
                    spaced, os.path.join(os.path.dirname(conf), conf_name)), fleet)
                self.assertEqual(re.findall(r"@[A-Z_]+@", fleet), [])

            r = subprocess.run([spaced, "version"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(r.stdout.startswith("spaced "), r.stdout)

            # The shipped config file is valid as shipped (every line a comment or blank).
            s = Spaced(binary=spaced, runtime="none", env={"SPACE_CONFIG": conf})
            try:
                s.start()
                st, body = s.request("GET", "/healthz", key="")
                self.assertEqual((st, body["status"]), (200, "ok"))
                key = s.cli("keys", "create", "--team", "installed").stdout.strip()
                st, body = s.request("GET", "/v1/templates", key=key)
                self.assertEqual(st, 200, body)
                with open(os.path.join(s.data_dir, "admin-key")) as f:
                    admin = f.read().strip()
                st, body = s.request("GET", "/v1/admin/teams", key=admin)
                self.assertEqual(st, 200, body)
                self.assertIn("installed", [t["name"] for t in body["teams"]])
            finally:
                s.destroy()

            # The installed spaced finds the installed agent (template builds put it in images):
            # an unknown template is refused after the agent was found.
            env = {k: v for k, v in os.environ.items() if k != "SPACE_AGENT_BIN"}
            data = tmpdir("sp-data-")
            r = subprocess.run([spaced, "template", "build", "no-such-template", "--data-dir",
                                data, "--config", conf], capture_output=True, text=True,
                               env=env, timeout=60)
            shutil.rmtree(data, ignore_errors=True)
            self.assertNotEqual(r.returncode, 0)
            self.assertNotIn("cannot find the guest agent", r.stderr)
            self.assertIn("no-such-template", r.stderr)

            # The config file is read: a bad setting stops spaced with its line number.
            bad = os.path.join(prefix, "bad.conf")
            with open(conf) as f, open(bad, "w") as g:
                g.write(f.read() + "listen = 127.0.0.1:1\nno-such-option = 1\n")
            data = tmpdir("sp-data-")
            r = subprocess.run([spaced, "serve", "--config", bad, "--data-dir", data],
                               capture_output=True, text=True, timeout=60)
            shutil.rmtree(data, ignore_errors=True)
            self.assertEqual(r.returncode, 2, r)
            n = len(open(bad).read().splitlines())
            self.assertIn("line %d: unknown option 'no-such-option'" % n, r.stderr)
        finally:
            if not KEEP:
                shutil.rmtree(prefix, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
