"""Snapshots of a running sandbox (e2b-templates.md section 4): create_snapshot keeps the sandbox
running; Sandbox.create(snapshot_id) three times gives three sandboxes that each continue the
snapshot's in-memory Python counter on their own, see its files, and draw different random bytes;
a named snapshot; list_snapshots filtered by sandbox, paged one at a time through x-next-token;
delete_snapshot True then False, and a deleted snapshot no longer creates.

Snapshot calls are control-plane only: run in the single-address mode (the host-routing run skips
them)."""
import time

from e2b import Sandbox
from e2b.exceptions import SandboxException

from lib import API, RUN_ID, SINGLE_ADDRESS, Skip, remember, scenario

A = "snapshots"

# A counter that lives only in a Python process's memory; /tmp/count shows it.
COUNTER = ("nohup python3 -c 'import os, time\nopen(\"/tmp/count.pid\", \"w\").write(str(os.getpid()))"
           "\ni = 0\nwhile True:\n    i += 1\n"
           "    open(\"/tmp/count.tmp\", \"w\").write(str(i))\n"
           "    __import__(\"os\").rename(\"/tmp/count.tmp\", \"/tmp/count\")\n"
           "    time.sleep(0.1)' >/dev/null 2>&1 &")


def only_once():
    if not SINGLE_ADDRESS:
        raise Skip("snapshots run in the single-address mode only")


def count(sbx):
    # python3 takes a while to start under TCG: wait for its first write
    r = sbx.commands.run("for i in $(seq 1 100); do [ -s /tmp/count ] && break; sleep 0.2; done;"
                         " cat /tmp/count")
    return int(r.stdout.strip())


def rising(sbx):
    a = count(sbx)
    deadline = time.time() + 20
    while time.time() < deadline:
        time.sleep(0.5)
        b = count(sbx)
        if b > a:
            return a, b
    raise AssertionError("counter stuck at %d in %s" % (a, sbx.sandbox_id))


@scenario(A, "Snapshot of a running sandbox, three forks from it, names, list, delete",
          timeout=600)
def _forks():
    only_once()
    src = Sandbox.create(**API)
    remember(src.sandbox_id)
    made = []
    try:
        src.commands.run(COUNTER)
        src.files.write("/home/user/state.txt", "at-snapshot-" + RUN_ID)
        rising(src)
        snap = src.create_snapshot()
        assert snap.snapshot_id.endswith(":default"), snap
        assert snap.names == [], snap
        at_snap = count(src)  # the source goes on running, and changes its file afterwards
        src.files.write("/home/user/state.txt", "after-snapshot")
        assert src.is_running(), "the source stopped"

        forks = []
        for _ in range(3):
            f = Sandbox.create(snap.snapshot_id, **API)
            remember(f.sandbox_id)
            forks.append(f)
        ids = {f.sandbox_id for f in forks} | {src.sandbox_id}
        assert len(ids) == 4, ids
        rnd = set()
        for f in forks:
            got = f.files.read("/home/user/state.txt")
            assert got == "at-snapshot-" + RUN_ID, got
            a, b = rising(f)  # the process came back with the memory, and runs
            # it continued from the snapshot's count, not from zero (a fork restarts nothing)
            assert a >= at_snap - 50, (a, at_snap)
            rnd.add(f.commands.run("head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
                    .stdout)
        assert len(rnd) == 3, rnd
        # independent: stopping one fork's counter leaves the others going
        forks[0].commands.run("kill $(cat /tmp/count.pid)")
        time.sleep(0.5)
        stopped = count(forks[0])
        rising(forks[1])
        time.sleep(0.5)
        assert count(forks[0]) == stopped, (count(forks[0]), stopped)

        named = Sandbox.create_snapshot(src.sandbox_id, name="conf-snap-" + RUN_ID, **API)
        assert named.snapshot_id.endswith(":default"), named
        assert named.names and named.names[0].endswith("conf-snap-" + RUN_ID), named
        f = Sandbox.create(named.snapshot_id, **API)
        remember(f.sandbox_id)
        forks.append(f)
        got = f.files.read("/home/user/state.txt")
        assert got == "after-snapshot", got

        # listed for this sandbox, one per page
        seen = []
        pager = Sandbox.list_snapshots(sandbox_id=src.sandbox_id, limit=1, **API)
        pages = 0
        while pager.has_next and pages < 10:
            items = pager.next_items()
            pages += 1
            assert len(items) <= 1, items
            seen += [i.snapshot_id for i in items]
        assert set(seen) == {snap.snapshot_id, named.snapshot_id}, seen
        assert pages >= 2, pages

        made = [snap.snapshot_id, named.snapshot_id]
        first = Sandbox.delete_snapshot(snap.snapshot_id, **API)
        again = Sandbox.delete_snapshot(snap.snapshot_id, **API)
        assert first is True and again is False, (first, again)
        try:
            Sandbox.create(snap.snapshot_id, **API)
            raise AssertionError("a deleted snapshot created a sandbox")
        except SandboxException as e:
            assert "404" in str(e) or "not found" in str(e).lower(), e
        # its forks are untouched by the delete
        got = forks[1].files.read("/home/user/state.txt")
        assert got == "at-snapshot-" + RUN_ID, got
        for x in forks:
            x.kill()
    finally:
        for sid in made:
            Sandbox.delete_snapshot(sid, **API)
        src.kill()
