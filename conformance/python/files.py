"""sandbox.files through the Python SDK (twin of ../js/files.mjs). The sync watch uses the
polling watcher RPCs (CreateWatcher/GetWatcherEvents/RemoveWatcher); the async one the
WatchDir stream, which is also covered here."""
import asyncio
import io
import os
import time

from e2b import (AsyncSandbox, FileNotFoundException, FilesystemEventType, FileType,
                 InvalidArgumentException)
from e2b.sandbox.filesystem.filesystem import WriteEntry

import httpx

from lib import (API, RUN_ID, host_routing_only, raises, scenario, sha256, shared_sandbox,
                 wait_for)

A = "files"
sandbox = shared_sandbox(metadata={"group": "files"})
H = "/home/user"


@scenario(A, "write and read text")
def _text():
    sbx = sandbox()
    text = "héllo wörld ✓\nsecond line\n"
    info = sbx.files.write(H + "/hello.txt", text)
    # The SDK builds WriteInfo from envd's upload JSON as is: type is the string "file".
    assert (info.name, info.path, info.type) == ("hello.txt", H + "/hello.txt", "file"), info
    assert sbx.files.read(H + "/hello.txt") == text
    r = sbx.commands.run("cat %s/hello.txt; stat -c %%U %s/hello.txt" % (H, H))
    assert r.stdout == text + "user\n"
    sbx.files.write(H + "/hello.txt", "short")
    assert sbx.files.read(H + "/hello.txt") == "short"
    sbx.files.write(H + "/empty.txt", "")
    assert sbx.files.read(H + "/empty.txt") == ""
    rel = sbx.files.write("rel/dir/r.txt", "relative")
    assert rel.path == H + "/rel/dir/r.txt"
    assert sbx.files.get_info(H + "/rel/dir").owner == "user"
    assert sbx.files.write("/root/by-root.txt", "r", user="root").path == "/root/by-root.txt"
    assert sbx.files.get_info("/root/by-root.txt", user="root").owner == "root"


@scenario(A, "read bytes and stream")
def _bytes():
    sbx = sandbox()
    allb = bytes(i % 256 for i in range(1024))
    sbx.files.write(H + "/all-bytes.bin", allb)
    got = sbx.files.read(H + "/all-bytes.bin", format="bytes")
    assert bytes(got) == allb
    payload = os.urandom(3 << 20)
    # A file object of unknown length: the SDK may send a chunked multipart body.
    sbx.files.write(H + "/streamed.bin", io.BytesIO(payload))
    parts = b"".join(sbx.files.read(H + "/streamed.bin", format="stream"))
    assert sha256(parts) == sha256(payload)
    gz = sbx.files.read(H + "/streamed.bin", format="bytes", gzip=True)
    assert sha256(bytes(gz)) == sha256(payload)


@scenario(A, "octet-stream and gzip uploads")
def _octet():
    sbx = sandbox()
    data = "octet ✓ " * 1000
    assert sbx.files.write(H + "/octet.txt", data, use_octet_stream=True).path == H + "/octet.txt"
    assert sbx.files.read(H + "/octet.txt") == data
    sbx.files.write(H + "/gz.txt", data, use_octet_stream=True, gzip=True)
    assert sbx.files.read(H + "/gz.txt") == data


@scenario(A, "write several files at once")
def _multi():
    sbx = sandbox()
    infos = sbx.files.write_files([
        WriteEntry(path="/tmp/multi/a.txt", data="A"),
        WriteEntry(path="/tmp/multi/b/c.txt", data="C"),
        WriteEntry(path=H + "/multi-d.txt", data=b"D"),
    ])
    assert sorted(i.path for i in infos) == [H + "/multi-d.txt", "/tmp/multi/a.txt",
                                             "/tmp/multi/b/c.txt"]
    assert sbx.files.read("/tmp/multi/b/c.txt") == "C"


@scenario(A, "list with depth")
def _list():
    sbx = sandbox()
    root = H + "/tree"
    sbx.files.write_files([WriteEntry(path=root + "/a.txt", data="12345"),
                           WriteEntry(path=root + "/sub/b.txt", data="b"),
                           WriteEntry(path=root + "/sub/deeper/c.txt", data="c")])
    one = sbx.files.list(root)
    assert sorted((e.name, e.type) for e in one) == [("a.txt", FileType.FILE),
                                                     ("sub", FileType.DIR)]
    a = [e for e in one if e.name == "a.txt"][0]
    assert (a.path, a.size, a.owner) == (root + "/a.txt", 5, "user")
    assert len(a.permissions) == 10 and a.permissions[0] == "-", a.permissions
    assert abs(time.time() - a.modified_time.timestamp()) < 3600
    two = sorted(e.path for e in sbx.files.list(root, depth=2))
    assert two == [root + "/a.txt", root + "/sub", root + "/sub/b.txt", root + "/sub/deeper"], two
    assert any(e.path == root + "/sub/deeper/c.txt" for e in sbx.files.list(root, depth=3))
    raises(FileNotFoundException, sbx.files.list, root + "/missing")


