"""Control plane through the Python SDK (twin of ../js/lifecycle.mjs): create, connect, list
with metadata filter and pagination, get_info, set_timeout and expiry, pause + connect with
files and a background process intact, kill, and the error cases."""
import os
import time
from datetime import datetime, timezone

from e2b import (
    AuthenticationException,
    CommandExitException,
    ConnectionConfig,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)

from lib import (API, REQUEST_TIMEOUT, RUN_ID, TEMPLATE, forget, gone, new_sandbox, raises,
                 scenario, shared_sandbox, wait_for)

A = "lifecycle"
UNKNOWN_ID = "nosuchsandbox" + RUN_ID
# Seconds of silence on the pooled connections (h2o's own default closed them after 10).
IDLE_WAIT = float(os.environ.get("CONFORMANCE_IDLE_WAIT", "15"))
main = shared_sandbox(metadata={"group": "main", "purpose": "lifecycle"}, envs={"LC": "yes"})


def now():
    return datetime.now(timezone.utc)


def listed(metadata, state=None, limit=None, **opts):
    """All pages of Sandbox.list for this filter; returns (items, pages)."""
    p = Sandbox.list(query=SandboxQuery(metadata=metadata, state=state), limit=limit,
                     **dict(API, **opts))
    items, pages = [], 0
    while p.has_next and pages < 10:
        items += p.next_items()
        pages += 1
    return items, pages


@scenario(A, "create")
def _create():
    sbx = main()
    assert sbx.sandbox_id.isalnum() and sbx.sandbox_id.islower(), sbx.sandbox_id
    assert sbx.sandbox_domain and sbx.sandbox_domain != "e2b.app", \
        "create must return a domain (else code-interpreter traffic goes to E2B's cloud)"
    assert sbx.get_host(8080) == "8080-%s.%s" % (sbx.sandbox_id, sbx.sandbox_domain)
    assert sbx.is_running() is True
    assert sbx.commands.run("echo ready:$LC").stdout == "ready:yes\n"


@scenario(A, "connect by id to a running sandbox")
def _connect_running():
    sbx = main()
    # The class-level connect: later envd requests carry only X-Access-Token (no id header).
    other = Sandbox.connect(sbx.sandbox_id, **API)
    assert other.sandbox_id == sbx.sandbox_id
    assert other.commands.run("echo via-connect").stdout == "via-connect\n"
    other.files.write("/tmp/connected.txt", "one sandbox")
    assert sbx.files.read("/tmp/connected.txt") == "one sandbox"


@scenario(A, "get_info")
def _get_info():
    sbx = main()
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert TEMPLATE in (info.template_id, info.name), (info.template_id, info.name)
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {"conformance": RUN_ID, "group": "main", "purpose": "lifecycle"}, \
        info.metadata
    ttl = (info.end_at - info.started_at).total_seconds()
    assert 800 < ttl < 1000, "end_at - started_at = %s s, created with 900 s" % ttl
    assert info.cpu_count > 0 and info.memory_mb > 0
    again = Sandbox.get_info(sbx.sandbox_id, **API)
    assert again.sandbox_id == sbx.sandbox_id and again.state == SandboxState.RUNNING


@scenario(A, "list with metadata filter and pagination")
def _list():
    sbx = main()
    odd = {"odd key": "a&b=c d/é%"}
    a = new_sandbox(metadata=dict(group="list", **odd))
    b = new_sandbox(metadata=dict(group="list", **odd))
    want = sorted([a.sandbox_id, b.sandbox_id])
    items, pages = listed({"conformance": RUN_ID, "group": "list"}, limit=1)
    assert sorted(s.sandbox_id for s in items) == want, [s.sandbox_id for s in items]
    assert pages >= 2, "two matches with limit 1 take two pages, got %d" % pages
    for s in items:
        assert s.metadata["group"] == "list" and s.state == SandboxState.RUNNING
    by_odd, _ = listed(dict(conformance=RUN_ID, **odd))
    assert sorted(s.sandbox_id for s in by_odd) == want
    allmine, _ = listed({"conformance": RUN_ID})
    for sid in [sbx.sandbox_id] + want:
        assert any(s.sandbox_id == sid for s in allmine), sid
    none, _ = listed({"conformance": RUN_ID, "group": "nope"})
    assert none == []
    for s in (a, b):
        s.kill()
        forget(s.sandbox_id)
    after, _ = listed({"conformance": RUN_ID, "group": "list"})
    assert after == [], "killed sandboxes leave the list"


@scenario(A, "set_timeout")
def _set_timeout():
    sbx = main()
    sbx.set_timeout(1800)
    left = (sbx.get_info().end_at - now()).total_seconds()
    assert 1700 < left < 1900, "after set_timeout(1800) end_at is %s s away" % left
    Sandbox.set_timeout(sbx.sandbox_id, 600, **API)
    left = (sbx.get_info().end_at - now()).total_seconds()
    assert 500 < left < 700, "after set_timeout(600) end_at is %s s away" % left


