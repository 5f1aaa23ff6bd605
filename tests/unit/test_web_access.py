"""The web page's gate, without a database: who gets in, who may act, and which POSTs are cross-site.

Every request these tests make is refused (or served from static files) before any route reads
Postgres, so the app is built on a URL nothing listens on.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from dramatiq_reliable.errors import ConfigurationError
from dramatiq_reliable.web import Access, create_app
from dramatiq_reliable.web.access import cross_site_problem, is_loopback

# Never connected to: every request below is answered before a route runs.
NOWHERE = "postgresql://nobody@127.0.0.1:1/none"
LOOPBACK = ("127.0.0.1", 50000)
REMOTE = ("203.0.113.7", 50000)


def _request(method: str = "POST", **headers: str) -> Request:
    scope = {
        "type": "http",
        "method": method,
        "path": "/dead-letters/replay",
        "headers": [(key.replace("_", "-").lower().encode(), value.encode()) for key, value in headers.items()],
        "query_string": b"",
        "client": LOOPBACK,
        "server": ("jobs.example.com", 443),
        "scheme": "https",
    }
    return Request(scope)


def test_an_access_level_must_be_one_of_the_three_and_names_the_fix():
    assert Access("full", user="ann").can_act and Access("full").label == "full"
    assert not Access("read").can_act and Access("read").label == "read-only"
    with pytest.raises(ConfigurationError, match="one of .*'full', 'read', 'forbidden'.*Access\\('read'\\)"):
        Access("admin")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.5.0.1", True),
        ("::1", True),
        ("10.0.0.1", False),
        ("testclient", False),
        (None, False),
    ],
)
def test_loopback_means_this_machine_only(host, loopback):
    assert is_loopback(host) is loopback


def test_with_no_hook_a_remote_client_is_forbidden_and_told_how_to_let_it_in():
    with TestClient(create_app(NOWHERE), client=REMOTE, base_url="http://localhost") as client:
        response = client.get("/")
    assert response.status_code == 403
    assert "loopback clients only" in response.text and "access=" in response.text


def test_with_no_hook_a_loopback_client_reads_but_may_not_post():
    with TestClient(create_app(NOWHERE), client=LOOPBACK, base_url="http://localhost") as client:
        assert client.get("/static/htmx.min.js").status_code == 200
        response = client.post("/dead-letters/replay", data={"id": "1", "confirm": "1"})
    assert response.status_code == 403 and "read-only access" in response.text


def test_a_forbidden_user_gets_403_on_every_request_static_files_included():
    with TestClient(create_app(NOWHERE, access=lambda request: "forbidden"), client=LOOPBACK) as client:
        for path in ("/", "/dead-letters", "/static/web.css"):
            response = client.get(path)
            assert response.status_code == 403, path
            assert "the access hook refused" in response.text


def test_the_hook_may_be_async_and_is_asked_for_every_request():
    asked: list[str] = []

    async def access(request: Request) -> Access:
        asked.append(request.url.path)
        return Access("read", user="ann")

    with TestClient(create_app(NOWHERE, access=access), client=REMOTE) as client:
        assert client.get("/static/web.css").status_code == 200
        assert client.post("/outbox/retry").status_code == 403
    assert asked == ["/static/web.css", "/outbox/retry"]


def test_a_hook_answer_that_is_not_an_access_is_an_error_naming_the_fix():
    app = create_app(NOWHERE, access=lambda request: True)  # type: ignore[arg-type,return-value]
    with TestClient(app, client=LOOPBACK) as client, pytest.raises(ConfigurationError, match="return an Access"):
        client.get("/")


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
def test_a_post_from_another_site_is_refused_even_for_full_access(site):
    with TestClient(create_app(NOWHERE, access=lambda request: "full"), client=LOOPBACK) as client:
        response = client.post(
            "/dead-letters/discard", data={"id": "1", "confirm": "1"}, headers={"Sec-Fetch-Site": site}
        )
    assert response.status_code == 403
    assert f"Sec-Fetch-Site: {site!r}" in response.text


def test_a_post_whose_origin_is_another_host_is_refused_when_sec_fetch_site_is_missing():
    with TestClient(create_app(NOWHERE, access=lambda request: "full"), client=LOOPBACK) as client:
        response = client.post("/outbox/retry", headers={"Origin": "https://evil.example"})
    assert response.status_code == 403
    assert "Origin 'https://evil.example' is not this page's host 'testserver'" in response.text


@pytest.mark.parametrize(
    ("headers", "refused"),
    [
        ({"sec_fetch_site": "same-origin"}, False),
        ({"sec_fetch_site": "none"}, False),
        ({"sec_fetch_site": "cross-site", "origin": "https://jobs.example.com", "host": "jobs.example.com"}, True),
        ({"origin": "https://jobs.example.com", "host": "jobs.example.com"}, False),
        ({"origin": "https://JOBS.example.com", "host": "jobs.example.com"}, False),
        ({"origin": "https://jobs.example.com:8443", "host": "jobs.example.com"}, True),
        ({"origin": "null", "host": "jobs.example.com"}, True),
        ({"host": "jobs.example.com"}, False),
    ],
)
def test_the_cross_site_rule(headers, refused):
    assert (cross_site_problem(_request(**headers)) is not None) is refused


def test_create_app_refuses_bad_options_with_the_fix():
    with pytest.raises(ConfigurationError, match="needs database="):
        create_app()
    with pytest.raises(ConfigurationError, match="statement_timeout_ms"):
        create_app(NOWHERE, statement_timeout_ms=0)
    with pytest.raises(ConfigurationError, match="target must be 'outbox'"):
        create_app(NOWHERE, target="rabbit")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="access= must be a callable"):
        create_app(NOWHERE, access="full")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="a name in queues= must be a non-empty string, got ''"):
        create_app(NOWHERE, queues=[""])


def test_importing_the_web_page_without_its_extra_names_the_install_command():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["starlette"] = None  # as if the extra were not installed
        try:
            import dramatiq_reliable.web
        except ImportError as error:
            print(error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "pip install 'dramatiq-reliable[web]'" in result.stdout
    assert "starlette is not installed" in result.stdout
