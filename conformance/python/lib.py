"""The Python conformance suite's runner and helpers (twin of ../js/lib.mjs).

Scenarios register with @scenario(area, name); run.py runs them one at a time, each in a
thread under a deadline, and prints `area | scenario | result | ms`. Sandboxes made with
new_sandbox() carry metadata conformance=RUN_ID and are killed at the end.

Configuration only through the environment, as for any SDK user: E2B_API_URL, E2B_API_KEY,
E2B_SANDBOX_URL or E2B_DOMAIN (+ SSL_CERT_FILE for a private CA). CONFORMANCE_TEMPLATE
(default base), SP_TEST_TIMEOUT_MULT.
"""
import hashlib
import os
import secrets
import threading
import time

from e2b import Sandbox, SandboxNotFoundException

MULT = float(os.environ.get("SP_TEST_TIMEOUT_MULT", "1") or 1)
TEMPLATE = os.environ.get("CONFORMANCE_TEMPLATE", "base")
RUN_ID = "c%x%s" % (int(time.time() * 1000), secrets.token_hex(3))
# Seconds, generous: cold boots under TCG, 20 MiB uploads.
REQUEST_TIMEOUT = 180 * MULT
SANDBOX_TIMEOUT = 900
API = {"request_timeout": REQUEST_TIMEOUT}

_scenarios = []
_created = set()
_lock = threading.Lock()


class Skip(Exception):
    """Raised by a scenario that cannot apply to this configuration (reported, not failed)."""


SINGLE_ADDRESS = bool(os.environ.get("E2B_SANDBOX_URL"))


def host_routing_only(why):
    if SINGLE_ADDRESS:
        raise Skip("needs host routing: " + why)


def single_address_only(why):
    """Skips in the host-routing run what would repeat the single-address run request for
    request (why says so); the scenario still runs once per SDK, in the single-address mode."""
    if not SINGLE_ADDRESS:
        raise Skip("runs in the single-address mode only: " + why)


def scenario(area, name, timeout=180):
    def deco(fn):
        _scenarios.append((area, name, fn, timeout * MULT))
        return fn
    return deco


def registered():
    return list(_scenarios)


def new_sandbox(metadata=None, **kw):
    kw.setdefault("timeout", SANDBOX_TIMEOUT)
    kw.setdefault("request_timeout", REQUEST_TIMEOUT)
    md = {"conformance": RUN_ID}
    md.update(metadata or {})
    sbx = Sandbox.create(TEMPLATE, metadata=md, **kw)
    with _lock:
        _created.add(sbx.sandbox_id)
    return sbx


def remember(sandbox_id):
    """Kills sandbox_id at the end of the run (sandboxes made without new_sandbox)."""
    with _lock:
        _created.add(sandbox_id)


def forget(sandbox_id):
    with _lock:
        _created.discard(sandbox_id)


def shared_sandbox(factory=None, **kw):
    """A lazily created sandbox for one area (factory(**kw), default new_sandbox); a failed
    creation is remembered, not retried."""
    factory = factory or new_sandbox
    state = {}

    def get():
        with _lock:
            if "ev" not in state:
                state["ev"] = threading.Event()
                mine = True
            else:
                mine = False
        if mine:
            try:
                state["sbx"] = factory(**kw)
            except Exception as e:  # noqa: BLE001 - reported by every scenario that needs it
                state["err"] = e
            state["ev"].set()
        state["ev"].wait()
        if "err" in state:
            raise state["err"]
        return state["sbx"]
    return get


def cleanup():
    failures = []
    for sid in list(_created):
        try:
            Sandbox.kill(sid, request_timeout=60 * MULT)
        except Exception as e:  # noqa: BLE001
            failures.append("%s: %s" % (sid, e))
    _created.clear()
    return failures


def wait_for(what, fn, timeout=30, interval=0.2):
    deadline = time.time() + timeout * MULT
    last = None
    while True:
        try:
            v = fn()
            if v:
                return v
            last = None
        except Exception as e:  # noqa: BLE001
            last = e
        if time.time() > deadline:
            raise AssertionError("timed out waiting for %s%s" % (what, ": %s" % last if last else ""))
        time.sleep(interval)


def raises(cls, fn, *a, what="", **kw):
    """Calls fn and asserts it raises an instance of cls; returns the exception."""
    try:
        fn(*a, **kw)
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, cls), "%s: expected %s, got %s: %s" % (
            what or cls.__name__, cls.__name__, type(e).__name__, e)
        return e
    raise AssertionError("%s: expected %s, call succeeded" % (what or cls.__name__, cls.__name__))


def sha256(b):
    return hashlib.sha256(b).hexdigest()


def gone(sandbox_id):
    try:
        Sandbox.get_info(sandbox_id, **API)
        return False
    except SandboxNotFoundException:
        return True


def config_problem():
    e = os.environ
    if not e.get("E2B_API_KEY"):
        return "E2B_API_KEY is not set"
    if not e.get("E2B_API_URL") and not e.get("E2B_DOMAIN"):
        return "set E2B_API_URL (and E2B_SANDBOX_URL or E2B_DOMAIN) to the server under test"
    if not e.get("E2B_SANDBOX_URL") and not e.get("E2B_DOMAIN"):
        return "set E2B_SANDBOX_URL (single address) or E2B_DOMAIN (host routing)"
    if e.get("E2B_SANDBOX_URL", "").endswith("/"):
        return "E2B_SANDBOX_URL must not end with '/'"
    if e.get("E2B_DEBUG", "").lower() == "true":
        return "E2B_DEBUG=true makes the SDK skip kill/set_timeout calls: unset it"
    return None
