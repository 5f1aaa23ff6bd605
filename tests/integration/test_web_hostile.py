"""The web page never answers 500 to hostile input: every route x every parameter x hostile values.

Requests go straight to the ASGI app as raw scopes (no HTTP client in between to refuse or
re-encode them), so a path may carry a NUL or a lone surrogate, as an ASGI server or WSGI
adapter could hand over, and a query or form carries whatever bytes a browser could send.  Each
answer must be below 500 and readable: an HTML page or a short text, never a traceback, and a
value sent in is never reflected unescaped.  One migrated schema for the module, with a dead
letter and a schedule in it so that the routes reach their queries; dropped afterwards.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql
from support import capture_dead_letter

from dramatiq_reliable import PostgresBroker, schema
from dramatiq_reliable.scheduler import Registry, Scheduler
from dramatiq_reliable.scheduler import schedule as declare
from dramatiq_reliable.web import Access, create_app

pytestmark = pytest.mark.integration

#: Hostile values, each sent as a browser would encode it (UTF-8, percent-encoded; a lone
#: surrogate as the bytes Python's 'surrogatepass' gives, which no decoder accepts).
HOSTILE: dict[str, str] = {
    "nul": "a\x00b",
    "lone-surrogate": "\ud800",
    "huge-int": "9" * 40,
    "more-digits-than-int-takes": "9" * 5000,
    "past-bigint": str(2**63),
    "negative": "-1",
    "zero": "0",
    "cursor-time-overflow": "99999999999999999999.1",
    "cursor-time-underflow": "-99999999999999999999.1",
    "cursor-id-past-bigint": f"1700000000000000.{2**63}",
    "cursor-unicode-digits": "\u0661\u0667\u0660\u0660.\u0661",
    "float-overflow": "1e309",
    "nan": "nan",
    "very-long": "x" * 100_000,
    "empty": "",
    "blank": " \t",
    "newline": "name\n",
    "markup": "<script>alert(1)</script>",
    "percent-junk": "%ZZ%00%FF%",
    "broken-url": "http://[::1",
    "twice": "1",
}
#: Values that go into the request raw, not percent-encoded again.
RAW = {"percent-junk"}

FILTERS = ["queue", "actor", "fingerprint", "error_type"]
ACTION_FIELDS = ["id", *FILTERS, "force", "reason", "confirm"]

#: Every route with the parameters it reads: ``?name`` a query parameter, ``=name`` a form
#: field, ``{name}`` a path parameter, ``header:name`` a request header.  ``?junk`` probes a
#: parameter no route reads.
ROUTES: dict[tuple[str, str], list[str]] = {
    ("GET", "/"): ["?junk", "header:cookie", "header:origin", "header:sec-fetch-site"],
    ("GET", "/fragments/overview"): ["?junk"],
    ("GET", "/dead-letters"): ["?junk"],
    ("GET", "/dead-letters/list"): [f"?{name}" for name in [*FILTERS, "state", "cursor", "junk"]],
    ("GET", "/dead-letters/{id}"): ["{id}", "?junk"],
    ("POST", "/dead-letters/replay"): [f"={name}" for name in [*ACTION_FIELDS, "junk"]]
    + ["header:origin", "header:content-type"],
    ("POST", "/dead-letters/discard"): [f"={name}" for name in [*ACTION_FIELDS, "junk"]],
    ("GET", "/outbox"): ["?junk"],
    ("POST", "/outbox/retry"): ["=junk", "header:origin", "header:sec-fetch-site"],
    ("GET", "/schedules"): ["?junk"],
    ("POST", "/schedules/{name}/{verb}"): ["{name}", "{verb}"],
    ("GET", "/jobs"): [f"?{name}" for name in ("state", "actor", "queue", "junk")],
    ("GET", "/jobs/show"): ["?id", "?junk"],
    ("POST", "/jobs/cancel"): [f"={name}" for name in ("id", "reason", "confirm", "junk")] + ["header:origin"],
    ("GET", "/batches"): ["?state", "?junk"],
    ("GET", "/batches/show"): ["?id", "?state", "?junk"],
    ("POST", "/batches/cancel"): [f"={name}" for name in ("id", "reason", "confirm", "junk")] + ["header:origin"],
    ("GET", "/workflows"): ["?state", "?junk"],
    ("GET", "/workflows/show"): ["?id", "?junk"],
    ("POST", "/workflows/cancel"): [f"={name}" for name in ("id", "reason", "confirm", "junk")] + ["header:origin"],
    ("GET", "/rate-limits"): ["?junk"],
    ("GET", "/static/{path}"): ["{path}"],
}
#: What a path parameter is when it is not the one probed.
PATH_DEFAULTS = {"id": "1", "name": "probe-often", "verb": "pause", "path": "web.css"}

CASES = [
    pytest.param(method, path, parameter, value_name, id=f"{method} {path} {parameter} {value_name}")
    for (method, path), parameters in ROUTES.items()
    for parameter in parameters
    for value_name in HOSTILE
]


def _encode(value_name: str) -> str:
    value = HOSTILE[value_name]
    if value_name in RAW:
        return value
    if value_name == "twice":
        return value + "," + value
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


def _repeat(value_name: str, value: str) -> list[str]:
    """A parameter sent once, or twice with different values (a list where one value is read)."""
    return [value, "x"] if value_name == "twice" else [value]


def _scope(method: str, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    raw_path = quote(path.encode("utf-8", "surrogatepass"), safe="/%").encode("ascii")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": raw_path,
        "root_path": "",
        "query_string": query.encode("ascii"),
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
    }


async def _call(app: Any, scope: dict[str, Any], body: bytes) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict[str, Any]] = []
    received = False

    async def receive() -> dict[str, Any]:
        nonlocal received
        if received:
            await asyncio.sleep(3600)  # the app waits for a disconnect that never comes
        received = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(message for message in sent if message["type"] == "http.response.start")
    headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in start["headers"]}
    content = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return start["status"], headers, content


def request(
    app: Any,
    method: str,
    template: str,
    *,
    path_params: dict[str, str],
    query: list[tuple[str, str]] = (),  # type: ignore[assignment]
    form: list[tuple[str, str]] = (),  # type: ignore[assignment]
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], str]:
    """Send one request to ``app``; values in ``query`` and ``form`` are already encoded."""
    path = template.format(**path_params)
    body = "&".join(f"{key}={value}" for key, value in form).encode("ascii")
    sent_headers = {"host": "localhost:8080", **(headers or {})}
    if method == "POST":
        sent_headers.setdefault("content-type", "application/x-www-form-urlencoded")
    raw_headers = [
        (key.encode("latin-1"), value.encode("utf-8", "surrogatepass")) for key, value in sent_headers.items()
    ]
    query_string = "&".join(f"{key}={value}" for key, value in query)
    status, response_headers, content = asyncio.run(_call(app, _scope(method, path, query_string, raw_headers), body))
    return status, response_headers, content.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def hostile_app(database_url: str) -> Iterator[tuple[Any, int]]:
    """The app with full access on a schema holding one dead letter and one schedule; its id."""
    name = f"webh_{uuid.uuid4().hex[:12]}"
    app = None
    broker = None
    try:
        schema.migrate(database_url, schema=name)
        broker = PostgresBroker(database=database_url, schema=name)
        stored = capture_dead_letter(broker, queue_name="probe_q")
        registry = Registry()
        declare("probe-often", actor="tick", queue_name="probe_q", every_ms=60_000, registry=registry)
        scheduler = Scheduler(database=database_url, schema=name, registry=registry)
        scheduler.sync()
        scheduler.close()
        app = create_app(database_url, schema=name, access=lambda request: Access("full", user="probe"))
        yield app, stored.id
    finally:
        if app is not None:
            app.state.settings.close()
        if broker is not None:
            broker.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_the_probe_covers_every_route_the_app_has(hostile_app):
    app, _ = hostile_app
    served = {route.path.replace(":int", "").replace(":str", "") for route in app.routes}
    probed = {path.removesuffix("/{path}") for _, path in ROUTES}
    assert served == probed, "add the new route and its parameters to ROUTES"


@pytest.mark.parametrize(("method", "path", "parameter", "value_name"), CASES)
def test_no_hostile_value_in_any_parameter_gets_a_500(hostile_app, method, path, parameter, value_name):
    app, dead_letter_id = hostile_app
    value = _encode(value_name)
    path_params = {**PATH_DEFAULTS, "id": str(dead_letter_id)}
    query: list[tuple[str, str]] = []
    form: list[tuple[str, str]] = []
    headers: dict[str, str] = {}
    if method == "POST" and "dead-letters" in path:
        form.append(("confirm", "1"))
        if parameter not in (f"={name}" for name in ("id", *FILTERS)):
            form.append(("id", str(dead_letter_id)))
    if method == "POST" and path == "/jobs/cancel":
        form += [("confirm", "1"), ("id", str(uuid.uuid4()))]  # a job no table knows: cancel_job runs, changes nothing
    if parameter.startswith("?"):
        query += [(parameter[1:], item) for item in _repeat(value_name, value)]
    elif parameter.startswith("="):
        form = [(key, item) for key, item in form if key != parameter[1:]]
        form += [(parameter[1:], item) for item in _repeat(value_name, value)]
    elif parameter.startswith("{"):
        path_params[parameter[1:-1]] = HOSTILE[value_name] if value_name != "twice" else "1,2"
    else:
        header = parameter.split(":", 1)[1]
        text = HOSTILE[value_name]
        if header == "cookie":
            # A flash cookie someone crafted: JSON, percent-encoded, with the value as its text.
            text = "dramatiq_reliable_flash=" + quote(json.dumps([["ok", text]]), safe="")
        headers[header] = text.replace("\n", " ")
    status, response_headers, text = request(
        app, method, path, path_params=path_params, query=query, form=form, headers=headers
    )
    assert status < 500, text[:500]
    kind = response_headers.get("content-type", "")
    if kind.startswith("text/html"):
        assert "<script>alert(1)" not in text, "a value sent in was reflected unescaped"
    if status >= 400:
        assert kind.startswith(("text/html", "text/plain")) and text.strip(), (status, kind, text[:200])
        assert "Traceback" not in text
        if kind.startswith("text/plain"):
            assert len(text) < 2000, "a refusal should be short"
