"""deploy/ checked offline against the program it deploys, so the two cannot drift apart:

- every kustomize overlay renders with `kubectl kustomize` (whatever kubectl is on the PATH;
  scripts/lib.sh installs Debian's kubernetes-client when there is none), and every document
  has apiVersion, kind and metadata.name; containers name a tagged image (never latest), every
  $(VAR) in their arguments is in their env, every volume mount has its volume, every Secret
  and ConfigMap they use is in the same output;
- every option the manifests, the config files and the systemd units give spaced is one
  `spaced serve` accepts: its getopt table in server/server.c, plus the many-host options by
  name until they land there (FLEET below);
- deploy/Containerfile: FROM pinned to a Debian 12 tag (never latest), every COPY source exists,
  every folder the top-level CMakeLists.txt builds is copied or skipped, every package it
  installs is known to apt-cache;
- the systemd units (deploy/systemd/*.in and packaging/spaced.service.in), written as
  `cmake --install` writes them with ExecStart on this build's spaced, pass
  `systemd-analyze verify` without a word about them.

What this does not do: build the image (no registry to pull the base image from), apply the
manifests to a cluster, or start the units. Environment: SPACED (the built spaced, for the
units' ExecStart), KUBECTL (default: kubectl on the PATH). Exits 77 (skipped) when kubectl is
missing, after the other checks passed."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DEPLOY = os.path.join(SRC, "deploy")
K8S = os.path.join(DEPLOY, "kubernetes")

# The many-host options (issue 20), fixed by name, being added to spaced beside this.
FLEET = {"role", "advertise", "snapshot-dir", "cluster-key-file", "worker-vcpus",
         "worker-memory-mb", "worker-labels", "heartbeat-timeout-s", "lost-grace-s"}
# In the shared getopt table but meaningful only to other commands (keys, teams, template).
NOT_SERVE = {"help", "team", "name", "force", "no-snapshot", "templates-dir", "sandboxes",
             "vcpus", "memory-mb"}

errors = []


def fail(where, msg):
    errors.append("%s: %s" % (where, msg))


def serve_options():
    """name -> takes a value, from the getopt table(s) in server/."""
    opts = {}
    for f in sorted(os.listdir(os.path.join(SRC, "server"))):
        if f.endswith(".c"):
            with open(os.path.join(SRC, "server", f)) as fh:
                for m in re.finditer(r'\{"([a-z0-9-]+)",\s*(no|required|optional)_argument',
                                     fh.read()):
                    opts[m.group(1)] = m.group(2) != "no"
    # The table moved or changed shape: say so rather than accept nothing (or anything).
    if not {"listen", "data-dir", "database-url", "master-key-file"} <= set(opts):
        sys.exit("cannot find spaced's getopt table in server/*.c (found %s)" % sorted(opts))
    missing = sorted(FLEET - set(opts))
    if missing:
        print("not in spaced's getopt table yet, accepted by name: %s" % " ".join(missing))
    for n in FLEET:
        opts.setdefault(n, True)
    for n in NOT_SERVE:
        opts.pop(n, None)
    return opts


def check_args(where, args, opts):
    """args: a command line after `spaced serve` (["--a=b", "--c", "d", ...])."""
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("--"):
            fail(where, "%r is not an option" % a)
            continue
        name, eq, _ = a[2:].partition("=")
        if name not in opts:
            fail(where, "spaced serve has no option --%s" % name)
        elif opts[name] and not eq:
            i += 1  # the value is the next word
            if i > len(args):
                fail(where, "--%s wants a value" % name)
        elif not opts[name] and eq:
            fail(where, "--%s takes no value" % name)


def check_conf(where, text, opts):
    """A config file (server/config.c): `name = value` lines; the names are long options."""
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        name, eq, _ = s.partition("=")
        name = name.strip()
        if not eq:
            fail("%s:%d" % (where, n), "expected name = value")
        elif name == "config" or name not in opts:
            fail("%s:%d" % (where, n), "spaced serve has no option %r" % name)


# ---- Kubernetes ----

def render(kubectl, overlay):
    r = subprocess.run([kubectl, "kustomize", overlay], capture_output=True, text=True)
    if r.returncode != 0:
        fail(overlay, "kubectl kustomize failed: %s" % r.stderr.strip())
        return []
    return [d for d in yaml.safe_load_all(r.stdout) if d is not None]


def pod_spec(doc):
    kind = doc.get("kind")
    if kind in ("Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"):
        return doc.get("spec", {}).get("template", {}).get("spec")
    if kind == "Pod":
        return doc.get("spec")
    return None


def check_docs(where, docs, opts):
    have = {(d.get("kind"), (d.get("metadata") or {}).get("name")) for d in docs}
    for d in docs:
        name = (d.get("metadata") or {}).get("name")
        w = "%s: %s/%s" % (where, d.get("kind"), name)
        for k in ("apiVersion", "kind"):
            if not d.get(k):
                fail(w, "no %s" % k)
        if not name:
            fail(w, "no metadata.name")
        spec = pod_spec(d)
        if spec is None:
            continue
        vols = {v.get("name"): v for v in spec.get("volumes", [])}
        for v in vols.values():
            ref = (v.get("secret") or {}).get("secretName")
            if ref and ("Secret", ref) not in have:
                fail(w, "volume %s: no Secret %s in the output" % (v["name"], ref))
            ref = (v.get("configMap") or {}).get("name")
            if ref and ("ConfigMap", ref) not in have:
                fail(w, "volume %s: no ConfigMap %s in the output" % (v["name"], ref))
            ref = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if ref and ("PersistentVolumeClaim", ref) not in have:
                fail(w, "volume %s: no PersistentVolumeClaim %s in the output" % (v["name"], ref))
        claims = {(c.get("metadata") or {}).get("name") for c in spec.get("volumeClaimTemplates",
                                                                           [])}
        claims |= {(c.get("metadata") or {}).get("name")
                   for c in d.get("spec", {}).get("volumeClaimTemplates", [])}
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            cw = "%s container %s" % (w, c.get("name"))
            image = c.get("image", "")
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            if not tag or tag == "latest":
                fail(cw, "image %r is not pinned to a tag (or is latest)" % image)
            env = {e.get("name") for e in c.get("env", [])}
            for e in c.get("env", []):
                ref = ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
                if ref and ("Secret", ref) not in have:
                    fail(cw, "env %s: no Secret %s in the output" % (e["name"], ref))
            for a in c.get("command", []) + c.get("args", []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(a)):
                    if var not in env:
                        fail(cw, "$(%s) is not in the container's env (it would stay as is)"
                             % var)
            for m in c.get("volumeMounts", []):
                if m.get("name") not in vols and m.get("name") not in claims:
                    fail(cw, "mount %s has no volume" % m.get("name"))
            # The image's entrypoint is `spaced serve`: its args are serve's options.
            if not c.get("command") and "space" in image.rsplit("/", 1)[-1].split(":")[0]:
                check_args(cw, [str(a) for a in c.get("args", [])], opts)
        if d.get("kind") in ("Deployment", "DaemonSet"):
            for c in spec.get("containers", []):
                if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/healthz":
                    fail(w, "container %s: no readiness probe on /healthz" % c.get("name"))
                if not c.get("livenessProbe"):
                    fail(w, "container %s: no liveness probe" % c.get("name"))
                if not (c.get("resources") or {}).get("requests"):
                    fail(w, "container %s: no resource requests" % c.get("name"))
    for d in docs:
        if d.get("kind") == "ConfigMap":
            for k, v in (d.get("data") or {}).items():
                if k.endswith(".conf"):
                    check_conf("%s: ConfigMap %s %s" % (where, (d.get("metadata") or {}).get("name"), k),
                               v, opts)


def check_kubernetes(kubectl, opts):
    overlays = os.path.join(K8S, "overlays")
    names = sorted(os.listdir(overlays))
    if not names:
        fail(overlays, "no overlays")
    for o in names:
        docs = render(kubectl, os.path.join(overlays, o))
        check_docs("overlay " + o, docs, opts)
        print("overlay %s: %d documents" % (o, len(docs)))
    # Every file with a value to change is named in the README, which says what to put there.
    with open(os.path.join(K8S, "README.md")) as f:
        readme = f.read()
    for root, _, files in os.walk(K8S):
        for f in files:
            p = os.path.join(root, f)
            with open(p) as fh:
                marked = "CHANGE-ME" in fh.read()
            rel = os.path.relpath(p, K8S)
            if marked and rel != "README.md" and rel not in readme:
                fail(rel, "has CHANGE-ME values but deploy/kubernetes/README.md does not name it")


# ---- Containerfile ----

def instructions(path):
    """(line number, INSTRUCTION, rest) with continuations joined and comments dropped."""
    out, cur, start = [], "", 0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            s = line.rstrip("\n")
            if not cur and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if cur and s.lstrip().startswith("#"):
                continue
            if not cur:
                start = n
            if s.endswith("\\"):
                cur += s[:-1] + " "
                continue
            cur += s
            word, _, rest = cur.strip().partition(" ")
            out.append((start, word.upper(), rest.strip()))
            cur = ""
    return out


def check_containerfile(path):
    where = os.path.relpath(path, SRC)
    ins = instructions(path)
    froms = [(n, r) for n, w, r in ins if w == "FROM"]
    if not froms:
        fail(where, "no FROM")
    copied, skipped, pkgs = set(), set(), []
    for n, word, rest in ins:
        w = "%s:%d" % (where, n)
        if word == "FROM":
            image = rest.split()[0]
            if image.startswith("$"):
                fail(w, "FROM %s: name the image, pinned, not through an ARG" % image)
                continue
            name, _, tag = image.split("@")[0].rsplit("/", 1)[-1].partition(":")
            if name != "debian" or not re.match(r"^(12|bookworm)([.-]|$)", tag or ""):
                fail(w, "FROM %s: want Debian 12 with a pinned tag (debian:12.N-slim)" % image)
        elif word in ("COPY", "ADD"):
            parts = [p for p in rest.split() if not p.startswith("--")]
            if any(p.startswith("--from") for p in rest.split()):
                continue
            if word == "ADD":
                fail(w, "ADD: use COPY (ADD fetches URLs and unpacks archives)")
            for s in parts[:-1]:
                if not os.path.exists(os.path.join(SRC, s)):
                    fail(w, "COPY source %s is not in the tree" % s)
                copied.add(s.strip("/").split("/")[0] if "/" in s.strip("/") else s.strip("/"))
        elif word == "RUN":
            for m in re.finditer(r"-DSP_SKIP_DIRS=([^\"' ]+)", rest):
                skipped |= set(m.group(1).split(";"))
            for m in re.finditer(r"apt-get install((?:\s+[^&|;]+))", rest):
                pkgs += [p for p in m.group(1).split() if not p.startswith("-")]
        elif word == "ENTRYPOINT":
            if "spaced" not in rest or "serve" not in rest:
                fail(w, "the entrypoint is not `spaced serve`")
    # Every folder the top-level CMakeLists.txt builds is copied, or skipped on purpose.
    with open(os.path.join(SRC, "CMakeLists.txt")) as f:
        m = re.search(r"foreach\(dir ([^)]*)\)", f.read())
    for d in (m.group(1).split() if m else []):
        if os.path.exists(os.path.join(SRC, d, "CMakeLists.txt")) and d not in copied | skipped:
            fail(where, "folder %s is built but neither copied nor in SP_SKIP_DIRS" % d)
    if not pkgs:
        fail(where, "no apt-get install found")
    if shutil.which("apt-cache") is None:
        print("apt-cache is not installed: the Containerfile's packages were not checked")
        return
    # One call for all (each apt-cache reads the package lists): "pkg:" then its Candidate.
    r = subprocess.run(["apt-cache", "policy"] + sorted(set(pkgs)), capture_output=True,
                       text=True)
    known, cur = set(), None
    for line in r.stdout.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            cur = line[:-1]
        elif cur and line.strip().startswith("Candidate:") and "(none)" not in line:
            known.add(cur)
    for p in sorted(set(pkgs) - known):
        fail(where, "package %s is unknown to apt-cache (no candidate)" % p)
    print("%s: %d FROM, %d packages known to apt-cache" % (where, len(froms), len(set(pkgs))))


# ---- systemd ----

def check_units(opts):
    spaced = os.environ.get("SPACED")
    units = [os.path.join(SRC, "packaging", "spaced.service.in")]
    units += sorted(os.path.join(DEPLOY, "systemd", f)
                    for f in os.listdir(os.path.join(DEPLOY, "systemd")) if f.endswith(".in"))
    for f in os.listdir(os.path.join(DEPLOY, "systemd")):
        if f.endswith(".conf"):
            with open(os.path.join(DEPLOY, "systemd", f)) as fh:
                check_conf("deploy/systemd/" + f, fh.read(), opts)
    out = tempfile.mkdtemp(prefix="sp-units-")
    try:
        written = []
        for u in units:
            with open(u) as f:
                text = f.read()
            bindir = os.path.dirname(spaced) if spaced else "/usr/bin"
            text = (text.replace("@SPACE_BIN@", bindir).replace("@SPACE_CONF_DIR@", out)
                    .replace("@SPACE_CONF@", os.path.join(out, "spaced.conf")))
            left = re.findall(r"@[A-Z_]+@", text)
            if left:
                fail(u, "a placeholder is left: %s" % " ".join(left))
            m = re.search(r"^ExecStart=(.*?)(?<!\\)$", text.replace("\\\n", " "), re.M)
            if not m:
                fail(u, "no ExecStart")
            else:
                argv = m.group(1).split()
                if argv[1:2] != ["serve"]:
                    fail(u, "ExecStart is not `spaced serve ...`")
                check_args(os.path.relpath(u, SRC) + " ExecStart", argv[2:], opts)
            dst = os.path.join(out, os.path.basename(u)[:-3])
            with open(dst, "w") as f:
                f.write(text)
            written.append(dst)
        if shutil.which("systemd-analyze") is None:
            print("systemd-analyze is not installed: the units were not verified")
            return
        if not spaced:
            print("SPACED is not set: the units were not verified (ExecStart needs a binary)")
            return
        r = subprocess.run(["systemd-analyze", "verify", "--man=no"] + written,
                           capture_output=True, text=True)
        said = [l for l in (r.stdout + r.stderr).splitlines()
                if any(os.path.basename(w) in l for w in written)]
        if r.returncode != 0 or said:
            fail("systemd-analyze verify", "\n  ".join(said) or r.stderr.strip())
        print("systemd units verified: %s" % " ".join(os.path.basename(w) for w in written))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def self_test(opts):
    """The checks catch what they are for (a checker that passes everything passes this too)."""
    global errors
    saved, errors = errors, []
    bad = [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
            "spec": {"template": {"spec": {"containers": [{
                "name": "spaced", "image": "space:latest",
                "args": ["--no-such-option=1", "--advertise=$(NOPE):3000", "--no-jail=yes"],
                "volumeMounts": [{"name": "gone", "mountPath": "/x"}]}]}}}},
           {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {},
            "data": {"spaced.conf": "listen = :1\nlisten-typo = 1\n"}}]
    check_docs("self-test", bad, opts)
    caught, errors = errors, saved
    want = ["no-such-option", "$(NOPE)", "no-jail takes no value", "latest", "mount gone",
            "no metadata.name", "listen-typo", "readiness"]
    for w in want:
        if not any(w in e for e in caught):
            fail("self-test", "a broken manifest was not caught: %s" % w)


def main():
    opts = serve_options()
    self_test(opts)
    check_containerfile(os.path.join(DEPLOY, "Containerfile"))
    check_units(opts)
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if kubectl:
        check_kubernetes(kubectl, opts)
    if errors:
        print("\n".join(errors))
        print("FAILED: %d problem(s) in deploy/" % len(errors))
        return 1
    if not kubectl:
        print("kubectl is not installed (Debian: kubernetes-client): manifests not rendered, "
              "skipped")
        return 77
    print("deploy/: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