@scenario(A, "expiry kills the sandbox")
def _expiry():
    sbx = new_sandbox(metadata={"group": "expiry"})
    sbx.set_timeout(3)
    assert (sbx.get_info().end_at - now()).total_seconds() < 10
    wait_for("the expired sandbox to be gone", lambda: gone(sbx.sandbox_id), timeout=90,
             interval=1)
    forget(sbx.sandbox_id)
    assert sbx.is_running() is False
    items, _ = listed({"conformance": RUN_ID, "group": "expiry"})
    assert items == []


def counter(sbx):
    """/home/user/counter as a number; None while it is empty (being rewritten)."""
    text = sbx.files.read("/home/user/counter").strip()
    return int(text) if text else None


@scenario(A, "pause then connect keeps files and processes", timeout=300)
def _pause():
    sbx = new_sandbox(metadata={"group": "pause"})
    sbx.files.write("/home/user/persist.txt", "kept across pause")
    bg = sbx.commands.run(
        "i=0; while true; do i=$((i+1)); echo $i > /home/user/counter; echo tick $i; "
        "sleep 0.5; done", background=True, timeout=0)
    wait_for("the counter", lambda: (counter(sbx) or 0) > 1)
    bg.disconnect()

    sbx.pause()
    assert Sandbox.get_info(sbx.sandbox_id, **API).state == SandboxState.PAUSED
    items, _ = listed({"conformance": RUN_ID, "group": "pause"}, state=[SandboxState.PAUSED])
    assert [s.sandbox_id for s in items] == [sbx.sandbox_id]
    items, _ = listed({"conformance": RUN_ID, "group": "pause"}, state=[SandboxState.RUNNING])
    assert items == []
    assert sbx.is_running() is False, "is_running while paused"
    Sandbox.pause(sbx.sandbox_id, **API)  # already paused: 409, which the SDK takes as done

    resumed = Sandbox.connect(sbx.sandbox_id, **API)
    assert resumed.get_info().state == SandboxState.RUNNING
    assert resumed.files.read("/home/user/persist.txt") == "kept across pause"
    pids = [p.pid for p in resumed.commands.list()]
    assert bg.pid in pids, "pid %d still listed: %s" % (bg.pid, pids)
    # The loop's `echo $i > counter` truncates before it writes, and the pause may have
    # caught it in between: the file is empty until the loop moves on
    seen = []
    wait_for("the counter readable after resume",
             lambda: seen.append(counter(resumed)) or seen[-1] is not None)
    before = seen[-1]
    wait_for("the counter to move after resume", lambda: (counter(resumed) or 0) > before)
    h = resumed.commands.connect(bg.pid)
    for out, _, _ in h:
        if out and "tick" in out:
            break
    # The original object still works after connect() (same access token).
    sbx.connect()
    assert sbx.commands.run("cat /home/user/persist.txt").stdout == "kept across pause"
    assert resumed.commands.kill(bg.pid) is True
    raises(CommandExitException, h.wait, what="killed process wait()")
    sbx.kill()
    forget(sbx.sandbox_id)


@scenario(A, "kill")
def _kill():
    sbx = new_sandbox(metadata={"group": "kill"})
    assert sbx.kill() is True
    forget(sbx.sandbox_id)
    raises(SandboxNotFoundException, Sandbox.get_info, sbx.sandbox_id, **API)
    assert Sandbox.kill(sbx.sandbox_id, **API) is False, "second kill: 404 -> False"
    assert sbx.is_running() is False
    raises(SandboxNotFoundException, Sandbox.connect, sbx.sandbox_id, **API)


@scenario(A, "errors: unknown sandbox")
def _unknown():
    raises(SandboxNotFoundException, Sandbox.connect, UNKNOWN_ID, what="connect", **API)
    raises(SandboxNotFoundException, Sandbox.get_info, UNKNOWN_ID, what="get_info", **API)
    raises(SandboxNotFoundException, Sandbox.set_timeout, UNKNOWN_ID, 60, what="set_timeout",
           **API)
    raises(SandboxNotFoundException, Sandbox.pause, UNKNOWN_ID, what="pause", **API)
    assert Sandbox.kill(UNKNOWN_ID, **API) is False


@scenario(A, "errors: unknown template")
def _unknown_template():
    e = raises(SandboxException, Sandbox.create, "no-such-template-" + RUN_ID,
               metadata={"conformance": RUN_ID}, **API)
    assert str(e)[:1] == "4" and str(e)[3:5] == ": ", "a 4xx with a message: %s" % e


@scenario(A, "errors: bad API key")
def _bad_key():
    bad = dict(API, api_key="e2b_" + "0" * 40)
    raises(AuthenticationException, Sandbox.create, TEMPLATE, metadata={"conformance": RUN_ID},
           what="create", **bad)
    raises(AuthenticationException, lambda: Sandbox.list(**bad).next_items(), what="list")
    sbx = main()
    raises(AuthenticationException, Sandbox.get_info, sbx.sandbox_id, what="get_info", **bad)
    raises(AuthenticationException, Sandbox.kill, sbx.sandbox_id, what="kill", **bad)
    raises(AuthenticationException, Sandbox.connect, sbx.sandbox_id, what="connect", **bad)
    assert sbx.get_info().state == SandboxState.RUNNING


