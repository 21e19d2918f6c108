"""spacectl, the built binary, against a real spaced on real VMs: every command as a user
types it, its output, and its exit status.

One sandbox serves the suite (created by `spacectl sandbox create` in setUpClass, deleted by
the last test). The interactive shell runs in a detached tmux session whose pane is read
back. Needs root, PostgreSQL, tmux and SP_TEST_DATA_DIR with the base template; SPACECTL and
SPACED name the binaries.
"""
import base64
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "e2e"))
from harness import KEEP, MULT, Platform, free_port, tmpdir, wait_s  # noqa: E402
from test_vm_api import skip_reason as vm_skip_reason  # noqa: E402

DATA = os.environ.get("SP_TEST_DATA_DIR")
SPACECTL = os.environ.get("SPACECTL")


def skip_reason():
    if SPACECTL is None:
        return "SPACECTL is not set"
    if shutil.which("tmux") is None:
        return "tmux is not installed"
    return vm_skip_reason()


def sha(data):
    return hashlib.sha256(data).hexdigest()


@unittest.skipIf(skip_reason(), skip_reason())
class SpacectlTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tmpdir("sp-cli-")
        cls.home = os.path.join(cls.tmp, "home")
        os.makedirs(cls.home)
        cls.p = Platform(teams=(None,), binary=os.environ["SPACED"], data_dir=DATA,
                         env={"SPACE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()})
        cls.s = cls.p.s
        cls.url = "http://127.0.0.1:%d" % cls.s.port
        cls.sid = None
        r = cls.ctl("sandbox", "create", "--wait", "--json", "--metadata", "suite=spacectl",
                    "--env", "GREETING=hello there", timeout=180)
        if r.returncode != 0:
            cls.tearDownClass()
            raise AssertionError("sandbox create failed: %r" % (r,))
        cls.created = json.loads(r.stdout)
        cls.sid = cls.created["sandbox"]["id"]

    @classmethod
    def tearDownClass(cls):
        if cls.sid is not None:
            cls.s.delete_quietly(cls.sid)  # VMs outlive spaced: the VM goes first
        cls.p.destroy()
        if not KEEP:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    # ---- helpers ----

    @classmethod
    def env(cls, **over):
        """spacectl's environment: a private HOME, the server and key in SPACE_API_*; a value
        of None removes the variable."""
        e = dict(os.environ, HOME=cls.home, SPACE_API_URL=cls.url, SPACE_API_KEY=cls.s.key,
                 SPACE_DATA_DIR=os.path.join(cls.tmp, "no-data-dir"))
        e.pop("XDG_CONFIG_HOME", None)
        for k, v in over.items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = v
        return e

    @classmethod
    def ctl(cls, *args, input=None, env=None, timeout=120, text=True):
        """Runs spacectl; stdin is input, else empty (a file, not a terminal)."""
        kw = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
        if input is not None and text and isinstance(input, bytes):
            text = False
        return subprocess.run([SPACECTL] + list(args), capture_output=True, text=text,
                              env=env or cls.env(), timeout=timeout * MULT, **kw)

    def ok(self, *args, **kw):
        r = self.ctl(*args, **kw)
        self.assertEqual(r.returncode, 0, r)
        return r

    def sh(self, script, **kw):
        """A shell command in the sandbox through spacectl exec; its stdout."""
        return self.ok("exec", self.sid, "--", "sh", "-c", script, **kw).stdout

    def raw_error(self, method, path, body=None, key=None):
        """The server's own error message for a request (what spacectl must show)."""
        st, body = self.s.request(method, path, body, key=key)
        self.assertGreaterEqual(st, 400, body)
        return body["error"]["message"]

    # ---- sandboxes ----

    def test_create_list_get(self):
        self.assertEqual(self.created["operation"]["status"], "succeeded", self.created)
        self.assertEqual(self.created["sandbox"]["state"], "running", self.created)
        self.assertEqual(self.created["sandbox"]["metadata"], {"suite": "spacectl"})

        out = self.ok("sandbox", "list").stdout.splitlines()
        self.assertEqual(out[0].split()[:3], ["ID", "TEMPLATE", "STATE"], out)
        row = [line for line in out if line.startswith(self.sid)]
        self.assertEqual(len(row), 1, out)
        self.assertEqual(row[0].split()[1:3], ["base", "running"], row)
        self.assertIn("suite=spacectl", row[0])

        r = self.ok("sandbox", "list", "-q", "--metadata", "suite=spacectl")
        self.assertEqual(r.stdout.split(), [self.sid])
        r = self.ok("sandbox", "list", "-q", "--metadata", "suite=other")
        self.assertEqual(r.stdout, "")
        r = self.ok("sandbox", "list", "--state", "running", "--json")
        self.assertIn(self.sid, [sb["id"] for sb in json.loads(r.stdout)["sandboxes"]])

        out = self.ok("sandbox", "get", self.sid).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines())
        self.assertEqual(fields["id"].strip(), self.sid)
        self.assertEqual(fields["state"].strip(), "running")
        self.assertEqual(fields["template"].strip(), "base")
        sb = json.loads(self.ok("sandbox", "get", self.sid, "--json").stdout)
        self.assertEqual((sb["id"], sb["state"]), (self.sid, "running"))
        # The environment given at create reaches its processes.
        self.assertEqual(self.sh('printf %s "$GREETING"'), "hello there")

    def test_templates(self):
        out = self.ok("template", "list").stdout.splitlines()
        self.assertEqual(out[0].split()[:2], ["NAME", "STATUS"])
        base = [line.split() for line in out if line.startswith("base ")]
        self.assertEqual(len(base), 1, out)
        self.assertEqual(base[0][1], "ready", out)
        names = [t["name"] for t in json.loads(self.ok("template", "list", "--json").stdout)
                 ["templates"]]
        self.assertIn("base", names)
        # A built-in name is not the team's to build.
        r = self.ctl("template", "build", "code-interpreter-v1", "--from", "base", "--run", "true")
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("taken", r.stderr)
        # A build through the API, its log followed live (each run step's output under its
        # number), then a sandbox of it, then the template deleted.
        nonce = "n%d" % os.getpid()
        r = self.ctl("template", "build", "clitpl", "--from", "base", "--env", "WHO=cli",
                     "--run", "echo built-$WHO-%s > /etc/clitpl" % nonce,
                     "--run", "echo second-step-output", "--force")
        self.assertEqual(r.returncode, 0, r)
        self.assertIn("  [3] second-step-output", r.stdout.splitlines())
        self.assertIn("template clitpl: version", r.stdout)
        listed = self.ok("template", "list").stdout
        self.assertIn("clitpl ", listed)
        out = self.ok("sandbox", "create", "--template", "clitpl", "--wait", "--json",
                      timeout=240).stdout
        sid = json.loads(out)["sandbox"]["id"]
        try:
            r = self.ctl("exec", sid, "--", "sh", "-c", 'cat /etc/clitpl; echo "$WHO"')
            self.assertEqual((r.returncode, r.stdout), (0, "built-cli-%s\ncli\n" % nonce), r)
        finally:
            self.ctl("sandbox", "delete", sid)
        r = self.ctl("template", "build", "clitpl", "--run", "exit 9", "--from", "clitpl")
        self.assertEqual(r.returncode, 1, r)  # from itself: refused before anything runs
        self.assertIn("itself", r.stderr)
        r = self.ctl("template", "build", "clitpl", "--run", "echo boom; exit 9")
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("exited with code 9", r.stderr)
        self.assertIn("boom", r.stdout)
        self.assertIn("clitpl deleted", self.ok("template", "delete", "clitpl").stdout)
        self.assertNotIn("clitpl ", self.ok("template", "list").stdout)
        r = self.ctl("template", "delete", "base")
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("built in", r.stderr)

    def test_template_from_dockerfile(self):
        # A Dockerfile and its context directory: the context is packed and uploaded as a
        # template file, the build follows the Dockerfile (COPY from the context, ENV, RUN,
        # USER, CMD), and a sandbox of it has the files, the env and the CMD running. The same
        # files again pack to the same key: the build comes from the cache.
        nonce = "n%d-%d" % (os.getpid(), time.time_ns() % 1000000)
        ctx = os.path.join(self.tmp, "ctx")
        os.makedirs(os.path.join(ctx, "site"), exist_ok=True)
        with open(os.path.join(ctx, "site", "index.html"), "w") as f:
            f.write("from-dockerfile-%s\n" % nonce)
        with open(os.path.join(ctx, "setup.sh"), "w") as f:
            f.write("#!/bin/sh\necho \"$1\" > /etc/dockerfile-setup\n")
        os.chmod(os.path.join(ctx, "setup.sh"), 0o755)
        df = os.path.join(self.tmp, "Dockerfile")
        with open(df, "w") as f:
            f.write("FROM base\n"
                    "ENV MODE=cli\n"
                    "COPY --chown=user site/ /srv/site/\n"
                    "COPY setup.sh /usr/local/bin/\n"
                    "RUN /usr/local/bin/setup.sh \"$MODE\"\n"
                    "USER user\n"
                    "WORKDIR /srv/site\n"
                    "CMD [\"python3\", \"-m\", \"http.server\", \"8000\"]\n")
        r = self.ctl("template", "build", "clidock", "--dockerfile", df, "--context", ctx,
                     "--ready-cmd", "curl -sf http://127.0.0.1:8000/", timeout=900)
        self.assertEqual(r.returncode, 0, r)
        self.assertIn("template clidock: version", r.stdout)
        self.assertNotIn("(cached)", r.stdout)
        try:
            out = self.ok("sandbox", "create", "--template", "clidock", "--wait", "--json",
                          timeout=240).stdout
            sid = json.loads(out)["sandbox"]["id"]
            try:
                r = self.ctl("exec", sid, "--", "sh", "-c",
                             "curl -sf http://127.0.0.1:8000/index.html; cat /etc/dockerfile-setup;"
                             " p=$(grep -l '^python3' /proc/[0-9]*/cmdline | cut -d/ -f3);"
                             " echo \"$MODE $(stat -c %U /proc/$p)"
                             " $(readlink /proc/$p/cwd)\"; stat -c %U /srv/site/index.html")
                # the CMD runs as the USER, in the WORKDIR
                want = "from-dockerfile-%s\ncli\ncli user /srv/site\nuser\n" % nonce
                self.assertEqual((r.returncode, r.stdout), (0, want), r)
            finally:
                self.ctl("sandbox", "delete", sid)
            # the same Dockerfile and files (touched: times do not count): from the cache
            os.utime(os.path.join(ctx, "setup.sh"), (1, 1))
            r = self.ctl("template", "build", "clidock", "--dockerfile", df, "--context", ctx,
                         "--ready-cmd", "curl -sf http://127.0.0.1:8000/", timeout=300)
            self.assertEqual(r.returncode, 0, r)
            self.assertIn("(cached)", r.stdout)
        finally:
            self.ctl("template", "delete", "clidock")
        # what cannot work is refused before anything is sent
        for args, msg in ((("--dockerfile", df, "--from", "base"), "FROM is the parent"),
                          (("--context", ctx), "goes with --dockerfile"),
                          (("--dockerfile", df, "--context", df), "not a directory"),
                          (("--dockerfile", os.path.join(self.tmp, "nope")), "No such file")):
            r = self.ctl("template", "build", "clidock2", *args)
            self.assertEqual(r.returncode, 1, (args, r))
            self.assertIn(msg, r.stderr, args)
        # the server's own refusal of an instruction it does not take, with its line
        with open(df, "a") as f:
            f.write("HEALTHCHECK CMD true\n")
        r = self.ctl("template", "build", "clidock2", "--dockerfile", df, "--context", ctx)
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("line 9: HEALTHCHECK is not supported", r.stderr)

    # ---- exec ----

    def test_exec_status_and_streams(self):
        r = self.ctl("exec", self.sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
        self.assertEqual((r.returncode, r.stdout, r.stderr), (7, "out\n", "err\n"), r)
        r = self.ctl("exec", self.sid, "--", "sh", "-c", "kill -TERM $$")
        self.assertEqual(r.returncode, 128 + 15, r)
        r = self.ctl("exec", self.sid, "--", "false")
        self.assertEqual(r.returncode, 1, r)
        # Options before the command are spacectl's; after it, the command's.
        r = self.ok("exec", "-e", "A=1", "--cwd", "/tmp", self.sid, "--", "sh", "-c",
                    'echo "$A" "$(pwd)" "$0"', "-e")
        self.assertEqual(r.stdout, "1 /tmp -e\n")
        r = self.ok("exec", self.sid, "echo", "-n", "no dashes needed")
        self.assertEqual(r.stdout, "no dashes needed")

    def test_exec_stdin(self):
        r = self.ok("exec", self.sid, "--", "wc", "-l", input="one\ntwo\nthree\n")
        self.assertEqual(r.stdout.strip(), "3")
        blob = os.urandom(3 * 1024 * 1024 + 17)  # binary and larger than one message
        r = self.ctl("exec", self.sid, "--", "sh", "-c", "cat; echo done >&2", input=blob,
                     timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(r.stdout), len(blob))
        self.assertEqual(sha(r.stdout), sha(blob))
        self.assertEqual(r.stderr, b"done\n")
        # Without stdin (empty file), the command sees its end at once.
        r = self.ok("exec", self.sid, "--", "cat")
        self.assertEqual(r.stdout, "")

    def test_exec_streams_live(self):
        """Output arrives as the command writes it, not when it ends."""
        proc = subprocess.Popen([SPACECTL, "exec", self.sid, "--", "sh", "-c",
                                 "echo first; sleep 8; echo second; exit 4"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self.env(), text=True)
        try:
            first = proc.stdout.readline()
            self.assertEqual(first, "first\n")
            self.assertIsNone(proc.poll(), "spacectl ended before the command")
            rest, err = proc.communicate(timeout=120 * MULT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.assertEqual((rest, proc.returncode), ("second\n", 4), err)

    # ---- cp ----

    def make_tree(self, root):
        os.makedirs(os.path.join(root, "sub", "deeper"))
        files = {
            "a.txt": b"alpha\n",
            "empty": b"",
            os.path.join("sub", "blob.bin"): os.urandom(2 * 1024 * 1024 + 5),
            os.path.join("sub", "deeper", "run.sh"): b"#!/bin/sh\necho ran\n",
        }
        for rel, data in files.items():
            with open(os.path.join(root, rel), "wb") as f:
                f.write(data)
        os.chmod(os.path.join(root, "sub", "deeper", "run.sh"), 0o750)
        os.chmod(os.path.join(root, "sub"), 0o750)
        return files

    def test_cp_both_ways(self):
        src = os.path.join(self.tmp, "tree")
        files = self.make_tree(src)
        self.sh("rm -rf /tmp/cp && mkdir -p /tmp/cp")
        r = self.ok("cp", src, self.sid + ":/tmp/cp/", timeout=300)
        self.assertEqual(r.stderr, "", r)  # no progress bar: stderr is not a terminal
        sums = self.sh("cd /tmp/cp/tree && find . -type f | sort | xargs sha256sum")
        want = "".join("%s  ./%s\n" % (sha(files[k]), k) for k in sorted(files))
        self.assertEqual(sums, want)
        modes = self.sh("stat -c '%a %n' /tmp/cp/tree/sub /tmp/cp/tree/sub/deeper/run.sh")
        self.assertEqual(modes, "750 /tmp/cp/tree/sub\n750 /tmp/cp/tree/sub/deeper/run.sh\n")
        self.assertEqual(self.sh("/tmp/cp/tree/sub/deeper/run.sh"), "ran\n")

        # Change it in the sandbox, then copy the tree back out under a new name.
        self.sh("echo changed > /tmp/cp/tree/a.txt && mkdir /tmp/cp/tree/new && "
                "printf 'x' > /tmp/cp/tree/new/x")
        dst = os.path.join(self.tmp, "back")
        self.ok("cp", self.sid + ":/tmp/cp/tree", dst, timeout=300)
        for rel, data in files.items():
            with open(os.path.join(dst, rel), "rb") as f:
                got = f.read()
            self.assertEqual(sha(got), sha(b"changed\n" if rel == "a.txt" else data), rel)
        with open(os.path.join(dst, "new", "x"), "rb") as f:
            self.assertEqual(f.read(), b"x")
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(dst, "sub")).st_mode), 0o750)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(dst, "sub", "deeper", "run.sh"))
                                      .st_mode), 0o750)

        # A single file each way; an existing local directory receives it under its name.
        self.ok("cp", os.path.join(src, "a.txt"), self.sid + ":/tmp/cp/one.txt")
        self.assertEqual(self.sh("cat /tmp/cp/one.txt"), "alpha\n")
        self.ok("cp", self.sid + ":/tmp/cp/one.txt", self.tmp)
        with open(os.path.join(self.tmp, "one.txt")) as f:
            self.assertEqual(f.read(), "alpha\n")

        # Errors: a missing source on either side, and two local paths.
        r = self.ctl("cp", self.sid + ":/tmp/cp/nope", self.tmp)
        self.assertEqual(r.returncode, 1, r)
        self.assertIn(self.sid + ":/tmp/cp/nope: ", r.stderr)
        r = self.ctl("cp", os.path.join(self.tmp, "nope"), self.sid + ":/tmp/cp/")
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("No such file", r.stderr)
        r = self.ctl("cp", src, self.tmp)
        self.assertEqual(r.returncode, 2, r)

    # ---- lifecycle, logs ----

    def test_lifecycle_and_logs(self):
        for verb, state in (("pause", "paused"), ("wake", "running"), ("suspend", "suspended"),
                            ("wake", "running")):
            r = self.ok("sandbox", verb, self.sid, "--wait", timeout=300)
            row = [line.split() for line in r.stdout.splitlines() if line.startswith(self.sid)]
            self.assertEqual(row[0][2], state, r.stdout)
            sb = json.loads(self.ok("sandbox", "get", self.sid, "--json").stdout)
            self.assertEqual(sb["state"], state)
        self.assertEqual(self.sh("echo awake"), "awake\n")
        # Without --wait: the operation as accepted; the sandbox gets there on its own.
        r = self.ok("sandbox", "pause", self.sid)
        lines = r.stdout.splitlines()
        self.assertEqual(lines[0].split()[:3], ["OPERATION", "SANDBOX", "KIND"], r.stdout)
        self.assertEqual(lines[1].split()[1:3], [self.sid, "pause"], r.stdout)
        deadline = time.time() + 120 * MULT
        while json.loads(self.ok("sandbox", "get", self.sid, "--json").stdout)["state"] != \
                "paused":
            self.assertLess(time.time(), deadline, "never paused")
            time.sleep(0.5)
        # Waking a running sandbox is the server's 409, shown as it says it.
        self.ok("sandbox", "wake", self.sid, "--wait", timeout=300)
        r = self.ctl("sandbox", "wake", self.sid)
        self.assertEqual(r.returncode, 1, r)
        self.assertIn(self.raw_error("POST", "/v1/sandboxes/%s/wake" % self.sid), r.stderr)

        out = self.ok("logs", self.sid).stdout.splitlines()
        self.assertEqual(out[0].split(), ["TIME", "KIND", "DETAIL"])
        kinds = [line.split()[2] for line in out[1:]]
        self.assertEqual(kinds[0], "created", out)
        for k in ("boot", "pause", "suspend", "restore"):
            self.assertIn(k, kinds, out)
        events = json.loads(self.ok("logs", self.sid, "--json").stdout)["events"]
        self.assertEqual([e["kind"] for e in events], kinds)

    # ---- secrets, egress ----

    def test_secrets(self):
        r = self.ok("secrets", "set", "CLI_TOKEN", "--value", "first-value")
        self.assertIn("stored", r.stdout)
        r = self.ok("secrets", "set", "CLI_TOKEN", input="second-value\n")
        self.assertIn("replaced", r.stdout)
        out = self.ok("secrets", "list").stdout
        self.assertIn("CLI_TOKEN", out)
        self.assertNotIn("value", out)
        listed = json.loads(self.ok("secrets", "list", "--json").stdout)["secrets"]
        self.assertIn("CLI_TOKEN", [s["name"] for s in listed])
        self.assertNotIn("second-value", json.dumps(listed))
        self.ok("secrets", "delete", "CLI_TOKEN")
        self.assertNotIn("CLI_TOKEN", self.ok("secrets", "list").stdout)
        r = self.ctl("secrets", "delete", "CLI_TOKEN")
        self.assertEqual(r.returncode, 1, r)
        self.assertIn(self.raw_error("DELETE", "/v1/secrets/CLI_TOKEN"), r.stderr)
        r = self.ctl("secrets", "set", "1bad", "--value", "v")
        self.assertEqual(r.returncode, 1, r)

    def test_egress(self):
        out = self.ok("egress", "get", self.sid).stdout
        self.assertIn("internet:  on", out)
        out = self.ok("egress", "set", self.sid, "--internet", "off", "--allow", "example.com",
                      "--allow", "*.example.org:443", "--deny", "bad.example.com").stdout
        self.assertIn("internet:  off", out)
        pol = json.loads(self.ok("egress", "get", self.sid, "--json").stdout)
        self.assertEqual(pol["internet"], False)
        self.assertEqual(pol["allow"], ["example.com", "*.example.org:443"])
        self.assertEqual(pol["deny"], ["bad.example.com"])
        self.ok("egress", "set", self.sid, "--json", '{"internet": true}')
        pol = json.loads(self.ok("egress", "get", self.sid, "--json").stdout)
        self.assertEqual((pol["internet"], pol["allow"]), (True, []))
        r = self.ctl("egress", "set", self.sid, "--allow", "not a rule")
        self.assertEqual(r.returncode, 1, r)
        self.assertTrue(r.stderr.startswith("spacectl: "), r.stderr)
        r = self.ctl("egress", "set", self.sid)
        self.assertEqual(r.returncode, 2, r)

    # ---- errors and settings ----

    def test_errors(self):
        # A wrong key: the server's message, exit 1.
        r = self.ctl("sandbox", "list", env=self.env(SPACE_API_KEY="sk_not_a_real_key"))
        self.assertEqual(r.returncode, 1, r)
        self.assertIn(self.raw_error("GET", "/v1/sandboxes", key="sk_not_a_real_key"), r.stderr)
        # Nobody listening.
        dead = "http://127.0.0.1:%d" % free_port()
        r = self.ctl("sandbox", "list", env=self.env(SPACE_API_URL=dead))
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("cannot reach the server at " + dead, r.stderr)
        # An unknown sandbox, for a plain call and for exec (which keeps 255 for itself).
        msg = self.raw_error("GET", "/v1/sandboxes/nosuchsandbox")
        for args, rc in ((("sandbox", "get", "nosuchsandbox"), 1),
                         (("sandbox", "pause", "nosuchsandbox"), 1),
                         (("logs", "nosuchsandbox"), 1),
                         (("exec", "nosuchsandbox", "--", "true"), 255)):
            r = self.ctl(*args)
            self.assertEqual(r.returncode, rc, r)
            self.assertIn(msg, r.stderr, args)
        # No key anywhere.
        r = self.ctl("sandbox", "list", env=self.env(SPACE_API_KEY=None))
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("no API key", r.stderr)
        # A request the server refuses: its 400 message.
        r = self.ctl("sandbox", "create", "--template", "no-such-template")
        self.assertEqual(r.returncode, 1, r)
        self.assertIn(self.raw_error("POST", "/v1/sandboxes", {"template": "no-such-template"}),
                      r.stderr)
        # Usage errors are 2 and name the problem.
        r = self.ctl("sandbox", "create", "--cpu", "99")
        self.assertEqual(r.returncode, 2, r)
        self.assertIn("--cpu", r.stderr)

    def test_settings(self):
        # The local default: the key spaced writes to <data-dir>/api-key.
        data = os.path.join(self.tmp, "data")
        os.makedirs(data, exist_ok=True)
        with open(os.path.join(data, "api-key"), "w") as f:
            f.write(self.s.key + "\n")
        r = self.ok("sandbox", "list", "-q", env=self.env(SPACE_API_KEY=None, SPACE_DATA_DIR=data))
        self.assertIn(self.sid, r.stdout.split())

        # login checks the key, then saves url and key (0600); the file then serves alone.
        home = os.path.join(self.tmp, "home2")
        os.makedirs(home)
        bare = self.env(HOME=home, SPACE_API_URL=None, SPACE_API_KEY=None)
        cfg = os.path.join(home, ".config", "space", "config")
        r = self.ctl("login", "--url", self.url, "--key", "sk_wrong", env=bare)
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("nothing saved", r.stderr)
        self.assertFalse(os.path.exists(cfg))
        r = self.ctl("login", "--url", self.url, input=self.s.key + "\n", env=bare)
        self.assertEqual(r.returncode, 0, r)
        self.assertEqual(stat.S_IMODE(os.stat(cfg).st_mode), 0o600)
        r = self.ok("sandbox", "list", "-q", env=bare)
        self.assertIn(self.sid, r.stdout.split())
        # The environment wins over the file.
        r = self.ctl("sandbox", "list", env=dict(bare, SPACE_API_KEY="sk_env_wins"))
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("SPACE_API_KEY", r.stderr)

    # ---- shell (a real terminal: tmux) ----

    def tmux(self, *args):
        return subprocess.run(["tmux", "-L", self.tmux_sock] + list(args), capture_output=True,
                              text=True, timeout=30)

    def pane(self):
        return self.tmux("capture-pane", "-p", "-J", "-t", "sh").stdout

    def wait_pane(self, text, timeout=60):
        deadline = time.time() + timeout * MULT
        while time.time() < deadline:
            out = self.pane()
            if text in out:
                return out
            time.sleep(0.2)
        self.fail("%r never showed in the pane:\n%s" % (text, self.pane()))

    def start_shell(self, rows, cols):
        env = " ".join("%s=%s" % (k, v) for k, v in (("SPACE_API_URL", self.url),
                                                     ("SPACE_API_KEY", self.s.key),
                                                     ("HOME", self.home)))
        # The pane stays after spacectl ends so that its status can be read.
        cmd = "env %s %s shell %s; echo SPACECTL_EXIT=$?; sleep 3600" % (env, SPACECTL, self.sid)
        r = self.tmux("new-session", "-d", "-s", "sh", "-x", str(cols), "-y", str(rows), cmd)
        self.assertEqual(r.returncode, 0, r)

    def test_shell(self):
        self.tmux_sock = "spacectl-test-%d" % os.getpid()
        try:
            self.start_shell(24, 80)
            # The first prompt; then a command and the terminal it runs on.
            self.tmux("send-keys", "-t", "sh", "echo hi$((6*7)); tty", "Enter")
            self.wait_pane("hi42")
            out = self.wait_pane("/dev/pts/")  # tty answers a moment after the echo
            self.assertIn("hi42", out)
            self.tmux("send-keys", "-t", "sh", "stty size", "Enter")
            self.wait_pane("24 80")
            self.tmux("resize-window", "-t", "sh", "-x", "101", "-y", "33")
            time.sleep(1)
            self.tmux("send-keys", "-t", "sh", "clear; stty size", "Enter")
            self.wait_pane("33 101")
            # Ctrl-C reaches the shell's program, not spacectl.
            self.tmux("send-keys", "-t", "sh", "clear; sleep 100", "Enter")
            time.sleep(2)
            self.tmux("send-keys", "-t", "sh", "C-c")
            self.tmux("send-keys", "-t", "sh", "echo after$((1+1))", "Enter")
            self.wait_pane("after2")
            self.assertNotIn("SPACECTL_EXIT", self.pane())
            self.tmux("send-keys", "-t", "sh", "exit 3", "Enter")
            self.wait_pane("SPACECTL_EXIT=3")
            self.tmux("kill-session", "-t", "sh")

            # Ctrl-D ends the shell like a local one: status 0.
            self.start_shell(24, 80)
            self.tmux("send-keys", "-t", "sh", "echo ready$((2*2))", "Enter")
            self.wait_pane("ready4")
            self.tmux("send-keys", "-t", "sh", "C-d")
            self.wait_pane("SPACECTL_EXIT=0")
        finally:
            self.tmux("kill-server")
        # Nothing stays behind: the sessions were removed when they ended.
        st, body = self.s.request("GET", "/v1/sandboxes/%s/sessions" % self.sid)
        self.assertEqual(st, 200, body)
        self.assertEqual(body["sessions"], [], body)

    # ---- last: delete ----

    def test_zz_delete(self):
        # logs --follow prints the events so far, then waits; the sandbox's end ends it.
        follow = subprocess.Popen([SPACECTL, "logs", "--follow", self.sid],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=self.env(), text=True)
        try:
            self.assertEqual(follow.stdout.readline().split(), ["TIME", "KIND", "DETAIL"])
            self.assertEqual(follow.stdout.readline().split()[2], "created")
            self.assertIsNone(follow.poll())
            r = self.ok("sandbox", "delete", self.sid, "--wait", timeout=300)
            self.assertIn("delete", r.stdout)
            _, err = follow.communicate(timeout=60 * MULT)
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait()
        self.assertEqual(follow.returncode, 0, err)
        self.assertIn("sandbox %s is gone" % self.sid, err)
        r = self.ctl("sandbox", "get", self.sid)
        self.assertEqual(r.returncode, 1, r)
        self.assertIn(self.raw_error("GET", "/v1/sandboxes/%s" % self.sid), r.stderr)
        type(self).sid = None


if __name__ == "__main__":
    unittest.main()
