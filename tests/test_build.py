"""The whole tree builds warning-free (-DSPACE_WERROR=ON) with another compiler and build type
than scripts/test's own builds (gcc Debug with sanitizers, gcc RelWithDebInfo): by default
clang, Release (-O3), in a temporary directory. About a minute and a half on 2 cores.

Environment: SP_BUILD_CC (default clang), SP_BUILD_TYPE (default Release), SP_BUILD_JOBS
(default 2). Skips (77) when the compiler is not installed."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def main():
    cc = os.environ.get("SP_BUILD_CC", "clang")
    btype = os.environ.get("SP_BUILD_TYPE", "Release")
    jobs = os.environ.get("SP_BUILD_JOBS", "2")
    cmake = os.environ.get("CMAKE", "cmake")
    if shutil.which(cc) is None:
        print("%s is not installed: skipped" % cc)
        return 77
    out = tempfile.mkdtemp(prefix="sp-build-")
    env = dict(os.environ, CC=cc)
    # The sanitizer runtime options of the surrounding test run mean nothing to a compiler.
    for k in ("ASAN_OPTIONS", "LSAN_OPTIONS", "UBSAN_OPTIONS"):
        env.pop(k, None)
    t0 = time.time()
    try:
        for argv in ([cmake, "-S", SRC, "-B", out, "-DCMAKE_BUILD_TYPE=" + btype,
                      "-DSPACE_WERROR=ON"],
                     [cmake, "--build", out, "-j" + jobs]):
            r = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
            if r.returncode != 0:
                lines = r.stdout.splitlines()
                bad = [l for l in lines if "error" in l or "warning" in l]
                print("\n".join((bad or lines)[-60:]))
                print("FAILED: %s (CC=%s, %s)" % (" ".join(argv), cc, btype))
                return 1
        print("CC=%s %s build of the whole tree: ok in %.0f s" % (cc, btype, time.time() - t0))
        return 0
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
