"""The web page against hostile sites, without a database: the Host allowlist (DNS rebinding) and
the security headers on every response.

A page on another site can make the victim's browser talk to the loopback page through a name
it controls (DNS rebinding: ``evil.example`` first resolves to the attacker, then to 127.0.0.1).
The browser then sends ``Host: evil.example``, same-origin for the attacker's script, so the
page must refuse a Host it does not answer to.  Every request here is answered before a route
reads Postgres (refused, a static file, a page that reads no table), so the app is built on a URL
nothing listens on; tests/integration/test_web.py checks the headers of the pages themselves.
"""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from dramatiq_reliable.errors import ConfigurationError
from dramatiq_reliable.web import Access, create_app
from dramatiq_reliable.web.security import allowed_host, host_of

NOWHERE = "postgresql://nobody@127.0.0.1:1/none"
LOOPBACK = ("127.0.0.1", 50000)

SECURITY_HEADERS = ("content-security-policy", "x-frame-options", "x-content-type-options", "referrer-policy")


def client(app: Any, host: str = "localhost:8080", *, peer: tuple[str, int] = LOOPBACK) -> TestClient:
    """A test client whose requests carry ``Host: host`` (the browser sends the name it resolved)."""
    return TestClient(app, client=peer, base_url=f"http://{host}", raise_server_exceptions=False)


# -- DNS rebinding: the Host allowlist ------------------------------------------------------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "localhost.evil.example"])
def test_without_a_hook_a_rebound_host_is_refused_with_400_before_any_data_is_read(host):
    with client(create_app(NOWHERE), host) as browser:
        for path in ("/", "/dead-letters/1", "/static/htmx.min.js"):
            response = browser.get(path)
            assert response.status_code == 400, path
            assert response.headers["content-type"].startswith("text/plain")
            assert f"Host {host.split(':')[0]!r}" in response.text and "allowed_hosts" in response.text
            assert len(response.text) < 400  # short, no page


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8080", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:8080", "[::1]", "[::1]:8080"]
)
def test_without_a_hook_loopback_hosts_pass_with_any_port(host):
    with client(create_app(NOWHERE), host) as browser:
        assert browser.get("/static/web.css").status_code == 200


def test_a_configured_host_passes_and_the_loopback_names_still_do():
    app = create_app(NOWHERE, allowed_hosts=["jobs.internal", "*.ops.example"])
    for host in ("jobs.internal:8080", "a.ops.example", "b.c.ops.example:443", "localhost:8080"):
        with client(app, host) as browser:
            assert browser.get("/static/web.css").status_code == 200, host
    for host in ("ops.example", "jobs.internal.evil.example", "evil.example"):
        with client(app, host) as browser:
            assert browser.get("/static/web.css").status_code == 400, host


def test_with_a_hook_any_host_passes_unless_allowed_hosts_is_given():
    # Behind a reverse proxy the page has a real name the library cannot guess, and the hook
    # authenticates with credentials a browser never sends to a rebound name.
    hooked = create_app(NOWHERE, access=lambda request: "read")
    with client(hooked, "jobs.example.com") as browser:
        assert browser.get("/static/web.css").status_code == 200
    pinned = create_app(NOWHERE, access=lambda request: "read", allowed_hosts=["jobs.example.com"])
    with client(pinned, "jobs.example.com") as browser:
        assert browser.get("/static/web.css").status_code == 200
    with client(pinned, "evil.example") as browser:
        assert browser.get("/static/web.css").status_code == 400
    with client(pinned, "localhost") as browser:  # loopback names are never an attacker's
        assert browser.get("/static/web.css").status_code == 200


def test_mounted_under_a_prefix_the_host_rule_still_applies():
    parent = Starlette(routes=[Mount("/jobs", app=create_app(NOWHERE))])
    with client(parent, "127.0.0.1:9000") as browser:
        assert browser.get("/jobs/static/web.css").status_code == 200
    with client(parent, "evil.example:9000") as browser:
        assert browser.get("/jobs/static/web.css").status_code == 400