@scenario(A, "exists and get_info")
def _exists():
    sbx = sandbox()
    sbx.files.write(H + "/ex/file.txt", "x")
    assert sbx.files.exists(H + "/ex/file.txt") is True
    assert sbx.files.exists(H + "/ex") is True
    assert sbx.files.exists(H + "/ex/nope.txt") is False
    f = sbx.files.get_info(H + "/ex/file.txt")
    assert (f.type, f.size) == (FileType.FILE, 1)
    assert sbx.files.get_info(H + "/ex").type == FileType.DIR
    sbx.commands.run("ln -sf %s/ex/file.txt %s/ex/link" % (H, H))
    assert sbx.files.get_info(H + "/ex/link").symlink_target == H + "/ex/file.txt"
    raises(FileNotFoundException, sbx.files.get_info, H + "/ex/nope.txt")


@scenario(A, "rename")
def _rename():
    sbx = sandbox()
    sbx.files.write(H + "/mv/old.txt", "moving")
    info = sbx.files.rename(H + "/mv/old.txt", H + "/mv/new.txt")
    assert (info.path, info.name) == (H + "/mv/new.txt", "new.txt")
    assert sbx.files.exists(H + "/mv/old.txt") is False
    assert sbx.files.read(H + "/mv/new.txt") == "moving"
    sbx.files.rename(H + "/mv", H + "/moved")
    assert sbx.files.read(H + "/moved/new.txt") == "moving"
    raises(FileNotFoundException, sbx.files.rename, H + "/nope-src", H + "/nope-dst")


@scenario(A, "make_dir")
def _make_dir():
    sbx = sandbox()
    assert sbx.files.make_dir(H + "/made/x/y") is True
    assert sbx.files.make_dir(H + "/made/x/y") is False
    info = sbx.files.get_info(H + "/made/x/y")
    assert (info.type, info.owner) == (FileType.DIR, "user")


@scenario(A, "remove")
def _remove():
    sbx = sandbox()
    sbx.files.write(H + "/rm/one.txt", "1")
    sbx.files.write(H + "/rm/sub/two.txt", "2")
    sbx.files.remove(H + "/rm/one.txt")
    assert sbx.files.exists(H + "/rm/one.txt") is False
    sbx.files.remove(H + "/rm")
    assert sbx.files.exists(H + "/rm") is False
    raises(FileNotFoundException, sbx.files.remove, H + "/rm")


@scenario(A, "read errors")
def _errors():
    sbx = sandbox()
    raises(FileNotFoundException, sbx.files.read, H + "/missing-file.txt")
    raises(InvalidArgumentException, sbx.files.read, H)
    sbx.files.write(H + "/a-dir-here/x", "x")
    raises(InvalidArgumentException, sbx.files.write, H + "/a-dir-here", "y")


@scenario(A, "watch (polling watcher)")
def _watch():
    sbx = sandbox()
    d = H + "/watched"
    sbx.files.make_dir(d)
    w = sbx.files.watch_dir(d)
    seen = []

    def has(name, typ):
        seen.extend(w.get_new_events())
        return any(e.name == name and e.type == typ for e in seen)
    sbx.files.write(d + "/w1.txt", "first")
    wait_for("create of w1.txt", lambda: has("w1.txt", FilesystemEventType.CREATE))
    sbx.commands.run("echo more >> %s/w1.txt" % d)
    wait_for("write of w1.txt", lambda: has("w1.txt", FilesystemEventType.WRITE))
    sbx.files.rename(d + "/w1.txt", d + "/w2.txt")
    wait_for("rename of w1.txt", lambda: has("w1.txt", FilesystemEventType.RENAME))
    sbx.files.remove(d + "/w2.txt")
    wait_for("remove of w2.txt", lambda: has("w2.txt", FilesystemEventType.REMOVE))
    w.stop()
    sbx.files.make_dir(d + "/sub")
    wr = sbx.files.watch_dir(d, recursive=True)
    sbx.files.write(d + "/sub/deep.txt", "deep")
    rec = []
    wait_for("create of sub/deep.txt", lambda: rec.extend(wr.get_new_events()) or any(
        e.name == "sub/deep.txt" and e.type == FilesystemEventType.CREATE for e in rec))
    wr.stop()
    raises(FileNotFoundException, sbx.files.watch_dir, H + "/not-there")


@scenario(A, "watch (async stream)")
def _watch_async():
    sbx = sandbox()

    async def go():
        a = await AsyncSandbox.connect(sbx.sandbox_id, **API)
        d = H + "/watched-async"
        await a.files.make_dir(d)
        events = []
        h = await a.files.watch_dir(d, on_event=events.append, timeout=120)
        await a.files.write(d + "/x.txt", "x")
        for _ in range(150):
            if any(e.name == "x.txt" and e.type == FilesystemEventType.CREATE for e in events):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("no create event for x.txt: %s" % events)
        await h.stop()
    asyncio.run(go())


