"""Runs E2B conformance clients against a local spaced on real microVMs.

    conformance/run_local.py CLIENTS [FILTER...]

CLIENTS: one client, or lanes joined by '+', each lane clients joined by ','. A client is
js, python or cli; js-host, python-host and cli-host are the same in host-routing mode.
Starts a private PostgreSQL and the shipped spaced on SP_TEST_DATA_DIR (a data dir with
built `base` and `code-interpreter-v1` templates, like the e2e suites), creates an API key,
points each client at the server the way a user would (E2B_API_URL = E2B_SANDBOX_URL = the
listener, E2B_API_KEY, and spaced's CA for the code interpreter's https://49999-<id>.<domain>),
runs conformance/<sdk>/run.sh (cli: the E2B CLI, with E2B_ACCESS_TOKEN = the API key) and
stops everything again. Exit status is the client's; 77 (skip) with the reason on stderr when
it cannot run here.

With several clients they share the one spaced: the lanes run at the same time, the clients of a
lane one after another (ctest's conformance.clients: js,python+cli,js-host,python-host,
cli-host: the two suites with code interpreter scenarios, which keep the CPU busy under TCG, one
after the other; beside them the clients that mostly wait on their sandboxes). Each client's
sandboxes, templates and listings carry its own run id. The Node packages are installed first,
once per folder. The SDK clients' from_image scenarios build from an image this script pushes to
docker-registry on loopback (class Images). Each client's output is printed whole when it ends,
with its time; then one line per client, and its failed scenarios again. Exit: 1 when any
failed, 77 when all skipped, else 0.

Environment: SPACED (the binary; ctest sets it), SP_TEST_DATA_DIR, SP_TEST_KEEP=1 (keep
logs), SP_TEST_TIMEOUT_MULT, SPACE_ACCEL (default auto), SP_CONFORMANCE_MODE=host (host
routing over TLS instead of one plain address, for clients named without -host),
CONFORMANCE_PYTHON (python: the interpreter; default ../shared/pysdk/python3 beside the
project when it exists).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from harness import Platform, pg_bindir  # noqa: E402
import oci_registry  # noqa: E402

SKIP = 77
CLIENTS = ("js", "python", "cli", "js-host", "python-host", "cli-host")


def skip(why):
    print("conformance: SKIP: " + why, file=sys.stderr)
    sys.exit(SKIP)


def sdk_of(client):
    return client[:-len("-host")] if client.endswith("-host") else client


def host_mode(client):
    return client.endswith("-host") or os.environ.get("SP_CONFORMANCE_MODE", "single") == "host"


def prepare(client, installed):
    """Runs what must hold before a client starts; returns None (ready) or its exit status:
    77 a skip (reason on stderr), anything else a failure. installed: the Node folders whose
    packages are already in place."""
    sdk = sdk_of(client)
    if sdk in ("js", "cli"):
        if shutil.which("node") is None or shutil.which("npm") is None:
            print("conformance.%s: SKIP: node and npm are not installed (scripts/lib.sh installs "
                  "them)" % client, file=sys.stderr)
            return SKIP
        if sdk not in installed:
            # npm ci replaces node_modules: once per folder, before any client of it runs.
            rc = subprocess.call([os.path.join(HERE, sdk, "run.sh")],
                                 env=dict(os.environ, CONFORMANCE_INSTALL_ONLY="1"))
            if rc != 0:
                return rc
            installed.add(sdk)
    if sdk == "python":
        # Before starting anything: the SDK must import (run.sh picks the interpreter).
        rc = subprocess.call([os.path.join(HERE, "python", "run.sh"), "--check-sdk"])
        if rc != 0:
            return rc
    return None


class Images:
    """The images the SDKs' from_image scenarios build templates from: one OCI image (busybox,
    bash, which the SDKs run commands with, a marker file, ENV, WORKDIR, CMD;
    tests/oci_registry.py) pushed to two of Debian's
    docker-registry on loopback, one open and one behind a password. Its env() tells the
    clients where (CONFORMANCE_IMAGE, CONFORMANCE_IMAGE_LOCKED, CONFORMANCE_IMAGE_CREDS
    user:password, CONFORMANCE_IMAGE_MARKER), or why not (CONFORMANCE_IMAGE_SKIP: a tool is
    missing; the scenarios then skip)."""

    def __init__(self):
        self.work, self.regs = None, []
        self.why = oci_registry.missing_tools(("bash-static",))
        if self.why:
            return
        self.work = tempfile.mkdtemp(prefix="sp-conformance-images-")
        self.marker = "image-marker-%d" % os.getpid()
        self.creds = ("puller", "pw-%s" % os.urandom(6).hex())
        try:
            ref = oci_registry.make_image(self.work, "conf", self.marker, bash=True)
            self.regs.append(oci_registry.Registry(self.work))
            self.regs.append(oci_registry.Registry(self.work, *self.creds))
            self.open = self.regs[0].host + "/conformance/img:1"
            self.locked = self.regs[1].host + "/private/img:1"
            oci_registry.push(ref, self.open)
            oci_registry.push(ref, self.locked, creds="%s:%s" % self.creds)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            self.stop()  # not a skip: the tools are there, so this is a failure to show
            raise RuntimeError("conformance: cannot set up the registry images: %s" % e)

    def env(self):
        if self.why:
            return {"CONFORMANCE_IMAGE_SKIP": self.why}
        return {"CONFORMANCE_IMAGE": self.open, "CONFORMANCE_IMAGE_LOCKED": self.locked,
                "CONFORMANCE_IMAGE_CREDS": "%s:%s" % self.creds,
                "CONFORMANCE_IMAGE_MARKER": self.marker}

    def stop(self):
        for r in self.regs:
            r.stop()
        self.regs = []
        if self.work:
            shutil.rmtree(self.work, ignore_errors=True)


def client_env(client, s, data, images=None):
    url = "http://127.0.0.1:%d" % s.port
    env = dict(os.environ, E2B_API_URL=url, E2B_API_KEY=s.key)
    if images is not None:
        env.update(images.env())
    for k in ("E2B_DOMAIN", "E2B_DEBUG", "E2B_ACCESS_TOKEN", "E2B_SANDBOX_URL"):
        env.pop(k, None)
    # The code interpreter SDKs always use https://49999-<id>.<domain from the create
    # response>, in both modes: trust spaced's CA.
    tls = os.path.join(data, "tls")
    env.update(NODE_EXTRA_CA_CERTS=os.path.join(tls, "ca.pem"),
               SSL_CERT_FILE=os.path.join(tls, "bundle.pem"))
    if host_mode(client):
        # What a user of the README's first command sets: the domain (the SDK then talks
        # to https://api.<domain> and https://<port>-<id>.<domain>, all on spaced's one
        # listener over TLS), the key, and the CA file.
        env.pop("E2B_API_URL", None)
        env["E2B_DOMAIN"] = "space.localhost:%d" % s.port
    else:
        env["E2B_SANDBOX_URL"] = url
    if sdk_of(client) == "cli":
        # The CLI's template commands insist on an access token; space takes the key.
        env["E2B_ACCESS_TOKEN"] = s.key
    return env


def run_lanes(lanes, ready, s, data, filters, installed, images):
    """Runs the lanes at once, each lane's ready clients one after another; returns
    {client: (exit status, seconds, the client's FAIL lines)}."""
    done = {}
    outdir = tempfile.mkdtemp(prefix="sp-conformance-")
    lock = threading.Lock()

    def one(client):
        path = os.path.join(outdir, client + ".log")
        env = client_env(client, s, data, images)
        if sdk_of(client) in installed:
            env["CONFORMANCE_SKIP_INSTALL"] = "1"
        t0 = time.time()
        with open(path, "w") as out:
            rc = subprocess.call([os.path.join(HERE, sdk_of(client), "run.sh")] + filters,
                                 env=env, stdout=out, stderr=subprocess.STDOUT)
        secs = time.time() - t0
        with lock:  # one client's output at a time, whole
            with open(path) as f:
                text = f.read()
            done[client] = (rc, secs, [ln.strip() for ln in text.splitlines()
                                       if ln.lstrip().startswith("FAIL ")])
            print("==== conformance %s: %s in %.0f s ====\n%s" % (client, word(rc), secs, text),
                  end="" if text.endswith("\n") else "\n", flush=True)

    def lane(clients):
        for c in clients:
            if c in ready:
                one(c)

    threads = [threading.Thread(target=lane, args=(ln,)) for ln in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shutil.rmtree(outdir, ignore_errors=True)
    return done


def word(rc):
    return "passed" if rc == 0 else "skipped" if rc == SKIP else "FAILED (exit %d)" % rc


def main():
    lanes = [ln.split(",") for ln in sys.argv[1].split("+")] if len(sys.argv) > 1 else []
    names = [c for ln in lanes for c in ln]
    if not names or any(c not in CLIENTS for c in names) or len(set(names)) != len(names):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    filters = sys.argv[2:]
    data = os.environ.get("SP_TEST_DATA_DIR")
    binary = os.environ.get("SPACED")
    if any(sdk_of(c) == "python" for c in names):
        # The pinned SDKs beside the project (../shared/pysdk, importable by Debian's
        # python3 without PyPI) unless another interpreter was named.
        pysdk = os.path.join(HERE, "..", "..", "shared", "pysdk", "python3")
        if not os.environ.get("CONFORMANCE_PYTHON") and os.access(pysdk, os.X_OK):
            os.environ["CONFORMANCE_PYTHON"] = os.path.abspath(pysdk)
            os.environ["CONFORMANCE_REQUIRE_SDK"] = "1"  # there: an import error is a failure
    if len(names) == 1 and sdk_of(names[0]) in ("js", "cli") and (
            shutil.which("node") is None or shutil.which("npm") is None):
        skip("node and npm are not installed (scripts/lib.sh installs them)")
    if len(names) == 1 and sdk_of(names[0]) == "python":
        rc = prepare(names[0], set())
        if rc is not None:
            return rc
    if not binary or not os.access(binary, os.X_OK):
        skip("SPACED does not name the spaced binary")
    if data is None or not os.path.exists(os.path.join(data, "templates", "base", "current")):
        skip("SP_TEST_DATA_DIR has no built base template (ctest's e2e.template makes one)")
    if any(sdk_of(c) != "cli" for c in names) and not os.path.exists(
            os.path.join(data, "templates", "code-interpreter-v1", "current")):
        # Not a skip: the code_interpreter scenarios run and fail on the missing template.
        print("conformance: note: SP_TEST_DATA_DIR has no built code-interpreter-v1 template, "
              "the code_interpreter scenarios will fail (spaced template build "
              "code-interpreter-v1, or ctest's e2e.template-ci)", file=sys.stderr)
    if os.geteuid() != 0:
        skip("needs root (microVMs, PostgreSQL as the postgres user)")
    if pg_bindir() is None:
        skip("PostgreSQL is not installed")

    results, ready, installed = {}, [], set()
    if len(names) > 1:
        for c in names:
            rc = prepare(c, installed)
            if rc is None:
                ready.append(c)
            else:
                results[c] = (rc, 0.0, [])
        if not ready:
            return 1 if any(r[0] != SKIP for r in results.values()) else SKIP

    # The registry images (SDK clients only: the CLI builds from its Dockerfile), then
    # PostgreSQL, spaced on the data dir and a key of the default team (s.key)
    images = Images() if any(sdk_of(c) != "cli" for c in names) else None
    try:
        p = Platform(teams=(None,), binary=binary, data_dir=data,
                     env={"SPACE_ACCEL": os.environ.get("SPACE_ACCEL", "auto")})
    except BaseException:
        if images is not None:
            images.stop()
        raise
    s = p.s
    try:
        print("conformance: spaced on http://127.0.0.1:%d (log %s)" % (s.port, s.log_path),
              flush=True)
        if len(names) == 1:
            client = names[0]
            rc = subprocess.call([os.path.join(HERE, sdk_of(client), "run.sh")] + filters,
                                 env=client_env(client, s, data, images))
            if rc not in (0, SKIP):
                print("---- spaced log (tail) ----\n" + s.read_log(), file=sys.stderr)
            return rc
        results.update(run_lanes(lanes, ready, s, data, filters, installed, images))
        for c in names:
            rc, secs, fails = results[c]
            print("conformance: %-12s %s in %.0f s" % (c, word(rc), secs), flush=True)
            for ln in fails:  # again here, where the tail of a long CI log shows them
                print("conformance: %-12s   %s" % (c, ln[:400]), flush=True)
        failed = [c for c in names if results[c][0] not in (0, SKIP)]
        if failed:
            print("---- spaced log (tail) ----\n" + s.read_log(), file=sys.stderr)
            return 1
        return SKIP if all(results[c][0] == SKIP for c in names) else 0
    finally:
        p.destroy()
        if images is not None:
            images.stop()


if __name__ == "__main__":
    sys.exit(main())
