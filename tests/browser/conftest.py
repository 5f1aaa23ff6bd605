"""Fixtures of the browser tests: Debian's Chromium driven by Playwright, the web app served by
uvicorn on loopback ports, and a seeded schema of the test's own.

Chromium is the system package (``/usr/bin/chromium``, or ``$CHROMIUM``): Playwright's own
browser builds cannot be downloaded here, so ``playwright install`` is never run.  Without it the
tests skip on a laptop and fail with ``CI=true``, naming the command that installs it.

Each test gets a fresh ``webb_`` schema, seeded by :mod:`webseed`, shown by three apps (on
three uvicorn servers that start once a session):

* ``site.full``: the app run alone (mounted at ``/``), whose access hook answers ``full`` for
  the user ``alice``;
* ``site.jobs``: the same app mounted at ``/jobs`` inside a parent Starlette app, full access;
* ``site.read``: the app mounted at ``/jobs`` with an access hook answering ``read``; beside it
  ``site.private`` (read-only, ``hide_args=True``) and ``site.closed`` (``forbidden``).

Everything is torn down even when the test fails: the apps' connections closed, the schema
dropped, the queues deleted (their names derive from ``queue_name``, so the suite's janitor
deletes them), the servers stopped at the end of the session.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import QueueJanitor
from webseed import Seeded, seed
from webtools import csp_violations, serve

from dramatiq_reliable import Database, OutboxBroker, schema

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1280, "height": 800}
#: Where the screenshots go: docs/img with WEB_SCREENSHOTS=1 (to commit them), else a tmp dir.
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
WRITE_DOCS = os.environ.get("WEB_SCREENSHOTS", "") == "1"


def _missing(what: str) -> None:
    """Skip on a laptop, fail in CI: a CI run without the browser tests proves nothing."""
    if IN_CI:
        pytest.fail(f"{what}; CI=true, so this is a failure, not a skip", pytrace=False)
    pytest.skip(what)


# --------------------------------------------------------------------------------------------
# The browser
# --------------------------------------------------------------------------------------------


# Module scope, not session: while Playwright's sync API is open it keeps an asyncio loop
# running in the main thread, and the tests after this folder that call asyncio.run() would fail.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the browser tests (starting it takes seconds); a context per test."""
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    executable = shutil.which(CHROMIUM)  # a path, or a name on $PATH
    if executable is None:
        _missing(
            f"Chromium not found at {CHROMIUM!r}: install Debian's package with 'apt-get install -y chromium' "
            "(or point $CHROMIUM at a Chromium binary); never 'playwright install'"
        )
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _missing("Playwright for Python is not installed: run pip install -e '.[dev]'")
    # The machine is shared and CI runs the whole suite: give the page's assertions room.
    expect.set_options(timeout=10_000)
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page (own cookies and cache) at 1280x800; fails fast instead of waiting 30 s.

    Every test using it also proves the page works under its Content-Security-Policy: a
    violation the browser reports (htmx injecting a style, an inline script) fails the test.
    """
    context = browser.new_context(viewport=VIEWPORT, locale="en-GB", timezone_id="UTC")
    context.set_default_timeout(10_000)
    violations = csp_violations(context)
    try:
        yield context.new_page()
    finally:
        context.close()
    if violations:
        pytest.fail(f"the page broke its Content-Security-Policy: {violations}", pytrace=False)


@pytest.fixture
def shot(tmp_path: Path) -> Callable[[Any, str], Path]:
    """``shot(page, "web-overview")``: a screenshot of the viewport, into docs/img with
    ``WEB_SCREENSHOTS=1`` and into the test's tmp dir otherwise (so CI leaves the tree clean)."""

    def take(page: Any, name: str) -> Path:
        target = (DOCS_IMG if WRITE_DOCS else tmp_path) / f"{name}.png"
        page.screenshot(path=str(target), full_page=False, animations="disabled", caret="hide")
        assert target.stat().st_size > 0
        return target

    return take


# --------------------------------------------------------------------------------------------
# The seeded site
# --------------------------------------------------------------------------------------------


