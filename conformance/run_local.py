"""Runs an E2B SDK conformance suite against a local spaced on real microVMs.

    conformance/run_local.py js|python|cli [FILTER...]

Starts a private PostgreSQL and the shipped spaced on SP_TEST_DATA_DIR (a data dir with
built `base` and `code-interpreter-v1` templates, like the e2e suites), creates an API key,
points the suite at the server the way a user would (E2B_API_URL = E2B_SANDBOX_URL = the
listener, E2B_API_KEY, and spaced's CA for the code interpreter's https://49999-<id>.<domain>),
runs conformance/<sdk>/run.sh (cli: the E2B CLI, with E2B_ACCESS_TOKEN = the API key) and
stops everything again. Exit status is the suite's;
77 (skip) with the reason on stderr when it cannot run here.

Environment: SPACED (the binary; ctest sets it), SP_TEST_DATA_DIR, SP_TEST_KEEP=1 (keep
logs), SP_TEST_TIMEOUT_MULT, SPACE_ACCEL (default auto), SP_CONFORMANCE_MODE=host (host
routing over TLS instead of one plain address), CONFORMANCE_PYTHON (python: the interpreter;
default ../shared/pysdk/python3 beside the project when it exists).
"""
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from harness import Platform, pg_bindir  # noqa: E402

SKIP = 77


def skip(why):
    print("conformance: SKIP: " + why, file=sys.stderr)
    sys.exit(SKIP)


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("js", "python", "cli"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    sdk, filters = sys.argv[1], sys.argv[2:]
    data = os.environ.get("SP_TEST_DATA_DIR")
    binary = os.environ.get("SPACED")
    if sdk in ("js", "cli") and (shutil.which("node") is None or shutil.which("npm") is None):
        skip("node and npm are not installed (scripts/lib.sh installs them)")
    if sdk == "python":
        # The pinned SDKs beside the project (../shared/pysdk, importable by Debian's
        # python3 without PyPI) unless another interpreter was named.
        pysdk = os.path.join(HERE, "..", "..", "shared", "pysdk", "python3")
        if not os.environ.get("CONFORMANCE_PYTHON") and os.access(pysdk, os.X_OK):
            os.environ["CONFORMANCE_PYTHON"] = os.path.abspath(pysdk)
            os.environ["CONFORMANCE_REQUIRE_SDK"] = "1"  # there: an import error is a failure
        # Before starting anything: the SDK must import (run.sh picks the interpreter).
        rc = subprocess.call([os.path.join(HERE, "python", "run.sh"), "--check-sdk"])
        if rc != 0:
            return rc
    if not binary or not os.access(binary, os.X_OK):
        skip("SPACED does not name the spaced binary")
    if data is None or not os.path.exists(os.path.join(data, "templates", "base", "current")):
        skip("SP_TEST_DATA_DIR has no built base template (ctest's e2e.template makes one)")
    if sdk != "cli" and not os.path.exists(
            os.path.join(data, "templates", "code-interpreter-v1", "current")):
        # Not a skip: the code_interpreter scenarios run and fail on the missing template.
        print("conformance: note: SP_TEST_DATA_DIR has no built code-interpreter-v1 template, "
              "the code_interpreter scenarios will fail (spaced template build "
              "code-interpreter-v1, or ctest's e2e.template-ci)", file=sys.stderr)
    if os.geteuid() != 0:
        skip("needs root (microVMs, PostgreSQL as the postgres user)")
    if pg_bindir() is None:
        skip("PostgreSQL is not installed")

    # PostgreSQL, spaced on the data dir and a key of the default team (s.key)
    p = Platform(teams=(None,), binary=binary, data_dir=data,
                 env={"SPACE_ACCEL": os.environ.get("SPACE_ACCEL", "auto")})
    s = p.s
    try:
        url = "http://127.0.0.1:%d" % s.port
        env = dict(os.environ, E2B_API_URL=url, E2B_API_KEY=s.key)
        for k in ("E2B_DOMAIN", "E2B_DEBUG", "E2B_ACCESS_TOKEN", "E2B_SANDBOX_URL"):
            env.pop(k, None)
        # The code interpreter SDKs always use https://49999-<id>.<domain from the create
        # response>, in both modes: trust spaced's CA.
        tls = os.path.join(data, "tls")
        env.update(NODE_EXTRA_CA_CERTS=os.path.join(tls, "ca.pem"),
                   SSL_CERT_FILE=os.path.join(tls, "bundle.pem"))
        if os.environ.get("SP_CONFORMANCE_MODE", "single") == "host":
            # What a user of the README's first command sets: the domain (the SDK then talks
            # to https://api.<domain> and https://<port>-<id>.<domain>, all on spaced's one
            # listener over TLS), the key, and the CA file.
            env.pop("E2B_API_URL", None)
            env["E2B_DOMAIN"] = "space.localhost:%d" % s.port
        else:
            env["E2B_SANDBOX_URL"] = url
        if sdk == "cli":
            # The CLI's template commands insist on an access token; space takes the key.
            env["E2B_ACCESS_TOKEN"] = s.key
        print("conformance: spaced on %s (log %s)" % (url, s.log_path), flush=True)
        rc = subprocess.call([os.path.join(HERE, sdk, "run.sh")] + filters, env=env)
        if rc not in (0, SKIP):
            print("---- spaced log (tail) ----\n" + s.read_log(), file=sys.stderr)
        return rc
    finally:
        p.destroy()


if __name__ == "__main__":
    sys.exit(main())
