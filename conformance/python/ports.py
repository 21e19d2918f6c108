"""Forwarded sandbox ports through the Python SDK's get_host (twin of what the JS suite's
lifecycle checks of get_host cover): an HTTP server in the sandbox reached at
https://<port>-<id>.<domain>, and E2B's error for a port nothing listens on."""
import os

import httpx

from lib import RUN_ID, scenario, shared_sandbox, wait_for

A = "ports"
sandbox = shared_sandbox(metadata={"group": "ports"})


def client():
    return httpx.Client(verify=os.environ.get("SSL_CERT_FILE") or True, timeout=60)


@scenario(A, "an HTTP server in the sandbox answers on its host")
def _server():
    sbx = sandbox()
    sbx.files.write("/home/user/www/index.html", "hello " + RUN_ID)
    sbx.commands.run("cd /home/user/www && exec python3 -m http.server 8000", background=True,
                     timeout=0)
    url = "https://%s/index.html" % sbx.get_host(8000)
    with client() as c:
        r = wait_for("the server to answer", lambda: (lambda r: r if r.status_code == 200
                                                      else None)(c.get(url)), timeout=60)
        assert r.text == "hello " + RUN_ID, r.text
        r = c.get("https://%s/missing" % sbx.get_host(8000))
        assert r.status_code == 404, "the guest's own 404 passes through: %s" % r.status_code


@scenario(A, "a closed port answers E2B's closed-port error")
def _closed():
    sbx = sandbox()
    with client() as c:
        r = c.get("https://%s/" % sbx.get_host(8999))
        assert r.status_code == 502, (r.status_code, r.text)
        body = r.json()
        assert body == {"sandboxId": sbx.sandbox_id, "port": 8999, "code": 502,
                        "message": "The sandbox is running but port is not open"}, body
        page = c.get("https://%s/" % sbx.get_host(8999), headers={"Accept": "text/html"})
        assert page.status_code == 502 and "text/html" in page.headers["content-type"]
        assert "8999" in page.text


@scenario(A, "an unknown sandbox's host answers not found")
def _unknown():
    sbx = sandbox()
    host = sbx.get_host(8000).replace(sbx.sandbox_id, "nosuch" + RUN_ID)
    with client() as c:
        r = c.get("https://%s/" % host)
        # E2B's edge: 502 with the sandbox it could not find.
        assert r.status_code == 502, (r.status_code, r.text)
        assert r.json() == {"sandboxId": "nosuch" + RUN_ID, "code": 502,
                            "message": "The sandbox was not found"}, r.text
