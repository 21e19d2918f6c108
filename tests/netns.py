"""Network namespaces for multi-node suites: one bridge in the root namespace (the test's side,
with the first address of a private /24) and one namespace per node, each joined to the bridge
by a veth pair and holding an address of its own (and its loopback). Standard library and
iproute2 only; root.

    lab = Netns(["api1", "w1"])           # bridge up, namespaces made (cleans a killed run's)
    lab.addr["w1"]                        # "10.213.N.3"
    lab.wrap("w1") + ["spaced", ...]      # a command run inside w1's namespace
    lab.destroy()                         # everything removed; also on a failure

Every name carries the creating process's pid (`spnt<pid>...`: namespaces spnt<pid>-<node>,
the bridge spnt<pid>b, veths spnt<pid>v<i>), so a run removes what a run that died left behind
(its pid gone) and never what a run beside it made. Nodes run under `nsenter --net=`, which
changes the network namespace only (not `ip netns exec`: that remounts /sys, hiding the cgroup
tree a worker needs) and exec's in place, so the pid a test holds is the node's.
"""
import os
import re
import shutil
import signal
import subprocess

PREFIX = "spnt"
NAME_RE = re.compile(r"^%s(\d+)(?:-|b$|v\d+$|p\d+$)" % PREFIX)


def ip(*args, check=True):
    return subprocess.run(["ip"] + list(args), capture_output=True, text=True, check=check)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def skip_reason():
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return "%s is not installed" % tool
    probe = "%s%d-probe" % (PREFIX, os.getpid())
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return "ip netns add failed: " + r.stderr.strip()
    ip("netns", "del", probe, check=False)
    return None


def stale_names():
    """(namespaces, links) whose names carry the pid of a process that is gone."""
    def dead(name):
        m = NAME_RE.match(name)
        return m is not None and not pid_alive(int(m.group(1)))
    spaces = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]
    links = []
    for line in ip("-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        links.append(name)
    return [n for n in spaces if dead(n)], [n for n in links if dead(n)]


def kill_in(ns):
    """SIGKILLs every process in namespace ns (a dead run's nodes: only ever ours)."""
    r = ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def clean_stale():
    """Removes the namespaces and links a killed run left (their processes killed first)."""
    spaces, links = stale_names()
    for ns in spaces:
        kill_in(ns)
        ip("netns", "del", ns, check=False)
    for link in links:
        ip("link", "del", link, check=False)
    return spaces + links


def free_subnet():
    """A 10.213.N.0/24 no route of this host uses (a run beside us, or the host's own)."""
    used = ip("-4", "route", "show", "table", "all").stdout
    for n in [os.getpid() % 200 + 20] + list(range(20, 220)):
        if "10.213.%d." % n not in used:
            return "10.213.%d" % n
    raise RuntimeError("no free 10.213.N.0/24 subnet")


class Netns:
    """A bridge with the root namespace on .1 and one namespace per name on .2, .3, ..."""

    def __init__(self, names):
        self.cleaned = clean_stale()
        self.tag = "%s%d" % (PREFIX, os.getpid())
        self.bridge = self.tag + "b"
        self.net = free_subnet()
        self.host = self.net + ".1"  # the root namespace, on the bridge
        self.addr = {}
        self.ns = {}
        self.made = []  # namespaces made, for destroy
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", self.host + "/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                self.add(i, name)
        except BaseException:
            self.destroy()
            raise

    def add(self, i, name):
        ns = "%s-%s" % (self.tag, name)
        veth, peer = "%sv%d" % (self.tag, i), "%sp%d" % (self.tag, i)
        ip("netns", "add", ns)
        self.made.append(ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", ns)
        ip("link", "set", veth, "master", self.bridge, "up")
        addr = "%s.%d" % (self.net, i + 2)
        ip("-n", ns, "link", "set", peer, "name", "eth0")
        ip("-n", ns, "addr", "add", addr + "/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        self.addr[name] = addr
        self.ns[name] = ns

    def wrap(self, name):
        """The argv prefix that runs a command inside name's namespace."""
        return ["nsenter", "--net=/run/netns/" + self.ns[name], "--"]

    def pids(self, name):
        r = ip("netns", "pids", self.ns[name], check=False)
        return [int(p) for p in r.stdout.split()]

    def destroy(self):
        """Kills what still runs in the namespaces, removes them (their veth ends go with
        them) and the bridge. Safe to call twice."""
        for ns in self.made:
            kill_in(ns)
            ip("netns", "del", ns, check=False)
        self.made = []
        ip("link", "del", self.bridge, check=False)