@scenario(A, "20 MiB upload", timeout=600)
def _big():
    sbx = sandbox()
    blob = os.urandom(20 << 20)
    want = sha256(blob)
    assert sbx.files.write(H + "/big.bin", blob).path == H + "/big.bin"
    assert sbx.files.get_info(H + "/big.bin").size == 20 << 20
    assert sbx.commands.run("sha256sum %s/big.bin" % H, timeout=120).stdout.split()[0] == want
    assert sha256(bytes(sbx.files.read(H + "/big.bin", format="bytes"))) == want


@scenario(A, "modes and permissions as envd reports them")
def _modes():
    sbx = sandbox()
    sbx.commands.run("mkdir -p %s/modes/d && chmod 750 %s/modes/d && "
                     "printf x > %s/modes/f && chmod 640 %s/modes/f && "
                     "ln -sfn %s/modes/d %s/modes/to-dir && ln -sfn f %s/modes/to-file && "
                     "ln -sfn nowhere %s/modes/dangling" % ((H,) * 8))
    d = sbx.files.get_info(H + "/modes/d")
    # mode is the permission bits only (Go's FileMode.Perm()), permissions Go's String().
    assert (d.type, d.mode, d.permissions) == (FileType.DIR, 0o750, "drwxr-x---"), \
        (d.type, oct(d.mode), d.permissions)
    f = sbx.files.get_info(H + "/modes/f")
    assert (f.type, f.mode, f.permissions) == (FileType.FILE, 0o640, "-rw-r-----"), \
        (f.type, oct(f.mode), f.permissions)
    # A link is described by what it names, with the resolved target.
    ld = sbx.files.get_info(H + "/modes/to-dir")
    assert (ld.type, ld.mode, ld.permissions, ld.symlink_target) == (
        FileType.DIR, 0o750, "Lrwxrwxrwx", H + "/modes/d"), vars(ld)
    lf = sbx.files.get_info(H + "/modes/to-file")
    assert (lf.type, lf.mode, lf.symlink_target) == (FileType.FILE, 0o640, H + "/modes/f"), \
        vars(lf)
    dl = sbx.files.get_info(H + "/modes/dangling")
    assert dl.type is None and dl.permissions == "Lrwxrwxrwx", vars(dl)
    # Special bits: /tmp is sticky, sudo setuid.
    t = sbx.files.get_info("/tmp")
    assert t.permissions == "dtrwxrwxrwx" and t.mode == 0o777, (t.permissions, oct(t.mode))
    listed = {e.name: e for e in sbx.files.list(H + "/modes")}
    assert listed["to-dir"].type == FileType.DIR and listed["d"].mode == 0o750, listed


@scenario(A, "~ paths are the user's home")
def _tilde():
    sbx = sandbox()
    sbx.files.write("~/tilde-%s.txt" % RUN_ID, "home")
    assert sbx.files.read(H + "/tilde-%s.txt" % RUN_ID) == "home"
    assert sbx.files.read("~/tilde-%s.txt" % RUN_ID) == "home"
    sbx.files.write("~/t/../tilde-root.txt", "r", user="root")
    assert sbx.files.read("/root/tilde-root.txt", user="root") == "r"
    assert sbx.files.get_info("~", user="root").path == "/root"
    assert sbx.files.get_info("~/").name == "user"
    assert sbx.files.exists("~/tilde-%s.txt" % RUN_ID) is True
    assert any(e.name == "tilde-%s.txt" % RUN_ID for e in sbx.files.list("~"))
    assert sbx.files.make_dir("~/tilde-dir") is True and sbx.files.exists(H + "/tilde-dir")
    sbx.files.rename("~/tilde-dir", "~/tilde-dir2")
    assert sbx.files.exists(H + "/tilde-dir2")
    assert sbx.commands.run("pwd", cwd="~/tilde-dir2").stdout == H + "/tilde-dir2\n"
    raises(InvalidArgumentException, sbx.files.read, "~root/.bashrc",
           what="another user's ~ is refused, as envd does")


@scenario(A, "signed upload and download URLs with a plain HTTP client")
def _signed_urls():
    # With E2B_SANDBOX_URL the SDK finds the sandbox by a header a plain client does not send.
    host_routing_only("a signed URL names its sandbox only in its host")
    sbx = sandbox()
    path = H + "/signed-%s.bin" % RUN_ID
    payload = os.urandom(100000)
    up = sbx.upload_url(path)
    assert "signature=" in up, up
    with httpx.Client(verify=os.environ.get("SSL_CERT_FILE") or True, timeout=60) as c:
        r = c.post(up, files={"file": ("x.bin", payload)})
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.json()[0]["path"] == path, r.text
        down = sbx.download_url(path)
        r = c.get(down)
        assert r.status_code == 200 and r.content == payload, r.status_code
        # A signature is bound to its path and operation.
        assert c.get(down.replace("signed-", "other-")).status_code in (401, 403)
        assert c.get(up).status_code in (401, 403), "an upload signature does not read"
        # Expiring signatures.
        exp = sbx.download_url(path, use_signature_expiration=60)
        assert "signature_expiration=" in exp
        assert c.get(exp).content == payload
        gone = sbx.download_url(path, use_signature_expiration=-120)
        assert c.get(gone).status_code in (401, 403), "an expired signature is refused"
    assert sha256(bytes(sbx.files.read(path, format="bytes"))) == sha256(payload)
