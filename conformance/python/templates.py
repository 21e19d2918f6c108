"""Templates built with the SDK's Template builder (e2b-templates.md section 2): from E2B's base
image (our `base`) with run_cmd, set_envs, set_workdir, set_user, a start command and its ready
check; apt_install of a package from the host's Debian mirror (the build reaches it through the
egress proxy); copy of files and a directory (uploaded through the link the server gives, cached
the second time); Sandbox.create by the name with the server already up; build_in_background with
get_build_status; pip_install of a local package and npm_install (global and in the workdir) of
packages from the npm registry on the base image; from_dockerfile; a failing step's
BuildException; exists and delete; from_image of an image in a
registry on loopback (conformance/run_local.py pushes it), open and behind a password; and an
image from an unreachable registry failing with its reason.

Builds run in a single mode only (they do not depend on how sandbox traffic is addressed):
the host-routing run skips them."""
import os
import tempfile
import time

from e2b import Sandbox, Template, wait_for_url
from e2b.exceptions import BuildException, SandboxException

from lib import API, RUN_ID, SINGLE_ADDRESS, Skip, remember, scenario

A = "templates"
SIZE = {"cpu_count": 1, "memory_mb": 256}  # the base template's size: its spare clones serve builds


def only_once():
    if not SINGLE_ADDRESS:
        raise Skip("template builds run in the single-address mode only")


def delete(name):
    # E2B's template delete is DELETE /templates/{id}; the SDK's caller is delete_snapshot.
    return Sandbox.delete_snapshot(name, **API)


@scenario(A, "Template builder: steps, env, workdir, user, start and ready commands", timeout=600)
def _builder():
    only_once()
    name = "py-" + RUN_ID
    tpl = (Template()
           .from_base_image()
           .set_envs({"GREETING": "hello " + RUN_ID})
           .run_cmd("mkdir -p /srv/www && echo site-$GREETING > /srv/www/index.html", user="root")
           .set_workdir("app")
           .run_cmd(["echo \"$GREETING\" > greeting.txt", "pwd > where.txt"])
           .set_user("root")
           .run_cmd("id -un > /whoami")
           .set_user("user")
           .set_start_cmd("cd /srv/www && python3 -m http.server 8000",
                          wait_for_url("http://127.0.0.1:8000/index.html")))
    logs = []
    info = Template.build(tpl, name, on_build_logs=logs.append, **SIZE, **API)
    assert info.template_id == name, info
    messages = [getattr(e, "message", "") for e in logs]
    assert any("step" in m for m in messages), messages[:20]
    try:
        sbx = Sandbox.create(name, **API)
        remember(sbx.sandbox_id)
        try:
            # started in the template's snapshot: answering at once, no boot wait
            r = sbx.commands.run("curl -sf http://127.0.0.1:8000/index.html")
            assert r.stdout == "site-hello %s\n" % RUN_ID, r.stdout
            r = sbx.commands.run("cat /home/user/app/greeting.txt /home/user/app/where.txt "
                                 "/whoami")
            assert r.stdout == "hello %s\n/home/user/app\nroot\n" % RUN_ID, r.stdout
        finally:
            sbx.kill()
        assert Template.exists(name, **API) is True
        assert Template.exists("nosuch-" + RUN_ID, **API) is False
    finally:
        assert delete(name) is True
    assert Template.exists(name, **API) is False
    assert delete(name) is False


@scenario(A, "apt_install: a package from the host's Debian mirror, through the egress proxy",
          timeout=900)
def _apt():
    only_once()
    name = "py-apt-" + RUN_ID
    # the run's id first: the package step runs afresh, never from an earlier run's step cache
    tpl = (Template().from_base_image().run_cmd("echo %s > /dev/null" % RUN_ID)
           .apt_install("hello", no_install_recommends=True))
    try:
        Template.build(tpl, name, **SIZE, **API)
        sbx = Sandbox.create(name, **API)
        remember(sbx.sandbox_id)
        try:
            r = sbx.commands.run("hello")
            assert r.stdout == "Hello, world!\n", r.stdout
        finally:
            sbx.kill()
    finally:
        delete(name)


@scenario(A, "pip_install and npm_install on the base image: a local package, the npm registry",
          timeout=900)
