"""The async client (AsyncSandbox from e2b and from e2b_code_interpreter): the same calls
the sync scenarios make, through asyncio, with their own sandbox. Only the Python SDK has
this surface (the JS SDK is async throughout)."""
import asyncio

from e2b import (AsyncSandbox, CommandExitException, FilesystemEventType, NotFoundException,
                 PtySize, SandboxQuery, SandboxState)
from e2b_code_interpreter import AsyncSandbox as AsyncCiSandbox

from lib import (API, MULT, REQUEST_TIMEOUT, RUN_ID, SANDBOX_TIMEOUT, TEMPLATE, forget,
                 remember, scenario, single_address_only)

A = "async"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 240 * MULT))


async def new_async(**kw):
    kw.setdefault("timeout", SANDBOX_TIMEOUT)
    kw.setdefault("request_timeout", REQUEST_TIMEOUT)
    md = {"conformance": RUN_ID, "group": "async"}
    md.update(kw.pop("metadata", {}))
    sbx = await AsyncSandbox.create(TEMPLATE, metadata=md, **kw)
    remember(sbx.sandbox_id)
    return sbx


@scenario(A, "create, commands, files, list, kill", timeout=300)
def _basics():
    async def go():
        sbx = await new_async(envs={"ASYNC_ENV": "from-create"}, metadata={"part": "basics"})
        assert await sbx.is_running() is True
        r = await sbx.commands.run("echo $ASYNC_ENV; echo err >&2")
        assert (r.exit_code, r.stdout, r.stderr) == (0, "from-create\n", "err\n"), r
        e = await raises_async(CommandExitException, sbx.commands.run("exit 5"))
        assert (e.exit_code, e.error) == (5, "exit status 5"), (e.exit_code, e.error)
        # Several calls at once on one client.
        outs = await asyncio.gather(*[sbx.commands.run("echo %d" % i) for i in range(5)])
        assert [o.stdout for o in outs] == ["%d\n" % i for i in range(5)]
        chunks = []
        h = await sbx.commands.run("for i in 1 2 3; do echo n$i; sleep 0.3; done",
                                   background=True, on_stdout=chunks.append)
        res = await h.wait()
        assert res.stdout == "n1\nn2\nn3\n" and "".join(chunks) == res.stdout, (res, chunks)
        await sbx.files.write("/home/user/async.txt", "async ✓")
        assert await sbx.files.read("/home/user/async.txt") == "async ✓"
        names = [e.name for e in await sbx.files.list("/home/user")]
        assert "async.txt" in names, names
        info = await sbx.get_info()
        assert info.metadata["part"] == "basics" and info.state == SandboxState.RUNNING
        p = AsyncSandbox.list(query=SandboxQuery(metadata={"conformance": RUN_ID,
                                                           "part": "basics"}), limit=1, **API)
        found = []
        while p.has_next:
            found += await p.next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id], found
        other = await AsyncSandbox.connect(sbx.sandbox_id, **API)
        assert (await other.commands.run("cat /home/user/async.txt")).stdout == "async ✓"
        assert await sbx.kill() is True
        forget(sbx.sandbox_id)
        assert await AsyncSandbox.kill(sbx.sandbox_id, **API) is False
    run(go())


@scenario(A, "background process: kill, connect, list")
def _processes():
    async def go():
        sbx = await new_async(metadata={"part": "processes"})
        h = await sbx.commands.run("sleep 600", background=True)
        assert any(p.pid == h.pid for p in await sbx.commands.list())
        assert await sbx.commands.kill(h.pid) is True
        e = await raises_async(CommandExitException, h.wait())
        assert e.error == "signal: killed", e.error
        assert await sbx.commands.kill(h.pid) is False
        h2 = await sbx.commands.run("for i in $(seq 1 100); do echo t$i; sleep 0.2; done",
                                    background=True)
        await h2.disconnect()
        seen = []
        h3 = await sbx.commands.connect(h2.pid, on_stdout=seen.append)
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.1)
        assert seen, "output after connect"
        assert await h3.kill() is True
        await raises_async(NotFoundException, sbx.commands.send_stdin(999999, "x"))
        await sbx.kill()
        forget(sbx.sandbox_id)
    run(go())