def test_a_request_without_a_host_header_is_refused_when_hosts_are_checked():
    app = create_app(NOWHERE)
    with client(app) as browser:
        response = browser.get("/static/web.css", headers={"host": ""})
    assert response.status_code == 400


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ("localhost:8080", "localhost"),
        ("LocalHost.", "localhost"),
        ("[::1]:80", "[::1]"),
        ("[::1]", "[::1]"),
        ("127.0.0.1", "127.0.0.1"),
        ("", None),
        ("a b", None),
        ("[::1", None),
        ("host:port:extra", None),
        ("évil.example", None),
        ("x" * 300, None),
    ],
)
def test_the_host_of_a_header(header, host):
    assert host_of(header) == host


def test_allowed_host_patterns():
    assert allowed_host("a.example", ("*.example",)) and not allowed_host("example", ("*.example",))
    assert allowed_host("localhost", ("LOCALHOST",))
    assert not allowed_host(None, ("localhost",))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("jobs.example.com", "allowed_hosts must be a list of host names"),
        ([""], "cannot be a host name"),
        (["jobs.example.com:8080"], "without a port"),
        (["http://jobs.example.com"], "cannot be a host name"),
        (["*"], "cannot be a host name"),
        ([1], "cannot be a host name"),
    ],
)
def test_create_app_refuses_a_bad_allowed_hosts_with_the_fix(value, match):
    with pytest.raises(ConfigurationError, match=match):
        create_app(NOWHERE, allowed_hosts=value)


# -- framing and headers -------------------------------------------------------------------------


def _assert_secured(response: Any) -> None:
    headers = response.headers
    for name in SECURITY_HEADERS:
        assert headers.get_list(name) and len(headers.get_list(name)) == 1, (name, response.request.url)
    policy = {
        part.split()[0]: part.split()[1:] for part in headers["content-security-policy"].split(";") if part.strip()
    }
    assert policy["frame-ancestors"] == ["'none'"]
    assert policy["default-src"] == ["'none'"]
    assert policy["script-src"] == ["'self'"] and policy["style-src"] == ["'self'"]
    assert policy["form-action"] == ["'self'"] and policy["connect-src"] == ["'self'"]
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "same-origin"


def test_every_kind_of_response_carries_the_security_headers():
    full = create_app(NOWHERE, access=lambda request: Access("full", user="ann"))
    with client(full) as browser:
        responses = [
            browser.get("/static/htmx.min.js"),  # a static file
            browser.get("/static/nothing-here.js"),  # a static 404
            browser.get("/no-such-page"),  # the router's 404
            browser.post("/outbox/retry", headers={"Sec-Fetch-Site": "cross-site"}),  # a refused POST (403)
            browser.post("/schedules/x/explode"),  # an action's own 404 page
            browser.delete("/dead-letters"),  # 405
        ]
    with client(create_app(NOWHERE), "evil.example") as browser:
        responses.append(browser.get("/"))  # a refused Host (400)
    with client(create_app(NOWHERE), peer=("203.0.113.7", 5)) as browser:
        responses.append(browser.get("/"))  # a refused client (403)
    assert [response.status_code for response in responses] == [200, 404, 404, 403, 404, 405, 400, 403]
    for response in responses:
        _assert_secured(response)


def test_an_unexpected_error_gets_a_readable_500_page_with_the_headers_and_no_traceback():
    def broken(request: Any) -> Access:
        raise RuntimeError("the hook broke")

    with client(create_app(NOWHERE, access=broken)) as browser:
        response = browser.get("/")
    assert response.status_code == 500
    _assert_secured(response)
    assert "Traceback" not in response.text and "the hook broke" not in response.text
    assert "server log" in response.text


def test_the_page_asks_htmx_not_to_inject_inline_styles_the_policy_would_block():
    # htmx 2 adds a <style> for its indicators unless told not to; under style-src 'self' the
    # browser would refuse it (and say so in the console).
    with client(create_app(NOWHERE, access=lambda request: "full")) as browser:
        page = browser.post("/schedules/x/explode")  # a page of the app's layout that reads no table
    assert page.status_code == 404
    assert '<meta name="htmx-config" content=\'{"includeIndicatorStyles":false' in page.text
    assert "<style" not in page.text and " style=" not in page.text and "<script>" not in page.text
