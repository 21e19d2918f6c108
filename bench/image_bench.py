#!/usr/bin/env python3
"""Templates from container images: the import next to the tools alone, from the same run.

  bench/image_bench.py BUILD_DIR [DATA_DIR]

Each round makes a fresh ~100 MB OCI image (busybox and 100 MiB of random bytes: a new digest,
nothing cached), pushes it to Debian's docker-registry on loopback, then prints medians of:
  - `skopeo copy` docker:// -> oci: plus `umoci raw unpack`, alone (the baseline);
  - our import of it (the build log's "imported in" figure: inspect, pull, layer checks,
    unpack, the tree made bootable, mkfs.ext4 -d and qemu-img convert);
  - the same image again: the digest cache;
  - the whole template build (import, builder VM, disk export, template snapshot).
Needs root, QEMU, PostgreSQL, skopeo, umoci, docker-registry. Machines here are shared and
noisy: read ratios, not absolutes. Environment: BENCH_ROUNDS (3), BENCH_IMAGE_MB (100).
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from benchlib import Platform, build_template, line, ratio  # noqa: E402
from oci_registry import Registry, make_image, push  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
MB = int(os.environ.get("BENCH_IMAGE_MB", "100"))


def build(s, body):
    t0 = time.time()
    _, b = build_template(s, body)
    st, text = s.request("GET", "/v1/templates/%s/builds/%s/logs" % (b["template"], b["id"]))
    text = text.decode() if isinstance(text, bytes) else str(text)
    secs = None
    for ln in text.splitlines():
        for key in (" imported in ", " digest cache in "):
            if key in ln:
                secs = float(ln.split(key)[1].split(" s")[0])
    return (time.time() - t0) * 1000, secs * 1000 if secs is not None else None


def tools_alone(reg, ref, work):
    out = tempfile.mkdtemp(dir=work)
    t0 = time.time()
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "docker://" + ref,
                    "oci:%s/layout:img" % out], check=True)
    subprocess.run(["umoci", "raw", "unpack", "--image", "%s/layout:img" % out, out + "/rootfs"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ms = (time.time() - t0) * 1000
    shutil.rmtree(out)
    return ms


def main():
    work = tempfile.mkdtemp(prefix="sp-image-bench-")
    reg = Registry(work)
    p = Platform(sys.argv, templates=("base",)).start()
    s = p.s
    try:
        alone, ours, cached, total = [], [], [], []
        for i in range(ROUNDS):
            tag = "r%d-%d" % (i, os.getpid())
            ref = make_image(work, tag, "round-%d" % i, extra_mb=MB)
            dest = "%s/bench:%s" % (reg.host, tag)
            push(ref, dest)
            alone.append(tools_alone(reg, dest, work))
            ms, imp = build(s, {"name": "imgbench", "from": {"image": dest}, "force": True})
            total.append(ms)
            ours.append(imp)
            ms, imp = build(s, {"name": "imgbench2", "from": {"image": dest}, "force": True})
            cached.append(imp)
            print("round %d: tools %.0f ms, import %.0f ms, cached %.0f ms, build %.0f ms"
                  % (i + 1, alone[-1], ours[-1], cached[-1], total[-1]), flush=True)
        print()
        line("skopeo copy + umoci unpack alone", alone)
        line("our import (pull, checks, unpack, bootable, disk)", ours)
        line("the same digest again (digest cache)", cached)
        line("whole build from the image (VM, snapshot)", total)
        ratio("import / tools alone", statistics.median(ours), statistics.median(alone))
    finally:
        for n in ("imgbench", "imgbench2"):
            s.request("DELETE", "/v1/templates/" + n, timeout=30)
        p.stop()
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
