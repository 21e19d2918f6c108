"""A container registry on loopback and OCI images made without any network, for the suites
and benches that build templates from images (e2e/test_images.py, conformance/run_local.py,
bench/image_bench.py).

Registry: Debian's docker-registry on 127.0.0.1:<free port>, open or behind htpasswd.
make_image: an OCI layout made with umoci from the host's busybox-static, with a marker file,
ENV, WORKDIR, ENTRYPOINT + CMD (and USER, and Debian's bash-static as /bin/bash, when asked).
push: skopeo copy to a registry. Needs skopeo, umoci, docker-registry, htpasswd and busybox
(missing_tools says which are not there).
"""
import os
import shutil
import socket
import subprocess
import tempfile
import time

from harness import free_port

TOOLS = ("skopeo", "umoci", "docker-registry", "htpasswd", "busybox")


def missing_tools(extra=()):
    gone = [t for t in TOOLS + tuple(extra) if shutil.which(t) is None]
    return "missing: " + ", ".join(gone) if gone else None


def sh(*argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300, **kw)


class Registry:
    """Debian's docker-registry on 127.0.0.1:<free port>, storage in dir, htpasswd optional."""

    def __init__(self, root, user=None, password=None):
        self.dir = tempfile.mkdtemp(prefix="reg-", dir=root)
        self.port = free_port()
        cfg = ["version: 0.1", "log:", "  level: error", "storage:", "  filesystem:",
               "    rootdirectory: %s/data" % self.dir, "http:",
               "  addr: 127.0.0.1:%d" % self.port]
        if user is not None:
            pw = sh("htpasswd", "-Bbn", user, password).stdout
            with open(os.path.join(self.dir, "htpasswd"), "w") as f:
                f.write(pw)
            cfg += ["auth:", "  htpasswd:", "    realm: space-test",
                    "    path: %s/htpasswd" % self.dir]
        with open(os.path.join(self.dir, "config.yml"), "w") as f:
            f.write("\n".join(cfg) + "\n")
        self.log = open(os.path.join(self.dir, "log"), "w")
        self.proc = subprocess.Popen(["docker-registry", "serve", self.dir + "/config.yml"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("docker-registry did not start")

    @property
    def host(self):
        return "127.0.0.1:%d" % self.port

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def make_image(work, tag, marker, extra_mb=0, user=None, bash=False):
    """An OCI layout work/layout:tag: busybox, /srv/hello.txt (marker), ENV, WORKDIR, CMD,
    USER when given; bash: /bin/bash too (Debian's bash-static)."""
    root = os.path.join(work, "root-" + tag)
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "srv"))
    shutil.copy2(shutil.which("busybox"), os.path.join(root, "bin", "busybox"))
    if bash:
        shutil.copy2(shutil.which("bash-static"), os.path.join(root, "bin", "bash"))
    for applet in sh("busybox", "--list").stdout.split():
        if applet != "busybox" and "/" not in applet:
            os.symlink("busybox", os.path.join(root, "bin", applet))
    with open(os.path.join(root, "srv", "hello.txt"), "w") as f:
        f.write(marker + "\n")
    if extra_mb:
        with open(os.path.join(root, "srv", "blob.bin"), "wb") as f:
            for _ in range(extra_mb):
                f.write(os.urandom(1 << 20))
    layout = os.path.join(work, "layout")
    if not os.path.exists(layout):
        sh("umoci", "init", "--layout", layout)
    ref = "%s:%s" % (layout, tag)
    sh("umoci", "new", "--image", ref)
    sh("umoci", "insert", "--image", ref, root, "/")
    sh("umoci", "config", "--image", ref, "--config.env", "HELLO=from image",
       "--config.env", "PATH=/usr/local/bin:/usr/bin:/bin", "--config.workingdir", "/srv",
       "--config.entrypoint", "/bin/sh", "--config.entrypoint", "-c",
       "--config.cmd", "echo \"$HELLO|$(pwd)|$(id -un)\" > /tmp/cmd-ran; exec sleep 1000000",
       *(["--config.user", user] if user else []))
    shutil.rmtree(root)
    return ref


def push(ref, dest, creds=None):
    argv = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    if creds:
        argv += ["--dest-creds", creds]
    sh(*argv, "oci:" + ref, "docker://" + dest)
