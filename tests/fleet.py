"""What suites with several QEMU workers on one machine share: a worker's data dir made from the
e2e data dir's base template build, the QEMU processes seen from /proc and the one a worker
runs for a sandbox, and a guest port server for forwarded-port checks. Standard library only.
"""
import os
import socket
import subprocess

from harness import MULT

# In the guest (python3 -c): port 8080 answers HTTP with "port ok <path>", and upgrades a
# request asking for a WebSocket to a pretend one that upper-cases what it gets after the 101
# (the bytes are what matters: the forwarders pass them through untouched).
PORT_SERVER = r"""
import socket, threading
def serve(c):
    f = c.makefile('rb')
    line = f.readline()
    hdrs = {}
    while True:
        h = f.readline()
        if h in (b'\r\n', b''):
            break
        k, v = h.decode().split(':', 1)
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get('upgrade', '').lower() == 'websocket':
        c.sendall(b'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n')
        while True:
            b = c.recv(65536)
            if not b:
                break
            c.sendall(b.upper())
    else:
        body = ('port ok ' + line.decode().split()[1]).encode()
        c.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n' % len(body) + body)
    c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', 8080)); s.listen(8)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def websocket_echo(addr, port, host, payload):
    """Upgrades GET /ws on addr:port (Host: host) to PORT_SERVER's WebSocket, sends payload:
    (the response head, the bytes that came back, as many as were sent)."""
    s = socket.create_connection((addr, port), timeout=60 * MULT)
    try:
        s.sendall(b"GET /ws HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                  b"Sec-WebSocket-Key: x\r\nSec-WebSocket-Version: 13\r\n\r\n" % host.encode())
        got = b""
        while b"\r\n\r\n" not in got:
            b = s.recv(4096)
            if not b:
                return got, b""
            got += b
        head, back = got.split(b"\r\n\r\n", 1)
        if not head.startswith(b"HTTP/1.1 101"):
            return head, back
        s.sendall(payload)
        while len(back) < len(payload):
            b = s.recv(4096)
            if not b:
                break
            back += b
        return head, back
    finally:
        s.close()


def worker_data_dir(data, path):
    """A data dir at path holding data's current base template build (files hard-linked,
    directories its own) and its images, so a worker neither touches data nor builds."""
    cur = os.path.realpath(os.path.join(data, "templates", "base", "current"))
    h = os.path.basename(cur)
    os.makedirs(os.path.join(path, "templates", "base", h))
    for name in os.listdir(cur):
        src = os.path.join(cur, name)
        if os.path.isfile(src) and not os.path.islink(src):
            os.link(src, os.path.join(path, "templates", "base", h, name))
    os.symlink(h, os.path.join(path, "templates", "base", "current"))
    os.makedirs(os.path.join(path, "images"))
    subprocess.run(["cp", "-al", os.path.join(data, "images") + "/.",
                    os.path.join(path, "images")], check=True)


def qemu_cmdlines():
    """(pid, command line) of every qemu-system process."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]).startswith(b"qemu-system"):
            out.append((int(pid), b" ".join(argv).decode(errors="replace")))
    return out


def kill_qemus(under):
    """SIGKILLs every QEMU whose command line names a path under the directory under."""
    n = 0
    for pid, line in qemu_cmdlines():
        if under in line:
            try:
                os.kill(pid, 9)
                n += 1
            except OSError:
                pass
    return n


def vm_pid(data_dir, sid):
    """The pid of the live QEMU a worker (its data dir) runs for sandbox sid, else None: the
    pid in its VM dir's qemu.pid (a spare clone's dir is renamed to the sandbox's, so its
    command line may name the spare) is a running qemu-system process."""
    try:
        with open(os.path.join(data_dir, "vms", sid, "qemu.pid")) as f:
            pid = int(f.read().strip())
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv0 = f.read().split(b"\0")[0]
    except (OSError, ValueError):
        return None
    return pid if os.path.basename(argv0).startswith(b"qemu-system") else None


def live_vms(data_dir):
    """{sandbox id: qemu pid} of the VMs alive under a worker's data dir."""
    out = {}
    vms = os.path.join(data_dir, "vms")
    for sid in os.listdir(vms) if os.path.isdir(vms) else []:
        pid = vm_pid(data_dir, sid)
        if pid is not None:
            out[sid] = pid
    return out