def _packages():
    only_once()
    name = "py-pkg-" + RUN_ID
    with tempfile.TemporaryDirectory() as ctx:
        # No PyPI here: pip installs a package from the build's own files (pip_install() with
        # no names is `pip install .` in the workdir, as root: into the system's Python).
        os.makedirs(os.path.join(ctx, "pkg"))
        with open(os.path.join(ctx, "pkg", "setup.py"), "w") as f:
            f.write("from setuptools import setup\n"
                    "setup(name='spacedemo', version='1.0', py_modules=['spacedemo'])\n")
        with open(os.path.join(ctx, "pkg", "spacedemo.py"), "w") as f:
            f.write("RUN = %r\n" % RUN_ID)
        # the run's id first: the package steps run afresh, never from an earlier run's cache
        tpl = (Template(file_context_path=ctx).from_base_image()
               .run_cmd("echo %s > /dev/null" % RUN_ID)
               .copy("pkg", "/home/user/pkg")
               .set_workdir("/home/user/pkg")
               .pip_install()
               .npm_install("is-number@7.0.0", g=True)
               .set_workdir("/home/user/web")
               .npm_install("is-odd@3.0.1"))
        try:
            Template.build(tpl, name, **SIZE, **API)
            sbx = Sandbox.create(name, **API)
            remember(sbx.sandbox_id)
            try:
                r = sbx.commands.run("cd / && python3 -c 'import spacedemo; print(spacedemo.RUN)'"
                                     " && pip show spacedemo | grep ^Version")
                assert r.stdout == "%s\nVersion: 1.0\n" % RUN_ID, r.stdout
                # global: for root, under npm's prefix; local: in the workdir, for user
                r = sbx.commands.run("cat \"$(npm root -g)/is-number/package.json\" | "
                                     "python3 -c 'import json,sys; print(json.load(sys.stdin)"
                                     "[\"version\"])'; cd /home/user/web && "
                                     "node -e 'console.log(require(\"is-odd\")(3))' && "
                                     "stat -c %U node_modules/is-odd")
                assert r.stdout == "7.0.0\ntrue\nuser\n", r.stdout
            finally:
                sbx.kill()
        finally:
            delete(name)


@scenario(A, "from_dockerfile: FROM E2B's base, RUN, COPY, ENV, ARG, WORKDIR and USER",
          timeout=600)
def _dockerfile():
    only_once()
    name = "py-df-" + RUN_ID
    with tempfile.TemporaryDirectory() as ctx:
        with open(os.path.join(ctx, "conf.txt"), "w") as f:
            f.write("conf-%s\n" % RUN_ID)
        # The SDK reads the Dockerfile itself and sends its steps (the server never sees it).
        dockerfile = "\n".join([
            "FROM e2bdev/base",
            "ARG FLAVOUR=plain",
            "ENV RUN_ID=%s" % RUN_ID,
            "WORKDIR /opt/app",
            "COPY conf.txt /opt/app/conf.txt",
            "RUN echo \"$RUN_ID $FLAVOUR $(pwd) $(id -un)\" > /opt/app/made.txt",
            "USER user",
            "RUN id -un > /home/user/who.txt",
        ])
        tpl = Template(file_context_path=ctx).from_dockerfile(dockerfile)
        try:
            Template.build(tpl, name, **SIZE, **API)
            sbx = Sandbox.create(name, **API)
            remember(sbx.sandbox_id)
            try:
                r = sbx.commands.run("cat /opt/app/conf.txt /opt/app/made.txt /home/user/who.txt;"
                                     " echo $RUN_ID")
                assert r.stdout == ("conf-{0}\n{0} plain /opt/app root\nuser\n{0}\n"
                                    .format(RUN_ID)), r.stdout
            finally:
                sbx.kill()
        finally:
            delete(name)


@scenario(A, "copy: files and a directory, with user and mode, uploaded once", timeout=600)
def _copy():
    only_once()
    name = "pycp-" + RUN_ID
    with tempfile.TemporaryDirectory() as ctx:
        os.makedirs(os.path.join(ctx, "app", "lib"))
        with open(os.path.join(ctx, "app", "main.py"), "w") as f:
            f.write("print('main-%s')\n" % RUN_ID)
        with open(os.path.join(ctx, "app", "lib", "util.py"), "w") as f:
            f.write("X = 1\n")
        with open(os.path.join(ctx, "motd"), "w") as f:
            f.write("motd-%s\n" % RUN_ID)

        def tpl():
            return (Template(file_context_path=ctx).from_base_image()
                    .copy("app", "/home/user/app")
                    .copy("motd", "/etc/motd-copy", user="root", mode=0o640)
                    .run_cmd("python3 /home/user/app/main.py > /home/user/ran.txt"))
        logs = []
        try:
            Template.build(tpl(), name, on_build_logs=logs.append, **SIZE, **API)
            sbx = Sandbox.create(name, **API)
            remember(sbx.sandbox_id)
            try:
                r = sbx.commands.run("cat /home/user/ran.txt; stat -c '%U %a' /etc/motd-copy "
                                     "/home/user/app/lib/util.py; cat /etc/motd-copy",
                                     user="root")
                assert r.stdout == "main-%s\nroot 640\nuser 644\nmotd-%s\n" % (RUN_ID, RUN_ID), \
                    r.stdout
            finally:
                sbx.kill()
            # the same files again: the server has them, the SDK skips the uploads
            logs2 = []
            Template.build(tpl(), name, on_build_logs=logs2.append, **SIZE, **API)
            text = " ".join(getattr(e, "message", "") for e in logs2)
            assert "already cached" in text or "Skipping upload" in text, text[:2000]
        finally:
            delete(name)