def _web() -> Any:
    try:
        from dramatiq_reliable import web
    except ImportError as error:
        _missing(f"the web page cannot be imported ({error}): run pip install -e '.[dev,web]'")
    return web


@dataclasses.dataclass
class Site:
    """The seeded schema and the servers showing it (see the module docstring)."""

    seeded: Seeded
    full: str
    jobs: str
    read: str
    #: read-only with ``hide_args=True``
    private: str
    #: the access hook answers ``forbidden``
    closed: str
    database_url: str
    database: Database
    broker: OutboxBroker


@pytest.fixture
def web_schema(database_url: str) -> Iterator[str]:
    """A migrated ``webb_`` schema of the test's own, dropped afterwards."""
    name = f"webb_{uuid.uuid4().hex[:12]}"
    try:
        schema.migrate(database_url, schema=name)
        yield name
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def queue_base(queue_name: str) -> str:
    """What the seeded queue names start with: the test's own ``queue_name`` (so the janitor
    deletes every queue a relay declares for them)."""
    return queue_name


class Switch:
    """An ASGI app passing each request to the app the current test set: the servers start once
    a session, the apps (and the schema they show) are each test's own."""

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        app = self.app
        if app is None:
            from starlette.responses import PlainTextResponse

            app = PlainTextResponse("no test is using this server", status_code=503)
        await app(scope, receive, send)


@dataclasses.dataclass
class Servers:
    alone: Switch
    mounted: Switch
    read_only: Switch
    urls: tuple[str, str, str]


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    """Three uvicorn servers in threads on free loopback ports, for one test module."""
    switches = (Switch(), Switch(), Switch())
    with serve(switches[0]) as alone, serve(switches[1]) as mounted, serve(switches[2]) as read_only:
        yield Servers(*switches, urls=(alone, mounted, read_only))


@pytest.fixture
def site(
    browser: Any,
    database_url: str,
    rabbitmq_url: str,
    web_schema: str,
    queue_base: str,
    queues: QueueJanitor,
    db: psycopg.Connection[Any],
    servers: Servers,
) -> Iterator[Site]:
    """The seeded schema served three ways: alone with full access, mounted at /jobs with full
    access, and mounted at /jobs read-only.  (``browser`` first: without Chromium nothing is seeded.)"""
    web = _web()
    from starlette.applications import Starlette
    from starlette.routing import Mount

    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=web_schema, pool_max_size=2)
    # The apps' action pool, shared by the three (each also opens a small read pool of its own).
    database = Database(url=database_url, max_size=3)
    apps: list[Any] = []
    try:
        seeded = seed(broker, db, schema=web_schema, base=queue_base)
        for name in seeded.queues:
            queues.add(name)  # the relay may declare them: the janitor deletes them afterwards

        def full(request: Any) -> Any:
            return web.Access("full", user="alice")

        def read(request: Any) -> Any:
            return "read"

        def forbidden(request: Any) -> Any:
            return web.Access("forbidden")

        def app(access: Callable[[Any], Any], **options: Any) -> Any:
            apps.append(web.create_app(database, schema=web_schema, access=access, broker=broker, **options))
            return apps[-1]

        servers.alone.app = app(full)
        # Mounted as a user's app mounts it.  Starlette runs no lifespan of a mounted app (nor does
        # the switch run the alone app's): the teardown closes each app's connections instead.
        servers.mounted.app = Starlette(routes=[Mount("/jobs", app=app(full))])
        servers.read_only.app = Starlette(
            routes=[
                Mount("/jobs", app=app(read)),
                Mount("/private", app=app(read, hide_args=True)),
                Mount("/closed", app=app(forbidden)),
            ]
        )
        alone, mounted, read_only = servers.urls
        yield Site(
            seeded=seeded,
            full=alone,
            jobs=f"{mounted}/jobs",
            read=f"{read_only}/jobs",
            private=f"{read_only}/private",
            closed=f"{read_only}/closed",
            database_url=database_url,
            database=database,
            broker=broker,
        )
    finally:
        servers.alone.app = servers.mounted.app = servers.read_only.app = None
        for each in apps:
            each.state.settings.close()
        database.close()
        broker.close()