@scenario(A, "PTY")
def _pty():
    async def go():
        sbx = await new_async(metadata={"part": "pty"})
        data = bytearray()
        term = await sbx.pty.create(PtySize(rows=25, cols=90), on_data=data.extend, timeout=120)
        await sbx.pty.send_stdin(term.pid, b"stty size; echo pty-$((3*14))\n")
        for _ in range(300):
            if b"pty-42" in data:
                break
            await asyncio.sleep(0.1)
        text = data.decode("utf-8", "replace")
        assert "25 90" in text and "pty-42" in text, text
        await sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
        await sbx.pty.send_stdin(term.pid, b"stty size; exit 3\n")
        e = await raises_async(CommandExitException, term.wait())
        assert e.exit_code == 3 and b"30 100" in data, (e.exit_code, bytes(data[-200:]))
        await sbx.kill()
        forget(sbx.sandbox_id)
    run(go())


@scenario(A, "watch a directory recursively")
def _watch():
    async def go():
        sbx = await new_async(metadata={"part": "watch"})
        d = "/home/user/aw"
        await sbx.files.make_dir(d + "/sub")
        events = []
        w = await sbx.files.watch_dir(d, on_event=events.append, recursive=True, timeout=120)
        await sbx.files.write(d + "/sub/deep.txt", "deep")
        await sbx.files.write(d + "/top.txt", "top")
        for _ in range(150):
            names = {(e.name, e.type) for e in events}
            if ("sub/deep.txt", FilesystemEventType.CREATE) in names and \
                    ("top.txt", FilesystemEventType.CREATE) in names:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("events: %s" % events)
        await w.stop()
        await sbx.kill()
        forget(sbx.sandbox_id)
    run(go())


@scenario(A, "code interpreter: callbacks, contexts, errors", timeout=300)
def _code():
    # Like code_interpreter.py's scenarios: the interpreter is reached the same way in both modes.
    single_address_only("the SDK reaches the code interpreter at https://49999-<id>.<domain> in "
                        "both modes")

    async def go():
        sbx = await AsyncCiSandbox.create(timeout=SANDBOX_TIMEOUT, request_timeout=REQUEST_TIMEOUT,
                                          metadata={"conformance": RUN_ID, "group": "async-ci"})
        remember(sbx.sandbox_id)
        outs, results = [], []

        async def on_result(r):  # an async callback is awaited
            results.append(r)
        ex = await sbx.run_code('print("a")\nprint("b")\n{"k": [1, 2]}',
                                on_stdout=outs.append, on_result=on_result)
        assert ex.error is None, ex.error
        assert "".join(m.line for m in outs) == "a\nb\n", outs
        assert results and results[-1].json == {"k": [1, 2]}, results
        ctx = await sbx.create_code_context(cwd="/tmp")
        await sbx.run_code("z = 5", context=ctx)
        assert (await sbx.run_code("z * 2", context=ctx)).text == "10"
        assert any(c.id == ctx.id for c in await sbx.list_code_contexts())
        await sbx.restart_code_context(ctx)
        err = await sbx.run_code("z", context=ctx)
        assert err.error is not None and err.error.name == "NameError", err.error
        await sbx.remove_code_context(ctx)
        bash = await sbx.run_code("echo $((2 + 3))", language="bash")
        assert "".join(bash.logs.stdout) == "5\n", bash.logs
        await sbx.kill()
        forget(sbx.sandbox_id)
    run(go())


async def raises_async(cls, awaitable):
    try:
        await awaitable
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, cls), "expected %s, got %s: %s" % (cls.__name__, type(e).__name__, e)
        return e
    raise AssertionError("expected %s, call succeeded" % cls.__name__)
