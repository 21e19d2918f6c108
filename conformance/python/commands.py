"""sandbox.commands and sandbox.pty through the Python SDK (twin of ../js/commands.mjs)."""
import time

from e2b import (AuthenticationException, CommandExitException, NotFoundException, PtySize,
                 TimeoutException)

from lib import RUN_ID, raises, scenario, shared_sandbox, wait_for

A = "commands"
sandbox = shared_sandbox(metadata={"group": "commands"}, envs={"SBX_ENV": "from-create"})


class Reader:
    """Reads a background handle's output in the calling thread, as far as a check needs.

    Not a thread of its own: the sync SDK's HTTP/2 connection (httpcore 1.0.7, used in the
    host-routing mode over TLS) is not safe for two threads at once. One thread reading a
    stream while another opens one can put HEADERS frames on the wire out of stream order,
    which any HTTP/2 server must treat as a connection error (RFC 9113, 5.1.1): h2o sends
    GOAWAY and closes, and every call on the connection fails with "Server disconnected".
    Between reads, the output waits in the stream's flow-control window (16 MiB)."""

    def __init__(self, handle):
        self.handle, self.out, self.pty, self.result, self.error = handle, "", b"", None, None
        self._events = iter(handle)

    def _next(self):
        stdout, _, pty = next(self._events)
        if stdout is not None:
            self.out += stdout
        if pty is not None:
            self.pty += pty

    def until(self, what, cond):
        """Reads until cond() holds; the command's own timeout bounds a read that never ends."""
        while not cond():
            try:
                self._next()
            except StopIteration:
                raise AssertionError("the command ended before %s: %r %r"
                                     % (what, self.out, self.pty)) from None
        return self

    def join(self):
        """Reads to the end; result is wait()'s, or error what it raised."""
        try:
            while True:
                self._next()
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001
            self.error = e
            return self
        try:
            self.result = self.handle.wait()
        except Exception as e:  # noqa: BLE001
            self.error = e
        return self


@scenario(A, "run")
def _run():
    sbx = sandbox()
    r = sbx.commands.run("echo hello; echo to-stderr >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hello\n", "to-stderr\n"), r
    assert sbx.commands.run("printf 'ünïcødé ✓\\n'").stdout == "ünïcødé ✓\n"
    lines = sbx.commands.run("seq 1 20000").stdout.split()
    assert len(lines) == 20000 and lines[-1] == "20000"


@scenario(A, "non-zero exit")
def _nonzero():
    sbx = sandbox()
    e = raises(CommandExitException, sbx.commands.run, "echo partial; echo broken >&2; exit 3")
    assert (e.exit_code, e.stdout, e.stderr) == (3, "partial\n", "broken\n")
    # envd's end event carries Go's wait error, which the SDK keeps as .error.
    assert e.error == "exit status 3", repr(e.error)
    k = raises(CommandExitException, sbx.commands.run, "kill -KILL $$")
    assert (k.exit_code, k.error) == (-1, "signal: killed"), (k.exit_code, k.error)
    t = raises(CommandExitException, sbx.commands.run, "kill -TERM $$")
    assert t.error == "signal: terminated", repr(t.error)
    assert sbx.commands.run("true").error in (None, ""), "no error text on success"
    e = raises(CommandExitException, sbx.commands.run, "no-such-command-" + RUN_ID)
    assert e.exit_code == 127 and "not found" in e.stderr


@scenario(A, "output streams while the command runs")
def _streams():
    sbx = sandbox()
    chunks, t0 = [], time.time()
    r = sbx.commands.run("for i in 1 2 3; do echo line $i; sleep 0.5; done",
                         on_stdout=lambda d: chunks.append((d, time.time() - t0)))
    assert "".join(c for c, _ in chunks) == r.stdout == "line 1\nline 2\nline 3\n"
    assert len(chunks) >= 2, "output came in %d chunk(s): not streamed" % len(chunks)
    assert chunks[-1][1] - chunks[0][1] >= 0.5, "output was buffered"


@scenario(A, "background + wait")
def _background():
    sbx = sandbox()
    t0 = time.time()
    h = sbx.commands.run("sleep 1.5; echo done", background=True)
    started = time.time() - t0
    assert h.pid > 0
    me = [p for p in sbx.commands.list() if p.pid == h.pid]
    assert me and me[0].cmd == "/bin/bash" and me[0].args == ["-l", "-c", "sleep 1.5; echo done"]
    r = h.wait()
    assert (r.exit_code, r.stdout) == (0, "done\n")
    assert time.time() - t0 >= 1.5 and started < time.time() - t0 - 1
    bad = sbx.commands.run("sleep 0.2; exit 4", background=True)
    assert raises(CommandExitException, bad.wait).exit_code == 4


