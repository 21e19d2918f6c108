"""Runs the Python conformance scenarios against the server named by the environment and
prints what passed.

    python3 run.py [FILTER...]
    python3 run.py --check-sdk      (only: is the pinned SDK importable? 0 or 77)

FILTER: substrings of "area/scenario" (CONFORMANCE_FILTER: comma-separated, the same).
Exit: 0 all passed, 1 some failed, 2 bad configuration, 77 the pinned SDK is not importable.
"""
import json
import os
import re
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def pinned_version(dist="e2b"):
    with open(os.path.join(HERE, "requirements.txt")) as f:
        for line in f:
            m = re.match(r"\s*%s==([\w.]+)" % re.escape(dist), line)
            if m:
                return m.group(1)
    return None


def check_sdk():
    # Both pinned packages: the SDK and the code interpreter SDK built on it.
    for dist, module in (("e2b", "e2b"), ("e2b-code-interpreter", "e2b_code_interpreter")):
        try:
            mod = __import__(module)
        except Exception as e:  # noqa: BLE001 - any import failure means "cannot run here"
            if os.environ.get("CONFORMANCE_REQUIRE_SDK"):
                print("conformance.python: the pinned SDK is there but %s does not import (%s: "
                      "%s): a Debian package it needs is missing (scripts/lib.sh lists them)"
                      % (module, type(e).__name__, e), file=sys.stderr)
                sys.exit(1)
            print("conformance.python: SKIP: cannot import the %s package (%s: %s); the pinned "
                  "SDKs are read from ../shared/pysdk beside the project (with the Debian "
                  "packages scripts/lib.sh installs), or install them: python3 -m venv .venv "
                  "&& .venv/bin/pip install -r requirements.txt"
                  % (module, type(e).__name__, e), file=sys.stderr)
            sys.exit(77)
        want = pinned_version(dist)
        try:
            from importlib.metadata import PackageNotFoundError, version
            have = version(dist)
        except PackageNotFoundError:
            # A source checkout on PYTHONPATH has no distribution metadata.
            print("conformance.python: note: %s imported from %s without package metadata; "
                  "cannot confirm it is %s" % (module, os.path.dirname(mod.__file__), want))
            continue
        if have != want:
            print("conformance.python: the installed %s is %s, requirements.txt pins %s"
                  % (dist, have, want), file=sys.stderr)
            sys.exit(1)


def one_line(e):
    text = "%s: %s" % (type(e).__name__, e)
    return re.sub(r"\s+", " ", text)[:300]


def table(rows):
    head = ["area", "scenario", "result", "ms"]
    data = [[r["area"], r["scenario"],
             "SKIP" if r.get("skipped") else "PASS" if r["ok"] else "FAIL", str(r["ms"])]
            for r in rows]
    w = [max([len(head[i])] + [len(d[i]) for d in data]) for i in range(4)]

    def line(c):
        return " | ".join(c[i].rjust(w[i]) if i == 3 else c[i].ljust(w[i]) for i in range(4))
    return "\n".join([line(head), "-|-".join("-" * n for n in w)] + [line(d) for d in data])


def main():
    check_sdk()
    if sys.argv[1:] == ["--check-sdk"]:
        return 0
    sys.path.insert(0, HERE)
    import lib
    import lifecycle  # noqa: F401 - registers scenarios
    import commands  # noqa: F401
    import files  # noqa: F401
    import code_interpreter  # noqa: F401
    import ports  # noqa: F401
    import async_sdk  # noqa: F401
    import templates  # noqa: F401
    import snapshots  # noqa: F401

    problem = lib.config_problem()
    if problem:
        print("conformance: " + problem, file=sys.stderr)
        return 2
    filters = sys.argv[1:] + [f for f in os.environ.get("CONFORMANCE_FILTER", "").split(",") if f]
    selected = [s for s in lib.registered()
                if not filters or any(f in "%s/%s" % (s[0], s[1]) for f in filters)]
    base = ("sandbox URL " + os.environ["E2B_SANDBOX_URL"]) if os.environ.get("E2B_SANDBOX_URL") \
        else ("domain " + os.environ.get("E2B_DOMAIN", ""))
    print("e2b Python SDK conformance: API %s, %s, template %s, run %s"
          % (os.environ.get("E2B_API_URL", "(from domain)"), base, lib.TEMPLATE, lib.RUN_ID),
          flush=True)

    results = []
    for area, name, fn, timeout in selected:
        box = {}

        def body():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                box["err"] = e
        t0 = time.time()
        th = threading.Thread(target=body, daemon=True)
        th.start()
        th.join(timeout)
        if th.is_alive():
            box["err"] = TimeoutError("scenario deadline of %d s passed" % timeout)
        ms = int((time.time() - t0) * 1000)
        err = box.get("err")
        skipped = isinstance(err, lib.Skip)
        if skipped:
            err = None
        results.append({"area": area, "scenario": name, "ok": err is None, "ms": ms,
                        "skipped": skipped, "why": str(box["err"]) if skipped else None,
                        "error": one_line(err) if err else None})
        word = "FAIL" if err else "SKIP" if skipped else "PASS"
        print("  %s %s/%s (%d ms)%s" % (word, area, name, ms,
                                        ": " + one_line(err) if err else
                                        ": " + str(box["err"]) if skipped else ""), flush=True)
        if err and os.environ.get("CONFORMANCE_VERBOSE"):
            import traceback
            traceback.print_exception(type(err), err, err.__traceback__)

    leftovers = lib.cleanup()
    failed = [r for r in results if not r["ok"]]
    print("\n" + table(results))
    skipped = [r for r in results if r.get("skipped")]
    print("\n%d/%d passed, %d skipped here" % (len(results) - len(failed) - len(skipped),
                                                len(results), len(skipped)))
    if failed:
        print("\nfailures:")
        for r in failed:
            print("  %s/%s: %s" % (r["area"], r["scenario"], r["error"]))
    if leftovers:
        print("\ncleanup could not kill: " + "; ".join(leftovers))
    if os.environ.get("CONFORMANCE_JSON"):
        with open(os.environ["CONFORMANCE_JSON"], "w") as f:
            json.dump(results, f, indent=2)
    sys.stdout.flush()
    # Threads of scenarios that overran their deadline may still block: do not wait for them.
    os._exit(1 if failed or not results else 0)


if __name__ == "__main__":
    sys.exit(main())