@scenario(A, "build_in_background, then get_build_status until ready", timeout=600)
def _background():
    only_once()
    name = "pybg-" + RUN_ID
    tpl = Template().from_template("base").run_cmd("echo bg-%s > /tmp/bg" % RUN_ID)
    info = Template.build_in_background(tpl, name, **SIZE, **API)
    assert (info.template_id, info.name) == (name, name), info
    seen, offset = [], 0
    deadline = time.time() + 500
    try:
        while time.time() < deadline:
            st = Template.get_build_status(info, logs_offset=offset, **API)
            seen += st.log_entries
            offset += len(st.log_entries)
            if st.status.value in ("ready", "error"):
                break
            time.sleep(0.5)
        assert st.status.value == "ready", (st.status, st.reason)
        assert any(("bg-" + RUN_ID) in e.message or "step" in e.message for e in seen), seen[:10]
    finally:
        delete(name)


@scenario(A, "skip_cache: the same steps run again, where a rebuild comes from the cache",
          timeout=600)
def _skip_cache():
    only_once()
    name = "pyskip-" + RUN_ID
    roll = "head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /home/user/r"

    def built(tpl):
        Template.build(tpl, name, **SIZE, **API)
        sbx = Sandbox.create(name, **API)
        remember(sbx.sandbox_id)
        try:
            return sbx.commands.run("cat /home/user/r").stdout
        finally:
            sbx.kill()

    try:
        first = built(Template().from_template("base").run_cmd("echo %s" % RUN_ID).run_cmd(roll))
        again = built(Template().from_template("base").run_cmd("echo %s" % RUN_ID).run_cmd(roll))
        assert again == first and len(first) == 16, (first, again)  # from the cache
        forced = built(Template().from_template("base").run_cmd("echo %s" % RUN_ID)
                       .skip_cache().run_cmd(roll))
        assert forced != first and len(forced) == 16, (first, forced)  # run again
    finally:
        delete(name)


@scenario(A, "a failing step raises BuildException with the server's reason", timeout=600)
def _failing():
    only_once()
    name = "pyfail-" + RUN_ID
    tpl = Template().from_base_image().run_cmd("echo about-to-fail; exit 7")
    try:
        Template.build(tpl, name, **SIZE, **API)
    except BuildException as e:
        assert "exited with code 7" in str(e), str(e)
        assert "about-to-fail" in str(e), str(e)
    else:
        raise AssertionError("the build did not fail")
    finally:
        delete(name)


def registry_image():
    """The image conformance/run_local.py pushed to docker-registry on loopback: (open ref, ref
    behind a password, (user, password), the marker file's line)."""
    only_once()
    if os.environ.get("CONFORMANCE_IMAGE_SKIP"):
        raise Skip("no registry images: " + os.environ["CONFORMANCE_IMAGE_SKIP"])
    if not os.environ.get("CONFORMANCE_IMAGE"):
        raise Skip("no registry images (conformance/run_local.py pushes them)")
    user, password = os.environ["CONFORMANCE_IMAGE_CREDS"].split(":", 1)
    return (os.environ["CONFORMANCE_IMAGE"], os.environ["CONFORMANCE_IMAGE_LOCKED"],
            (user, password), os.environ["CONFORMANCE_IMAGE_MARKER"])