@scenario(A, "errors: wrong envd access token")
def _forged():
    from packaging.version import Version
    sbx = main()
    info = sbx.get_info()
    forged = Sandbox(sandbox_id=sbx.sandbox_id, sandbox_domain=sbx.sandbox_domain,
                     envd_version=Version(info.envd_version), envd_access_token="forged-" + RUN_ID,
                     connection_config=ConnectionConfig(request_timeout=REQUEST_TIMEOUT))
    raises(AuthenticationException, forged.commands.run, "echo should-not-run", what="run")
    raises(AuthenticationException, forged.files.read, "/etc/hostname", what="read")
    raises(AuthenticationException, forged.files.write, "/tmp/forged", "x", what="write")
    assert sbx.files.exists("/tmp/forged") is False


@scenario(A, "lifecycle on_timeout pause, then connect resumes with files", timeout=300)
def _on_timeout_pause():
    sbx = new_sandbox(metadata={"group": "on-timeout-pause"}, lifecycle={"on_timeout": "pause"})
    sbx.files.write("/home/user/kept.txt", "through the timeout")
    sbx.set_timeout(3)
    wait_for("the timeout to pause the sandbox",
             lambda: Sandbox.get_info(sbx.sandbox_id, **API).state == SandboxState.PAUSED,
             timeout=120, interval=1)
    assert sbx.is_running() is False
    back = Sandbox.connect(sbx.sandbox_id, timeout=600, **API)
    assert back.get_info().state == SandboxState.RUNNING
    assert back.files.read("/home/user/kept.txt") == "through the timeout"
    back.kill()
    forget(sbx.sandbox_id)


@scenario(A, "lifecycle auto_resume wakes on traffic", timeout=300)
def _auto_resume():
    sbx = new_sandbox(metadata={"group": "auto-resume"},
                      lifecycle={"on_timeout": "pause", "auto_resume": True})
    sbx.files.write("/home/user/auto.txt", "resumed by traffic")
    sbx.pause()
    assert Sandbox.get_info(sbx.sandbox_id, **API).state == SandboxState.PAUSED
    # No connect: the envd call itself wakes it.
    assert sbx.files.read("/home/user/auto.txt") == "resumed by traffic"
    assert Sandbox.get_info(sbx.sandbox_id, **API).state == SandboxState.RUNNING
    sbx.kill()
    forget(sbx.sandbox_id)


@scenario(A, "get_metrics")
def _metrics():
    sbx = main()
    sbx.commands.run("head -c 20000000 /dev/zero | md5sum >/dev/null")
    ms = wait_for("a metrics sample", lambda: sbx.get_metrics(), timeout=60, interval=1)
    m = ms[-1]
    assert m.cpu_count > 0 and 0 <= m.cpu_used_pct <= 100 * m.cpu_count, vars(m)
    assert m.mem_total > 0 and 0 < m.mem_used <= m.mem_total, vars(m)
    assert m.disk_total > 0 and 0 <= m.disk_used <= m.disk_total, vars(m)
    assert abs((now() - m.timestamp).total_seconds()) < 600, m.timestamp
    again = Sandbox.get_metrics(sbx.sandbox_id, **API)
    assert again and again[-1].mem_total == m.mem_total
    # A series sampled every 5 s while the sandbox runs, oldest first, not one sample.
    series = []

    def two_samples():
        series[:] = sbx.get_metrics()
        return len(series) >= 2

    wait_for("a second metrics sample", two_samples, timeout=30)
    stamps = [x.timestamp for x in series]
    assert stamps == sorted(stamps), stamps


@scenario(A, "an idle pooled connection stays usable", timeout=300)
def _idle_connection():
    # The SDK keeps its connections (HTTP/2 over TLS in host routing, and always for the code
    # interpreter) pooled for 300 s; a server that drops them after a few seconds of silence
    # makes the next call fail with "EOF occurred in violation of protocol".
    sbx = main()
    assert sbx.commands.run("echo before").stdout == "before\n"
    sbx.files.write("/tmp/idle.txt", "idle")  # the envd connection, last used now
    assert sbx.get_info().state == SandboxState.RUNNING  # and the API's
    time.sleep(IDLE_WAIT)
    # Requests with a body are what a closed connection breaks (their second write fails).
    sbx.files.write("/tmp/idle.txt", "after idle")
    sbx.set_timeout(900)
    assert sbx.files.read("/tmp/idle.txt") == "after idle"
    assert sbx.commands.run("echo after").stdout == "after\n"


@scenario(A, "kill the main sandbox")
def _kill_main():
    sbx = main()
    sbx.kill()
    forget(sbx.sandbox_id)
    raises(SandboxNotFoundException, sbx.get_info)