@scenario(A, "stdin")
def _stdin():
    sbx = sandbox()
    # stdin=False (default) gives the command end-of-file at once.
    assert sbx.commands.run("cat; echo eof", timeout=30).stdout == "eof\n"
    # bash's echo writes each line at once (cat or head would buffer a pipe until exit).
    h = sbx.commands.run('while read -r l; do echo "got $l"; [ "$l" = end ] && break; done',
                         background=True, stdin=True, timeout=60)
    rd = Reader(h)
    sbx.commands.send_stdin(h.pid, "first line\n")
    rd.until("the first line back", lambda: rd.out == "got first line\n")
    sbx.commands.send_stdin(h.pid, "second ✓\nend\n")
    rd.join()
    assert rd.error is None and rd.result.stdout == "got first line\ngot second ✓\ngot end\n", \
        (rd.error, rd.out)
    raises(NotFoundException, sbx.commands.send_stdin, h.pid, "late")


@scenario(A, "kill")
def _kill():
    sbx = sandbox()
    h = sbx.commands.run("sleep 600", background=True)
    assert sbx.commands.kill(h.pid) is True
    assert raises(CommandExitException, h.wait).exit_code != 0
    wait_for("the pid to leave the list",
             lambda: all(p.pid != h.pid for p in sbx.commands.list()))
    assert sbx.commands.kill(h.pid) is False
    h2 = sbx.commands.run("sleep 600", background=True)
    assert h2.kill() is True
    raises(CommandExitException, h2.wait)


@scenario(A, "connect by pid")
def _connect():
    sbx = sandbox()
    h = sbx.commands.run("for i in $(seq 1 200); do echo tick $i; sleep 0.2; done",
                         background=True)
    first = ""
    for out, _, _ in h:
        first += out or ""
        if "tick 2\n" in first:
            break
    h.disconnect()
    assert any(p.pid == h.pid for p in sbx.commands.list()), "still running after disconnect"
    last = max(int(x.split()[1]) for x in first.splitlines() if x.startswith("tick"))
    h2 = sbx.commands.connect(h.pid)
    assert h2.pid == h.pid
    again = ""
    for out, _, _ in h2:
        again += out or ""
        if any(int(x.split()[1]) > last for x in again.splitlines()
               if x.startswith("tick ") and x.split()[1].isdigit()):
            break
    assert h2.kill() is True
    raises(CommandExitException, h2.wait)
    # envd forgets a process once it has exited: re-attaching is not_found (allow a moment).

    def not_found():
        try:
            sbx.commands.connect(h.pid).kill()
            return False
        except NotFoundException:
            return True
    wait_for("connect to the exited pid to be not found", not_found, timeout=10, interval=0.5)


@scenario(A, "env")
def _env():
    sbx = sandbox()
    r = sbx.commands.run('echo "$ONE|$TWO|$SBX_ENV"', envs={"ONE": "1", "TWO": "two words"})
    assert r.stdout == "1|two words|from-create\n", r.stdout
    assert sbx.commands.run("echo $SBX_ENV", envs={"SBX_ENV": "over"}).stdout == "over\n"
    h = sbx.commands.run("sleep 5", background=True, envs={"LISTED": "yes"})
    me = [p for p in sbx.commands.list() if p.pid == h.pid]
    assert me and me[0].envs.get("LISTED") == "yes", me
    h.kill()


@scenario(A, "cwd")
def _cwd():
    sbx = sandbox()
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    raises(Exception, sbx.commands.run, "pwd", cwd="/no/such/dir" + RUN_ID)


@scenario(A, "user")
def _user():
    sbx = sandbox()
    assert sbx.commands.run("whoami").stdout == "user\n"
    assert sbx.commands.run("whoami; echo $HOME; pwd", user="root").stdout == "root\n/root\n/root\n"
    assert sbx.commands.run("id -un; echo $HOME", user="user").stdout == "user\n/home/user\n"
    raises(AuthenticationException, sbx.commands.run, "true", user="nosuchuser" + RUN_ID)


@scenario(A, "command timeout kills the process")
def _timeout():
    sbx = sandbox()
    marker = "sleep 37.%d" % (int(time.time() * 1000) % 1000)
    t0 = time.time()
    raises(TimeoutException, sbx.commands.run, marker, timeout=2)
    assert time.time() - t0 < 30
    wait_for("the timed-out process to be gone",
             lambda: all(marker not in " ".join(p.args) for p in sbx.commands.list()))
    assert sbx.commands.run("pgrep -f '%s' || true" % marker).stdout.strip() == ""


@scenario(A, "pty")
def _pty():
    sbx = sandbox()
    term = sbx.pty.create(PtySize(rows=30, cols=100), timeout=120)
    rd = Reader(term)
    sbx.pty.send_stdin(term.pid, b"stty size; tty; echo $TERM; echo pty-$((6*7))\n")
    rd.until("the PTY to answer", lambda: b"pty-42" in rd.pty)
    text = rd.pty.decode("utf-8", "replace")
    assert "30 100" in text and "/dev/pts/" in text and "xterm-256color" in text, text
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(term.pid, b"stty size\n")
    rd.until("the new size", lambda: b"40 120" in rd.pty)
    sbx.pty.send_stdin(term.pid, b"exit 0\n")
    rd.join()
    assert rd.error is None and rd.result.exit_code == 0, rd.error
    t2 = sbx.pty.create(PtySize(rows=24, cols=80))
    assert sbx.pty.kill(t2.pid) is True
    raises(CommandExitException, t2.wait)