@scenario(A, "from_image: an image from a registry, open and behind a password", timeout=900)
def _from_image():
    ref, locked, (user, password), marker = registry_image()
    name, priv, bad = "pyimg-" + RUN_ID, "pyimgpw-" + RUN_ID, "pyimgbad-" + RUN_ID
    tpl = (Template().from_image(ref)
           .run_cmd("echo built-%s > /srv/built.txt" % RUN_ID, user="root"))
    try:
        Template.build(tpl, name, **SIZE, **API)
        sbx = Sandbox.create(name, **API)
        remember(sbx.sandbox_id)
        try:  # the image's files and ENV, the step's file, the user E2B runs commands as
            r = sbx.commands.run('cat /srv/hello.txt /srv/built.txt; echo "$HELLO"; id -un')
            assert r.stdout == "%s\nbuilt-%s\nfrom image\nuser\n" % (marker, RUN_ID), r.stdout
        finally:
            sbx.kill()
        # behind a password: the SDK's username and password pull it; a wrong one fails the
        # build with the registry's refusal, the password in no message
        Template.build(Template().from_image(locked, username=user, password=password), priv,
                       **SIZE, **API)
        sbx = Sandbox.create(priv, **API)
        remember(sbx.sandbox_id)
        try:
            assert sbx.commands.run("cat /srv/hello.txt").stdout == marker + "\n"
        finally:
            sbx.kill()
        try:
            Template.build(Template().from_image(locked, username=user, password="not-" + password),
                           bad, **SIZE, **API)
        except BuildException as e:
            assert "refused the credentials" in str(e), str(e)
            assert locked.split("/")[0] in str(e), str(e)
            assert password not in str(e), str(e)
        else:
            raise AssertionError("a build with a wrong registry password succeeded")
    finally:
        for n in (name, priv, bad):
            delete(n)


@scenario(A, "an image from a registry that cannot be reached fails with the reason", timeout=120)
def _refused():
    only_once()
    name = "pyno-" + RUN_ID
    try:  # nothing listens on port 1: the build fails naming the registry
        Template.build(Template().from_image("127.0.0.1:1/img:1").run_cmd("true"), name, **SIZE,
                       **API)
    except BuildException as e:
        assert "cannot reach the image registry 127.0.0.1:1" in str(e), str(e)
    else:
        raise AssertionError("a build from an unreachable registry succeeded")
    finally:
        delete(name)


@scenario(A, "names and tags: build name:tag, assign, get, remove, create and exists by tag",
          timeout=900)
def _tags():
    only_once()
    name = "pytag-" + RUN_ID
    tpl = Template().from_template("base").run_cmd("echo one-%s > /home/user/v" % RUN_ID)
    try:
        info = Template.build(tpl, name + ":v1", tags=["stable"], **SIZE, **API)
        assert set(info.tags) == {"v1", "stable"}, info.tags
        assert Template.exists(name + ":v1", **API)
        assert not Template.exists(name + ":nope", **API)
        t2 = Template().from_template("base").run_cmd("echo two-%s > /home/user/v" % RUN_ID)
        Template.build(t2, name, **SIZE, **API)  # the default tag
        sbx = Sandbox.create(name + ":v1", **API)
        remember(sbx.sandbox_id)
        try:
            assert sbx.commands.run("cat /home/user/v").stdout == "one-%s\n" % RUN_ID
        finally:
            sbx.kill()
        tag = Template.assign_tags(name + ":v1", "prod", **API)
        assert tag.tags == ["prod"], tag
        assert str(tag.build_id) == str(info.build_id), (tag, info)
        sbx = Sandbox.create(name + ":prod", **API)
        remember(sbx.sandbox_id)
        try:
            assert sbx.commands.run("cat /home/user/v").stdout == "one-%s\n" % RUN_ID
        finally:
            sbx.kill()
        sbx = Sandbox.create(name, **API)
        remember(sbx.sandbox_id)
        try:
            assert sbx.commands.run("cat /home/user/v").stdout == "two-%s\n" % RUN_ID
        finally:
            sbx.kill()
        tags = {t.tag for t in Template.get_tags(name, **API)}
        assert {"v1", "stable", "prod", "default"} <= tags, tags
        Template.remove_tags(name, "prod", **API)
        try:
            Sandbox.create(name + ":prod", **API)
        except SandboxException as e:
            assert "404" in str(e) and "prod" in str(e), str(e)
        else:
            raise AssertionError("a removed tag still creates sandboxes")
        # built on a tag's version (fromTemplate "name:v1"), not on the default's
        child = name + "-child"
        t3 = Template().from_template(name + ":v1").run_cmd("echo child >> /home/user/v")
        try:
            Template.build(t3, child, **SIZE, **API)
            sbx = Sandbox.create(child, **API)
            remember(sbx.sandbox_id)
            try:
                got = sbx.commands.run("cat /home/user/v").stdout
                assert got == "one-%s\nchild\n" % RUN_ID, got
            finally:
                sbx.kill()
        finally:
            delete(child)
    finally:
        delete(name)
